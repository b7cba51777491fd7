"""The commands as compositions of a plan, a reader, a writer and an engine: ingest, export, transform, load, ..."""
