"""Imports inside ``zckpt.formats`` run one way: the opener knows every format, no format
module knows the opener, and the modules import each other without a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ROOT / "zckpt" / "formats"
OPENER = "zckpt.formats.opener"


def _imported(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (at its top or inside functions), relative ones resolved;
    ``from p import m`` counts as importing ``p.m`` too, as it may name a submodule."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def _format_modules() -> dict[str, set[str]]:
    """``zckpt.formats.<m>`` -> the ``zckpt.formats`` modules it imports."""
    mods = {f"zckpt.formats.{p.stem}": p for p in FORMATS.glob("*.py") if p.stem != "__init__"}
    assert OPENER in mods and "zckpt.formats.shard_reader" in mods
    return {m: {i for i in _imported(p, "zckpt.formats") if i in mods and i != m} for m, p in mods.items()}


def test_no_format_module_imports_the_opener() -> None:
    graph = _format_modules()
    importers = sorted(m for m, deps in graph.items() if OPENER in deps)
    assert importers == [], f"format modules must not import {OPENER} (it imports them): {importers}"
    assert {"zckpt.formats.mindformers", "zckpt.formats.unified"} <= graph[OPENER]


def test_format_modules_import_without_a_circle() -> None:
    graph = _format_modules()
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import circle: {' -> '.join((*path[path.index(m):], m))}"
        if m in done:
            return
        for dep in sorted(graph[m]):
            visit(dep, (*path, m))
        done.add(m)

    for m in sorted(graph):
        visit(m, ())


def test_relative_imports_resolve(tmp_path: Path) -> None:
    """The import reader sees every spelling a format module could use for the opener."""
    src = tmp_path / "m.py"
    src.write_text("from .opener import open_shard\n"
                   "def f():\n    from . import opener\n    import zckpt.formats.opener\n", encoding="utf-8")
    assert OPENER in _imported(src, "zckpt.formats")
    src.write_text("from . import opener\n", encoding="utf-8")
    assert OPENER in _imported(src, "zckpt.formats")


def test_the_package_lists_its_modules_in_import_order() -> None:
    """``zckpt/formats/__init__.py`` names every format module, each after those it imports."""
    doc = (FORMATS / "__init__.py").read_text(encoding="utf-8")
    graph = _format_modules()
    listed = [f"zckpt.formats.{m}" for m in re.findall(r"``([a-z_]+)``", doc) if f"zckpt.formats.{m}" in graph]
    assert sorted(listed) == sorted(graph), "every format module is listed once"
    for i, m in enumerate(listed):
        assert graph[m] <= set(listed[:i]), f"{m} imports {sorted(graph[m] - set(listed[:i]))}, listed after it"
