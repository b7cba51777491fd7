"""Where work runs: engines (in-process, Dask local or cluster), the helper process, progress, GC pauses."""
