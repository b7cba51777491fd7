"""The ingest's helper process (zckpt.run.helper): the store it helps write is the one a single
process writes, byte for byte; a failure in its share reaches the caller with the file and
reason; a helper that dies, or a caller killed mid-run, leaves nothing that looks complete
and no helper behind. Values are checked against the generator's, not read back from zckpt."""

from __future__ import annotations

import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import SourceError, ZckptError
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.run import helper
from zckpt.run.engines import run_all
from zckpt.run.helper import Helper
from zckpt.write import group_writer

ROOT = Path(__file__).resolve().parents[1]
RANKS = 40  # two ranks per record group (ceil(40 / 32)): the helper's share starts on a group border


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> GeneratedModel:
    rng = np.random.default_rng(40)
    tensors = [TensorDef(f"layer{i}.w", (160, 24), "Float32" if i % 3 else "BFloat16",
                         random_layout(rng, (160, 24), RANKS)) for i in range(12)]
    return write_model(tmp_path_factory.mktemp("helper") / "src", tensors, device_num=RANKS)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _args(job: GeneratedModel, store: Path, *extra: str) -> list[str]:
    return ["ingest", str(job.root), "--strategy", str(job.strategy_path), "--store", str(store), "--quiet", *extra]


def _helpers_of(pid: int) -> list[int]:
    """Processes running ``zckpt.run.helper`` for the process ``pid`` (its pid is their first argument)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"zckpt.run.helper" in argv and str(pid).encode() in argv:
            found.append(int(entry.name))
    return found


def test_store_with_a_helper_is_the_single_process_store(job: GeneratedModel, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    shares: list[tuple[int, int]] = []
    from zckpt.run import helper as helper_mod

    real = helper_mod.share_from

    def spy(sizes: list[int], step: int) -> int:
        first: int = real(sizes, step)
        shares.append((first, len(sizes)))
        return first

    monkeypatch.setattr(helper_mod, "share_from", spy)
    alone, helped = tmp_path / "alone.zarr", tmp_path / "helped.zarr"
    assert cli_main(_args(job, alone, "--no-helper")) == 0
    assert not shares, "--no-helper still split the ranks"
    assert cli_main(_args(job, helped, "--helper")) == 0
    assert shares and 0 < shares[0][0] < shares[0][1] == RANKS and shares[0][0] % 2 == 0
    assert _snapshot(helped) == _snapshot(alone)
    st = zckpt.open_store(helped)
    for t in job.tensors:
        got, want = np.asarray(st.array(t.name)[...]), job.global_value(t.name)
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), t.name


def test_failure_in_the_helpers_share_names_the_file(job: GeneratedModel, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    import shutil

    shutil.copytree(job.root, src)
    real = Helper.submit
    cut: list[Path] = []

    def truncate_helpers_rank(self: Helper, fn: Any, *args: Any) -> None:
        path = Path(args[0][-1].path)  # the helper's last rank
        os.truncate(path, path.stat().st_size // 2)
        cut.append(path)
        real(self, fn, *args)

    monkeypatch.setattr(Helper, "submit", truncate_helpers_rank)
    store = tmp_path / "s.zarr"
    code = cli_main(["ingest", str(src), "--strategy", str(job.strategy_path), "--store", str(store), "--quiet",
                     "--helper"])
    err = capsys.readouterr().err
    assert cut and code == 1
    assert cut[0].name in err and "the file changed after planning" in err, err
    assert not store.exists()


def test_a_helper_that_dies_fails_the_ingest(job: GeneratedModel, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    real = Helper.result

    def killed_first(self: Helper) -> object:
        self.proc.send_signal(signal.SIGKILL)
        return real(self)

    monkeypatch.setattr(Helper, "result", killed_first)
    store = tmp_path / "s.zarr"
    code = cli_main(_args(job, store, "--helper"))
    err = capsys.readouterr().err
    assert code == 1 and "helper process ended without a result" in err
    assert not store.exists()


def test_killed_ingest_takes_its_helper_along_and_resumes(job: GeneratedModel, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ref = tmp_path / "ref.zarr"
    assert cli_main(_args(job, ref, "--no-helper")) == 0
    store = tmp_path / "s.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "zckpt.cli", *_args(job, store, "--helper")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    helpers: list[int] = []
    deadline = time.monotonic() + 60
    while not helpers and proc.poll() is None and time.monotonic() < deadline:
        helpers = _helpers_of(proc.pid)
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.fail("the ingest ended before its helper was seen: the job is too small for this test")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _helpers_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert helpers and not _helpers_of(proc.pid), "the helper outlived the ingest that started it"
    assert cli_main(_args(job, store, "--helper")) == 0
    assert _snapshot(store) == _snapshot(ref)


def test_busy_helper_ends_with_the_process_that_started_it() -> None:
    """A helper in the middle of its call (not waiting for one, which ends on its own when the
    pipe closes) is killed with its caller: a rerun must not meet it writing."""
    code = ("import time, zckpt.run.helper as h\n"
            "x = h.Helper()\nx.submit(time.sleep, 60)\nprint('submitted', flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    caller = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 30
        helpers = _helpers_of(caller.pid)
        while not helpers and time.monotonic() < deadline:
            time.sleep(0.05)
            helpers = _helpers_of(caller.pid)
        assert helpers, "no helper process found"
        time.sleep(0.5)  # the helper has read its call and sleeps in it
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 10
        while _helpers_of(caller.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _helpers_of(caller.pid), "the busy helper outlived its caller"
    finally:
        if caller.poll() is None:
            caller.kill()
        for pid in _helpers_of(caller.pid):
            os.kill(pid, signal.SIGKILL)


def test_helper_returns_results_and_raises_errors_as_raised() -> None:
    from zckpt.core.errors import CheckpointFormatError
    from zckpt.formats.ckpt import CkptReader

    with Helper() as h:
        h.submit(divmod, 17, 5)
        assert h.result() == (3, 2)
    with Helper(["zckpt.formats.ckpt"]) as h:
        h.submit(CkptReader, "/nonexistent/rank_0.ckpt")
        with pytest.raises(CheckpointFormatError) as info:
            h.result()
    assert info.value.path == "/nonexistent/rank_0.ckpt" and "cannot open" in str(info.value)
    with Helper() as h:
        h.submit(os.kill, os.getpid() + 10**7, 0)  # no such process: a builtin error crosses too
        with pytest.raises(ProcessLookupError):
            h.result()


def test_exception_that_cannot_cross_keeps_its_class_name_and_message() -> None:
    import io

    from zckpt.run.helper import _answer

    out = io.BytesIO()
    _answer(out, "error", _Unpicklable("lost"))
    kind, value = pickle.loads(out.getvalue())
    assert kind == "error" and isinstance(value, ZckptError) and str(value) == "_Unpicklable: lost"
    err = SourceError("bad", path="f.ckpt", param="w")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SourceError and (back.path, back.param, str(back)) == ("f.ckpt", "w", str(err))


class _Unpicklable(Exception):
    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("no")


def test_no_helper_where_none_can_start(job: GeneratedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_processes(*args: object, **kwargs: object) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_processes)
    store = tmp_path / "s.zarr"
    assert cli_main(_args(job, store, "--helper")) == 0  # in this process alone
    st = zckpt.open_store(store)
    for t in job.tensors:
        assert np.asarray(st.array(t.name)[...]).tobytes() == job.global_value(t.name).tobytes(), t.name


def test_helper_never_used_ends_quietly() -> None:
    h = Helper(["zckpt.jobs.ingest"])
    h.close()
    assert h.proc.returncode is not None


def _dst_strategy(job: GeneratedModel, tmp_path: Path, ranks: int) -> Path:
    from zckpt.formats.strategy import StrategyMap, encode_strategy

    rng = np.random.default_rng(ranks)
    layouts = {}
    for t in job.tensors:
        layout = random_layout(rng, t.shape, ranks)
        assert layout is not None
        layouts[t.name] = {0: layout}
    dst = StrategyMap(layouts=layouts)
    path = tmp_path / f"dst{ranks}.ckpt"
    path.write_bytes(encode_strategy(dst))
    return path


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many units each helper was given (its call goes through unchanged)."""
    counts: list[int] = []
    real = Helper.submit

    def spy(self: Helper, fn: Any, *args: Any) -> None:
        counts.append(len(args[0]))
        real(self, fn, *args)

    monkeypatch.setattr(Helper, "submit", spy)
    return counts


