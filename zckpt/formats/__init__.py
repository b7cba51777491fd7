"""MindSpore file formats, each module importing only those listed before it.

``wire`` (protobuf primitives), ``ckpt`` (``.ckpt`` shards), ``strategy`` (parallel strategy
files), ``safetensors``, ``shard_reader`` (the :class:`~zckpt.formats.shard_reader.ShardReader`
protocol every source reader satisfies, and the reader of a rank saved as several
safetensors files), ``unified`` and ``mindformers`` (MindSpore's unified directory,
MindFormers' iterations), ``rank_files`` (which file of a rank directory is its checkpoint),
and ``opener`` (which reader reads a path: the one module that knows every format).
"""
