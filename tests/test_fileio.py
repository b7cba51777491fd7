"""Byte-range copies between files (zckpt.io.fileio): one read, summed and written from one buffer."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from zckpt.core.errors import DiskFullError
from zckpt.io import fileio
from zckpt.io.checksums import BlockSummer, ChunkSums, SpanCheck, block_sums


@pytest.mark.parametrize(("offset", "length", "at", "bufsize"),
                         [(0, 0, 5, 8), (3, 1000, 17, 7), (123, 40_000, 4099, 4096), (0, 50_000, 0, 1 << 20)])
def test_copy_at_fills_only_its_range_and_sums_the_bytes_it_wrote(
    tmp_path: Path, offset: int, length: int, at: int, bufsize: int
) -> None:
    """A range copied into a preallocated file lands at ``at`` and nowhere else (the bytes
    around it are other writers'), and its per-block sums are those of the source bytes."""
    data = os.urandom(50_000)
    (tmp_path / "src").write_bytes(data)
    around = os.urandom(at + length + 100)
    (tmp_path / "dst").write_bytes(around)
    summer = BlockSummer(1000, offset)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY)
    try:
        fileio.copy_range_at(src, dst, offset, length, at, bytearray(bufsize), summer.feed)
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == around[:at] + data[offset : offset + length] + around[at + length :]
    piece = data[offset : offset + length]
    assert summer.result() == [google_crc32c.value(piece[i : i + 1000]) for i in range(0, max(1, length), 1000)]


