"""Packed tiny tensors at scale, judged by readers zckpt does not share.

The shard is written and the exported file read with MindSpore's protobuf classes alone
(no :mod:`zckpt.formats.ckpt`, no :mod:`zckpt.jobs.generate`), the values drawn here with numpy:
a packing, checksum-run or batched-read bug that puts one tensor's bytes under another name
fails the comparison whatever zckpt believes it wrote.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

import zckpt
from zckpt.core.errors import StoreError
from zckpt.jobs.verify import verify
from zckpt.store import integrity
from zckpt.third_party.mindspore_proto import ms_checkpoint_pb2 as ckpt_pb

ROOT = Path(__file__).resolve().parents[1]
COUNT = 20_000
TYPES = {"Float32": np.float32, "Float16": np.float16, "Int32": np.int32, "Int8": np.int8, "Float64": np.float64}
SHAPES = ((37,), (4, 9), (), (1,), (3, 2, 5), (130,))


def _values(count: int) -> dict[str, tuple[str, np.ndarray]]:
    """``count`` tiny tensors of mixed types and ranks, every element random."""
    rng = np.random.default_rng(17)
    names = list(TYPES)
    out = {}
    for i in range(count):
        ms_type = names[i % len(names)]
        shape = SHAPES[(i // len(names)) % len(SHAPES)]
        raw = rng.integers(0, 256, size=math.prod(shape) * np.dtype(TYPES[ms_type]).itemsize, dtype=np.uint8)
        out[f"layer.{i // 10}.p{i % 10}"] = (ms_type, raw.view(TYPES[ms_type]).reshape(shape))
    return out


def _write_shard(path: Path, values: dict[str, tuple[str, np.ndarray]]) -> None:
    msg = ckpt_pb.Checkpoint()
    for name, (ms_type, arr) in values.items():
        v = msg.value.add()
        v.tag = name
        v.tensor.dims.extend(arr.shape)
        v.tensor.tensor_type = ms_type
        v.tensor.tensor_content = arr.tobytes()
    path.parent.mkdir(parents=True)
    path.write_bytes(msg.SerializeToString())


def _read_ckpt(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every entry of a ``.ckpt`` as ``(type, dims, bytes)``, continuation values joined."""
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for v in ckpt_pb.Checkpoint.FromString(path.read_bytes()).value:
        ms_type, dims, data = out.get(v.tag, (v.tensor.tensor_type, tuple(v.tensor.dims), b""))
        out[v.tag] = (ms_type, dims, data + v.tensor.tensor_content)
    return out


def _same_as_written(got: dict[str, tuple[str, tuple[int, ...], bytes]],
                     values: dict[str, tuple[str, np.ndarray]]) -> list[str]:
    wrong = [n for n, (t, a) in values.items() if got.get(n) != (t, a.shape, a.tobytes())]
    return wrong + sorted(set(got) - set(values))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("packed_scale")
    values = _values(COUNT)
    _write_shard(root / "src" / "rank_0" / "checkpoint_0.ckpt", values)
    zckpt.ingest(str(root / "src"), root / "s.zarr")
    return root, values


