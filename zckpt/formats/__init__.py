"""MindSpore file formats, each module importing only those listed before it.

``wire`` (protobuf primitives), ``entries`` (where an entry's bytes lie: the index values
every reader builds, the file ranges writers copy), the ``.ckpt`` codec in four:
``ckpt_encoding`` (the bytes of a ``Value`` and the CRC trailer), ``ckpt_index`` (the file
mapped and walked for its entries), ``ckpt`` (the reader) and ``ckpt_writer``; ``strategy``
(parallel strategy files), ``safetensors``, ``shard_reader`` (the
:class:`~zckpt.formats.shard_reader.ShardReader` protocol every source reader satisfies, and
the reader of a rank saved as several safetensors files), ``unified`` and ``mindformers``
(MindSpore's unified directory, MindFormers' iterations), ``remote_shard`` (the ``.ckpt`` and
safetensors readers of a shard in object storage, read by byte range), ``rank_files`` (which
file of a rank directory is its checkpoint), and ``opener`` (which reader reads a path: the one module that
knows every format).
"""
