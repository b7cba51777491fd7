"""MindSpore file formats: checkpoint shards (``ckpt``) and parallel strategy files (``strategy``)."""
