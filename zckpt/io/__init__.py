"""Files and bytes: local and remote paths, safe paths, locks, new files, byte copies, checksums, zarr-python's door."""
