"""zckpt's layers: every module placed in one, no import into a higher one, and the picture of
docs/architecture.md as ``docs/make_architecture.py`` draws it from the code now.

``lint-imports`` (``.ci/run``) enforces the same contracts with import-linter; this test
checks them with :mod:`ast` alone, so it also runs where import-linter is not installed
(MindSpore's virtualenv), and it fails on a module that no layer names, which import-linter
would let through unconstrained.

An import inside a function is kept there only for a reason (an optional or heavy package, a
command's laziness, numpy after ``ONE_THREAD``) and says it in a comment; everything else is
imported at the top of its module.
"""

from __future__ import annotations

import ast
import re
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


HEAVY = frozenset({"zarr", "numcodecs", "dask", "distributed", "fsspec", "s3fs", "tensorstore", "mindspore", "psutil",
                   "tqdm", "ml_dtypes", "grpc_tools"})
"""Optional or heavy packages: imported where used, which needs no comment."""

DOORS = frozenset({"zckpt.io.zarr_local", "zckpt.zarr_bfloat16", "zckpt.jobs.msnet"})
"""zckpt's own modules that import one of :data:`HEAVY` as they load (zarr-python, MindSpore):
as heavy as the package behind them."""


def _self_explanatory(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = "." * node.level + (node.module or "")
        names = [base, *(f"{base}.{a.name}" for a in node.names)]
    return any(n.split(".")[0] in HEAVY or n in DOORS for n in names)


def _said(lines: list[str], lineno: int) -> bool:
    """A reason on the import's own line, or in a comment line just above the block of imports it opens."""
    own = lines[lineno - 1].partition("#")[2]
    if re.sub(r"noqa(:[\w ,]*)?|type: *ignore(\[[\w, -]*\])?", "", own).strip(" #"):
        return True
    above = lineno - 2
    while above >= 0 and lines[above].lstrip().startswith(("import ", "from ")):
        above -= 1
    return above >= 0 and len(lines[above].strip()) > 1 and lines[above].lstrip().startswith("#")


def unexplained(root: Path) -> dict[str, list[int]]:
    """Per file of the package at ``root`` (keyed ``zckpt/...``), the lines of its imports inside
    functions that are neither of a heavy package (:data:`HEAVY`, :data:`DOORS`) nor say why."""
    found: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith("_pb2.py"):
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        bad = sorted({node.lineno for fn in ast.walk(ast.parse(text))
                      if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                      for node in ast.walk(fn)
                      if isinstance(node, ast.Import | ast.ImportFrom) and not _self_explanatory(node)
                      and not _said(lines, node.lineno)})
        if bad:
            found[path.relative_to(root.parent).as_posix()] = bad
    return found


def test_imports_inside_functions_say_why() -> None:
    """An import inside a function is of a heavy package or says why it is there (a trailing
    comment, or a comment line above its block); any other belongs at the top of its module."""
    found = unexplained(ROOT / "zckpt")
    assert found == {}, \
        "imports inside functions without a reason: move them to the top of the module or say why"


def test_unexplained_inner_imports_are_found(tmp_path: Path) -> None:
    """The check itself: what it reports and what it lets through."""
    pkg = tmp_path / "zckpt"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import json\n"                                      # 1 module level: fine
        "def f():\n"
        "    import os\n"                                     # 3 reported
        "    import zarr\n"                                   # 4 heavy
        "    from zckpt.io.zarr_local import sync\n"          # 5 zarr's door
        "    from zckpt import zarr_bfloat16\n"               # 6 likewise
        "    import resource  # Unix only\n"                  # 7 says why
        "    import ctypes  # noqa: F401\n"                   # 8 reported: no reason
        "    # the command's own modules only\n"
        "    from zckpt.jobs import a\n"                      # 10 the comment above its block
        "    from zckpt.jobs import b\n"                      # 11 likewise
        "\n"
        "    from zckpt.jobs import c\n"                      # 13 reported: another block
        "    async def g():\n"
        "        from zckpt.core import d\n"                  # 15 reported
    )
    assert unexplained(pkg) == {"zckpt/m.py": [3, 8, 13, 15]}