def test_export_with_a_helper_writes_the_single_process_files(job: GeneratedModel, tmp_path: Path,
                                                              submitted: list[int], one_by_one: None) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(_args(job, store, "--no-helper")) == 0
    dst = _dst_strategy(job, tmp_path, 6)
    alone, helped = tmp_path / "alone", tmp_path / "helped"
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(alone), "--quiet", "--no-helper"]) == 0
    assert not submitted
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(helped), "--quiet", "--helper"]) == 0
    assert submitted and 0 < submitted[0] < 6
    assert _snapshot(helped) == _snapshot(alone)
    reference = tmp_path / "whole"  # one rank holding every tensor, compared with the generator's values
    assert cli_main(["export", str(store), "--out", str(reference), "--quiet", "--helper"]) == 0
    from zckpt.formats.ckpt import CkptReader

    with CkptReader(next(reference.rglob("*.ckpt"))) as r:
        for t in job.tensors:
            assert np.asarray(r.array(t.name)).tobytes() == job.global_value(t.name).tobytes(), t.name


def test_transform_with_a_helper_writes_the_single_process_files(job: GeneratedModel, tmp_path: Path,
                                                                 submitted: list[int], one_by_one: None) -> None:
    dst = _dst_strategy(job, tmp_path, 5)
    outs = {}
    for flag in ("--no-helper", "--helper"):
        outs[flag] = tmp_path / flag.strip("-")
        assert cli_main(["transform", str(job.root), "--src-strategy", str(job.strategy_path), "--dst-strategy",
                         str(dst), "--out", str(outs[flag]), "--quiet", flag]) == 0
        assert bool(submitted) == (flag == "--helper")
    assert 0 < submitted[0] < 5
    assert _snapshot(outs["--helper"]) == _snapshot(outs["--no-helper"])


