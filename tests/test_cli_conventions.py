"""The command line behaves as people expect of a Unix tool: ``--version``, the help for a bare
``zckpt``, exit 2 for a command line that cannot be read and 1 for every refusal of input or
output, a suggestion for a misspelt option, errors as JSON with ``--json``, one reading of
sizes, quiet on a closed pipe and on Ctrl-C (no traceback, no temporary file left), no silent
overwrite. Signals are sent to real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import EXIT_INTERRUPT, EXIT_PIPE, EXIT_USAGE
from zckpt.cli.main import main as cli_main
from zckpt.cli.report import rank_ranges
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
CLI = [sys.executable, "-m", "zckpt.cli"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"zckpt {zckpt.__version__}"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:  # argparse's own
        cli_main(["export"])
    assert done.value.code == EXIT_USAGE
    assert cli_main(["info", str(EXAMPLE / "src/strategy.ckpt"), "--param", "x"]) == EXIT_USAGE  # zckpt's
    assert "go with --svg" in capsys.readouterr().err


def test_json_errors_are_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--src-strategy", "no/such/file", "--json"]) == 1
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["error"]["type"] == "StrategyError"
    assert doc["error"]["file"] == "no/such/file"
    assert doc["error"]["command"] == "plan"
    assert "no such strategy file" in out.err


@pytest.mark.parametrize("spelling", ["--out", "positional"])
def test_merge_strategies_does_not_overwrite_silently(tmp_path: Path, spelling: str) -> None:
    src = tmp_path / "s"
    src.mkdir()
    (src / "strategy_0.ckpt").write_bytes((EXAMPLE / "src/strategy.ckpt").read_bytes())
    out = tmp_path / "merged.ckpt"
    out.write_bytes(b"keep me")
    dest = ["--out", str(out)] if spelling == "--out" else [str(out)]
    assert cli_main(["merge-strategies", str(src), *dest]) == 1
    assert out.read_bytes() == b"keep me"
    assert cli_main(["merge-strategies", str(src), *dest, "--overwrite"]) == 0
    assert out.read_bytes() != b"keep me"


def test_merge_strategies_writes_to_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Like every other command, merge-strategies names what it writes with ``--out``."""
    src = tmp_path / "s"
    src.mkdir()
    (src / "strategy_0.ckpt").write_bytes((EXAMPLE / "src/strategy.ckpt").read_bytes())
    assert cli_main(["merge-strategies", str(src), "--out", str(tmp_path / "m.ckpt")]) == 0
    assert (tmp_path / "m.ckpt").is_file()
    assert cli_main(["merge-strategies", str(src)]) == EXIT_USAGE
    assert "required: --out" in capsys.readouterr().err
    assert cli_main(["merge-strategies", str(src), str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "b.ckpt")]) \
        == EXIT_USAGE
    assert not (tmp_path / "a.ckpt").exists() and not (tmp_path / "b.ckpt").exists()


