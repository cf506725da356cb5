"""Generated protobuf messages for LLMariner's wire protocol.

Do not edit the ``*_pb2`` modules: ``tools/gen_proto`` writes them from ``proto/``.
"""
