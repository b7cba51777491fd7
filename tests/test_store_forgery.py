"""Consistent forgeries: a store edited with its digests recomputed (issue 25).

The digests of a store (``zckpt/store/integrity.py``) are not keyed: whoever edits a store can
recompute them, so ``zckpt verify STORE`` alone cannot tell such an edit from the store its
ingest wrote, and export then writes wrong or missing data. What can tell is comparing the
store with the shards it came from: ``zckpt verify STORE --sources SRC_DIR``. Each forgery
below passes the first and is reported by the second (non-zero exit, the parameter named).

The expected bytes are the generator's global values (``zckpt.jobs.generate_model.global_value``), not
anything zckpt's export computes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from store_jobs import StoreJob, run_cli

from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions
from zckpt.store import integrity

ROOT = Path(__file__).resolve().parents[1]


_run = run_cli


class Job(StoreJob):
    def __init__(self, tmp: Path) -> None:
        rng = np.random.default_rng(25)
        defs = [TensorDef(f"layer{i}.w", (64, 32), "Float32", random_layout(rng, (64, 32), 4, allow_opt=False))
                for i in range(4)]
        defs += [TensorDef(f"bias{i}", (8,), "Float32") for i in range(4)]  # whole on every rank: packed
        super().__init__(tmp, defs, 4, IngestOptions(pack_count=1, helper=False))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return Job(tmp_path_factory.mktemp("forgery"))


def _manifest(store: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((store / "zarr.json").read_text())
    return doc


def _rewrite_manifest(store: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and recompute its digest, as a forger would."""
    doc = _manifest(store)
    meta = doc["attributes"]["zckpt"]
    change(meta)
    meta["integrity"]["manifest"] = integrity.manifest_digest(meta)
    (store / "zarr.json").write_text(json.dumps(doc))


def _entry(store: Path, name: str) -> dict[str, Any]:
    entry: dict[str, Any] = next(e for e in _manifest(store)["attributes"]["zckpt"]["entries"] if e["name"] == name)
    return entry


def remove_entry(store: Path) -> str:
    """An entry and its array removed."""
    shutil.rmtree(store / _entry(store, "layer1.w")["key"])
    _rewrite_manifest(store, lambda m: m.__setitem__("entries", [e for e in m["entries"] if e["name"] != "layer1.w"]))
    return "layer1.w"


def move_packed_offset(store: Path) -> str:
    """A packed tensor pointed at another packed tensor's bytes (same type and shape)."""
    other = _entry(store, "bias2")["offset"]
    assert other is not None and other != _entry(store, "bias1")["offset"]

    def change(meta: dict[str, Any]) -> None:
        for e in meta["entries"]:
            if e["name"] == "bias1":
                e["offset"] = other

    _rewrite_manifest(store, change)
    return "bias1"


def drop_a_record_and_flip(store: Path) -> str:
    """One run's checksum record removed from its rank's progress record (the record's
    sealed digest recomputed), then a bit of that run flipped."""
    name = "layer2.w"
    for path in sorted((store / "progress").glob("rank*.json")):
        doc = json.loads(path.read_text())
        runs = doc["crc32c_blocks"]["runs"].get(name)
        if runs:
            break
    else:
        raise AssertionError("no rank records a run of layer2.w")
    key, text = sorted(runs.items())[0]
    del runs[key]
    if not runs:
        del doc["crc32c_blocks"]["runs"][name]
    path.write_text(json.dumps(doc))
    rank = doc.pop("rank")
    offset = int(text.split()[0].split(":")[0])
    with open(store / _entry(store, name)["key"] / key, "r+b") as f:
        f.seek(offset + 5)
        b = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([b[0] ^ 0x10]))
    top = _manifest(store)
    top["attributes"]["zckpt"]["integrity"]["records"][str(rank)] = integrity.record_digest({"rank": rank, **doc})
    (store / "zarr.json").write_text(json.dumps(top))
    return name


FORGERIES = {"entry removed": remove_entry, "packed offset moved": move_packed_offset,
             "record dropped, bit flipped": drop_a_record_and_flip}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_consistent_forgery_is_found_only_against_the_sources(job: Job, tmp_path: Path, forgery: str) -> None:
    store = tmp_path / "store.zarr"
    shutil.copytree(job.store, store)
    name = FORGERIES[forgery](store)

    alone = _run("verify", str(store))
    assert alone.returncode == 0 and "OK: no mismatch" in alone.stdout, alone.stdout + alone.stderr
    out = tmp_path / "out"
    exported = _run("export", str(store), "--out", str(out), "--quiet")
    assert exported.returncode == 0, exported.stderr  # what the digests cannot stop
    with CkptReader(out / "rank_0" / "checkpoint_0.ckpt") as r:
        wrong = name not in r.entries or r.array(name).tobytes() != job.value(name)
    assert wrong, "the forgery did not change the export: the test forges nothing"

    for args in (["--sources", str(job.src)], [str(job.src)]):
        found = _run("verify", str(store), *args, "--strategy", str(job.model.strategy_path))
        assert found.returncode == 1, found.stdout + found.stderr
        assert "Traceback" not in found.stderr
        assert f"parameter {name!r}" in found.stdout and "FAILED" in found.stdout, found.stdout


def test_the_unforged_store_verifies_against_its_sources(job: Job) -> None:
    found = _run("verify", str(job.store), "--sources", str(job.src), "--strategy", str(job.model.strategy_path))
    assert found.returncode == 0 and "OK: no mismatch" in found.stdout, found.stdout + found.stderr
    both = _run("verify", str(job.store), str(job.src), "--sources", str(job.src.parent))
    assert both.returncode == 2 and "SRC_DIR given twice" in both.stderr, both.stderr
