"""A store at a URL read by byte range: each needed byte fetched once, checked, faults retried.

moto's S3 server runs on loopback behind the counting, fault-injecting proxy of
``tests/s3_proxy.py`` (the job and helpers of ``tests/test_remote_ranges.py``). The same job is
ingested into a local store and into S3 stores of the same layout (one object per chunk):
chunked by the source ranks (``plain``) and also at the destination ranks' borders
(``served``, ``IngestOptions.serve``). What a rank reads from the S3 store must equal what it
reads from the local one bit for bit; what the proxy counted crossing the wire for the chunks
is what the reader reports it read, and for the served store at most 1.1x the rank's bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.core.errors import StoreError
from zckpt.io.ranged import DEFAULT_POLICY, RangedObject
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import write_model
from zckpt.jobs.segmented import read_slice
from zckpt.plan.export_plan import build_export_plan
from zckpt.sources.strategies import load_strategy
from zckpt.store.store import Store

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import Fault, Proxy, moto_server  # noqa: E402  (after the skips: it needs moto)
from test_remote_ranges import FAULTS, SLACK, SRC_N, _dst_strategy, _tensors, _tree, no_spool  # noqa: E402,F401

BUCKET = "zckpt-store-ranges"

RANK = 1
BLOCK = 16 * 1024
"""Checksum block of the test stores: chunks of 32-128 KiB span several, so a rank's part of
a chunk is read as a range with at most a block beyond either end, not as the whole chunk."""
NAMES = [t.name for t in _tensors()]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Proxy]]:
    """The S3 server (with a bucket of this module's own) and the proxy zckpt talks to."""
    with moto_server() as endpoint, Proxy(endpoint) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        try:
            yield fs, proxy
        finally:  # moto keeps its buckets in this process after its server stops
            fs.rm(BUCKET, recursive=True)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job of ``tests/test_remote_ranges.py`` (local sources) and its destination strategy."""
    root = tmp_path_factory.mktemp("store-ranges")
    write_model(root / "ckpt", _tensors(), device_num=SRC_N, strings={"note": "ranges"})
    return {"src": root / "ckpt", "dst": _dst_strategy(root / "dst_strategy.ckpt")}


@pytest.fixture(scope="module")
def stores(server: tuple[Any, Proxy], jobs: dict[str, Any],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """``{layout: (local store, S3 store)}`` for ``plain`` and ``served``, the local one
    unsharded and unpacked as a remote store is laid out; and ``sharded``: a local store of
    shard files (unpacked) copied to S3 as it is."""
    fs, proxy = server
    local = jobs["src"]
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for label, serve in (("plain", ()), ("served", (str(jobs["dst"]),))):
        here, there = root / f"{label}.zarr", f"s3://{BUCKET}/{label}.zarr"
        zckpt.ingest(str(local), str(here), str(local / "strategy.ckpt"),
                     options=zckpt.IngestOptions(shard_bytes=0, pack_bytes=0, serve=serve, checksum_block_bytes=BLOCK))
        zckpt.ingest(str(local), there, str(local / "strategy.ckpt"),
                     options=zckpt.IngestOptions(serve=serve, storage_options=proxy.options(),
                                                 checksum_block_bytes=BLOCK))
        a, b = Store.open(str(here)), Store.open(there, storage_options=proxy.options())
        assert all(a.chunk_info(n).chunks == b.chunk_info(n).chunks for n in NAMES)
        out[label] = (here, there)
    here = root / "sharded.zarr"
    zckpt.ingest(str(local), str(here), str(local / "strategy.ckpt"),
                 options=zckpt.IngestOptions(pack_bytes=0, checksum_block_bytes=BLOCK))
    assert Store.open(str(here)).chunk_info(NAMES[0]).per_shard is not None
    fs.put(str(here), f"{BUCKET}/sharded.zarr", recursive=True)
    out["sharded"] = (here, f"s3://{BUCKET}/sharded.zarr")
    return out


def _chunk_reads(proxy: Proxy, store: str) -> tuple[int, list[tuple[str, int, int]]]:
    """Body bytes of the ``GET`` answers for chunk objects of ``store`` (not metadata), and
    their ranges; fails when a chunk object was fetched whole or a byte of one twice."""
    prefix = f"/{BUCKET}/{store}/tensors/"
    chunk = {p: n for p, n in proxy.body_bytes.items() if p.startswith(prefix) and not p.endswith("zarr.json")}
    ranges = sorted(r for r in proxy.ranges if r[0] in chunk)
    gets = sum(n for k, n in proxy.requests.items() if k.startswith("GET ") and k[4:] in chunk)
    assert gets == len(ranges), "a chunk object was fetched whole (or by a suffix range)"
    for (p, _, b), (q, c, _) in zip(ranges, ranges[1:], strict=False):
        assert p != q or b <= c, f"bytes of {p} fetched twice"
    assert sum(b - a for _, a, b in ranges) == sum(chunk.values())
    return sum(chunk.values()), ranges


def _whole_chunks(ranges: list[tuple[str, int, int]], store: Path) -> int:
    """Bytes of the chunk objects ``ranges`` fall in, read whole (as zarr-python would)."""
    objects = {p.split(".zarr/", 1)[1] for p, _, _ in ranges}
    return sum((store / key).stat().st_size for key in objects)


@pytest.mark.parametrize("layout", ["served", "plain", "sharded"])
def test_read_slice_fetches_its_ranges_once(server: tuple[Any, Proxy], jobs: dict[str, Any],
                                            stores: dict[str, tuple[Path, str]], layout: str) -> None:
    """``read_slice`` of one rank from the S3 store: the local store's arrays bit for bit and
    the local reader's amplification; the chunk bytes fetched are the bytes reported read,
    each once, and for the store chunked for that destination within 1.1x of the slice."""
    _, proxy = server
    here, there = stores[layout]
    dst = str(jobs["dst"])
    proxy.reset_counts()
    needed = reported = 0
    for name in NAMES:
        got = read_slice(there, RANK, dst, name, storage_options=proxy.options())
        want = read_slice(str(here), RANK, dst, name)
        assert got.array.dtype == want.array.dtype and got.array.tobytes() == want.array.tobytes(), name
        assert got.read_bytes == want.read_bytes, name
        needed += got.array.nbytes
        reported += got.read_bytes
    fetched, ranges = _chunk_reads(proxy, f"{layout}.zarr")
    assert fetched == reported, (fetched, reported)
    assert needed <= fetched
    if layout == "served":
        assert fetched <= SLACK * needed, (fetched, needed)
    else:  # chunks (shards) of the source ranks: the rank's parts of them, not the whole objects
        assert fetched < _whole_chunks(ranges, here), (fetched, needed)


def test_loading_and_export_of_one_rank(server: tuple[Any, Proxy], jobs: dict[str, Any],
                                        stores: dict[str, tuple[Path, str]], tmp_path: Path) -> None:
    """``load_distributed_checkpoint(store=URL)`` and ``export --rank`` of one rank from the
    served S3 store: the local store's values and files; within 1.1x of the rank's bytes."""
    _, proxy = server
    here, there = stores["served"]
    opts = proxy.options()
    dst = str(jobs["dst"])
    want = zckpt.load_distributed_checkpoint(object(), predict_strategy=dst, format="safetensors",
                                             rank_id=RANK, return_param_dict=True, store=str(here))
    proxy.reset_counts()
    got = zckpt.load_distributed_checkpoint(object(), predict_strategy=dst, format="safetensors",
                                            rank_id=RANK, return_param_dict=True, store=there, storage_options=opts)
    assert want.keys() == got.keys()
    for k in want:
        assert not isinstance(want[k], np.ndarray) or np.asarray(got[k]).tobytes() == want[k].tobytes(), k
    needed = sum(v.nbytes for v in want.values() if isinstance(v, np.ndarray))
    fetched, _ = _chunk_reads(proxy, "served.zarr")
    assert needed <= fetched <= SLACK * needed, (fetched, needed)

    zckpt.export(str(here), str(tmp_path / "local"), dst, ranks=[RANK])
    proxy.reset_counts()
    report = zckpt.export(there, str(tmp_path / "remote"), dst, ranks=[RANK],
                          options=ExportOptions(storage_options=opts))
    assert _tree(tmp_path / "remote") == _tree(tmp_path / "local")
    fetched, _ = _chunk_reads(proxy, "served.zarr")
    assert fetched == report.bytes_read and needed <= fetched <= SLACK * needed, (fetched, needed)


def test_requests_in_flight_are_bounded(server: tuple[Any, Proxy], jobs: dict[str, Any],
                                        stores: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's chunk ranges go out concurrently, but never more than the policy's ``in_flight``."""
    _, proxy = server
    _, there = stores["plain"]
    dst = str(jobs["dst"])
    running, most, lock = 0, 0, threading.Lock()
    once = RangedObject._get_once

    def counted(self: RangedObject, start: int, stop: int) -> bytes:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            return once(self, start, stop)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(RangedObject, "_get_once", counted)
    zckpt.load_distributed_checkpoint(object(), predict_strategy=dst, format="safetensors", rank_id=RANK,
                                      return_param_dict=True, store=there, storage_options=proxy.options())
    assert 1 < most <= DEFAULT_POLICY.in_flight, most


@pytest.fixture
def damaged(server: tuple[Any, Proxy], jobs: dict[str, Any]) -> Iterator[tuple[Store, str, str]]:
    """A store of its own to damage (the served layout), and its URL."""
    fs, proxy = server
    local = jobs["src"]
    url = f"s3://{BUCKET}/damaged.zarr"
    zckpt.ingest(str(local), url, str(local / "strategy.ckpt"),
                 options=zckpt.IngestOptions(serve=(str(jobs["dst"]),), storage_options=proxy.options(),
                                             overwrite=True))
    yield Store.open(url, storage_options=proxy.options()), url, str(jobs["dst"])
    fs.rm(f"{BUCKET}/damaged.zarr", recursive=True)


def _rank_chunk(st: Store, dst: str, name: str) -> str:
    """The URL of the first chunk object of ``name`` that destination rank :data:`RANK` reads."""
    box = next(s.box for s in build_export_plan(st.specs(), load_strategy(dst), ranks=[RANK]).ranks[0].slices
               if s.name == name)
    key = st.chunk_keys(name, box)[0]
    return f"{st.url}/{st.entry(name).key}/{key}"


def test_a_damaged_chunk_is_refused_by_name(server: tuple[Any, Proxy],
                                            damaged: tuple[Store, str, str]) -> None:
    """A chunk whose bytes changed on the server fails its checksum, naming the object and the
    parameter; a chunk object gone is named as missing, at once (no retries)."""
    fs, proxy = server
    st, url, dst = damaged
    bad = _rank_chunk(st, dst, "net.a.weight")
    data = bytearray(fs.cat_file(bad[5:]))
    data[len(data) // 2] ^= 0x10
    fs.pipe(bad[5:], bytes(data))
    with pytest.raises(StoreError, match="fails its checksum") as err:
        read_slice(url, RANK, dst, "net.a.weight", storage_options=proxy.options())
    assert err.value.path == bad and err.value.param == "net.a.weight"
    got = read_slice(url, RANK, dst, "net.b.weight", storage_options=proxy.options())  # untouched chunks
    assert got.array.size

    gone = _rank_chunk(st, dst, "net.e.weight")
    fs.rm(gone[5:])
    proxy.reset_counts()
    with pytest.raises(StoreError, match="is missing: the store is damaged") as err:
        read_slice(url, RANK, dst, "net.e.weight", storage_options=proxy.options())
    assert err.value.path == gone and err.value.param == "net.e.weight"
    assert proxy.requests[f"GET {gone[4:]}"] == 1


@pytest.mark.parametrize("kind", FAULTS)
def test_transient_faults_are_retried(server: tuple[Any, Proxy], jobs: dict[str, Any],
                                      stores: dict[str, tuple[Path, str]], kind: str) -> None:
    """Two failures of each kind on the ranged reads of one tensor's chunks: retried, the
    slice the same as without them."""
    _, proxy = server
    here, there = stores["served"]
    dst = str(jobs["dst"])
    want = read_slice(str(here), RANK, dst, "net.a.weight")
    proxy.reset_counts()
    proxy.faults = [Fault(f"/{BUCKET}/served.zarr/{Store.open(str(here)).entry('net.a.weight').key}/c", kind,
                          times=2, stall_seconds=4)]
    try:
        got = read_slice(there, RANK, dst, "net.a.weight", storage_options=proxy.options())
    finally:
        proxy.faults = []
    assert proxy.injected[kind] == 2
    assert got.array.tobytes() == want.array.tobytes()


def test_lasting_fault_names_the_object(server: tuple[Any, Proxy], jobs: dict[str, Any],
                                        stores: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault that does not go away: the policy's tries, then an error naming the chunk object."""
    _, proxy = server
    here, there = stores["served"]
    dst = str(jobs["dst"])
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries off: zckpt's are counted
    where = f"/{BUCKET}/served.zarr/{Store.open(str(here)).entry('net.a.weight').key}/c"
    proxy.reset_counts()
    proxy.faults = [Fault(where, "503")]
    try:
        with pytest.raises(StoreError, match="tries") as err:
            read_slice(there, RANK, dst, "net.a.weight", storage_options=proxy.options())
    finally:
        proxy.faults = []
    assert err.value.path is not None and err.value.path.startswith(f"{there}/tensors/net.a.weight/c")
    assert err.value.param == "net.a.weight"
    # the rank's two chunk objects of it are tried side by side: the first to run out ends the read
    assert DEFAULT_POLICY.attempts <= proxy.injected["503"] <= 2 * DEFAULT_POLICY.attempts, proxy.injected
