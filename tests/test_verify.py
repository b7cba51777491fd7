"""``zckpt verify``: a clean store, its sources and its export verify; every kind of damage
is found and named (file, parameter, chunk or region), with exit code 1.

Uses the bundled MindSpore example (8 -> 4 ranks), ingested and exported once per module
and copied for each test that damages something.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.verify import verify
from zckpt.jobs.verify_files import first_difference
from zckpt.jobs.verify_store import chunk_grid
from zckpt.store.store import Store

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = EXAMPLE / "src" / "checkpoints"
SRC_STRATEGY = EXAMPLE / "src" / "strategy.ckpt"
DST_STRATEGY = EXAMPLE / "dst" / "strategy.ckpt"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    assert cli_main(["ingest", str(SRC), "--strategy", str(SRC_STRATEGY), "--store", str(root / "s.zarr"),
                     "--quiet"]) == 0
    assert cli_main(["export", str(root / "s.zarr"), "--strategy", str(DST_STRATEGY), "--out", str(root / "out"),
                     "--quiet"]) == 0
    shutil.copytree(SRC, root / "src")
    return root


@pytest.fixture
def work(built: Path, tmp_path: Path) -> Path:
    """A private copy of store, sources and export (writable: the example is read-only)."""
    for name in ("s.zarr", "src", "out"):
        shutil.copytree(built / name, tmp_path / name)
    for p in tmp_path.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return tmp_path


def _args(w: Path, *extra: str) -> list[str]:
    return ["verify", str(w / "s.zarr"), str(w / "src"), "--strategy", str(SRC_STRATEGY), "--against",
            str(w / "out"), "--dst-strategy", str(DST_STRATEGY), *extra]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _chunk_file(store_dir: Path, name: str, coords: tuple[int, ...]) -> Path:
    """The file holding chunk ``coords``: its own, or (sharded arrays) its shard's, as
    zarr-python names it."""
    st = Store.open(store_dir)
    arr = st.array(name)
    if arr.shards is not None:
        coords = tuple(c * k // s for c, k, s in zip(coords, arr.chunks, arr.shards, strict=True))
    return store_dir / arr.path / arr.metadata.encode_chunk_key(coords)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_clean_store_sources_and_export_verify(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run([*_args(work), "--json"], capsys)
    assert code == 0, out
    doc = json.loads(out)
    assert doc["ok"] and doc["mismatches"] == []
    assert doc["arrays"] == 11 and doc["chunks"] >= 11 and doc["chunk_bytes"] > 0
    assert doc["checksummed_chunks"] == doc["chunks"]  # ingest recorded a CRC for every chunk
    assert doc["source_files"] == 8 and doc["export_files"] == 4
    assert doc["source_bytes"] > doc["export_bytes"] > 0  # sources hold replicas, the export does not
    code, out = _run(["verify", str(work / "s.zarr")], capsys)
    assert code == 0 and "OK: no mismatch" in out


def test_flipped_byte_in_a_chunk_is_named(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = _chunk_file(work / "s.zarr", "layer3.weight", (1, 0))
    _flip(chunk, 7)
    code, out = _run(["verify", str(work / "s.zarr")], capsys)
    assert code == 1
    bad = [line for line in out.splitlines() if line.startswith("[store]")]
    assert len(bad) == 1, out
    assert "'layer3.weight'" in bad[0] and f" {chunk.name}" in bad[0] and "checksum" in bad[0]
    assert str(chunk) in bad[0]


def test_missing_chunk_of_a_complete_store_is_named(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = _chunk_file(work / "s.zarr", "layer2.weight", (3, 0))
    chunk.unlink()
    code, out = _run(["verify", str(work / "s.zarr")], capsys)
    assert code == 1
    assert f"parameter 'layer2.weight', shard {chunk.name}" in out and "missing from a complete store" in out


def test_differing_source_shard_is_named(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = work / "src" / "rank_5" / "checkpoint_5.ckpt"
    with CkptReader(f) as r:
        seg = r.entries["layer2.bias"].segments[0]
        shape = r.entries["layer2.bias"].shape
    _flip(f, seg.offset + 4)  # element 1 of rank 5's shard
    code, out = _run(_args(work), capsys)
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("[source]"), out
    assert str(f) in lines[0] and "'layer2.bias'" in lines[0] and "first difference at element" in lines[0]
    assert shape  # a real tensor, not a scalar


def test_changed_byte_in_an_export_file_is_named(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = work / "out" / "rank_2" / "checkpoint_2.ckpt"
    with CkptReader(f) as r:
        seg = r.entries["moments.layer3.weight"].segments[0]
    _flip(f, seg.offset + seg.length - 1)  # the last element of the slice
    code, out = _run(_args(work), capsys)
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("[export]"), out
    assert str(f) in lines[0] and "'moments.layer3.weight'" in lines[0]


def test_export_structure_problems(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing rank file, an extra one, and a file whose entries are reordered."""
    (work / "out" / "rank_1" / "checkpoint_1.ckpt").unlink()
    (work / "out" / "rank_9").mkdir()
    shutil.copyfile(work / "out" / "rank_0" / "checkpoint_0.ckpt", work / "out" / "rank_9" / "checkpoint_9.ckpt")
    f = work / "out" / "rank_3" / "checkpoint_3.ckpt"
    with CkptReader(f) as r:
        names = r.names()
        values = {n: (r.entries[n], bytes(r.map_bytes(n))) for n in names}
    from zckpt.formats.ckpt_encoding import value_header

    swapped = [names[1], names[0], *names[2:]]
    f.write_bytes(b"".join(value_header(n, values[n][0].ms_type, values[n][0].dims, len(values[n][1]))
                           + values[n][1] for n in swapped))
    code, out = _run(_args(work), capsys)
    assert code == 1
    assert "rank 1's file is missing" in out
    assert "checkpoint_9.ckpt: file is not part of this destination layout" in out
    assert f"file {f}: entries are out of order: position 0 holds {names[1]!r}" in out