def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    many = tmp_path / "many.ckpt"
    with CkptWriter(many) as w:
        for i in range(4000):  # far more than a pipe buffer of listing
            w.write_array(f"layer.{i}.weight_with_a_long_name", "Float32", np.zeros(1, np.float32))
    proc = subprocess.Popen([*CLI, "info", str(many)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == EXIT_PIPE
    assert err == ""


def _new_file_open(pid: int, out: Path) -> bool:
    """Whether process ``pid`` is writing a new file in ``out``: an unnamed one (a descriptor
    of a deleted file there, as ``/proc`` shows it) or one under a temporary name."""
    if list(out.rglob("*.tmp-zckpt")):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(out)) and target.endswith("(deleted)"):
            return True
    return False


def _ctrl_c_heard() -> None:
    """A terminal's Ctrl-C reaches the child: a suite started in the background of a shell
    without job control runs with SIGINT ignored, which a child inherits (and Python then
    installs no handler for it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    tensors = [TensorDef(f"w{i}", (2048, 1024), "Float32") for i in range(24)]  # 192 MiB
    model = write_model(tmp_path / "src", tensors, device_num=1, strategy_format=None, scalars=False)
    store, out = tmp_path / "s.zarr", tmp_path / "out"
    assert cli_main(["ingest", str(model.root), "--store", str(store), "--quiet"]) == 0
    for _ in range(3):
        proc = subprocess.Popen([*CLI, "export", str(store), "--out", str(out), "--quiet", "--overwrite",
                                 "--max-mem", "16MiB", "--no-overlap"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_ctrl_c_heard)
        deadline = time.monotonic() + 30
        while not _new_file_open(proc.pid, out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == EXIT_INTERRUPT, err
            assert b"Traceback" not in err and b"interrupted" in err
            assert list(out.rglob("*.tmp-zckpt")) == []
            assert list(out.rglob("*.ckpt")) == []
            return
        proc.communicate()
    pytest.fail("export finished before it could be interrupted three times")


def test_info_describes_job_and_rank_directories(capsys: pytest.CaptureFixture[str]) -> None:
    job = EXAMPLE / "src/checkpoints"
    assert cli_main(["info", str(job), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["type"] == "job"
    assert doc["ranks"] == {str(r): str(job / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(8)}
    assert cli_main(["info", str(job / "rank_5"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chosen_from"] == str(job / "rank_5") and doc["path"].endswith("checkpoint_5.ckpt")
    assert len(doc["entries"]) == 11
    assert cli_main(["info", str(EXAMPLE)]) == 1  # a refusal of the input, not of the command line
    assert "no store, no rank_<r>/ folders" in capsys.readouterr().err


@pytest.mark.parametrize("ranks, text", [([], "none"), ([3], "3"), ([0, 1, 2, 3, 8, 10, 11], "0-3, 8, 10-11"),
                                         (list(range(4096)), "0-4095"), ([1, 3, 5], "1, 3, 5")])
def test_plan_prints_rank_lists_as_ranges(ranks: list[int], text: str) -> None:
    assert rank_ranges(ranks) == text
    expanded = [] if text == "none" else [
        r for part in text.split(", ")
        for r in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))]
    assert expanded == ranks


@pytest.mark.parametrize("command", ["export", "transform"])
@pytest.mark.parametrize("prefix", ["../../x_", "a/b", "..\\x", "x\0"])
def test_a_prefix_cannot_leave_the_output_directory(tmp_path: Path, command: str, prefix: str) -> None:
    src_s, dst_s = str(EXAMPLE / "src/strategy.ckpt"), str(EXAMPLE / "dst/strategy.ckpt")
    out = tmp_path / "a" / "b" / "out"
    if command == "export":
        store = tmp_path / "s.zarr"
        assert cli_main(["ingest", str(EXAMPLE / "src/checkpoints"), "--strategy", src_s, "--store", str(store),
                         "--quiet"]) == 0
        argv = ["export", str(store), "--strategy", dst_s]
    else:
        argv = ["transform", str(EXAMPLE / "src/checkpoints"), "--src-strategy", src_s, "--dst-strategy", dst_s]
    before = sorted(p for p in tmp_path.rglob("*") if "s.zarr" not in p.parts)
    assert cli_main([*argv, "--out", str(out), "--prefix", prefix, "--quiet"]) == EXIT_USAGE
    assert sorted(p for p in tmp_path.rglob("*") if "s.zarr" not in p.parts) == before


def test_api_prefix_cannot_leave_the_output_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plain name"):
        zckpt.transform_checkpoints(str(EXAMPLE / "src/checkpoints"), str(tmp_path / "out"), "../x_",
                                    str(EXAMPLE / "src/strategy.ckpt"), str(EXAMPLE / "dst/strategy.ckpt"))
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("command", ["export", "transform", "api"])
def test_a_dangling_output_link_is_refused_by_name(tmp_path: Path, command: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    src_s, dst_s = str(EXAMPLE / "src/strategy.ckpt"), str(EXAMPLE / "dst/strategy.ckpt")
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere")
    if command == "api":
        with pytest.raises(zckpt.OutputError, match="symbolic link"):
            zckpt.transform_checkpoints(str(EXAMPLE / "src/checkpoints"), str(out), "c_", src_s, dst_s)
    elif command == "export":
        store = tmp_path / "s.zarr"
        assert cli_main(["ingest", str(EXAMPLE / "src/checkpoints"), "--strategy", src_s, "--store", str(store),
                         "--quiet"]) == 0
        assert cli_main(["export", str(store), "--strategy", dst_s, "--out", str(out), "--quiet"]) == 1
    else:
        assert cli_main(["transform", str(EXAMPLE / "src/checkpoints"), "--src-strategy", src_s,
                         "--dst-strategy", dst_s, "--out", str(out), "--quiet"]) == 1
    if command != "api":
        assert "symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


FIXED = {"ingest": ["SRC", "--store", "S"], "export": ["S", "--out", "O"], "verify": ["S"],
         "load": ["S", "--param", "p"], "transform": ["SRC", "--out", "O"]}


@pytest.mark.parametrize(("cmd", "new", "old", "value", "dest"), [
    ("ingest", "--src-strategy", "--strategy", "x.ckpt", "strategy"),
    ("export", "--dst-strategy", "--strategy", "x.ckpt", "strategy"),
    ("verify", "--src-strategy", "--strategy", "x.ckpt", "strategy"),
    ("load", "--dst-strategy", "--strategy", "x.ckpt", "strategy"),
    ("ingest", "--chunk-size", "--chunk-mb", "3", "chunk_bytes"),
    ("ingest", "--block-size", "--block-mb", "3", "block_bytes"),
    ("export", "--max-file-size", "--max-file-mb", "3", "max_file_bytes"),
    ("transform", "--no-verify-checksums", "--no-verify-crc", None, "no_verify_checksums"),
])
def test_one_option_name_with_the_old_spelling_kept_out_of_the_help(cmd: str, new: str, old: str,
                                                                     value: str | None, dest: str) -> None:
    """The help (and so cli.md) shows one name per option; the older spelling still works."""
    from zckpt.cli.doc import subcommands
    from zckpt.cli.parser import build_parser

    p = build_parser()
    given = [value] if value is not None else []
    assert getattr(p.parse_args([cmd, *FIXED[cmd], new, *given]), dest) == \
        getattr(p.parse_args([cmd, *FIXED[cmd], old, *given]), dest) != getattr(p.parse_args([cmd, *FIXED[cmd]]), dest)
    shown = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", subcommands(p)[cmd].format_help())
    assert new in shown and old not in shown


def test_no_verify_checksums_is_one_name_across_commands() -> None:
    from zckpt.cli.doc import options, subcommands
    from zckpt.cli.parser import build_parser

    subs = subcommands(build_parser())
    assert {name for name, sub in subs.items() if "--no-verify-checksums" in options(sub)} == {"export", "transform"}
    assert not any(o.startswith("--no-verify-") and o != "--no-verify-checksums"
                   for sub in subs.values() for o in options(sub))


_BLAS_PROBE = """
import atexit, ctypes, json, os, runpy, sys

def report():
    threads = None  # what numpy's OpenBLAS itself says, when its library is found
    libs = {l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l and l.split()[-1].endswith('.so')}
    for path in sorted(libs):
        lib = ctypes.CDLL(path)
        for name in ('scipy_openblas_get_num_threads64_', 'scipy_openblas_get_num_threads', 'openblas_get_num_threads'):
            if hasattr(lib, name):
                threads = getattr(lib, name)()
    print(json.dumps({'env': os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy': 'numpy' in sys.modules,
                      'blas_threads': threads}))

atexit.register(report)
sys.argv = ['zckpt', *sys.argv[1:]]
runpy.run_module('zckpt.cli.main', run_name='__main__', alter_sys=True)
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("own", [None, "2"])
def test_the_program_keeps_blas_on_one_thread_unless_told(tmp_path: Path, own: str | None) -> None:
    """``python -m zckpt.cli`` (as the console script) sets OPENBLAS_NUM_THREADS=1 before numpy
    is imported, so OpenBLAS starts no thread pool; a value the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    if own is not None:
        env["OPENBLAS_NUM_THREADS"] = own
    cmd = [sys.executable, "-c", _BLAS_PROBE, "plan", "--src-strategy", str(EXAMPLE / "src/strategy.ckpt"),
           "--dst-strategy", str(EXAMPLE / "dst/strategy.ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["numpy"]  # the command did import numpy: the setting was there before it
    assert got["env"] == (own or "1")
    if got["blas_threads"] is not None:
        assert got["blas_threads"] == min(int(own or "1"), os.cpu_count() or 1)


def test_main_leaves_the_callers_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the program (:func:`zckpt.cli.main.run`) sets the BLAS thread count; ``main`` called
    from Python changes nothing in its caller's process."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert cli_main(["plan", "--src-strategy", str(EXAMPLE / "src/strategy.ckpt")]) == 0
    assert "OPENBLAS_NUM_THREADS" not in os.environ