def test_copy_at_reads_each_source_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a sink the bytes are read once, summed and written from the same buffer (no
    kernel copy followed by a second read)."""
    data = os.urandom(30_000)
    (tmp_path / "src").write_bytes(data)
    read: list[int] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        n = real_preadv(fd, buffers, offset)
        read.append(n)
        return n

    def no_kernel_copy(*args: object) -> int:
        raise AssertionError("copied by the kernel, then read again for the sums")

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy)
    summer = BlockSummer(4096, 10)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        fileio.copy_range_at(src, dst, 10, 25_000, 0, bytearray(4096), summer.feed)
    finally:
        os.close(src)
        os.close(dst)
    assert sum(read) == 25_000
    assert (tmp_path / "dst").read_bytes() == data[10:25_010]


def test_copy_at_past_the_end_of_the_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * 10)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="source ended after 6 of 20"):
            fileio.copy_range_at(src, dst, 4, 20, 0, bytearray(4))
    finally:
        os.close(src)
        os.close(dst)


class _Damaged(Exception):
    pass


@pytest.mark.parametrize("crc_trailer", [False, True])  # buffered copy, or pread + the writer's own CRC
@pytest.mark.parametrize(("offset", "length"), [(0, 256), (40, 180), (100, 10)])
def test_a_checked_range_is_checked_in_the_copy_across_parts(
    tmp_path: Path, crc_trailer: bool, offset: int, length: int
) -> None:
    """A range split over two Values (MindSpore's slice size) is still checked once, on the
    blocks it covers; a damaged block it covers stops the writer, one outside does not."""
    from zckpt.formats.ckpt import CkptReader
    from zckpt.formats.ckpt_writer import CkptWriter
    from zckpt.formats.entries import FileRange

    data = np.arange(64, dtype=np.float32).tobytes()
    src = tmp_path / "chunk"
    src.write_bytes(data)
    sums = ChunkSums("crc32c", tuple(block_sums(data, 32)), 32)

    def write(record: ChunkSums, tag: str) -> Path:
        check = SpanCheck(src, record, len(data), offset, length, lambda bad: _Damaged(str(bad)))
        cut = length // 2
        blocks = [FileRange(src, offset, cut, check.feed),
                  FileRange(src, offset + cut, length - cut, check.feed)]
        out = tmp_path / f"out-{tag}.ckpt"
        with CkptWriter(out, crc=crc_trailer) as w:
            w.write_blocks("w", "UInt8", (length,), iter(blocks))
        return out

    with CkptReader(write(sums, "ok")) as r:
        assert r.array("w").tobytes() == data[offset : offset + length]
    covered = range(offset // 32, -(-(offset + length) // 32))
    for block in range(len(sums.values)):
        bad = ChunkSums("crc32c", tuple(v ^ (i == block) for i, v in enumerate(sums.values)), 32)
        if block in covered:
            with pytest.raises(_Damaged, match=f"block {block} of 8"):
                write(bad, f"bad{block}")
        else:
            write(bad, f"bad{block}")
    assert not list(tmp_path.glob("out-*.tmp-zckpt"))


def test_a_checked_range_fed_out_of_order_is_a_bug(tmp_path: Path) -> None:
    (tmp_path / "chunk").write_bytes(bytes(200))
    check = SpanCheck(tmp_path / "chunk", ChunkSums("crc32c", tuple(block_sums(bytes(200), 64)), 64), 200, 100, 10,
                      lambda bad: _Damaged())
    with pytest.raises(AssertionError, match="out of order"):
        check.feed(104, b"\0" * 6)


@pytest.mark.parametrize("unnamed", [True, False])
def test_publisher_failure_leaves_no_final_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                unnamed: bool) -> None:
    """A file whose sync fails on the publishing thread is never named, nothing of it is
    left (an unnamed file, or the named fallback's temporary file), and the failure is
    raised when the publisher closes (the other files are published)."""
    import errno

    from zckpt.io import new_files

    monkeypatch.setattr(new_files, "UNNAMED", unnamed)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the bad file is told by its bytes: descriptors and inodes are reused
        if os.path.isfile(f"/proc/self/fd/{fd}") and os.pread(fd, 3, 0) == b"bad":
            raise OSError(errno.EIO, "I/O error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="I/O error"), fileio.Publisher() as pub:
        for name in ("bad", "good"):
            new = new_files.NewFile(tmp_path / name)
            new.file.write(name.encode())
            pub.submit(new)
    assert [p.name for p in tmp_path.iterdir()] == ["good"]
    assert (tmp_path / "good").read_bytes() == b"good"


def _opener(tmp_path: Path, opened: list[str]) -> Callable[[str], int]:
    def open_(path: str) -> int:
        opened.append(path)
        return os.open(tmp_path / path, os.O_WRONLY | os.O_CREAT)
    return open_


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_shared_files_open_each_path_once_and_close_all(tmp_path: Path) -> None:
    opened: list[str] = []
    files = fileio.SharedFiles(_opener(tmp_path, opened), limit=8)
    fds = []
    for _ in range(3):
        for name in ("a", "b"):
            fd = files.acquire(name)
            os.pwrite(fd, name.encode(), 0)
            files.release(name)
            fds.append(fd)
    assert opened == ["a", "b"] and len(set(fds)) == 2
    files.close()
    assert not any(_is_open(fd) for fd in set(fds))
    assert (tmp_path / "a").read_bytes() == b"a" and (tmp_path / "b").read_bytes() == b"b"


def test_shared_files_close_the_least_recent_unheld_file_past_the_limit(tmp_path: Path) -> None:
    opened: list[str] = []
    files = fileio.SharedFiles(_opener(tmp_path, opened), limit=2)
    held = files.acquire("held")  # kept by a writer while others come and go
    a = files.acquire("a")
    files.release("a")
    b = files.acquire("b")  # three open: "a" is the least recent one nobody holds
    files.release("b")
    assert not _is_open(a) and _is_open(held) and _is_open(b)
    for name in ("c", "d", "e"):
        files.acquire(name)
        files.release(name)
    assert _is_open(held), "a descriptor in use was closed under its writer"
    files.release("held")
    files.acquire("a")
    assert opened == ["held", "a", "b", "c", "d", "e", "a"]
    files.close()
    assert not _is_open(held)


def test_write_behind_asks_for_merged_ranges_of_each_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise on this platform")
    asked: list[tuple[str, int, int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        asked.append((os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1], offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    opened: list[str] = []
    with fileio.SharedFiles(_opener(tmp_path, opened)) as files, fileio.WriteBehind(files, batch_bytes=100) as behind:
        for name in ("a", "b"):
            fd = files.acquire(name)
            os.pwrite(fd, b"x" * 300, 0)
            files.release(name)
        behind.add([("a", 0, 40), ("b", 100, 50), ("a", 40, 30)])  # 120 bytes: one batch
        behind.add([("b", 0, 10)])  # not a batch yet: dropped at close
    assert asked == [("a", 0, 70, os.POSIX_FADV_DONTNEED), ("b", 100, 50, os.POSIX_FADV_DONTNEED)]
    assert (tmp_path / "a").read_bytes() == b"x" * 300


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_allocate_leaves_the_file_alone_where_blocks_cannot_be_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    monkeypatch.setattr(fileio, "_fallocate", lambda: lambda fd, mode, offset, length: err)
    path = tmp_path / "f"
    with open(path, "wb") as f:
        assert fileio.allocate(f.fileno(), 1 << 20, path) is False
    assert path.stat().st_size == 0


def test_allocate_names_the_file_of_any_other_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    for err, kind in ((errno.EDQUOT, DiskFullError), (errno.EIO, OSError)):
        monkeypatch.setattr(fileio, "_fallocate", lambda e=err: lambda fd, mode, offset, length: e)
        with open(path, "wb") as f, pytest.raises(kind) as got:
            fileio.allocate(f.fileno(), 1 << 20, path)
        assert str(path) in str(got.value) and got.type is kind


def test_allocate_grows_the_file_to_zeros(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    with open(path, "r+b") as f:
        fileio.allocate(f.fileno(), 10_000, path)
        f.seek(0, os.SEEK_END)
        if f.tell() == 3:
            pytest.skip("this system cannot reserve blocks")
    assert path.read_bytes() == b"abc" + bytes(10_000 - 3)


def test_an_unnamed_file_gets_its_final_name_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new name is linked straight to the unnamed file: no temporary name exists at any
    moment, so a SIGKILL between two calls cannot leave one (it did, between the link to a
    temporary name and the rename). A file that replaces another still goes through a
    temporary name and a rename, and both end with the new bytes."""
    from zckpt.io import new_files, safe_paths

    probe = new_files.NewFile(tmp_path / "probe")
    if not probe.unnamed:
        probe.discard()
        pytest.skip("no O_TMPFILE with a usable link on this filesystem")
    probe.discard()
    temps: list[Path] = []
    real_temp_name = safe_paths.temp_name

    def temp_name(path: Path) -> Path:
        temps.append(path)
        return real_temp_name(path)

    monkeypatch.setattr(safe_paths, "temp_name", temp_name)
    new = new_files.NewFile(tmp_path / "fresh")
    new.file.write(b"first")
    new.publish(fsync=True)
    assert temps == [] and (tmp_path / "fresh").read_bytes() == b"first"
    again = new_files.NewFile(tmp_path / "fresh")
    again.file.write(b"second")
    again.publish(fsync=True)
    assert temps == [tmp_path / "fresh"] and (tmp_path / "fresh").read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh"]


def test_a_region_reader_refuses_a_map_entry_by_name() -> None:
    """A loaded rank's regions hold tensors and strings: a MapParameter entry is refused with a
    zckpt error that names it, not a crash."""
    from zckpt.core.errors import OutputError
    from zckpt.core.layout import Box
    from zckpt.write.box_adapters import RegionBoxes

    boxes = RegionBoxes([("table", "map", "Float32", Box.full((2,)))], lambda n, b: "")
    with pytest.raises(OutputError, match="MapParameter") as err:
        boxes.map_bytes("table")
    assert err.value.param == "table"


@pytest.mark.parametrize("fsync", [True, False])
def test_files_published_together_stop_at_a_failure_and_leave_the_rest_unnamed(tmp_path: Path, fsync: bool) -> None:
    """40 files published together (one filesystem sync, then the names): the tenth cannot
    take its name (a directory holds it); the nine before it are named, the thirty after it
    never appear, under their names or any other."""
    from zckpt.io.new_files import NewFile

    (tmp_path / "f09").mkdir()
    news = [NewFile(tmp_path / f"f{i:02d}") for i in range(40)]
    for i, n in enumerate(news):
        n.file.write(bytes([i]) * 100)
    assert len(news) >= fileio.BATCH
    with pytest.raises(OSError):
        fileio.publish_all(news, fsync)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"f{i:02d}" for i in range(10)]
    assert all((tmp_path / f"f{i:02d}").read_bytes() == bytes([i]) * 100 for i in range(9))
    assert all(n.file.closed for n in news)
