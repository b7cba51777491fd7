"""Shared test helpers: where the MindSpore ground-truth fixtures live.

The fixtures (``../shared/fixtures`` next to the repository, see its README) are produced
by MindSpore itself and are not part of the repository, so every test that needs them
asks for the ``fixtures_dir`` fixture and is skipped, with a reason, when they are absent.
Set ``ZCKPT_FIXTURES`` to use another copy.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

STATE = tempfile.mkdtemp(prefix="zckpt-test-state-")
"""The records of completed output directories (:mod:`zckpt.write.out_records`) of this test run,
never the user's: set for this process and the processes the tests start."""
os.environ["ZCKPT_STATE_DIR"] = STATE
atexit.register(shutil.rmtree, STATE, True)

FIXTURES: Path = Path(
    os.environ.get("ZCKPT_FIXTURES") or Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
)
"""Root of the MindSpore fixtures (may not exist)."""

collect_ignore = ["fixtures"]  # data and their regenerators, never tests

MINDFORMERS_FIXTURES: Path = Path(__file__).resolve().parent / "fixtures" / "mindformers"
"""Checkpoint 2.0 directories MindFormers itself saved, kept in the repository (its README says why)."""

NO_FIXTURES_REASON = f"MindSpore fixtures not found at {FIXTURES} (set ZCKPT_FIXTURES to their directory)"


def have_fixtures() -> bool:
    return (FIXTURES / "README.md").is_file()


@pytest.fixture
def fixtures_dir() -> Path:
    """The fixtures root; skips the test when the fixtures are absent."""
    if not have_fixtures():
        pytest.skip(NO_FIXTURES_REASON)
    return FIXTURES


def scenario(sid: str) -> Path:
    """Directory of fixture scenario ``sid`` (e.g. ``"s01"``); skips when it is absent."""
    path = FIXTURES / sid
    if not path.is_dir():
        pytest.skip(f"fixture scenario {sid} not found under {FIXTURES}")
    return path


@pytest.fixture
def one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Destination files written one by one, whatever they share (a test of that order's
    reads and refusals; source-major writing is tests/test_group_writer.py's)."""
    from zckpt.write import group_writer

    monkeypatch.setattr(group_writer, "GAIN", float("inf"))
    monkeypatch.setattr(group_writer, "SMALL_PIECE", 0)


@pytest.fixture
def groups_written(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the files of every group written source-major (zckpt/write/group_writer.py)."""
    from zckpt.write import group_writer

    seen: list[int] = []
    write = group_writer.GroupWriter.write

    def counted(self: group_writer.GroupWriter, reader: object, files: list[object], *a: object,
                **k: object) -> object:
        seen.append(len(files))
        return write(self, reader, files, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(group_writer.GroupWriter, "write", counted)
    return seen