def test_store_structure_problems(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An attribute that disagrees with the manifest, and an array the manifest does not list."""
    store = work / "s.zarr"
    meta_path = store / "tensors" / "learning_rate" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["zckpt"]["ms_dtype"] = "Float64"
    meta_path.write_text(json.dumps(meta))
    shutil.copytree(store / "tensors" / "momentum", store / "tensors" / "stray")
    code, out = _run(["verify", str(store)], capsys)
    assert code == 1
    assert "parameter 'learning_rate'" in out and "ms_dtype is 'Float64'" in out
    assert f"file {store / 'tensors' / 'stray'}: array is not in the manifest" in out


def test_undecodable_and_short_chunks_are_named(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without recorded checksums, damage still shows: a compressed chunk zarr cannot decode,
    and a raw chunk of the wrong size."""
    store_dir = work / "s.zarr"
    st = Store.open(store_dir)
    e = st.entry("layer2.weight")
    old = st.array(e.name)
    data, attrs = np.asarray(old[...]), dict(old.attrs)
    shutil.rmtree(store_dir / e.key)
    gz = zarr.create_array(store=str(store_dir), name=e.key, shape=data.shape, chunks=old.chunks, dtype=data.dtype,
                           compressors=zarr.codecs.GzipCodec(), attributes=attrs)
    gz[...] = data
    gz_chunk = _chunk_file(store_dir, e.name, (2, 0))
    gz_chunk.write_bytes(gz_chunk.read_bytes()[:-9])
    raw_chunk = _chunk_file(store_dir, "layer3.weight", (0, 1))
    raw_chunk.write_bytes(raw_chunk.read_bytes()[:-4])
    monkeypatch.setattr(Store, "checksums", lambda self: {})
    r = verify(store_dir)
    found = {(m.param, m.region.split(" ")[1] if m.region else None): m.message for m in r.mismatches}
    gz_key = gz_chunk.relative_to(store_dir / e.key).as_posix()  # "c/2/0": zarr's default key encoding
    assert set(found) == {("layer2.weight", gz_key), ("layer3.weight", raw_chunk.name)}, r.mismatches
    assert "cannot be decoded" in found[("layer2.weight", gz_key)]
    assert "need" in found[("layer3.weight", raw_chunk.name)]
    assert r.checksummed_chunks == 0


def test_incomplete_store_requires_only_ingested_regions(tmp_path: Path) -> None:
    """In a partial store, chunks of ranks never ingested are expected to be absent; a
    missing chunk of an ingested rank is still damage."""
    import zckpt

    files = {r: str(SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in (0, 1)}
    store_dir = tmp_path / "partial.zarr"
    zckpt.ingest(files, store_dir, str(SRC_STRATEGY), zckpt.IngestOptions(require_complete=False))
    assert verify(store_dir).ok
    st = Store.open(store_dir)
    written = [(r, b) for r, b in st.writers("layer1.weight") if r in st.ingested_ranks()]
    assert written
    arr = st.array("layer1.weight")
    box = written[0][1]
    coords = tuple(a // c for a, c in zip(box.start, arr.chunks, strict=True))
    (store_dir / arr.path / arr.metadata.encode_chunk_key(coords)).unlink()
    r = verify(store_dir)
    assert [(m.param, "missing from an ingested region" in m.message) for m in r.mismatches] == [
        ("layer1.weight", True)]


def test_usage_errors(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(["verify", str(work / "s.zarr"), "--strategy", str(SRC_STRATEGY)], capsys)
    assert code == 2 and "SRC_DIR" in out
    code, out = _run(["verify", str(work / "nope.zarr")], capsys)
    assert code == 1 and "not a zarr store" in out


def test_verify_never_writes(work: Path) -> None:
    def snapshot() -> dict[str, Any]:
        return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in work.rglob("*")}

    before = snapshot()
    assert cli_main(_args(work)) == 0
    assert snapshot() == before


def test_helpers() -> None:
    assert [(c, b.to_json()) for c, b in chunk_grid((5,), (2,))] == [
        ((0,), [[0], [2]]), ((1,), [[2], [4]]), ((2,), [[4], [5]])]  # the edge chunk is clipped
    assert list(chunk_grid((0, 3), (1, 1))) == []
    assert [c for c, _ in chunk_grid((), ())] == [()]
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = a.copy()
    assert first_difference(a, b) is None
    b[2, 1] = -0.0 if a[2, 1] == 0 else np.nan
    assert first_difference(a, b) == (2, 1)
    z = np.zeros(2, dtype=np.float32)
    assert first_difference(z, -z) == (0,)  # signed zeros differ in bytes


def test_manifest_key_problems(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two entries pointing at one array, and a key that leaves its group."""
    root_meta = work / "s.zarr" / "zarr.json"
    doc = json.loads(root_meta.read_text())
    entries = doc["attributes"]["zckpt"]["entries"]
    by_name = {e["name"]: e for e in entries}
    by_name["moments.layer2.bias"]["key"] = by_name["layer2.bias"]["key"]
    by_name["momentum"]["key"] = "tensors/../../outside"
    root_meta.write_text(json.dumps(doc))
    code, out = _run(["verify", str(work / "s.zarr")], capsys)
    assert code == 1
    assert "parameter 'moments.layer2.bias'" in out and "is shared with another entry" in out
    assert "parameter 'momentum'" in out and "is not one safe path component" in out
