"""Remote reads by byte range, outputs streamed up: bytes moved vs needed, spooled bytes, throughput vs plain s3fs.

Starts moto's S3 server on loopback behind the counting proxy of ``tests/s3_proxy.py``,
uploads a generated job, and runs, from its URLs:

* ``transform_rank``: one destination rank (what ``transform_checkpoint_by_rank`` and a
  loading rank read), and ``transform``: every destination rank;
* ``ingest`` into a local store;
* ``read_slice`` of one destination rank's slices, and ``export --rank`` of that rank, from
  a store at a URL, chunked by the source ranks and chunked for the destination too
  (``IngestOptions.serve``): raw chunks read by byte range, each range with the checksum
  blocks it touches, checked as they arrive (``zckpt/store/remote_chunks.py``); the
  amplification the reader reports is printed beside what the proxy counted.

For each it prints the bytes the server sent (counted by the proxy) against the bytes the
destination holds, the bytes written under ``$TMPDIR`` while it ran (a spool would show),
and the throughput against replaying the same ranges with the same client (s3fs) as plain
ranged GETs: ``cat_ranges`` (s3fs's batched async GETs), and a plain loop of ``cat_file``.
Then ``export`` of the local store to an S3 directory, the rank files streamed up as
multipart uploads: the bytes sent (counted by the proxy) against the bytes of the files,
the bytes written under ``$TMPDIR`` while it ran, and the time against plain uploads of
the same files (a local export of the same job) with the same client: ``put_file`` one file
at a time (as one export task writes them), and ``put`` (s3fs uploads the files at once).
Loopback has no round trip, and moto and the proxy share this process's CPU with the client:
``--put-latency`` holds every ``PUT`` of that comparison (parts, small objects) that many
seconds at the proxy, as a network would, where parts on the wire at once pay.
The figures are of loopback and moto (a Python server): relative, not absolute.

    python bench/bench_remote.py [--mib 64] [--src 8] [--dst 4] [--put-latency 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from s3_proxy import Fault, Proxy, moto_server  # noqa: E402  (tests/ put on the path above)

from zckpt.core.dtypes import ms_dtype  # noqa: E402
from zckpt.formats.ckpt import CkptReader  # noqa: E402
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout  # noqa: E402
from zckpt.io import streamed_files  # noqa: E402
from zckpt.jobs.export import export  # noqa: E402
from zckpt.jobs.export_job import ExportOptions  # noqa: E402
from zckpt.jobs.generate import write_model  # noqa: E402
from zckpt.jobs.generate_model import TensorDef  # noqa: E402
from zckpt.jobs.ingest import IngestOptions, ingest  # noqa: E402
from zckpt.jobs.segmented import read_slice  # noqa: E402
from zckpt.jobs.transform import TransformOptions, plan_transform, transform, transform_rank  # noqa: E402
from zckpt.jobs.unified import unified_safetensors  # noqa: E402
from zckpt.store.store import Store  # noqa: E402

MiB = 1024 * 1024
BUCKET = "zckpt-bench"


def make_job(root: Path, mib: int, src: int, dst: int) -> tuple[Path, Path]:
    """A job of about ``mib`` MiB on ``src`` ranks (rows split, one tensor by columns), and a
    ``dst``-rank destination strategy splitting every tensor by rows."""
    n = max(2, mib // 4)
    tensors = []
    for i in range(n):
        shape = (1024, 1024) if i % 4 else (2048, 256)
        lay = make_layout([1, src], [-1, 0]) if i % 5 == 4 else make_layout([src, 1], [1, -1])
        tensors.append(TensorDef(f"net.l{i}.weight", shape, "Float32", lay))
    write_model(root / "src", tensors, device_num=src)
    layouts: dict[str, dict[int, ParamLayout]] = {t.name: {0: make_layout([dst, 1], [1, -1])} for t in tensors}
    (root / "dst.ckpt").write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    return root / "src", root / "dst.ckpt"


class TmpWatch:
    """Bytes of the files under a directory, sampled while a run lasts (its peak)."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in self.root.rglob("*"):
                with contextlib.suppress(FileNotFoundError):  # a file removed while counted
                    total += p.stat().st_size if p.is_file() else 0
            self.peak = max(self.peak, total)
            self._stop.wait(0.01)

    def __enter__(self) -> TmpWatch:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def replay(proxy: Proxy, fs: Any) -> tuple[float, float, float | None]:
    """Seconds to fetch the ranges the last run fetched, with s3fs's ``cat_ranges``, with a loop
    of ``cat_file`` (one request at a time) and, when it is importable, obstore's ``get_range``
    from 8 threads (the same requests: its ``get_ranges`` would merge them)."""
    ranges = list(proxy.ranges)
    paths = [p.lstrip("/") for p, _, _ in ranges]
    t0 = time.perf_counter()
    fs.cat_ranges(paths, [a for _, a, _ in ranges], [b for _, _, b in ranges])
    batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p, (_, a, b) in zip(paths, ranges, strict=True):
        fs.cat_file(p, start=a, end=b)
    looped = time.perf_counter() - t0
    return batched, looped, _obstore(proxy.url, paths, ranges)


