"""Files and bytes: local and remote paths, remote objects read by byte range, safe paths, locks,
new files, byte copies, checksums, zarr-python's door."""
