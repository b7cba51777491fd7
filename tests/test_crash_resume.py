"""Crash safety: SIGKILL ingest and export at random moments, rerun, get the uninterrupted bytes.

Real processes (the CLI) are killed; after each kill nothing may look complete that is not
(no store marked complete early, no final-name rank file that does not parse), and
rerunning the same command must finish the job with a result byte-identical to an
uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef

ROOT = Path(__file__).resolve().parents[1]
INGEST_TRIALS = 12
EXPORT_TRIALS = 10
TRANSFORM_TRIALS = 6


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "zckpt.cli", *args, "--quiet"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(cmd: list[str]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    return time.monotonic() - t0


def _kill_after(cmd: list[str], delay: float) -> bool:
    """Start ``cmd``, SIGKILL it after ``delay`` s; True if it was killed before finishing."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("crash")
    rng = random.Random(7)
    import numpy as np

    nrng = np.random.default_rng(7)
    tensors = [TensorDef(f"layer{i}.w", (96, 64), "Float32" if i % 3 else "BFloat16",
                         random_layout(nrng, (96, 64), 8)) for i in range(60)]
    model = write_model(tmp / "src", tensors, device_num=8, strings={"run": "crash"})
    dst = StrategyMap(layouts={t.name: {0: random_layout(nrng, t.shape, 4)} for t in tensors})
    (tmp / "dst.ckpt").write_bytes(encode_strategy(dst))
    assert model.strategy_path is not None and rng
    return {"tmp": tmp, "src": tmp / "src", "strategy": model.strategy_path, "dst": tmp / "dst.ckpt"}


def test_ingest_killed_at_random_points_resumes_to_identical_store(job: dict[str, Path]) -> None:
    tmp = job["tmp"]
    ref_store = tmp / "ref.zarr"
    cmd = lambda store: _cli("ingest", str(job["src"]), "--strategy", str(job["strategy"]),  # noqa: E731
                             "--store", str(store), "--chunk-mb", "1")
    duration = _run(cmd(ref_store))
    reference = _snapshot(ref_store)
    rng = random.Random(20261123)
    killed = 0
    for trial in range(INGEST_TRIALS):
        store = tmp / f"s{trial}.zarr"
        if _kill_after(cmd(store), rng.uniform(0.2, duration)):
            killed += 1
            if (store / "zarr.json").is_file():
                meta = json.loads((store / "zarr.json").read_text())["attributes"]["zckpt"]
                assert not meta.get("complete") or _snapshot(store) == reference, f"trial {trial}: complete too early"
        _run(cmd(store))
        assert _snapshot(store) == reference, f"trial {trial}: store differs after resume"
        shutil.rmtree(store)
    print(f"ingest: {killed} of {INGEST_TRIALS} runs killed mid-way, all resumed to the reference store")
    assert killed >= INGEST_TRIALS // 2, f"only {killed} runs were killed before finishing"


def _killed_and_resumed(what: str, cmd: Callable[[Path], list[str]], tmp: Path, ref: Path, trials: int,
                        seed: int) -> None:
    """Run ``cmd`` once whole into ``ref``, then ``trials`` times SIGKILLed at a random point and
    rerun: each rerun ends with the reference files and nothing of zckpt's beside them."""
    duration = _run(cmd(ref))
    reference = _snapshot(ref)
    rng = random.Random(seed)
    killed = runs = 0
    while runs < trials or (killed < trials // 2 and runs < 3 * trials):  # a loaded machine finishes some first
        out = tmp / f"{what[0]}{runs}"
        if _kill_after(cmd(out), rng.uniform(0.2, duration)):
            killed += 1
            _check_killed(out, reference, runs)
        _run(cmd(out))
        assert _snapshot(out) == reference, f"trial {runs}: {what} differs after resume"
        assert _names(out) == set(reference), f"trial {runs}: the resumed {what} left files of its own"
        shutil.rmtree(out)
        runs += 1
    print(f"{what}: {killed} of {runs} runs killed mid-way, all resumed to the reference files")
    assert killed >= trials // 2, f"only {killed} of {runs} runs were killed before finishing"


def test_export_killed_at_random_points_resumes_to_identical_files(job: dict[str, Path]) -> None:
    tmp = job["tmp"]
    store = tmp / "exp.zarr"
    _run(_cli("ingest", str(job["src"]), "--strategy", str(job["strategy"]), "--store", str(store)))
    _killed_and_resumed("export", lambda out: _cli("export", str(store), "--strategy", str(job["dst"]), "--out",
                                                   str(out)), tmp, tmp / "ref", EXPORT_TRIALS, 11232026)


def test_transform_killed_at_random_points_resumes_to_identical_files(job: dict[str, Path]) -> None:
    tmp = job["tmp"]
    _killed_and_resumed("transform", lambda out: _cli("transform", str(job["src"]), "--src-strategy",
                                                      str(job["strategy"]), "--dst-strategy", str(job["dst"]),
                                                      "--out", str(out)), tmp, tmp / "tref", TRANSFORM_TRIALS, 25)


def _names(root: Path) -> set[str]:
    """Every file below ``root`` (whatever its name: zckpt's own files included)."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


def _check_killed(out: Path, reference: dict[str, bytes], trial: int) -> None:
    """What a killed run leaves: whole rank files (the reference's bytes), its marker (the
    run is incomplete), and no temporary file (new files are unnamed while written)."""
    for f in out.rglob("*.ckpt"):
        with CkptReader(f) as r:  # anything under a final name is whole
            assert r.names()
        assert f.read_bytes() == reference[str(f.relative_to(out))]
    left = _names(out) - set(reference) if out.is_dir() else set()
    assert left <= {".zckpt-export.json"}, f"trial {trial}: a killed run left {sorted(left)}"


def test_second_ingest_into_the_same_store_is_refused(job: dict[str, Path]) -> None:
    from zckpt.store.locking import store_lock

    store = job["tmp"] / "locked.zarr"
    with store_lock(store):
        proc = subprocess.run(_cli("ingest", str(job["src"]), "--strategy", str(job["strategy"]), "--store",
                                   str(store)), capture_output=True, text=True, env=_env(), check=False)
    assert proc.returncode == 1 and "another zckpt ingest" in proc.stderr
    assert not store.exists()


def test_many_readers_export_from_one_store_at_once(job: dict[str, Path]) -> None:
    tmp = job["tmp"]
    store = tmp / "shared.zarr"
    _run(_cli("ingest", str(job["src"]), "--strategy", str(job["strategy"]), "--store", str(store)))
    outs = [tmp / f"reader{i}" for i in range(4)]
    procs = [subprocess.Popen(_cli("export", str(store), "--strategy", str(job["dst"]), "--out", str(o)),
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for o in outs]
    for p in procs:
        assert p.wait(timeout=300) == 0
    first = _snapshot(outs[0])
    assert first and all(_snapshot(o) == first for o in outs[1:])