def _obstore(endpoint: str, paths: list[str], ranges: list[tuple[str, int, int]]) -> float | None:
    try:
        import obstore  # (optional: only to compare clients)
        from obstore.store import S3Store
    except ImportError:
        return None
    from concurrent.futures import ThreadPoolExecutor

    store = S3Store(BUCKET, endpoint=endpoint, region="us-east-1", access_key_id="testing",
                    secret_access_key="testing", client_options={"allow_http": True})
    keys = [(p.split("/", 1)[1], a, b) for p, (_, a, b) in zip(paths, ranges, strict=True)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:  # the same requests, as many at once as zckpt runs
        got = list(pool.map(lambda k: obstore.get_range(store, k[0], start=k[1], end=k[2]), keys))
    took = time.perf_counter() - t0
    assert sum(len(b) for b in got) == sum(b - a for _, a, b in ranges)
    return took


def run(label: str, proxy: Proxy, fs: Any, tmp: Path, needed: int, call: Any) -> None:
    proxy.reset_counts()
    with TmpWatch(tmp) as watch:
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
    fetched = proxy.fetched(f"/{BUCKET}/")
    requests = sum(n for k, n in proxy.requests.items() if k.startswith("GET"))
    print(f"{label}: needed {needed / MiB:.2f} MiB, fetched {fetched / MiB:.2f} MiB ({fetched / needed:.3f}x) "
          f"in {requests} GETs, spooled {watch.peak} B, {took:.2f} s = {fetched / MiB / took:.1f} MiB/s")
    if not proxy.ranges:
        print("  (whole objects, no ranged GETs to replay)")
        return
    batched, looped, obs = replay(proxy, fs)
    print(f"  the same ranges as plain GETs (throughput of zckpt / of the plain GETs): s3fs cat_ranges "
          f"{batched:.2f} s ({batched / took:.2f}), s3fs cat_file loop {looped:.2f} s ({looped / took:.2f})"
          + ("" if obs is None else f", obstore get_range x8 threads {obs:.2f} s ({obs / took:.2f})"))


def run_write(proxy: Proxy, fs: Any, tmp: Path, store: Path, dst: Path, opts: dict[str, Any],
              latency: float = 0.0) -> None:
    """``export`` to S3 (streamed) against a plain ``put`` of the same files, every ``PUT``
    held ``latency`` seconds."""
    local = tmp.parent / "out-local"
    t0 = time.perf_counter()
    export(str(store), str(local), str(dst))
    on_disk = time.perf_counter() - t0
    files = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    proxy.reset_counts()
    proxy.faults = [Fault(f"/{BUCKET}/", "delay", method="PUT", stall_seconds=latency)] if latency else []
    with TmpWatch(tmp) as watch:
        t0 = time.perf_counter()
        export(str(store), f"s3://{BUCKET}/out", str(dst), options=ExportOptions(storage_options=opts))
        took = time.perf_counter() - t0
    sent = sum(n for p, n in proxy.uploaded.items() if p.startswith(f"/{BUCKET}/out/rank_"))
    parts = sum(n for k, n in proxy.requests.items() if k.startswith(f"PUT /{BUCKET}/out/rank_"))
    held = f", every PUT held {latency:g} s" if latency else ""
    print(f"export to S3 (streamed{held}): files {files / MiB:.2f} MiB, sent {sent / MiB:.2f} MiB "
          f"({sent / files:.3f}x) in {parts} PUTs, spooled {watch.peak} B, {took:.2f} s = "
          f"{files / MiB / took:.1f} MiB/s")
    print(f"  the same export to local disk: {on_disk:.2f} s")
    named = sorted(p for p in local.rglob("*") if p.is_file())
    t0 = time.perf_counter()
    for f in named:  # one file at a time, as one export task writes them, in parts of the same size
        fs.put_file(str(f), f"{BUCKET}/plain-one/{f.relative_to(local).as_posix()}", chunksize=streamed_files.PART)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    fs.put(str(local), f"{BUCKET}/plain", recursive=True)
    batched = time.perf_counter() - t0
    proxy.faults = []
    print(f"  the same files as plain uploads (throughput of zckpt / of the plain uploads): s3fs put_file one "
          f"by one in {streamed_files.PART // MiB} MiB parts {one:.2f} s ({one / took:.2f}), s3fs put (files at "
          f"once, its own part size) {batched:.2f} s ({batched / took:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--src", type=int, default=8)
    ap.add_argument("--dst", type=int, default=4)
    ap.add_argument("--put-latency", type=float, default=0.0, help="seconds each PUT of the write comparison is held")
    a = ap.parse_args()
    import s3fs

    with tempfile.TemporaryDirectory(prefix="zckpt-bench-remote-") as work, moto_server() as endpoint, \
            Proxy(endpoint) as proxy:
        root = Path(work)
        spool = root / "tmpdir"
        spool.mkdir()
        os.environ["TMPDIR"] = str(spool)
        tempfile.tempdir = str(spool)
        src, dst = make_job(root / "job", a.mib, a.src, a.dst)
        up = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        up.mkdir(BUCKET)
        up.put(str(src), f"{BUCKET}/src", recursive=True)
        url = f"s3://{BUCKET}/src"
        opts = {"endpoint_url": proxy.url}
        fs = s3fs.S3FileSystem(**opts)
        plan = plan_transform(src, src / "strategy.ckpt", dst, verify_crc=False)
        sizes = {t.name: ms_dtype(t.ms_type).storage.itemsize for t in plan.source.tensors if t.kind == "tensor"}
        total = sum(t.nbytes for t in plan.source.tensors)
        print(f"job: {total / MiB:.1f} MiB on {a.src} ranks -> {a.dst} ranks; moto on loopback behind a counting proxy")
        files = {r: f"{url}/rank_{r}/checkpoint_{r}.ckpt" for r in range(a.src)}
        one = root / "one.ckpt"
        t_opts = TransformOptions(storage_options=opts, overwrite=True)
        transform_rank(files, 1, one, f"{url}/strategy.ckpt", dst, options=t_opts)  # to size what it needs
        with CkptReader(one) as r:
            need_one = sum(e.nbytes for e in r.entries.values() if e.kind == "tensor")
        run("transform_rank (1/N)", proxy, fs, spool, need_one,
            lambda: transform_rank(files, 1, one, f"{url}/strategy.ckpt", dst, options=t_opts))
        need_all = sum(s.box.size * sizes.get(s.name, 0) for r in plan.export.ranks for s in r.slices)
        run("transform (all ranks)", proxy, fs, spool, need_all,
            lambda: transform(url, root / "out", f"{url}/strategy.ckpt", dst, options=t_opts))
        run("unified_safetensors (every tensor, whole, into parts on S3)", proxy, fs, spool,
            sum(t.nbytes for t in plan.source.tensors if t.kind == "tensor"),
            lambda: unified_safetensors(url, f"{url}/strategy.ckpt", f"s3://{BUCKET}/unified", storage_options=opts))
        run("ingest", proxy, fs, spool, total,
            lambda: ingest(url, str(root / "store.zarr"), f"{url}/strategy.ckpt",
                           IngestOptions(storage_options=opts, overwrite=True)))
        names = [t.name for t in plan.source.tensors if t.kind == "tensor"]
        for label, serve in (("store chunked by the sources", ()), ("store chunked for the destination", (dst,))):
            store_url = f"s3://{BUCKET}/store-{len(serve)}.zarr"
            ingest(url, store_url, f"{url}/strategy.ckpt",
                   IngestOptions(storage_options={"endpoint_url": endpoint}, serve=serve))
            reported: list[int] = []

            def read_rank(store_url: str = store_url, reported: list[int] = reported) -> None:
                st = Store.open(store_url, storage_options=opts)  # once, as a loading rank opens it
                reported.append(sum(read_slice(st, 1, dst, n).read_bytes for n in names))

            run(f"read_slice (1/N), {label}", proxy, fs, spool, need_one, read_rank)
            print(f"  the reader reports {reported[0] / MiB:.2f} MiB read ({reported[0] / need_one:.3f}x)")
            run(f"export --rank (1/N), {label}", proxy, fs, spool, need_one,
                lambda store_url=store_url, serve=serve: export(
                    store_url, root / f"export-{len(serve)}", dst, ranks=[1],
                    options=ExportOptions(storage_options=opts)))
        run_write(proxy, fs, spool, root / "store.zarr", dst, opts, a.put_latency)


if __name__ == "__main__":
    main()
