"""zckpt's layers: every module placed in one, no import into a higher one, and the picture of
docs/architecture.md as ``docs/make_architecture.py`` draws it from the code now.

``lint-imports`` (``.ci/run``) enforces the same contracts with import-linter; this test
checks them with :mod:`ast` alone, so it also runs where import-linter is not installed
(MindSpore's virtualenv), and it fails on a module that no layer names, which import-linter
would let through unconstrained.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import make_architecture as arch  # noqa: E402


def test_every_module_is_in_exactly_one_layer() -> None:
    bands = arch.layers()
    named = [m for band in bands for m in band]
    assert len(named) == len(set(named)), "a module is named in two layers"
    tops = {m.layer for m in arch.modules().values()}
    unplaced = tops - set(named) - {"__init__"}
    assert not unplaced, f"modules in no layer of pyproject.toml's layers contract: {sorted(unplaced)}"
    gone = set(named) - tops
    assert not gone, f"layers name modules that do not exist: {sorted(gone)}"


def test_no_module_imports_a_higher_layer() -> None:
    assert arch.upward(arch.modules(), arch.layers()) == []


def test_upward_imports_are_found(tmp_path: Path) -> None:
    """The check itself: a core module importing a command is reported."""
    pkg = tmp_path / "zckpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for sub in ("core", "jobs"):
        (pkg / sub).mkdir()
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "core" / "layout.py").write_text("def f():\n    from zckpt.jobs.export import x\n")
    (pkg / "jobs" / "export.py").write_text("from zckpt.core import layout\n")
    mods = arch.modules(pkg)
    assert mods["jobs.export"].imports == {"core.layout"}
    assert arch.upward(mods, [["jobs"], ["core"]]) == [("core.layout", "jobs.export")]


def test_the_picture_is_drawn_from_the_code_as_it_is() -> None:
    assert arch.PICTURE.read_text(encoding="utf-8") == arch.picture(), \
        "docs/img/architecture.svg is stale: run python docs/make_architecture.py"


def test_the_page_lists_each_layer_as_the_contract_does() -> None:
    """docs/architecture.md's table names, row by row, the modules of each layer (top first)."""
    import re

    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| ") and line.count("|") == 4
            and not line.startswith("| layer") and "`" in line.rsplit("|", 2)[1]]
    listed = [[m.removesuffix("/") for m in re.findall(r"`([a-z0-9_/]+)`", row.rsplit("|", 2)[1])] for row in rows]
    assert [sorted(x) for x in listed] == [sorted(x) for x in arch.layers()]


MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """Modules of one job each: none over ~600 lines (generated protobuf code aside)."""
    long = {m.name: m.lines for m in arch.modules().values() if m.lines > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
