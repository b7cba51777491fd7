"""The README's install brings everything zckpt runs with, ``process_num`` and ``--workers`` included.

MindSpore's ``transform_checkpoints(..., process_num=2)`` is part of the drop-in promise, and
zckpt runs it (and ``--workers``) on a local Dask cluster: ``distributed`` was an extra, so the
README's plain ``pip install -e .`` gave ``UsageError: Dask distributed is not installed``
(issue 25). Here every package zckpt imports must come from the distributions that command
installs (``[project] dependencies`` plus the extras it names), and ``process_num=2`` /
``--workers 2`` must give MindSpore's own bytes for the bundled example.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs

import zckpt.parallel
from zckpt.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "example"
SRC = str(EXAMPLE / "src" / "checkpoints")
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")

NOT_INSTALLED = {
    "mindspore": "the user's own MindSpore, imported only to load values into a network it gave",
    "grpc_tools": "third_party/mindspore_proto/regen.py regenerates protoc's modules (a developer tool, test extra)",
    "s3fs": "the s3 extra (pip install 'zckpt[s3]'): imported by io/s3_parts only for an s3:// output, whose "
            "filesystem is s3fs's already",
}
"""Packages zckpt imports that its install does not bring, and why."""


def _name(req: str) -> str:
    return re.split(r"[\[<>=!~;\s]", req, maxsplit=1)[0].lower().replace("_", "-")


def readme_install() -> set[str]:
    """Distributions the README's install command brings: the dependencies, and those of the
    extras it names (``pip install -e '.[x]'``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    command = re.search(r"pip install[^&\n]*", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert command is not None, "the README has no pip install command"
    extras = re.search(r"\.\[([^\]]*)\]", command.group(0))
    names = {_name(r) for r in project["dependencies"]}
    for extra in (extras.group(1).split(",") if extras else []):
        names |= {_name(r) for r in project["optional-dependencies"][extra.strip()]}
    return names


def imported_packages() -> dict[str, set[str]]:
    """Top-level packages outside the standard library that zckpt's sources import, and where."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "zckpt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "zckpt":
                    out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


def test_the_readme_install_brings_every_package_zckpt_imports() -> None:
    installed = readme_install()
    providers = packages_distributions()
    missing = {}
    for top, where in imported_packages().items():
        if top in NOT_INSTALLED:
            continue
        dists = {_name(d) for d in providers.get(top, [])}
        assert dists, f"{top} (imported by {sorted(where)}) is not installed here: cannot tell its distribution"
        if not dists & installed:
            missing[top] = sorted(where)
    assert not missing, f"imported but not installed by the README's command: {missing}"
    assert "distributed" in installed


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.ckpt"))}


def test_process_num_2_writes_mindspores_bytes(tmp_path: Path) -> None:
    for n in (1, 2):
        zckpt.parallel.convert_checkpoints(SRC, str(tmp_path / f"p{n}"), "checkpoint_", SRC_S, DST_S, process_num=n)
        assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / f"p{n}") == []
    assert _files(tmp_path / "p1") == _files(tmp_path / "p2")


@pytest.mark.parametrize("command", ["transform", "store"])
def test_workers_2_writes_mindspores_bytes(command: str, tmp_path: Path) -> None:
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        if command == "transform":
            args = ["transform", SRC, "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(out)]
            assert cli_main([*args, "--workers", str(n)]) == 0
        else:
            store = tmp_path / f"s{n}.zarr"
            assert cli_main(["ingest", SRC, "--src-strategy", SRC_S, "--store", str(store), "--workers", str(n)]) == 0
            assert cli_main(["export", str(store), "--dst-strategy", DST_S, "--out", str(out),
                             "--workers", str(n)]) == 0
        assert diff_dirs(EXAMPLE / "dst" / "expected", out) == []
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")