def test_source_major_groups_split_with_the_helper_write_the_single_process_files(
        job: GeneratedModel, tmp_path: Path, submitted: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Source-major, the helper takes a group of files: the same files as one process writes."""
    store = tmp_path / "s.zarr"
    assert cli_main(_args(job, store, "--no-helper")) == 0
    dst = _dst_strategy(job, tmp_path, 6)
    monkeypatch.setattr(group_writer, "GAIN", 0.0)
    monkeypatch.setattr(group_writer, "SPLIT_COST", math.inf)
    outs = {}
    for flag in ("--no-helper", "--helper"):
        outs[flag] = tmp_path / flag.strip("-")
        assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(outs[flag]), "--quiet",
                         flag]) == 0
    assert submitted == [1]  # one group of files
    assert _snapshot(outs["--helper"]) == _snapshot(outs["--no-helper"])


def test_export_failure_in_the_helpers_share_leaves_no_final_file(job: GeneratedModel, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  one_by_one: None) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(_args(job, store, "--no-helper", "--pack-size", "0")) == 0  # each tensor its own array
    dst = _dst_strategy(job, tmp_path, 4)
    real = Helper.submit
    damaged: list[tuple[str, str]] = []

    def damage_a_chunk_then_submit(self: Helper, fn: Any, *args: Any) -> None:
        rank, target = args[0][-1]  # the helper's last file
        name = rank.slices[0].name
        chunks = [p for p in sorted((store / "tensors" / name).rglob("*")) if p.is_file() and p.name != "zarr.json"]
        assert chunks, name
        for chunk in chunks:  # every chunk of that tensor, whichever the file reads
            data = bytearray(chunk.read_bytes())
            data[0] ^= 0xFF
            chunk.write_bytes(bytes(data))
        damaged.append((name, target))
        real(self, fn, *args)

    monkeypatch.setattr(Helper, "submit", damage_a_chunk_then_submit)
    out = tmp_path / "out"
    code = cli_main(["export", str(store), "--strategy", str(dst), "--out", str(out), "--quiet", "--helper"])
    err = capsys.readouterr().err
    assert damaged and code == 1 and damaged[0][0] in err and "s.zarr" in err, err
    assert not Path(damaged[0][1]).exists(), "the file that read damaged bytes was published"


def test_helper_wanted_for_many_source_ranks_and_a_free_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from zckpt.run import engines as runner
    from zckpt.run.helper import HELPER_BYTES, HELPER_RANKS, wanted

    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    big = HELPER_BYTES
    assert wanted(None, 1, None, big, HELPER_RANKS)
    assert not wanted(None, 1, None, big, HELPER_RANKS - 1)  # a few large runs: the disk is the bound
    assert not wanted(None, 1, None, big - 1, 512)
    assert not wanted(None, 2, None, big, 512) and not wanted(None, 1, "tcp://h:8786", big, 512)  # Dask runs it
    assert wanted(True, 1, None, 0, 1) and not wanted(False, 1, None, big, 512)
    monkeypatch.setattr(runner, "usable_cpus", lambda: 1)
    assert not wanted(None, 1, None, big, 512)


@pytest.mark.parametrize("command", ["export", "transform"])
def test_transform_takes_a_helper_for_many_destination_ranks_of_few_sources(command: str, tmp_path: Path,
                                                                             submitted: list[int],
                                                                             one_by_one: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A scale-up from 4 to 40 ranks moves its bytes in small pieces too: left to decide (no
    ``--helper`` flag), a transform takes a helper for 40 destination ranks and none for 8; an
    export counts the store's source ranks only (a helper did not pay there)."""
    from zckpt.run import engines as runner

    rng = np.random.default_rng(4)
    few = write_model(tmp_path / "src", [TensorDef(f"w{i}", (80, 16), "Float32", random_layout(rng, (80, 16), 4))
                                         for i in range(6)], device_num=4)
    store = tmp_path / "s.zarr"
    assert cli_main(_args(few, store, "--no-helper")) == 0
    monkeypatch.setattr(helper, "HELPER_BYTES", 0)
    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    for ranks in (8, helper.HELPER_RANKS + 8):
        dst, out = _dst_strategy(few, tmp_path, ranks), tmp_path / f"out{ranks}"
        args = ["export", str(store), "--strategy", str(dst)] if command == "export" else \
            ["transform", str(few.root), "--src-strategy", str(few.strategy_path), "--dst-strategy", str(dst)]
        submitted.clear()
        assert cli_main([*args, "--out", str(out), "--quiet"]) == 0
        assert bool(submitted) == (command == "transform" and ranks >= helper.HELPER_RANKS), (ranks, submitted)


def test_share_from_halves_the_bytes_on_step_borders() -> None:
    from zckpt.run.helper import share_from

    assert share_from([1, 1, 1, 1]) == 2
    assert share_from([10, 1, 1, 1]) == 1
    assert share_from([1, 1, 1, 1, 1, 1], step=4) == 4
    assert share_from([5]) == 1 and share_from([]) == 0


def test_run_all_runs_the_units_aside_elsewhere_in_order() -> None:
    calls: list[int] = []

    def fn(u: int, *, report: object) -> int:
        calls.append(u)
        return u * 10

    out = run_all(fn, [1, 2, 3, 4], client=None, label="t", aside=(2, lambda: [30, 40]))
    assert out == [10, 20, 30, 40] and calls == [1, 2]
    with pytest.raises(ValueError):
        run_all(fn, [1], client=object(), label="t", aside=(0, lambda: [10]))


def test_the_helper_imports_the_same_zckpt_from_an_uninstalled_tree(tmp_path: Path) -> None:
    """A zckpt put on ``sys.path`` by hand (not installed) starts its helper on the same tree."""
    copy = tmp_path / "tree"
    shutil.copytree(Path(helper.__file__).resolve().parents[1], copy / "zckpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert helper.package_root() / "zckpt" == Path(helper.__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import zckpt.run.helper as h; "
            "print(h.package_root()); from zckpt.run.helper import Helper\n"
            "with Helper() as p:\n"
            "    p.submit(h.package_root)\n"
            "    print(p.result())\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, str(copy)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(copy), str(copy)]


@pytest.mark.parametrize("command", ["export", "transform"])
def test_a_helper_given_nothing_leaves_this_process_its_read_ahead(command: str, job: GeneratedModel, tmp_path: Path,
                                                                   submitted: list[int],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One source-major group (files that share their reads are not cut in two): the helper
    process gets nothing, so the group's task reads ahead on a second thread, as without a
    helper (beside a helper with work, each process has one core and reads inline)."""
    from zckpt.run import engines as runner
    from zckpt.write import boxes

    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    monkeypatch.setattr(group_writer, "GAIN", 0.0)
    monkeypatch.setattr(group_writer, "SPLIT_COST", 0.0)  # never cut: one group
    asked: list[bool] = []
    real = boxes.reading_ahead

    def spy(overlap: bool) -> Any:
        asked.append(overlap)
        return real(overlap)

    monkeypatch.setattr(group_writer, "reading_ahead", spy)
    dst = _dst_strategy(job, tmp_path, 6)
    if command == "export":
        store = tmp_path / "s.zarr"
        assert cli_main(_args(job, store, "--no-helper")) == 0
        args = ["export", str(store), "--strategy", str(dst)]
    else:
        args = ["transform", str(job.root), "--src-strategy", str(job.strategy_path), "--dst-strategy", str(dst)]
    assert cli_main([*args, "--out", str(tmp_path / "out"), "--quiet", "--helper"]) == 0
    assert not submitted and asked == [True]


def test_submit_returns_while_the_helper_is_still_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call larger than the pipe holds is sent on a thread: the caller goes on with its own
    share while the helper finishes its imports, and the helper still gets the call whole."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    payload = bytes(range(256)) * 16384  # 4 MiB
    with Helper(["slow_to_import"]) as h:
        t0 = time.monotonic()
        h.submit(len, payload)
        assert time.monotonic() - t0 < 1.5
        assert h.result() == len(payload)
