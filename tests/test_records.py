"""Progress records as plain files (store format 5), and the zarr-group records of format 4
still read and, when a format-4 ingest is resumed, still written."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr
from ckpt_compare import diff_dirs

import zckpt
from zckpt.core.errors import StoreError
from zckpt.jobs.verify import verify

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = EXAMPLE / "src" / "checkpoints"
STRATEGY = str(EXAMPLE / "src" / "strategy.ckpt")
DST = str(EXAMPLE / "dst" / "strategy.ckpt")


def _ingest(store: Path) -> None:
    report = zckpt.ingest(str(SRC), store, STRATEGY)
    assert report.complete


def _to_format_4(store: Path) -> None:
    """Rewrite a fresh store as format 4 kept it: one zarr group per record, its document
    (without ``rank``) as the group's attributes, and ``progress`` a group."""
    folder = store / "progress"
    docs = [json.loads(p.read_text()) for p in folder.glob("rank_*.json")]
    shutil.rmtree(folder)
    group = zarr.open_group(str(store), mode="r+")
    group.create_group("progress")
    for doc in docs:
        rank = doc.pop("rank")
        doc.pop("source", None)  # source identities and digests came later
        group.create_group(f"progress/rank_{rank}", attributes=doc)
    meta = dict(group.attrs["zckpt"])  # type: ignore[arg-type]
    meta["version"] = 4
    meta.pop("integrity", None)
    group.attrs["zckpt"] = meta


def test_records_are_one_file_per_rank_and_zarr_sees_an_empty_array(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    _ingest(store)
    files = sorted(p.name for p in (store / "progress").iterdir())
    assert files == sorted(["zarr.json"] + [f"rank_{r}.json" for r in range(8)])
    for r in range(8):
        doc = json.loads((store / "progress" / f"rank_{r}.json").read_text())
        assert doc["rank"] == r and doc["bytes"] > 0 and doc["crc32c_blocks"]["chunks"] | doc["crc32c_blocks"]["runs"]
    st = zckpt.open_store(store)
    assert st.manifest["version"] >= 5 and st.ingested_ranks() == set(range(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr warns of every object it does not recognise
        root = zarr.open_group(str(store), mode="r")
        members = dict(root.members(max_depth=None))
    progress = members["progress"]
    assert isinstance(progress, zarr.Array) and progress.shape == (0,)
    assert verify(store).ok


def test_format_4_group_records_still_read(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    _ingest(store)
    sums = zckpt.open_store(store).checksums()
    _to_format_4(store)
    st = zckpt.open_store(store)
    assert st.manifest["version"] == 4 and st.ingested_ranks() == set(range(8))
    assert st.checksums() == sums and sums
    assert verify(store).ok
    zckpt.export(store, tmp_path / "out", DST)
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "out") == []


def test_resumed_format_4_ingest_keeps_group_records(tmp_path: Path) -> None:
    """A format-4 store interrupted before rank 5 was recorded is finished as format 4: its
    record is a group again (an older zckpt reading the store finds every rank)."""
    store = tmp_path / "s.zarr"
    _ingest(store)
    before = np.asarray(zckpt.open_store(store).array("layer1.weight")[...])
    _to_format_4(store)
    shutil.rmtree(store / "progress" / "rank_5")
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["zckpt"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(doc))
    report = zckpt.ingest(str(SRC), store, STRATEGY)
    assert report.resumed and report.complete and report.bytes_written > 0
    assert (store / "progress" / "rank_5" / "zarr.json").is_file()
    assert not list((store / "progress").glob("rank_*.json"))
    st = zckpt.open_store(store)
    assert st.manifest["version"] == 4 and st.ingested_ranks() == set(range(8))
    assert np.array_equal(np.asarray(st.array("layer1.weight")[...]), before)
    assert verify(store).ok


def test_a_record_naming_another_rank_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    _ingest(store)
    record = store / "progress" / "rank_3.json"
    doc = json.loads(record.read_text())
    doc["rank"] = 4
    record.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="does not describe rank 3"):
        zckpt.open_store(store).checksums()
    record.write_text("{not json")
    with pytest.raises(StoreError, match="not JSON"):
        zckpt.open_store(store).checksums()


def test_a_missing_record_leaves_its_rank_to_resume(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    _ingest(store)
    (store / "progress" / "rank_2.json").unlink()
    (store / "progress" / ".rank_2.json.123.tmp-zckpt").write_bytes(b'{"rank": 2')  # a killed writer's
    st = zckpt.open_store(store)
    assert st.ingested_ranks() == set(range(8)) - {2}
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["zckpt"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(doc))
    report = zckpt.ingest(str(SRC), store, STRATEGY)
    assert report.resumed and report.complete and report.bytes_written > 0
    assert json.loads((store / "progress" / "rank_2.json").read_text())["rank"] == 2
    assert not list((store / "progress").glob("*.tmp-zckpt")), "the killed writer's temporary record was kept"
    zckpt.export(store, tmp_path / "out", DST)
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "out") == []
