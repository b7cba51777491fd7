"""Trust of a store across processes and time (issue 17): concurrency, staleness, damage.

Every case must end in correct data or a clear zckpt error naming the file or parameter,
never exit 0 with data that is neither the old nor the new (concurrency), old values after
the sources or the store changed (staleness), or wrong values from an edited manifest or a
store whose checksum records were removed (damage).

Expected values are computed here, independently of zckpt's export: the generator's global
values (model A) and their bitwise complement (model B, written by flipping every tensor
byte of A's rank files in place, so that B's files have A's sizes), sliced for each
destination rank by the independent re-slicer :mod:`oracle`. Concurrency uses real
processes (the CLI), started with random offsets.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from oracle import expected_shard, read_layouts

from zckpt.core.errors import StoreError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, global_value

ROOT = Path(__file__).resolve().parents[1]
DST_RANKS = 4


def _cli(*args: str) -> list[str]:
    quiet = ["--quiet"] if args[0] in ("ingest", "export", "transform") else []
    return [sys.executable, "-m", "zckpt.cli", *args, *quiet]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cli(*args), capture_output=True, text=True, env=_env(), check=False)


def _ok(*args: str) -> None:
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr


def _clean_refusal(proc: subprocess.CompletedProcess[str] | tuple[int, str], *words: str) -> None:
    """A non-zero exit with one zckpt error line (no traceback) holding every word."""
    code, err = (proc.returncode, proc.stderr) if isinstance(proc, subprocess.CompletedProcess) else proc
    assert code != 0, err
    assert "Traceback" not in err, err
    for w in words:
        assert w.lower() in err.lower(), (w, err)


def _complement(root: Path) -> None:
    """Flip every tensor byte of every rank file under ``root`` in place (sizes unchanged)."""
    for path in sorted(root.glob("rank_*/*.ckpt")):
        with CkptReader(path, verify_crc=False) as r:
            spans = [(s.offset, s.length) for e in r.entries.values() if e.kind == "tensor" for s in e.segments]
        with open(path, "r+b") as f:
            for offset, length in spans:
                f.seek(offset)
                data = np.frombuffer(f.read(length), np.uint8)
                f.seek(offset)
                f.write((~data).tobytes())


class Job:
    """Model A's and model B's sources (same layout, complementary bytes), a destination
    strategy, and the expected bytes of each destination file of either model."""

    def __init__(self, tmp: Path, tensors: int = 40, shape: tuple[int, int] = (256, 256), with_b: bool = True) -> None:
        nrng = np.random.default_rng(17)
        defs = [TensorDef(f"layer{i}.w", shape, "Float32" if i % 4 else "BFloat16",
                          random_layout(nrng, shape, 8)) for i in range(tensors)]
        self.tmp = tmp
        self.model = write_model(tmp / "a", defs, device_num=8)
        assert self.model.strategy_path is not None
        self.strategy = self.model.strategy_path
        if with_b:
            shutil.copytree(tmp / "a", tmp / "b")
            _complement(tmp / "b")
        dst = StrategyMap(layouts={t.name: {0: random_layout(nrng, t.shape, DST_RANKS)} for t in defs})
        self.dst = tmp / "dst.ckpt"
        self.dst.write_bytes(encode_strategy(dst))
        self.layouts = read_layouts(self.dst)

    def src(self, which: str) -> Path:
        return self.tmp / which

    def expected(self, name: str, rank: int, which: str) -> bytes:
        t = self.model.tensor(name)
        g = global_value(t.name, t.shape, t.ms_type)
        if which == "b":
            g = (~np.ascontiguousarray(g).reshape(-1).view(np.uint8)).view(g.dtype).reshape(g.shape)
        lay = self.layouts.get(name)
        part = g if lay is None else expected_shard(g, lay, rank)
        return np.ascontiguousarray(part).tobytes()

    def which(self, path: Path, rank: int) -> str:
        """``"a"`` or ``"b"`` when the file holds exactly that model's slices, else a description."""
        with CkptReader(path) as r:
            names = [n for n, e in r.entries.items() if e.kind == "tensor"]
            if sorted(names) != sorted(t.name for t in self.model.tensors):
                return f"entries {names}"
            got = {n: r.array(n).tobytes() for n in names}
        for which in ("a", "b"):
            if all(got[n] == self.expected(n, rank, which) for n in names):
                return which
        return "neither a nor b"

    def check_dir(self, out: Path, which: str) -> None:
        for rank in range(DST_RANKS):
            path = out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
            assert self.which(path, rank) == which, path


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return Job(tmp_path_factory.mktemp("trust"))