def test_twenty_thousand_tiny_tensors_export_as_written(
        job: tuple[Path, dict[str, tuple[str, np.ndarray]]], tmp_path: Path) -> None:
    root, values = job
    store = root / "s.zarr"
    files = sum(len(fs) for _, _, fs in os.walk(store))
    assert files < 20, files  # packed: a chunk file per type, not a file per tensor
    records = json.loads((store / "progress" / "rank_0.json").read_text())["crc32c_blocks"]
    assert "packed" in records and not records.get("runs")  # checksums per run written, not per tensor
    zckpt.export(store, tmp_path / "out", None)
    got = _read_ckpt(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt")
    assert _same_as_written(got, values) == []
    assert verify(store).ok


def test_a_flipped_byte_in_the_middle_of_a_packed_run_is_refused(
        job: tuple[Path, dict[str, tuple[str, np.ndarray]]], tmp_path: Path) -> None:
    root, values = job
    shutil.copytree(root / "s.zarr", tmp_path / "s.zarr")
    entries = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]["zckpt"]["entries"]
    victim = next(e for e in entries[COUNT // 2:] if e["ms_type"] == "Int32" and e["shape"] == [130])
    chunk = tmp_path / "s.zarr" / victim["key"] / "c.0"  # 20 000 tiny tensors: one chunk per type
    at = victim["offset"] * 4 + 17
    data = bytearray(chunk.read_bytes())
    data[at] ^= 0x01
    chunk.write_bytes(bytes(data))
    assert not verify(tmp_path / "s.zarr").ok
    with pytest.raises(StoreError, match="checksum"):
        zckpt.export(tmp_path / "s.zarr", tmp_path / "out", None)
    assert not (tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt").exists()


def _runs_per_tensor(store: Path) -> None:
    """Rewrite a store's checksum records as the first format-6 zckpt wrote them: one run
    record per packed tensor under its own name (``runs``), no ``packed`` section; then
    reseal the digests, as that zckpt would have."""
    meta_path = store / "zarr.json"
    doc = json.loads(meta_path.read_text())
    manifest = doc["attributes"]["zckpt"]
    records = {}
    chunk_lens: dict[str, int] = {}
    for path in sorted((store / "progress").glob("rank_*.json")):
        rec = json.loads(path.read_text())
        blocks = rec["crc32c_blocks"]
        size = blocks["block_bytes"]
        del blocks["packed"]
        runs = blocks.setdefault("runs", {})
        for e in manifest["entries"]:
            if e.get("offset") is None or e["writer"] != rec["rank"]:
                continue
            itemsize = np.dtype(TYPES[e["ms_type"]]).itemsize
            if e["key"] not in chunk_lens:
                chunk_lens[e["key"]] = json.loads((store / e["key"] / "zarr.json").read_text())[
                    "chunk_grid"]["configuration"]["chunk_shape"][0]
            chunk_len = chunk_lens[e["key"]]
            key, at = f"c.{e['offset'] // chunk_len}", (e["offset"] % chunk_len) * itemsize
            n = math.prod(e["shape"]) * itemsize
            with open(store / e["key"] / key, "rb") as f:
                f.seek(at)
                data = f.read(n)
            sums = ".".join(f"{google_crc32c.value(data[i:i + size]):08x}" for i in range(0, max(1, n), size))
            runs[e["name"]] = {key: f"{at}:{n}:{sums}"}
        path.write_text(json.dumps(rec, separators=(",", ":")))
        records[int(rec["rank"])] = rec
    manifest["integrity"] = integrity.sealed(manifest, records)
    meta_path.write_text(json.dumps(doc))


def test_stores_with_a_run_record_per_packed_tensor_are_still_read(
        job: tuple[Path, dict[str, tuple[str, np.ndarray]]], tmp_path: Path) -> None:
    root, values = job
    store = tmp_path / "s.zarr"
    shutil.copytree(root / "s.zarr", store)
    _runs_per_tensor(store)
    assert verify(store).ok
    zckpt.export(store, tmp_path / "out", None)
    assert _same_as_written(_read_ckpt(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt"), values) == []
    entries = json.loads((store / "zarr.json").read_text())["attributes"]["zckpt"]["entries"]
    victim = entries[COUNT // 3]
    itemsize = np.dtype(TYPES[victim["ms_type"]]).itemsize
    with open(store / victim["key"] / "c.0", "r+b") as f:
        f.seek(victim["offset"] * itemsize)
        byte = f.read(1)
        f.seek(victim["offset"] * itemsize)
        f.write(bytes([byte[0] ^ 0x80]))
    report = verify(store)
    assert [m.param for m in report.mismatches] == [victim["name"]]  # its own record names it exactly
    with pytest.raises(StoreError, match="checksum"):
        zckpt.export(store, tmp_path / "out2", None)


def _cli_ingest(src: Path, store: Path, *options: str) -> dict[str, dict[str, object]]:
    proc = subprocess.run([sys.executable, "-m", "zckpt.cli", "ingest", str(src), "--store", str(store),
                           "--quiet", *options], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((store / "zarr.json").read_text())
    return {e["name"]: e for e in doc["attributes"]["zckpt"]["entries"]}


def test_cli_packing_options(tmp_path: Path) -> None:
    values = _values(1500)
    _write_shard(tmp_path / "src" / "rank_0" / "checkpoint_0.ckpt", values)
    small = {n for n, (_, a) in values.items() if a.nbytes <= 40}
    got = _cli_ingest(tmp_path / "src", tmp_path / "a.zarr", "--pack-size", "40B", "--pack-count", "10")
    assert {n for n, e in got.items() if e.get("offset") is not None} == small
    got = _cli_ingest(tmp_path / "src", tmp_path / "b.zarr", "--pack-size", "0")
    assert not any(e.get("offset") is not None for e in got.values())
    assert not (tmp_path / "b.zarr" / "packed").exists()
    got = _cli_ingest(tmp_path / "src", tmp_path / "c.zarr", "--pack-count", str(len(values) + 1))
    assert not any(e.get("offset") is not None for e in got.values())
    got = _cli_ingest(tmp_path / "src", tmp_path / "d.zarr")
    assert all(e.get("offset") is not None for e in got.values())  # defaults: 64 KiB, from 1 024 tensors


def test_ingest_of_packed_tensors_killed_anywhere_resumes_to_the_same_store(tmp_path: Path) -> None:
    """SIGKILL at random points of an ingest that packs (the manifest written whole twice,
    the packed chunks preallocated, run records): rerunning it gives the store an
    uninterrupted run gives, file for file and byte for byte."""
    import random
    import signal
    import time

    values = _values(4000)
    _write_shard(tmp_path / "src" / "rank_0" / "checkpoint_0.ckpt", values)
    cmd = lambda store: [sys.executable, "-m", "zckpt.cli", "ingest", str(tmp_path / "src"),  # noqa: E731
                         "--store", str(store), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    subprocess.run(cmd(tmp_path / "ref.zarr"), env=env, check=True)
    duration = time.monotonic() - t0

    def snapshot(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    reference = snapshot(tmp_path / "ref.zarr")
    rng = random.Random(2026)
    killed = 0
    for trial in range(12):  # on a busy machine a run may end before its kill time: try more
        if killed == 4:
            break
        store = tmp_path / f"s{trial}.zarr"
        proc = subprocess.Popen(cmd(store), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=rng.uniform(0.3, duration))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed += 1
        subprocess.run(cmd(store), env=env, check=True)
        assert snapshot(store) == reference, f"trial {trial}: the resumed store differs"
    assert killed >= 2, f"only {killed} of {trial + 1} runs were killed before finishing"
