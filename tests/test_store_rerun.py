"""Rerunning an ingest into its own store (issue 25).

* A rank whose progress record was removed (or lost its checksums) is redone: the rerun
  copies its boxes again and seals the store anew, so the store verifies and exports the
  sources' values afterwards (expected bytes: the generator's global values).
* A complete store with nothing to redo is checked under the readers' shared lock: the rerun
  succeeds while an export (here: a held reader's lock) reads the store, writes nothing and
  says so; only a rerun with work to do needs the writer's lock.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from store_jobs import StoreJob, run_cli

from zckpt.formats.ckpt import CkptReader
from zckpt.io import locks
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, global_value

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4


_run = run_cli


class Job(StoreJob):
    def __init__(self, tmp: Path) -> None:
        rng = np.random.default_rng(71)
        super().__init__(tmp, [TensorDef(f"layer{i}.w", (64, 32), "Float32" if i % 2 else "BFloat16",
                                         random_layout(rng, (64, 32), RANKS, allow_opt=False)) for i in range(6)],
                         RANKS)

    def ingest_args(self, store: Path, *extra: str) -> list[str]:
        return ["ingest", str(self.src), "--strategy", str(self.model.strategy_path), "--store", str(store), *extra]

    def check_export(self, store: Path, out: Path) -> None:
        """Export (one rank, whole tensors) and compare every tensor with its global value."""
        done = _run("export", str(store), "--out", str(out), "--quiet")
        assert done.returncode == 0, done.stderr
        with CkptReader(out / "rank_0" / "checkpoint_0.ckpt") as r:
            for t in self.model.tensors:
                want = np.ascontiguousarray(global_value(t.name, t.shape, t.ms_type)).tobytes()
                assert r.array(t.name).tobytes() == want, t.name


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return Job(tmp_path_factory.mktemp("rerun"))


def _copy(job: Job, tmp: Path) -> Path:
    return job.copy(tmp)


def _flip_in_rank(store: Path, rank: int) -> None:
    """Flip a bit inside the first run rank ``rank`` wrote (as its record says)."""
    doc = json.loads((store / "progress" / f"rank_{rank}.json").read_text())
    name, runs = sorted(doc["crc32c_blocks"]["runs"].items())[0]
    key, text = sorted(runs.items())[0]
    offset = int(text.split()[0].split(":")[0])
    entry = next(e for e in json.loads((store / "zarr.json").read_text())["attributes"]["zckpt"]["entries"]
                 if e["name"] == name)
    with open(store / entry["key"] / key, "r+b") as f:
        f.seek(offset + 3)
        b = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([b[0] ^ 0x40]))


def _snapshot(store: Path) -> dict[str, bytes]:
    return {p.relative_to(store).as_posix(): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", ["record removed", "checksums removed"])
def test_rerun_redoes_a_rank_whose_record_is_gone(job: Job, tmp_path: Path, damage: str) -> None:
    store = _copy(job, tmp_path)
    record = store / "progress" / "rank_1.json"
    _flip_in_rank(store, 1)
    if damage == "record removed":
        record.unlink()
    else:
        doc = json.loads(record.read_text())
        doc.pop("crc32c_blocks")
        record.write_text(json.dumps(doc))
    assert _run("verify", str(store)).returncode == 1

    again = _run(*job.ingest_args(store))
    assert again.returncode == 0, again.stderr
    assert "source rank 1 ingested again" in again.stdout and "already complete" not in again.stdout, again.stdout
    verified = _run("verify", str(store))
    assert verified.returncode == 0 and "OK: no mismatch" in verified.stdout, verified.stdout
    job.check_export(store, tmp_path / "out")
    assert _snapshot(store) == _snapshot(job.store)  # the store the first ingest wrote, byte for byte


def test_rerun_of_a_complete_store_needs_no_writer_lock(job: Job, tmp_path: Path) -> None:
    store = _copy(job, tmp_path)
    before = _snapshot(store)
    with locks.store_reading(store):  # an export reading the store
        again = _run(*job.ingest_args(store))
        assert again.returncode == 0, again.stderr
        tensors = len(json.loads((store / "zarr.json").read_text())["attributes"]["zckpt"]["entries"])
        assert again.stdout.strip().splitlines()[-1] == (
            f"{store}: already complete ({tensors} entries from {RANKS} source ranks), nothing to do"), again.stdout
        as_json = _run(*job.ingest_args(store, "--json"))
        assert as_json.returncode == 0, as_json.stderr
        report = json.loads(as_json.stdout)
        assert report["already_complete"] is True and report["bytes_written"] == 0 and report["complete"] is True
        assert report["store_ranks"] == list(range(RANKS))
    assert _snapshot(store) == before
    assert not locks.store_lock_path(store).exists()


def test_rerun_with_work_to_do_still_waits_for_readers(job: Job, tmp_path: Path) -> None:
    store = _copy(job, tmp_path)
    (store / "progress" / "rank_2.json").unlink()
    before = _snapshot(store)
    with locks.store_reading(store):
        refused = _run(*job.ingest_args(store))
        assert refused.returncode == 1 and "lock held" in refused.stderr, refused.stdout + refused.stderr
    assert _snapshot(store) == before
    done = _run(*job.ingest_args(store))
    assert done.returncode == 0 and "source rank 2 ingested again" in done.stdout, done.stdout + done.stderr
    assert _run("verify", str(store)).returncode == 0


def test_rerun_seals_a_store_marked_complete_without_its_record_digests(job: Job, tmp_path: Path) -> None:
    """The ``complete`` flag kept but the record digests sealed with it removed: readers refuse
    the store; a rerun, with every record present and intact, only seals it again."""
    store = _copy(job, tmp_path)
    root = json.loads((store / "zarr.json").read_text())
    del root["attributes"]["zckpt"]["integrity"]["records"]
    (store / "zarr.json").write_text(json.dumps(root))
    assert _run("verify", str(store)).returncode == 1
    again = _run(*job.ingest_args(store))
    assert again.returncode == 0 and "already complete" not in again.stdout, again.stdout + again.stderr
    assert _run("verify", str(store)).returncode == 0
    assert _snapshot(store) == _snapshot(job.store)
