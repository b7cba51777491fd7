"""zckpt: reshard MindSpore distributed checkpoints through a global-coordinate Zarr store."""
