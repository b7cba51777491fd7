"""Print pip constraints pinning every dependency of zckpt to the floor pyproject.toml declares.

usage: python .ci/floors.py [NAME==VERSION ...]

Each ``name>=X`` in ``[project] dependencies`` and in the runtime extras (``distributed``,
``s3``: every optional group but the test ones) becomes ``name==X`` (extras dropped), so that
an install with ``-c`` tests exactly the lowest versions zckpt claims to work with; the
arguments replace a pin (``numpy==1.26.4``: the numpy MindSpore's environment has).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:;.*)?$")


def floors(pyproject: Path) -> dict[str, str]:
    doc = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    extras = doc["project"].get("optional-dependencies", {})
    runtime = [r for group, reqs in extras.items() if not group.startswith("test") for r in reqs]
    for req in [*doc["project"]["dependencies"], *runtime]:
        m = _REQ.match(req)
        if m is None:
            raise SystemExit(f"dependency {req!r} has no '>=' floor: declare one")
        out[m.group(1).lower()] = m.group(2)
    return out


def main(argv: list[str]) -> None:
    pins = {name: f"{name}=={v}" for name, v in floors(Path(__file__).resolve().parents[1] / "pyproject.toml").items()}
    for arg in argv:
        name = re.split(r"[=<>!~]", arg, maxsplit=1)[0].lower()
        pins[name] = arg
    print("\n".join(pins[n] for n in sorted(pins)))


if __name__ == "__main__":
    main(sys.argv[1:])
