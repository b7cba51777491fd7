"""The Zarr v3 store: its layout on disk, manifest and integrity, progress records, packed tensors, its reader."""
