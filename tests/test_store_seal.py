"""A store carries what its format requires, and errors name the file at fault (issue 25).

* A store of a format that always carries integrity digests (6 and later) whose seal and
  checksum records were removed is damaged, not a pre-integrity store: verify, export and
  load refuse it; a store that declares an older format still reads without them.
* An array whose sharding codec is not zckpt's (``index_location`` changed) is refused with
  the array's ``zarr.json`` and the parameter named, by every reader, instead of zarr's
  "Stored and computed checksum do not match".
* Errors about a progress record name its file (``progress/rank_3.json``, or the range file
  ``progress/ranks_0-3.json`` holding it), never ``progress/rank_3``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from store_jobs import StoreJob, run_cli

from zckpt.core.errors import StoreError
from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.store import records
from zckpt.store.store import Store

ROOT = Path(__file__).resolve().parents[1]


_run = run_cli


def _refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "ValueError" not in proc.stderr, proc.stderr
    text = proc.stdout + proc.stderr
    for w in words:
        assert w in text, (w, text)


class Job(StoreJob):
    def __init__(self, tmp: Path) -> None:
        rng = np.random.default_rng(6)
        super().__init__(tmp, [TensorDef(f"layer{i}.w", (64, 32), "Float32",
                                         random_layout(rng, (64, 32), 4, allow_opt=False)) for i in range(4)], 4)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return Job(tmp_path_factory.mktemp("seal"))


def _copy(job: Job, tmp: Path) -> Path:
    return job.copy(tmp)


def _edit_root(store: Path, change: Any) -> None:
    doc = json.loads((store / "zarr.json").read_text())
    change(doc["attributes"]["zckpt"])
    (store / "zarr.json").write_text(json.dumps(doc))


def _unseal(store: Path, version: int | None = None) -> None:
    """The manifest's digests and every record's checksums removed (``version``: the format
    the manifest then declares)."""
    def change(meta: dict[str, Any]) -> None:
        meta.pop("integrity")
        if version is not None:
            meta["version"] = version

    _edit_root(store, change)
    for path in (store / "progress").glob("rank*.json"):
        doc = json.loads(path.read_text())
        doc.pop("crc32c_blocks")
        path.write_text(json.dumps(doc))


def _flip(store: Path, name: str) -> None:
    folder = store / "tensors" / name
    chunk = sorted(p for p in folder.iterdir() if p.name.startswith("c"))[0]
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))


def _exported(out: Path, name: str) -> bytes:
    with CkptReader(out / "rank_0" / "checkpoint_0.ckpt") as r:
        return r.array(name).tobytes()


def test_current_format_without_its_seal_is_refused(job: Job, tmp_path: Path) -> None:
    store = _copy(job, tmp_path)
    _unseal(store)
    _flip(store, "layer1.w")
    words = ("integrity digests", "damaged", str(store))
    _refused(_run("verify", str(store)), *words)
    out = tmp_path / "out"
    _refused(_run("export", str(store), "--out", str(out), "--quiet"), *words)
    assert not list(out.rglob("*.ckpt")) if out.exists() else True
    _refused(_run("load", str(store), "--param", "layer1.w", "--out", str(tmp_path / "loaded")), *words)
    _refused(_run("consolidate", str(store)), *words)
    with pytest.raises(StoreError, match="integrity digests"):
        Store.open(store).check_integrity()


def test_older_format_without_digests_still_reads(job: Job, tmp_path: Path) -> None:
    """A store declaring format 5 (whose first stores had no digests) reads without them."""
    store = _copy(job, tmp_path)
    _unseal(store, version=5)
    out = tmp_path / "out"
    done = _run("export", str(store), "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    assert _exported(out, "layer1.w") == job.value("layer1.w")


@pytest.mark.parametrize(("setting", "value", "shown"), [
    ("index_location", "start", "index_location is 'start'"),
    ("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}}], "index_codecs"),
    ("codecs", [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip",
                                                                        "configuration": {"level": 1}}], "codecs"),
])
def test_foreign_sharding_is_refused_by_name(job: Job, tmp_path: Path, setting: str, value: Any, shown: str) -> None:
    store = _copy(job, tmp_path)
    meta = store / "tensors" / "layer1.w" / "zarr.json"
    doc = json.loads(meta.read_text())
    (codec,) = doc["codecs"]
    assert codec["name"] == "sharding_indexed", "the job's arrays are not sharded: the test checks nothing"
    codec["configuration"][setting] = value
    meta.write_text(json.dumps(doc))
    words = (str(meta), "'layer1.w'", shown)
    _refused(_run("export", str(store), "--out", str(tmp_path / "out"), "--quiet"), *words)
    _refused(_run("load", str(store), "--param", "layer1.w", "--out", str(tmp_path / "loaded")), *words)
    _refused(_run("verify", str(store)), *words)
    _refused(_run("consolidate", str(store)), *words)
    assert "consolidated_metadata" not in (store / "zarr.json").read_text()
    with pytest.raises(StoreError, match=shown) as err:
        Store.open(store).chunk_info("layer1.w")
    assert err.value.path == str(meta) and err.value.param == "layer1.w"
    with pytest.raises(StoreError, match=shown):
        Store.open(store).array("layer1.w")


def _records_as_one_range(store: Path) -> str:
    """The store's per-rank record files rewritten as one range file (format 7's grouping)."""
    folder = store / "progress"
    docs = {}
    for path in sorted(folder.glob("rank_*.json")):
        doc = json.loads(path.read_text())
        docs[doc.pop("rank")] = doc
        path.unlink()
    ((name, data),) = records.files_for(docs)
    (folder / name).write_bytes(data)
    return name


@pytest.mark.parametrize("grouped", [False, True])
def test_record_errors_name_the_record_file(job: Job, tmp_path: Path, grouped: bool) -> None:
    store = _copy(job, tmp_path)
    name = _records_as_one_range(store) if grouped else "rank_3.json"
    assert Store.open(store).ingested_ranks() == {0, 1, 2, 3}
    path = store / "progress" / name
    if grouped:
        docs = json.loads(path.read_text())
        docs[3].pop("crc32c_blocks")
        path.write_text(json.dumps(docs))
    else:
        doc = json.loads(path.read_text())
        doc.pop("crc32c_blocks")
        path.write_text(json.dumps(doc))
    proc = _run("export", str(store), "--out", str(tmp_path / "out"), "--quiet")
    _refused(proc, f"file {path}:", "source rank 3")
    verified = _run("verify", str(store))
    _refused(verified, f"file {path}", "source rank 3")
    assert f"{store / 'progress' / 'rank_3'}:" not in proc.stderr + verified.stdout


def test_missing_record_error_names_its_file(job: Job, tmp_path: Path) -> None:
    store = _copy(job, tmp_path)
    (store / "progress" / "rank_2.json").unlink()
    proc = _run("export", str(store), "--out", str(tmp_path / "out"), "--quiet")
    _refused(proc, "source rank(s) [2]", "progress/rank_2.json")
