"""Regenerate the protobuf modules from ``proto/`` (developer tool, needs grpcio-tools)."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_FILES = ("ms_checkpoint.proto", "ms_node_strategy.proto")


def proto_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "proto"


def main() -> int:
    from grpc_tools import protoc

    out = Path(__file__).resolve().parent
    src = proto_dir()
    args = ["protoc", f"-I{src}", f"--python_out={out}", f"--pyi_out={out}"]
    return int(protoc.main(args + [str(src / f) for f in PROTO_FILES]))


if __name__ == "__main__":
    sys.exit(main())
