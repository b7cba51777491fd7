"""How output files are written: rank-file writers fed by any box reader, and the output directories they fill."""
