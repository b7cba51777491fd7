"""Progress records of many ranks grouped in few files (store format 7): an ingest of more
than 32 ranks in one process records consecutive ranks together, ``progress/ranks_<a>-<b>.json``.
Crash-resume, a source changed inside a group, damage and older stores still behave as with
one file per rank. Values are checked against the generator's, not read back from zckpt."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import zckpt
from zckpt.core.errors import StoreError
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.verify import verify
from zckpt.store import integrity
from zckpt.store import records as rank_records

ROOT = Path(__file__).resolve().parents[1]
RANKS = 70  # 3 ranks a file (ceil(70 / 32)): 23 range files and rank_69.json


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> GeneratedModel:
    rng = np.random.default_rng(70)
    tensors = [TensorDef(f"w{i}", (140, 6), "Float32" if i % 2 else "Float16", random_layout(rng, (140, 6), RANKS))
               for i in range(4)]
    return write_model(tmp_path_factory.mktemp("groups") / "src", tensors, device_num=RANKS)


def _ingest(job: GeneratedModel, store: Path, src: Path | None = None) -> zckpt.IngestReport:
    return zckpt.ingest(str(src or job.root), store, str(job.strategy_path))


def _check_values(job: GeneratedModel, store: Path) -> None:
    st = zckpt.open_store(store)
    for t in job.tensors:
        got, want = np.asarray(st.array(t.name)[...]), job.global_value(t.name)
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), t.name


def _record_files(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "progress").iterdir() if p.name != "zarr.json")


def _reopen_incomplete(store: Path) -> None:
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["zckpt"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(doc))


def test_consecutive_ranks_share_a_record_file(job: GeneratedModel, tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    assert _ingest(job, store).complete
    want = sorted([f"ranks_{a}-{a + 2}.json" for a in range(0, 69, 3)] + ["rank_69.json"])
    assert _record_files(store) == want
    doc = json.loads((store / "progress" / "ranks_3-5.json").read_text())
    assert [d["rank"] for d in doc] == [3, 4, 5] and all(d["crc32c_blocks"] for d in doc)
    st = zckpt.open_store(store)
    assert st.manifest["version"] == 7 and st.ingested_ranks() == set(range(RANKS))
    assert sorted(st.progress_records()) == list(range(RANKS))
    assert verify(store).ok
    _check_values(job, store)


def test_few_ranks_keep_one_file_each(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    job8 = write_model(tmp_path / "src", [TensorDef("w", (16, 4), "Float32", random_layout(rng, (16, 4), 8))],
                       device_num=8)
    _ingest(job8, tmp_path / "s.zarr")
    assert _record_files(tmp_path / "s.zarr") == sorted(f"rank_{r}.json" for r in range(8))


def test_a_lost_group_is_redone_alone(job: GeneratedModel, tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    _ingest(job, store)
    before = zckpt.open_store(store).progress_records()
    (store / "progress" / "ranks_6-8.json").unlink()
    _reopen_incomplete(store)
    assert zckpt.open_store(store).ingested_ranks() == set(range(RANKS)) - {6, 7, 8}
    report = _ingest(job, store)
    assert report.resumed and report.complete
    assert report.bytes_written == sum(before[r]["bytes"] for r in (6, 7, 8)) > 0
    assert {"rank_6.json", "rank_7.json", "rank_8.json"} <= set(_record_files(store))  # 3 ranks: a file each
    after = zckpt.open_store(store).progress_records()
    assert {r: {k: v for k, v in d.items() if k != "source"} for r, d in after.items()} == \
        {r: {k: v for k, v in d.items() if k != "source"} for r, d in before.items()}
    assert verify(store).ok
    _check_values(job, store)


def test_a_changed_source_inside_a_group_is_redone_and_its_neighbours_kept(job: GeneratedModel,
                                                                          tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(job.root, src)
    store = tmp_path / "s.zarr"
    _ingest(job, store, src)
    before = zckpt.open_store(store).progress_records()
    f = src / "rank_4" / "checkpoint_4.ckpt"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same bytes, another time: redone
    report = _ingest(job, store, src)
    assert report.redone.keys() == {4} and report.complete
    assert report.bytes_written == before[4]["bytes"] > 0  # its neighbours' records were kept: not redone
    assert "ranks_3-5.json" not in _record_files(store)
    assert {"rank_3.json", "rank_4.json", "rank_5.json"} <= set(_record_files(store))
    after = zckpt.open_store(store).progress_records()
    assert after.keys() == before.keys()
    assert all(after[r] == before[r] for r in before if r != 4)
    assert after[4]["source"]["mtime_ns"] == st.st_mtime_ns + 10**9
    assert verify(store).ok
    _check_values(job, store)


def test_a_damaged_group_file_is_refused(job: GeneratedModel, tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    _ingest(job, store)
    path = store / "progress" / "ranks_0-2.json"
    docs = json.loads(path.read_text())
    path.write_text(json.dumps([docs[1], docs[0], docs[2]]))
    with pytest.raises(StoreError, match="does not describe ranks 0 to 2"):
        zckpt.open_store(store).checksums()
    path.write_text(json.dumps(docs)[:-40])
    with pytest.raises(StoreError, match="not JSON"):
        zckpt.open_store(store).checksums()


def test_a_format_6_store_resumed_keeps_one_file_per_rank(job: GeneratedModel, tmp_path: Path) -> None:
    """Format 6 had one file per rank: resuming such an ingest writes its records so (an
    older zckpt reading the store finds every rank)."""
    store = tmp_path / "s.zarr"
    _ingest(job, store)
    folder = store / "progress"
    records = zckpt.open_store(store).progress_records()
    for name in _record_files(store):
        (folder / name).unlink()
    for rank in range(RANKS):
        if rank < 40:  # ranks 40 and later were not done when the format-6 ingest stopped
            (folder / f"rank_{rank}.json").write_text(json.dumps(records[rank]))
    doc = json.loads((store / "zarr.json").read_text())
    meta = doc["attributes"]["zckpt"]
    meta.update(version=6, complete=False)
    meta["integrity"] = integrity.sealed(meta)
    (store / "zarr.json").write_text(json.dumps(doc))
    report = _ingest(job, store)
    assert report.resumed and report.complete
    assert _record_files(store) == sorted(f"rank_{r}.json" for r in range(RANKS))
    st = zckpt.open_store(store)
    assert st.manifest["version"] == 6 and st.ingested_ranks() == set(range(RANKS))
    assert verify(store).ok
    _check_values(job, store)


def test_record_files_of_rank_runs() -> None:
    assert rank_records.ranges([8, 1, 2, 3, 5, 9]) == [(1, 3), (5, 5), (8, 9)]
    files = rank_records.files_for({2: {"bytes": 1}, 3: {"bytes": 2}, 7: {"bytes": 3}})
    assert [n for n, _ in files] == ["ranks_2-3.json", "rank_7.json"]
    assert json.loads(files[0][1]) == [{"rank": 2, "bytes": 1}, {"rank": 3, "bytes": 2}]
    assert json.loads(files[1][1]) == {"rank": 7, "bytes": 3}
    assert rank_records.ranks_of("ranks_4-4.json") is None and rank_records.ranks_of("ranks_5-4.json") is None
    assert rank_records.ranks_of("ranks_04-5.json") is None and rank_records.ranks_of("ranks_4-5.json") == (4, 5)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "zckpt.cli", *args, "--quiet"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_ingest_killed_at_random_points_resumes_to_the_same_values_and_records(job: GeneratedModel,
                                                                               tmp_path: Path) -> None:
    cmd = lambda store: _cli("ingest", str(job.root), "--strategy", str(job.strategy_path),  # noqa: E731
                             "--store", str(store))
    t0 = time.monotonic()
    subprocess.run(cmd(tmp_path / "ref.zarr"), env=_env(), check=True, capture_output=True)
    duration = time.monotonic() - t0
    reference = zckpt.open_store(tmp_path / "ref.zarr").progress_records()
    rng = random.Random(70)
    killed = trial = 0
    while trial < 5 or (killed < 2 and trial < 15):  # a loaded machine finishes some runs first
        store = tmp_path / f"s{trial}.zarr"
        trial += 1
        proc = subprocess.Popen(cmd(store), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=rng.uniform(0.3 * duration, duration))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed += 1
        subprocess.run(cmd(store), env=_env(), check=True, capture_output=True)
        got = zckpt.open_store(store).progress_records()
        assert {r: d["crc32c_blocks"] for r, d in got.items()} == {r: d["crc32c_blocks"] for r, d in reference.items()}
        assert verify(store).ok
        _check_values(job, store)
        shutil.rmtree(store)
    assert killed >= 2, f"only {killed} of {trial} runs were killed before finishing"


def test_a_source_changed_while_it_is_read_is_refused(job: GeneratedModel, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs where the record is made (the record thread): the rank is never
    recorded, the ingest fails naming the file and leaves no store."""
    mod = sys.modules["zckpt.jobs.ingest"]  # the module (``zckpt.ingest`` is also the function)
    src = tmp_path / "src"
    shutil.copytree(job.root, src)
    victim = src / "rank_40" / "checkpoint_40.ckpt"
    finish = mod.ChunkCopier.finish

    def finish_then_touch(self: object) -> object:
        if Path(self.reader.path) == victim:  # type: ignore[attr-defined]
            st = victim.stat()
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return finish(self)

    monkeypatch.setattr(mod.ChunkCopier, "finish", finish_then_touch)
    store = tmp_path / "s.zarr"
    with pytest.raises(zckpt.SourceError, match="changed while it was being read") as err:
        _ingest(job, store, src)
    assert err.value.path == str(victim) and not store.exists()


@pytest.mark.parametrize("size", [10, integrity.ENDS_BYTES, 3 * integrity.ENDS_BYTES + 7])
def test_source_identity_is_size_time_and_the_hash_of_the_ends(tmp_path: Path, size: int) -> None:
    """What resuming compares with the identity a record holds, whichever zckpt wrote it:
    read through a path or through a reader's open descriptor alike."""
    import hashlib

    f = tmp_path / "x.ckpt"
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    f.write_bytes(data)
    ends = data[:integrity.ENDS_BYTES] + (data[max(integrity.ENDS_BYTES, size - integrity.ENDS_BYTES):]
                                          if size > integrity.ENDS_BYTES else b"")
    want = {"size": size, "mtime_ns": f.stat().st_mtime_ns, "ends_sha256": hashlib.sha256(ends).hexdigest()}
    assert integrity.source_identity(f) == want
    fd = os.open(f, os.O_RDONLY)
    try:
        assert integrity.source_identity(f, fd) == want
    finally:
        os.close(fd)
    assert integrity.source_identity(tmp_path) is None and integrity.source_identity(tmp_path / "absent") is None
