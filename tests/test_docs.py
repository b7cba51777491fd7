"""The documentation is true: the tutorial's runnable blocks run as written on the bundled
example and give MindSpore's own destination files; cli.md lists exactly the parser's
subcommands and options; links between the pages resolve."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs
from sf_models import entries_by_name

from zckpt.clidoc import options, subcommands

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_MARK = "<!-- run -->"


def runnable_blocks(markdown: str) -> list[str]:
    """The fenced ```bash blocks that directly follow a ``<!-- run -->`` line."""
    return [m.group(1) for m in re.finditer(r"^<!-- run -->\n```bash\n(.*?)^```$", markdown, re.S | re.M)]


@pytest.fixture(scope="module")
def tutorial_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """Run every marked block of docs/tutorial.md, in order, in a copy of the repository's docs."""
    pytest.importorskip("safetensors", reason="the tutorial's section 1.5 uses the safetensors package")
    root = tmp_path_factory.mktemp("tutorial")
    shutil.copytree(DOCS / "example", root / "docs" / "example")
    (root / "work").mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    results = []
    for block in runnable_blocks((DOCS / "tutorial.md").read_text(encoding="utf-8")):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        results.append(proc)
        if proc.returncode != 0:
            break
    return root, results


def test_tutorial_blocks_run(tutorial_run: tuple[Path, list[subprocess.CompletedProcess[str]]]) -> None:
    _, results = tutorial_run
    assert len(results) == len(runnable_blocks((DOCS / "tutorial.md").read_text(encoding="utf-8"))) >= 8
    for proc in results:
        assert proc.returncode == 0, f"tutorial block failed:\n{proc.args[-1]}\n--- stderr\n{proc.stderr[-3000:]}"


def test_tutorial_results(tutorial_run: tuple[Path, list[subprocess.CompletedProcess[str]]]) -> None:
    root, results = tutorial_run
    if any(p.returncode for p in results):
        pytest.fail("a tutorial block failed (see test_tutorial_blocks_run)")
    work = root / "work"
    expected = DOCS / "example" / "dst" / "expected"
    assert diff_dirs(expected, work / "dst") == []
    assert diff_dirs(expected, work / "dst_api") == []
    rank1 = "checkpoint_1.ckpt"
    assert (work / "dst_rank1" / rank1).read_bytes() == (expected / "rank_1" / rank1).read_bytes()
    for r in range(4):
        assert (work / "dst_st" / f"rank_{r}" / f"checkpoint_{r}.safetensors").is_file()
        parts = [f"checkpoint_{r}_part0.ckpt", f"checkpoint_{r}_part1.ckpt"]
        assert _visible(work / "dst_parts" / f"rank_{r}") == parts
    assert _visible(work / "only3") == ["rank_3"]
    full = entries_by_name(work / "full" / "rank_0" / "checkpoint_0.ckpt")
    ref = entries_by_name(expected / "rank_0" / "checkpoint_0.ckpt")
    assert set(full) == set(ref) and full["learning_rate"] == ref["learning_rate"]
    assert "identical to MindSpore's rank 0" in "".join(p.stdout for p in results)


def _visible(folder: Path) -> list[str]:
    """Names in a directory, without zckpt's hidden bookkeeping files."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_cli_reference_matches_the_parser() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## zckpt (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    subs = subcommands()
    assert list(sections) == list(subs), "docs/cli.md is stale: run python -m zckpt.clidoc > docs/cli.md"
    for name, sub in subs.items():
        usage = re.search(r"```text\n(.*?)```", sections[name], re.S)
        assert usage is not None, name
        documented = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage.group(1)))
        wanted = {o for o in options(sub) if o.startswith("-")}
        assert documented == wanted, (f"docs/cli.md section {name}: documents {sorted(documented - wanted)} "
                                      f"but lacks {sorted(wanted - documented)}; run python -m zckpt.clidoc")


def test_links_between_pages_resolve() -> None:
    pages = sorted(DOCS.glob("*.md"))
    assert {p.name for p in pages} >= {"tutorial.md", "cli.md", "mindspore-api.md", "dask-cluster.md",
                                       "store-format.md"}
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+\.md)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).is_file(), f"{page.name} links to missing {target}"
