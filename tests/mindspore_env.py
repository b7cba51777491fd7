"""Locating MindSpore's own virtualenv for cross-checks (it needs numpy 1.26, so it is separate)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ms_python() -> str | None:
    """``$ZCKPT_MS_PYTHON`` or ``.ms-venv/bin/python`` in the repository, if it imports mindspore."""
    for cand in (os.environ.get("ZCKPT_MS_PYTHON"), str(ROOT / ".ms-venv" / "bin" / "python")):
        if cand and Path(cand).is_file():
            return cand
    return None


def require_ms_python() -> str:
    py = ms_python()
    if py is None:
        pytest.skip("MindSpore virtualenv not found (set ZCKPT_MS_PYTHON; .ci/run installs mindspore==2.10.0)")
    return py


def run_ms_tool(tool: str, *args: str, timeout: float = 600) -> Any:
    """Run ``tests/tools/<tool>`` under MindSpore's Python and parse its JSON stdout."""
    py = require_ms_python()
    proc = subprocess.run(
        [py, str(ROOT / "tests" / "tools" / tool), *args],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "GLOG_v": "3"},
    )
    if proc.returncode != 0:
        raise AssertionError(f"{tool} failed under MindSpore ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)