def _ingest(job: Job, which: str, store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _run("ingest", str(job.src(which)), "--strategy", str(job.strategy), "--store", str(store), *extra)


def _export_args(job: Job, store: Path, out: Path, *extra: str) -> list[str]:
    return ["export", str(store), "--strategy", str(job.dst), "--out", str(out), *extra]


def _export(job: Job, store: Path, out: Path, *extra: str) -> list[str]:
    return _cli(*_export_args(job, store, out, *extra))


# --------------------------------------------------------------------------- concurrency


_WARM = """
import sys, time
from pathlib import Path
import zckpt.cli.main
trigger = Path(sys.argv[1])
while not trigger.exists():
    time.sleep(0.001)
sys.exit(zckpt.cli.main.main(sys.argv[2:]))
"""


def _started_warm(trigger: Path, args: list[str]) -> subprocess.Popen[str]:
    """A CLI process with zckpt already imported, which runs ``args`` once ``trigger``
    exists: it starts within milliseconds of the moment the test chooses."""
    return subprocess.Popen([sys.executable, "-c", _WARM, str(trigger), *args, "--quiet"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _writing(out: Path) -> bool:
    """Whether a writer is at work in ``out``: its marker is there (from the moment it holds
    the directory to its last step), or a file under a temporary name."""
    return out.is_dir() and ((out / ".zckpt-export.json").exists() or any(out.rglob("*.tmp-zckpt")))


def _wait_for(found: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 120.0) -> bool:
    """Wait until ``found()`` holds while ``proc`` runs; False if it finished first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return False
        if found():
            return True
        time.sleep(0.001)
    return False


def test_export_racing_an_overwriting_ingest_gets_old_or_new_data(job: Job, tmp_path: Path) -> None:
    """Each trial starts one command, then the other (already imported) in the middle of it:
    an export while an ingest rewrites the store, or an ingest while an export reads it."""
    store = tmp_path / "store.zarr"
    assert _ingest(job, "a", store).returncode == 0
    holds = "a"
    rng = random.Random(17)
    overlapped = 0
    for trial in range(6):
        other = "b" if holds == "a" else "a"
        out = tmp_path / f"out{trial}"
        ingest_args = ["ingest", str(job.src(other)), "--strategy", str(job.strategy), "--store", str(store),
                       "--overwrite"]
        trigger = tmp_path / f"go{trial}"
        if trial % 2 == 0:
            export = _started_warm(trigger, _export_args(job, store, out))
            ingest = subprocess.Popen(_cli(*ingest_args), env=_env(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
            overlapped += _wait_for(lambda: (tmp_path / "store.zarr.lock").exists(), ingest)
        else:
            ingest = _started_warm(trigger, ingest_args)
            export = subprocess.Popen(_cli(*_export_args(job, store, out)), env=_env(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
            overlapped += _wait_for(partial(_writing, out), export)
        time.sleep(rng.uniform(0.0, 0.05))
        trigger.touch()
        _, export_err = export.communicate()
        _, ingest_err = ingest.communicate()
        if export.returncode == 0:
            seen = {job.which(out / f"rank_{r}" / f"checkpoint_{r}.ckpt", r) for r in range(DST_RANKS)}
            assert seen in ({"a"}, {"b"}), (trial, seen)
        else:
            _clean_refusal((export.returncode, export_err), "ingest", str(store))
        if ingest.returncode == 0:
            holds = other
        else:
            _clean_refusal((ingest.returncode, ingest_err), "another zckpt", str(store))
    assert overlapped, "the second command never started while the first was running"
    _ok("verify", str(store))
    out = tmp_path / "final"
    _ok(*_export_args(job, store, out))
    job.check_dir(out, holds)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """A model whose export takes long enough for a second writer to start in the middle."""
    return Job(tmp_path_factory.mktemp("big"), tensors=24, shape=(1024, 1024), with_b=False)


@pytest.mark.parametrize("command", ["export", "transform"])
def test_two_writers_into_one_output_directory(big: Job, tmp_path: Path, command: str) -> None:
    store = tmp_path / "store.zarr"
    if command == "export":
        assert _ingest(big, "a", store).returncode == 0
    overlapped = 0
    for trial in range(3):
        out = tmp_path / f"out{trial}"
        args = (_export_args(big, store, out) if command == "export" else
                ["transform", str(big.src("a")), "--src-strategy", str(big.strategy), "--dst-strategy",
                 str(big.dst), "--out", str(out)])
        trigger = tmp_path / f"go{trial}"
        second = _started_warm(trigger, args)
        first = subprocess.Popen(_cli(*args), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        overlapped += _wait_for(partial(_writing, out), first)
        trigger.touch()
        _, second_err = second.communicate()
        _, first_err = first.communicate()
        assert first.returncode == 0, first_err
        if second.returncode != 0:
            _clean_refusal((second.returncode, second_err), "another zckpt", str(out))
        big.check_dir(out, "a")
        assert not list(out.rglob("*.tmp-zckpt"))
    assert overlapped, "the second writer never started while the first was writing"


# --------------------------------------------------------------------------- staleness


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_resume_after_sources_changed_in_place(job: Job, tmp_path: Path, keep_mtime: bool) -> None:
    src = tmp_path / "src"
    shutil.copytree(job.src("a"), src)
    store = tmp_path / "store.zarr"
    _ok("ingest", str(src), "--strategy", str(job.strategy), "--store", str(store))
    for path in sorted(src.glob("rank_*/*.ckpt")):
        before = path.stat()
        rank_dir = path.parent.name
        shutil.copyfile(job.src("b") / rank_dir / path.name, path)
        if keep_mtime:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = _run("ingest", str(src), "--strategy", str(job.strategy), "--store", str(store))
    if again.returncode != 0:
        _clean_refusal(again, "overwrite")
        return
    out = tmp_path / "out"
    _ok(*_export_args(job, store, out))
    job.check_dir(out, "b")


def test_export_again_after_the_store_was_reingested(job: Job, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(job.src("a"), src)
    store = tmp_path / "store.zarr"
    out = tmp_path / "out"
    _ok("ingest", str(src), "--strategy", str(job.strategy), "--store", str(store))
    _ok(*_export_args(job, store, out))
    job.check_dir(out, "a")
    shutil.rmtree(src)
    shutil.copytree(job.src("b"), src)  # same names and sizes: the same layout fingerprint
    _ok("ingest", str(src), "--strategy", str(job.strategy), "--store", str(store), "--overwrite")
    again = subprocess.run(_export(job, store, out), capture_output=True, text=True, env=_env(), check=False)
    if again.returncode != 0:
        _clean_refusal(again, "overwrite")
    else:
        job.check_dir(out, "b")
    _ok(*_export_args(job, store, out, "--overwrite"))
    job.check_dir(out, "b")


# --------------------------------------------------------------------------- damage


@pytest.fixture(scope="module")
def sealed(job: Job, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("sealed") / "store.zarr"
    assert _ingest(job, "a", store).returncode == 0
    return store


def _copy(store: Path, tmp: Path) -> Path:
    target = tmp / "store.zarr"
    shutil.copytree(store, target)
    return target


def _edit_manifest(store: Path, change: Any) -> None:
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    change(doc["attributes"]["zckpt"])
    meta.write_text(json.dumps(doc))


def _edit_entry(name: str, field: str, value: Any) -> Any:
    def change(manifest: dict[str, Any]) -> None:
        for e in manifest["entries"]:
            if e["name"] == name:
                e[field] = value(e[field])

    return change


def _flip_a_byte(store: Path, name: str) -> Path:
    """Flip one bit of the data of ``name`` (its first chunk or shard file)."""
    key = next(e["key"] for e in json.loads((store / "zarr.json").read_text())["attributes"]["zckpt"]["entries"]
               if e["name"] == name)
    chunk = sorted(p for p in (store / key).iterdir() if p.name.startswith("c"))[0]
    with open(chunk, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x10]))
    return chunk


def _drop_records(store: Path) -> None:
    """Remove the checksums from every progress record (record files, or format-4 groups)."""
    for meta in sorted((store / "progress").glob("rank_*.json")):
        doc = json.loads(meta.read_text())
        doc.pop("crc32c_blocks", None)
        meta.write_text(json.dumps(doc))
    for meta in sorted((store / "progress").glob("rank_*/zarr.json")):
        doc = json.loads(meta.read_text())
        doc["attributes"].pop("crc32c_blocks", None)
        meta.write_text(json.dumps(doc))


def _drop_progress(store: Path, rank: int) -> None:
    for p in (store / "progress").glob(f"rank_{rank}*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


DAMAGE = {
    "shape halved": lambda s: _edit_manifest(s, _edit_entry("layer1.w", "shape", lambda v: [v[0] // 2, *v[1:]])),
    "dtype changed": lambda s: _edit_manifest(s, _edit_entry("layer1.w", "ms_type", lambda v: "Int32")),
    "entry removed": lambda s: _edit_manifest(
        s, lambda m: m.__setitem__("entries", [e for e in m["entries"] if e["name"] != "layer1.w"])),
    "records removed, bit flipped": lambda s: (_drop_records(s), _flip_a_byte(s, "layer1.w")),
    "one rank's progress removed, bit flipped": lambda s: (
        _drop_progress(s, 0), [_flip_a_byte(s, f"layer{i}.w") for i in range(4)]),
    "complete flag set on an unfinished store": lambda s: (
        _drop_progress(s, 3),
        _edit_manifest(s, lambda m: m.__setitem__("integrity", {"manifest": m["integrity"]["manifest"]}))),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_manifest_or_records_are_refused(job: Job, sealed: Path, tmp_path: Path, damage: str) -> None:
    store = _copy(sealed, tmp_path)
    DAMAGE[damage](store)
    exported = subprocess.run(_export(job, store, tmp_path / "out"), capture_output=True, text=True, env=_env(),
                              check=False)
    _clean_refusal(exported, str(store))
    verified = _run("verify", str(store))
    assert verified.returncode != 0, verified.stdout
    assert "Traceback" not in verified.stderr


def test_load_param_checks_checksums(job: Job, sealed: Path, tmp_path: Path) -> None:
    from zckpt.jobs.segmented import load_slice

    store = _copy(sealed, tmp_path)
    clean = _run("load", str(store), "--param", "layer1.w", "--rank", "1", "--strategy", str(job.dst))
    assert clean.returncode == 0, clean.stderr
    chunk = _flip_a_byte(store, "layer1.w")
    bad = _run("load", str(store), "--param", "layer1.w", "--rank", "1", "--strategy", str(job.dst))
    _clean_refusal(bad, "checksum", "layer1.w")
    with pytest.raises(StoreError, match="checksum") as err:
        load_slice(store, 1, str(job.dst), "layer1.w")
    assert err.value.param == "layer1.w" and err.value.path is not None and chunk.name in err.value.path


def test_store_killed_before_its_manifest_is_refused(job: Job, tmp_path: Path) -> None:
    from zckpt.store.store import Store

    store = tmp_path / "store.zarr"
    Store.create(store)  # what an ingest killed between creating the store and defining its arrays leaves
    exported = subprocess.run(_export(job, store, tmp_path / "out"), capture_output=True, text=True, env=_env(),
                              check=False)
    _clean_refusal(exported, "incomplete", str(store))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.ckpt"))
    verified = _run("verify", str(store))
    assert verified.returncode != 0 and "Traceback" not in verified.stderr
    resumed = _ingest(job, "a", store)
    assert resumed.returncode == 0, resumed.stderr


def test_lock_files_are_never_followed(job: Job, tmp_path: Path) -> None:
    """A planted ``<store>.lock`` symlink is refused by name: zckpt never creates or
    truncates the file it points to. An output directory is locked through its own
    descriptor: a link planted under the name of its fallback lock file is an entry of
    someone else's, refused as such, and never followed."""
    from zckpt.io import locks

    outside = tmp_path / "outside"
    store = tmp_path / "store.zarr"
    locks.store_lock_path(store).symlink_to(outside)
    _clean_refusal(_ingest(job, "a", store), "symbolic link", "store.zarr.lock")
    assert not outside.exists() and not store.exists()
    locks.store_lock_path(store).unlink()
    assert _ingest(job, "a", store).returncode == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / locks.OUTPUT_LOCK).symlink_to(outside)
    _clean_refusal(subprocess.run(_export(job, store, out), capture_output=True, text=True, env=_env(), check=False),
                   "already holds 1 entry", str(out))
    assert not outside.exists() and not list(out.rglob("*.ckpt"))


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_cluster_task_refuses_a_store_rewritten_after_planning(job: Job, tmp_path: Path, fmt: str) -> None:
    """A task that opens the store itself (a Dask worker: remote stores have no reader lock)
    is stopped when the store is no longer the one the export was planned on, instead of
    writing model B's data into a file beside files of model A; the planned store still
    exports."""
    from zckpt.jobs.export import write_file, write_safetensors_file
    from zckpt.jobs.export_job import ExportOptions, PlannedStore, plan_export
    from zckpt.jobs.ingest import IngestOptions, ingest
    from zckpt.store.store import Store

    store = tmp_path / "store.zarr"
    ingest(job.src("a"), store, job.strategy)
    opened = Store.open(store)
    planned = PlannedStore.of(opened)
    rank = plan_export(opened, str(job.dst), None).ranks[0]
    opts = ExportOptions(format=fmt)
    task = write_file if fmt == "ckpt" else write_safetensors_file
    target = tmp_path / "ok" / f"checkpoint_0.{fmt}"
    target.parent.mkdir()
    assert task((rank, str(target)), planned, opts).path == str(target)
    ingest(job.src("b"), store, job.strategy, IngestOptions(overwrite=True))
    stale = tmp_path / "stale" / f"checkpoint_0.{fmt}"
    stale.parent.mkdir()
    with pytest.raises(StoreError, match="changed after this export was planned"):
        task((rank, str(stale)), planned, opts)
    assert not list(stale.parent.iterdir())
