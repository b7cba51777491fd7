"""The documentation is true: the tutorial's runnable blocks and the README's Python block run
as written on the bundled example and give MindSpore's own destination files, importing only
what ``pip install -e .`` brings; cli.md lists exactly the parser's subcommands and options;
links between the pages resolve."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs, diff_files
from sf_models import entries_by_name

from zckpt.cli.args import older_spellings
from zckpt.cli.doc import options, render, subcommands
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.safetensors import SafetensorsReader

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_MARK = "<!-- run -->"


def runnable_blocks(markdown: str) -> list[str]:
    """The fenced ```bash blocks that directly follow a ``<!-- run -->`` line."""
    return [m.group(1) for m in re.finditer(r"^<!-- run -->\n```bash\n(.*?)^```$", markdown, re.S | re.M)]


@pytest.fixture(scope="module")
def tutorial_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """Run every marked block of docs/tutorial.md, in order, in a copy of the repository's docs."""
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


def test_tutorial_says_what_bf16_comes_back_as(
        tutorial_run: tuple[Path, list[subprocess.CompletedProcess[str]]]) -> None:
    """The tutorial quotes the line its segmented-loading block prints; bf16 comes back as
    bfloat16 values, not as bit patterns."""
    _, results = tutorial_run
    text = (DOCS / "tutorial.md").read_text(encoding="utf-8")
    quoted = re.findall(r"the block prints\s+`([^`]+)`", text)
    assert quoted == ["l0.w is BFloat16 kept as bfloat16"]
    assert quoted[0] in "".join(p.stdout for p in results).splitlines()
    assert "uint16" not in text


def _visible(folder: Path) -> list[str]:
    """Names in a directory, without zckpt's hidden bookkeeping files."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_cli_reference_matches_the_parser() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## zckpt (\S+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    subs = subcommands()
    assert list(sections) == list(subs), "docs/cli.md is stale: run python -m zckpt.cli.doc > docs/cli.md"
    for name, sub in subs.items():
        usage = re.search(r"```text\n(.*?)```", sections[name], re.S)
        assert usage is not None, name
        documented = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage.group(1)))
        wanted = {o for o in options(sub) if o.startswith("-")}
        assert documented == wanted, (f"docs/cli.md section {name}: documents {sorted(documented - wanted)} "
                                      f"but lacks {sorted(wanted - documented)}; run python -m zckpt.cli.doc")
        older = re.findall(r"`(\S[^`]*)` \(now `(--[\w-]+)`\)", sections[name])
        assert dict(older) == older_spellings(sub), f"docs/cli.md section {name}: older spellings are stale"
    assert text == render(), "docs/cli.md is stale: run python -m zckpt.cli.doc > docs/cli.md"


TEACHING_PAGES = [ROOT / "README.md", *(DOCS / n for n in ("tutorial.md", "faq.md", "layouts.md", "layout-kinds.md",
                                                          "dask-cluster.md", "mindspore-api.md", "store-format.md"))]


def _command_lines(text: str) -> list[tuple[str, str]]:
    """``(command, rest of its command line)`` for every ``zckpt COMMAND ...`` a page shows,
    backslash continuations joined, cut at a closing backtick, a ``#`` comment or the next
    command of a shell line."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for m in re.finditer(r"(?<![\w.-])zckpt +([a-z][\w-]*)(?![\w:-])(?=([^\n`]*))", text):
        found.append((m.group(1), re.split(r" #|&&|\|\||;|\|", m.group(2), maxsplit=1)[0]))
    return found


@pytest.mark.parametrize("page", TEACHING_PAGES, ids=lambda p: p.name)
def test_pages_teach_one_name_per_option(page: Path) -> None:
    """Every option a page passes to a zckpt command is one that command's help shows; the
    older spellings (still accepted, listed in cli.md) appear on no page that teaches."""
    subs = subcommands()
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^<!-- faq-error: 2 -->\n```bash\n.*?^```$", "", text, flags=re.S | re.M)  # wrong on purpose
    lines = _command_lines(text)
    for command, rest in lines:
        if command not in subs:
            continue
        used = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest))
        unknown = used - options(subs[command])
        assert not unknown, f"{page.name}: zckpt {command}{rest} uses {unknown}"
    old = {o for sub in subs.values() for o in older_spellings(sub) if o.startswith("--")}
    mentioned = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text))
    assert not mentioned & old, f"{page.name} teaches older spellings {sorted(mentioned & old)}"


def test_links_between_pages_resolve() -> None:
    pages = sorted(DOCS.glob("*.md"))
    assert {p.name for p in pages} >= {"tutorial.md", "cli.md", "mindspore-api.md", "dask-cluster.md",
                                       "store-format.md"}
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+\.md)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).is_file(), f"{page.name} links to missing {target}"


def readme_python_block() -> str:
    """The README's one ```python block, as written."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) == 1, "the README should hold exactly one Python block (the one this test runs)"
    return str(blocks[0])


def test_readme_python_block_runs_as_written(tmp_path: Path) -> None:
    shutil.copytree(DOCS / "example", tmp_path / "docs" / "example")
    block = readme_python_block()
    for attempt in range(2):  # a second run over its own outputs must work too
        proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 0, f"README block, run {attempt + 1}:\n{proc.stderr[-3000:]}"
    out, expected = tmp_path / "example-out" / "api", DOCS / "example" / "dst" / "expected"
    assert diff_dirs(expected, out / "dst") == []
    assert diff_dirs(expected, out / "from_store") == []
    rank3 = "rank_3/checkpoint_3.ckpt"
    assert diff_files(expected / rank3, out / "rank_3_only" / "checkpoint_3.ckpt") == []
    loaded = sorted(p.relative_to(out / "from_unified") for p in (out / "from_unified").rglob("*.safetensors"))
    assert len(loaded) == 4, loaded
    for path in loaded:
        rank = path.parent.name.removeprefix("rank_")
        want_path = expected / path.parent / f"checkpoint_{rank}.ckpt"
        with SafetensorsReader(out / "from_unified" / path) as got, CkptReader(want_path) as want:
            params = [n for n in want.names() if want.entry(n).kind == "tensor" and n in got]
            assert len(params) >= 2, (path, params)
            for name in params:
                assert got.array(name).tobytes() == want.array(name).tobytes(), (path, name)


def _runtime_modules() -> set[str]:
    """Top-level modules importable after ``pip install -e .``: the standard library, zckpt and
    its declared dependencies (by their import names)."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    names = {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
    import_names = {"protobuf": "google", "google_crc32c": "google_crc32c", "ml_dtypes": "ml_dtypes"}
    return set(sys.stdlib_module_names) | {"zckpt"} | {import_names.get(n, n) for n in names}


def _python_snippets() -> list[tuple[str, str]]:
    """Every Python snippet the docs tell users to run: the README's block and the tutorial's
    ``python - <<'EOF'`` bodies."""
    snippets = [("README.md", readme_python_block())]
    blocks = [("docs/tutorial.md", b) for b in runnable_blocks((DOCS / "tutorial.md").read_text(encoding="utf-8"))]
    blocks += [("docs/faq.md", entry.block) for entry in faq_entries()]
    for page, block in blocks:
        snippets += [(page, body) for body in re.findall(r"python - <<'EOF'\n(.*?)^EOF$", block, re.S | re.M)]
    return snippets


def test_doc_snippets_import_only_what_the_install_brings() -> None:
    allowed = _runtime_modules()
    snippets = _python_snippets()
    assert len(snippets) >= 4
    for page, code in snippets:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for mod in mods:
                    assert mod.split(".")[0] in allowed, (
                        f"{page} imports {mod}, which `pip install -e .` does not install")


@dataclass(frozen=True)
class FaqEntry:
    """One reproduced error of docs/faq.md: the commands, the exit code and the message shown."""

    heading: str
    block: str
    code: int
    message: str

    def pattern(self) -> re.Pattern[str]:
        """The message with each ``…`` standing for any text on its line."""
        return re.compile("[^\n]*?".join(re.escape(part) for part in self.message.split("…")))


FAQ = DOCS / "faq.md"


def faq_setup() -> str:
    found = re.findall(r"^<!-- faq-setup -->\n```bash\n(.*?)^```$", FAQ.read_text(encoding="utf-8"), re.S | re.M)
    assert len(found) == 1
    return str(found[0])


def faq_entries() -> list[FaqEntry]:
    """Each ``### heading`` section's reproduced error, in page order."""
    entries = []
    for section in re.split(r"^### ", FAQ.read_text(encoding="utf-8"), flags=re.M)[1:]:
        found = re.search(r"^<!-- faq-error: (\d+) -->\n```bash\n(.*?)^```$\n\n```text\n(.*?)\n^```$", section,
                          re.S | re.M)
        if found:
            entries.append(FaqEntry(section.split("\n", 1)[0], found.group(2), int(found.group(1)), found.group(3)))
    return entries


def test_faq_lists_its_entries() -> None:
    text = FAQ.read_text(encoding="utf-8")
    assert len(faq_entries()) == text.count("<!-- faq-error:") >= 8


def test_faq_stays_apart_from_the_tutorial() -> None:
    """The FAQ's setup and entries write under ``faq/``, never the tutorial's ``work/``: a
    reader who runs both keeps both intact."""
    blocks = [faq_setup(), *(e.block for e in faq_entries()), *(b for b, _, _ in faq_json_entries())]
    for block in blocks:
        assert not re.search(r"(?<![\w.-])work/", block), block
    assert "faq/" in faq_setup()


def _in_fresh_copy(tmp_path: Path, block: str) -> subprocess.CompletedProcess[str]:
    """``block`` run after the FAQ's setup, in a fresh directory holding a copy of docs/example."""
    shutil.copytree(DOCS / "example", tmp_path / "docs" / "example")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    setup = subprocess.run(["bash", "-euo", "pipefail", "-c", faq_setup()], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300, check=False)
    assert setup.returncode == 0, setup.stderr
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def faq_json_entries() -> list[tuple[str, int, str]]:
    """``(commands, exit code, JSON shown)`` of each ``<!-- faq-json: N -->`` example."""
    return [(m.group(2), int(m.group(1)), m.group(3)) for m in re.finditer(
        r"^<!-- faq-json: (\d+) -->\n```bash\n(.*?)^```$\n\n```json\n(.*?)^```$", FAQ.read_text(encoding="utf-8"),
        re.S | re.M)]


def test_faq_json_error_is_what_json_prints(tmp_path: Path) -> None:
    """The FAQ's JSON error is, key for key and value for value, what ``--json`` prints."""
    entries = faq_json_entries()
    assert len(entries) == 1
    block, code, shown = entries[0]
    proc = _in_fresh_copy(tmp_path, block)
    assert proc.returncode == code, proc.stderr
    assert json.loads(proc.stdout) == json.loads(shown)


def test_layouts_page_shows_what_info_prints(tmp_path: Path) -> None:
    """docs/layouts.md's ``zckpt info`` output, its notation of ``tensor_map`` and its column
    names are what ``zckpt info`` prints for that strategy file."""
    text = (DOCS / "layouts.md").read_text(encoding="utf-8")
    found = re.findall(r"^<!-- info: (\S+) -->\n```text\n(.*?)^```$", text, re.S | re.M)
    assert len(found) == 1
    path, shown = found[0]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["zckpt", "info", path], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
    header = shown.splitlines()[1].split()
    for column in header[2:]:  # every field after name and stage is one the page explains
        assert f"| `{column}` |" in text, column
    row = next(re.split(r"\s{2,}", line) for line in shown.splitlines() if line.startswith("layer1.weight "))
    assert row[2:] == ["[2, 2, 2]", "[-1, 1]", "0"]
    assert "`dev_matrix [2, 2, 2]` and `tensor_map\n[-1, 1]`" in text  # the prose uses the same notation


@pytest.mark.parametrize("entry", faq_entries(), ids=lambda e: e.heading)
def test_faq_errors_are_what_zckpt_prints(entry: FaqEntry, tmp_path: Path) -> None:
    """Each entry alone, in a fresh directory: the setup block, then the entry's block."""
    proc = _in_fresh_copy(tmp_path, entry.block)
    assert proc.returncode == entry.code, (proc.returncode, proc.stderr[-3000:])
    assert entry.pattern().search(proc.stderr), f"docs/faq.md shows:\n{entry.message}\nzckpt printed:\n{proc.stderr}"
    leftovers = [p for p in (tmp_path / "faq").rglob("*") if p.name.endswith(".tmp-zckpt")]
    assert leftovers == []
