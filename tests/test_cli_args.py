"""The command line's one vocabulary: every size option reads a SIZE the same way (a plain
number is MiB) and hands bytes to the API; a path that is not there exits 1 in every command,
a command line that cannot be read exits 2; a misspelt command or option gets a suggestion;
bare ``zckpt`` prints the help; ``info`` on a file that is none of what it reads says so."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zckpt.cli.main import EXIT_USAGE
from zckpt.cli.main import main as cli_main

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC, SRC_S = str(EXAMPLE / "src/checkpoints"), str(EXAMPLE / "src/strategy.ckpt")
KiB, MiB, GiB = 1024, 1024**2, 1024**3
INGEST, EXPORT, TRANSFORM, VERIFY = (importlib.import_module(f"zckpt.jobs.{m}")  # the modules, not zckpt's functions
                                     for m in ("ingest", "export", "transform", "verify"))


class Called(Exception):
    """Raised by the stand-in of an API function: what the command line handed it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("called")
        self.args_, self.kwargs = args, kwargs


def _record(*args: Any, **kwargs: Any) -> None:
    raise Called(args, kwargs)


def _options(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, argv: list[str]) -> Any:
    """The options object (or keyword arguments) ``zckpt ARGV`` hands to ``module.name``."""
    monkeypatch.setattr(module, name, _record)
    with pytest.raises(Called) as got:
        cli_main(argv)
    call = got.value
    return call.kwargs.get("options", call.args_[-1] if name == "ingest" else call.kwargs)


SIZES = [("64", 64 * MiB), ("1024", 1024 * MiB), ("3", 3 * MiB), ("512KiB", 512 * KiB), ("512KB", 512_000),
         ("2GiB", 2 * GiB), ("2GB", 2_000_000_000), ("1.5G", int(1.5 * GiB)), ("24MiB", 24 * MiB),
         ("20MB", 20_000_000), ("40000000B", 40_000_000), ("16m", 16 * MiB)]


