"""The read-ahead of source files (zckpt.io.read_ahead): whole files, window by window."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from zckpt.io import fileio, read_ahead
from zckpt.sources.same_layout import Layouts

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise") or fileio.available_memory() is None,
                                reason="needs posix_fadvise and /proc/meminfo")


def test_read_soon_only_asks_for_what_fits(tmp_path: Path) -> None:
    """The read-ahead is started only when the files fit in the share of memory allowed,
    and never for a file that is not there (the reader names it instead)."""
    files = [tmp_path / f"f{i}" for i in range(3)]
    for f in files:
        f.write_bytes(os.urandom(4096))
    ahead = read_ahead.read_soon(files)
    assert ahead is not None
    ahead.join(30)
    assert ahead.asked == 3 * 4096
    assert read_ahead.read_soon(files, share=0.0) is None
    assert read_ahead.read_soon([*files, tmp_path / "missing"]) is None


def test_every_window_of_every_file_is_asked_for_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux reads one read-ahead window per WILLNEED: a file is asked for in steps of the
    device's window, first byte to last, file after file (one call for a whole shard read
    only its first 8 MiB); a file that vanished is passed over; stopped, it asks no more."""
    sizes = [10_000, 0, 25_000]
    files = [tmp_path / f"f{i}" for i in range(3)]
    for f, n in zip(files, sizes, strict=True):
        f.write_bytes(bytes(n))
    asked: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    inodes = {os.stat(f).st_ino: i for i, f in enumerate(files)}

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((inodes[os.fstat(fd).st_ino], offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    monkeypatch.setattr(read_ahead, "request_bytes", lambda device: 4096)
    ahead = read_ahead.ReadAhead([files[0], tmp_path / "gone", files[1], files[2]])
    ahead.join(30)
    want = [(0, o, min(4096, 10_000 - o)) for o in range(0, 10_000, 4096)]
    want += [(2, o, min(4096, 25_000 - o)) for o in range(0, 25_000, 4096)]
    assert asked == want and ahead.asked == 35_000
    asked.clear()
    stopped = read_ahead.ReadAhead([])
    stopped.stop()
    stopped._paths = files  # asked for after the stop: nothing
    again = threading.Thread(target=stopped._run)
    again.start()
    again.join()
    assert asked == []


def test_files_read_together_are_asked_for_a_window_of_each_in_turn(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A transform reads each tensor from every shard at the same pace: the files are asked
    for one window of each in turn; a job that reads only their starts, their first window."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(10))
    b.write_bytes(bytes(25))
    monkeypatch.setattr(read_ahead, "request_bytes", lambda device: 8)
    assert read_ahead.windows([a, b], "together") == [(a, 0, 8), (b, 0, 8), (a, 8, 2), (b, 8, 8), (b, 16, 8),
                                                       (b, 24, 1)]
    assert read_ahead.windows([a, b], "files") == [(a, 0, 8), (a, 8, 2), (b, 0, 8), (b, 8, 8), (b, 16, 8),
                                                    (b, 24, 1)]
    assert read_ahead.windows([a, tmp_path / "gone", b], "starts") == [(a, 0, 8), (b, 0, 8)]


def test_the_window_is_the_device_s_where_it_is_known(tmp_path: Path) -> None:
    """A file on a block device is asked for in steps of its device's larger limit
    (read_ahead_kb, max_sectors_kb), within the bounds; elsewhere in the fallback's."""
    f = tmp_path / "f"
    f.write_bytes(b"x")
    device = os.stat(f).st_dev
    step = read_ahead.request_bytes(device)
    assert read_ahead.FALLBACK_BYTES <= step <= read_ahead.MAX_BYTES
    base = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()
    queue = base / "queue" if (base / "queue").is_dir() else base.parent / "queue"
    if (queue / "read_ahead_kb").is_file():
        kib = max(int((queue / "read_ahead_kb").read_text()), int((queue / "max_sectors_kb").read_text()))
        assert step == min(read_ahead.MAX_BYTES, max(read_ahead.FALLBACK_BYTES, kib * 1024))
    else:
        assert step == read_ahead.FALLBACK_BYTES
    assert read_ahead.request_bytes(os.makedev(0, 0)) == read_ahead.FALLBACK_BYTES  # no block device


def _ra_store(tmp_path: Path) -> tuple[Path, Path]:
    from test_shards import _ingest, _model

    src, dst = _model(tmp_path)
    _ingest(src, tmp_path / "s.zarr", 0)  # one file per chunk: w in 32 row blocks, v in 4 x 8 blocks
    return tmp_path / "s.zarr", dst


def test_an_export_of_every_rank_reads_ahead_the_files_of_its_tensors(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank of a destination reads every file of its tensors, asked for in the order of
    the tensors and of their chunks (.ckpt and safetensors); fewer ranks may need a band of
    each file only, and ask for nothing ahead."""
    from test_shards import _check_export

    import zckpt
    from zckpt.jobs import export_job

    store, dst = _ra_store(tmp_path)
    asked: list[list[Path]] = []
    monkeypatch.setattr(export_job, "read_soon", lambda paths, share=0.25: asked.append(list(paths)))
    zckpt.export(store, tmp_path / "all", str(dst))
    _check_export(tmp_path / "all")
    w = [store / "tensors" / "w" / f"c.{i}.0" for i in range(32)]
    v = [store / "tensors" / "v" / f"c.{i}.{j}" for i in range(4) for j in range(8)]
    assert asked == [w + v]
    from zckpt.jobs.export import export_safetensors

    export_safetensors(store, tmp_path / "sf", str(dst))
    assert asked[1] == w + v
    zckpt.export(store, tmp_path / "one", str(dst), ranks=[0])
    assert len(asked) == 2


def test_no_read_ahead_for_a_cluster_s_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers of a Dask scheduler may run on other hosts, whose page caches this process
    cannot fill: no read-ahead there (a LocalCluster shares this machine's and gets it)."""
    from zckpt.jobs import export_job
    from zckpt.jobs.export_job import ExportOptions, plan_export
    from zckpt.store.store import Store

    store_path, dst = _ra_store(tmp_path)
    store = Store.open(store_path)
    plan = plan_export(store, str(dst))
    asked: list[list[Path]] = []
    monkeypatch.setattr(export_job, "read_soon", lambda paths, share=0.25: asked.append(list(paths)))
    export_job.read_store_ahead(store, plan, plan.ranks, ExportOptions(scheduler="tcp://127.0.0.1:1"))
    assert asked == []
    export_job.read_store_ahead(store, plan, plan.ranks, ExportOptions(workers=2))
    assert len(asked) == 1 and len(asked[0]) == 64


def test_only_the_read_ahead_thread_reads_at_idle_priority() -> None:
    """The read-ahead thread's reads are of the idle I/O class, so that the job's own reads
    pass them; the rest of the process keeps its class."""
    import ctypes
    import platform

    number = read_ahead.IOPRIO_SET.get(platform.machine())
    if number is None:
        pytest.skip(f"no ioprio_set number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.syscall(number + 1, 1, 0)  # ioprio_get of this thread
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.extend([read_ahead.idle_io(), libc.syscall(number + 1, 1, 0)]))
    thread.start()
    thread.join()
    assert seen == [True, 3 << 13]
    assert libc.syscall(number + 1, 1, 0) == before != 3 << 13
    ahead = read_ahead.ReadAhead([])
    ahead.join(30)
    assert ahead.idle


def test_each_job_reads_its_sources_ahead_in_the_order_it_reads_them(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of large entries, walked for their headers first: an ingest reads them ahead
    file after file, a transform of every rank all together; a transform of one rank and a
    dry run read nothing ahead (they need their starts, walked already). The outputs are the
    global values either way."""
    from test_shards import HUGE

    import zckpt
    from zckpt.formats.ckpt import CkptReader
    from zckpt.jobs.dryrun import dry_run_transform
    from zckpt.jobs.generate import write_model
    from zckpt.jobs.generate_model import global_value
    from zckpt.jobs.transform import transform

    src = tmp_path / "src"
    write_model(src, [HUGE], device_num=8, scalars=False, crc=False)
    orders: list[str] = []
    real = read_ahead.read_soon

    def soon(paths: list[Path], share: float = 0.25, order: read_ahead.Order = "starts") -> read_ahead.ReadAhead | None:
        orders.append(order)
        return real(paths, share, order)

    monkeypatch.setattr(read_ahead, "read_soon", soon)
    zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"))
    assert orders == ["files"]
    transform(str(src), tmp_path / "all", str(src / "strategy.ckpt"))
    assert orders == ["files", "together"]
    transform(str(src), tmp_path / "one", str(src / "strategy.ckpt"), str(src / "strategy.ckpt"), ranks=[3])
    dry_run_transform(str(src), tmp_path / "dry", str(src / "strategy.ckpt"), str(src / "strategy.ckpt"))
    assert orders == ["files", "together"]
    with CkptReader(tmp_path / "all" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.array(HUGE.name).tobytes() == global_value(HUGE.name, HUGE.shape, HUGE.ms_type).tobytes()
    with CkptReader(tmp_path / "one" / "rank_3" / "checkpoint_3.ckpt") as r:
        want = global_value(HUGE.name, HUGE.shape, HUGE.ms_type)[3 * 256 : 4 * 256]
        assert r.array(HUGE.name).tobytes() == want.tobytes()


def test_the_headers_of_large_entries_are_asked_for_together_from_the_first_file_s_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the first shard's entries are large, the other shards are asked for the 512 bytes
    before each payload of the first (its Value headers), all before any is walked; the
    indexes walked after are each file's own. read_headers asks each file for exactly those
    spans."""
    from test_shards import HUGE

    import zckpt
    from zckpt.formats.ckpt import CkptReader
    from zckpt.jobs.generate import write_model

    src = tmp_path / "src"
    write_model(src, [HUGE], device_num=8, scalars=False, crc=False)
    with CkptReader(src / "rank_0" / "checkpoint_0.ckpt") as r:
        offsets = sorted(s.offset for e in r.entries.values() for s in e.segments)
    want = [(max(0, o - 512), min(512, o)) for o in offsets]
    calls: list[tuple[list[Path], list[tuple[int, int]]]] = []
    walked: list[str] = []
    real_headers, real_init = read_ahead.read_headers, CkptReader.__init__

    def headers(paths: list[Path], spans: list[tuple[int, int]]) -> None:
        calls.append((list(paths), list(spans)))
        walked.append("headers")
        real_headers(paths, spans)

    def init(self: CkptReader, path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> None:
        walked.append(Path(path).parent.name)
        real_init(self, path, verify_crc=verify_crc, sparse=sparse)

    monkeypatch.setattr(read_ahead, "read_headers", headers)
    monkeypatch.setattr(CkptReader, "__init__", init)
    report = zckpt.ingest(str(src), tmp_path / "alike.zarr", str(src / "strategy.ckpt"))
    assert report.complete and walked == ["rank_0", "headers"]  # the others laid out as rank 0 (same_layout)
    assert calls == [([src / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in range(1, 8)], want)]
    calls.clear()
    walked.clear()
    monkeypatch.setattr(Layouts, "index_of", lambda self, path, group=None: None)  # each file walked
    report = zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"))
    assert report.complete
    assert walked[:2] == ["rank_0", "headers"] and sorted(walked[2:9]) == [f"rank_{r}" for r in range(1, 8)]
    assert calls == [([src / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in range(1, 8)], want)]

    asked: list[tuple[str, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, a: (asked.append((os.readlink(f"/proc/self/fd/{fd}"),
                                                                                 o, n)), real(fd, o, n, a)))
    real_headers([src / "rank_1" / "checkpoint_1.ckpt", tmp_path / "gone"], [(0, 100), (4096, 512)])
    assert asked == [(str(src / "rank_1" / "checkpoint_1.ckpt"), 0, 100),
                     (str(src / "rank_1" / "checkpoint_1.ckpt"), 4096, 512)]


def test_the_device_s_window_is_looked_up_once_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """256 files on one disk: one look at /sys for its window, not one per file."""
    files = []
    for i in range(256):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(b"x" * 10)
    looked: list[int] = []
    real = read_ahead.request_bytes

    def look(dev: int) -> int:
        looked.append(dev)
        return real(dev)

    monkeypatch.setattr(read_ahead, "request_bytes", look)
    got = read_ahead.windows(files, "files")
    assert [(p, o, n) for p, o, n in got] == [(p, 0, 10) for p in files]
    assert looked == [files[0].stat().st_dev]
