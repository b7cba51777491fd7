"""Code zckpt does not write by hand: protoc's output from MindSpore's own schemas (``proto/``).

Nothing here is edited; ``tests/test_proto.py`` checks that it is what protoc makes of
``proto/`` today. It sits at the bottom of the layers, beside ``core``.
"""