@pytest.mark.parametrize(("text", "size"), SIZES)
def test_every_size_option_reads_a_size_one_way(monkeypatch: pytest.MonkeyPatch, text: str, size: int) -> None:
    """A plain number is MiB for every size option, and each unit means the same everywhere;
    checked on the values that reach the API."""
    big = ["--max-mem", "64GiB"]  # room for any step size below
    ing = _options(monkeypatch, INGEST, "ingest", ["ingest", SRC, "--store", "s", *big, "--chunk-size", text,
                                                         "--block-size", text, "--pack-size", text])
    assert (ing.chunk_bytes, ing.block_bytes, ing.pack_bytes) == (size, size, size)
    for argv, module, name in ((["export", "s", "--out", "o"], EXPORT, "export"),
                               (["transform", SRC, "--out", "o"], TRANSFORM, "transform")):
        opts = _options(monkeypatch, module, name, [*argv, *big, "--block-size", text, "--max-file-size", text])
        assert (opts.block_bytes, opts.max_file_bytes) == (size, size)
    ver = _options(monkeypatch, VERIFY, "verify", ["verify", "s", "--block-size", text])
    assert ver["block_bytes"] == size
    if size >= 16 * MiB:
        ing = _options(monkeypatch, INGEST, "ingest", ["ingest", SRC, "--store", "s", "--max-mem", text])
        assert (ing.block_bytes, ing.chunk_bytes) == (size // 4, min(64 * MiB, size // 16))  # as the help says
        for argv, module, name in ((["export", "s", "--out", "o"], EXPORT, "export"),
                                   (["transform", SRC, "--out", "o"], TRANSFORM, "transform")):
            assert _options(monkeypatch, module, name, [*argv, "--max-mem", text]).block_bytes == size // 4


def test_size_defaults_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    ing = _options(monkeypatch, INGEST, "ingest", ["ingest", SRC, "--store", "s"])
    assert (ing.block_bytes, ing.chunk_bytes, ing.pack_bytes) == (256 * MiB, 64 * MiB, 64 * KiB)
    assert _options(monkeypatch, INGEST, "ingest", ["ingest", SRC, "--store", "s", "--pack-size", "0"]) \
        .pack_bytes == 0
    exp = _options(monkeypatch, EXPORT, "export", ["export", "s", "--out", "o", "--max-file-size", "0"])
    assert (exp.block_bytes, exp.max_file_bytes) == (256 * MiB, 0)
    assert _options(monkeypatch, VERIFY, "verify", ["verify", "s"])["block_bytes"] == 64 * MiB


@pytest.mark.parametrize("argv", [
    ["ingest", SRC, "--store", "s", "--max-mem", "1024KiB"],  # below the least, 16 MiB
    ["ingest", SRC, "--store", "s", "--max-mem", "15"],
    ["ingest", SRC, "--store", "s", "--chunk-size", "0"],
    ["ingest", SRC, "--store", "s", "--block-size", "12XB"],
    ["ingest", SRC, "--store", "s", "--pack-size", "-1"],
    ["export", "s", "--out", "o", "--block-size", "lots"],
    ["export", "s", "--out", "o", "--max-file-size", "1.5.2G"],
    ["transform", SRC, "--out", "o", "--max-mem", "0"],
    ["verify", "s", "--block-size", "0B"],
    ["export", "s", "--out", "o", "--workers", "0"],
])
def test_a_size_that_cannot_be_read_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as bad:
        cli_main(argv)
    assert bad.value.code == EXIT_USAGE
    assert "error: argument --" in capsys.readouterr().err


MISSING = {
    "info": ["info", "{m}"],
    "ingest": ["ingest", "{m}", "--store", "{t}/s.zarr"],
    "ingest strategy": ["ingest", SRC, "--src-strategy", "{m}", "--store", "{t}/s.zarr"],
    "export": ["export", "{m}", "--out", "{t}/o"],
    "export strategy": ["export", "{store}", "--dst-strategy", "{m}", "--out", "{t}/o"],
    "transform": ["transform", "{m}", "--out", "{t}/o"],
    "transform strategy": ["transform", SRC, "--src-strategy", SRC_S, "--dst-strategy", "{m}", "--out", "{t}/o"],
    "plan": ["plan", "--src-strategy", "{m}"],
    "verify": ["verify", "{m}"],
    "verify sources": ["verify", "{store}", "{m}"],
    "load": ["load", "{m}", "--param", "layer1.weight"],
    "load strategy": ["load", "{store}", "--dst-strategy", "{m}", "--param", "layer1.weight"],
    "consolidate": ["consolidate", "{m}"],
    "merge-strategies": ["merge-strategies", "{m}", "--out", "{t}/merged.ckpt"],
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("store") / "s.zarr"
    assert cli_main(["ingest", SRC, "--src-strategy", SRC_S, "--store", str(path), "--quiet"]) == 0
    return path


@pytest.mark.parametrize("case", sorted(MISSING))
def test_a_missing_path_exits_1_in_every_command(case: str, tmp_path: Path, store: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A path that is not there is a refusal of the input (1), named in the message; 2 is for
    a command line that cannot be read."""
    missing = tmp_path / "no" / "such.thing"
    argv = [a.format(m=missing, t=tmp_path, store=store) for a in MISSING[case]]
    assert cli_main(argv) == 1
    said = capsys.readouterr()
    assert str(missing) in said.err + said.out  # verify reports it among its mismatches


def test_usage_errors_stay_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["verify", "s.zarr", "--src-strategy", SRC_S]) == EXIT_USAGE  # zckpt's own check
    assert cli_main(["plan", "--src-strategy", SRC_S, "--svg", "x.svg"]) == EXIT_USAGE
    assert cli_main(["ingest", SRC, "--store", "s", "--storage-option", "novalue"]) == EXIT_USAGE
    assert cli_main(["ingest", SRC, "--store", "s", "--specify-prefix", ""]) == EXIT_USAGE
    assert capsys.readouterr().err.count("error:") == 4


@pytest.mark.parametrize(("argv", "said"), [
    (["exprot", "s"], "did you mean 'export'?"),
    (["merge-strategy", "d"], "did you mean 'merge-strategies'?"),
    (["export", "s", "--out", "o", "--blok-size", "3"], "--blok-size (did you mean --block-size?)"),
    (["export", "s", "--out", "o", "--dst-stratgy", "d"], "--dst-stratgy (did you mean --dst-strategy?)"),
    (["ingest", "s", "--store", "o", "--strategi", "d"], "--strategi (did you mean --src-strategy?)"),
    (["transform", "s", "--out", "o", "--no-verify-crcs"], "--no-verify-crcs (did you mean --no-verify-checksums?)"),
    (["info", "x", "--jsno"], "--jsno (did you mean --json?)"),
    (["export", "s", "--out", "o", "--format", "safetensor"], "did you mean 'safetensors'?"),
    (["ingest", "s", "--store", "o", "--chunk", "3"], "ambiguous option: --chunk; did you mean --chunk-size?"),
    (["plan", "--src-strategy", "s", "--s", "x"],
     "could match --src-strategy, --svg, --shape, --src, --storage-option"),
])
def test_a_misspelt_command_or_option_gets_a_suggestion(argv: list[str], said: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as bad:
        cli_main(argv)
    assert bad.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert said in err, err


def test_an_unknown_option_far_from_any_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["info", "x", "--zzzzzzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzzzzzz" in err and "did you mean" not in err


def test_bare_zckpt_prints_the_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "zckpt.cli"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: zckpt") and proc.stderr == ""
    for command in ("ingest", "export", "transform", "plan", "info", "merge-strategies", "load", "consolidate",
                    "verify"):
        assert f"\n    {command} " in proc.stdout or f"\n    {command}\n" in proc.stdout, command


def test_info_on_a_file_of_another_kind_says_what_it_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert cli_main(["info", str(readme)]) == 1
    err = capsys.readouterr().err
    assert f"file {readme}: not a checkpoint (.ckpt, .safetensors), strategy file or zckpt store" in err
    assert "protobuf" not in err
    cut = tmp_path / "cut.ckpt"  # a checkpoint by its name: what is wrong with it is the news
    shutil.copy(EXAMPLE / "src/checkpoints/rank_2/checkpoint_2.ckpt", cut)
    with cut.open("r+b") as f:
        f.truncate(1000)
    assert cli_main(["info", str(cut)]) == 1
    assert "corrupt or truncated protobuf" in capsys.readouterr().err
