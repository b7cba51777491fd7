"""Which file MindSpore takes in each rank directory, as JSON (run under MindSpore's Python).

usage: python ms_pick_files.py CASES.json

CASES.json: ``{case: {"names": [file names], "format": "ckpt" | "safetensors",
"file_suffix": str | null}}``. Each case's names are created (empty) in ``rank_0`` of a
temporary directory and MindSpore's own ``_collect_safetensor_files`` (what
``transform_checkpoints`` and ``unified_safetensors`` call) is asked which file it takes.
Printed: ``{case: file name | "error: <message>" | null}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from mindspore.parallel.transform_safetensors import _collect_safetensor_files


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out: dict[str, str | None] = {}
    for case, spec in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            rank = Path(tmp) / "rank_0"
            rank.mkdir()
            for name in spec["names"]:
                (rank / name).touch()
            try:
                got = _collect_safetensor_files(tmp, format=spec["format"], file_suffix=spec["file_suffix"])
                out[case] = os.path.basename(got[0]) if 0 in got else None
            except ValueError as err:
                out[case] = f"error: {err}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
