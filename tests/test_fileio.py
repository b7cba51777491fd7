"""Byte-range copies between files (zckpt.fileio): kernel path and buffered fallback."""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from zckpt import fileio
from zckpt.store import checksum_bytes


@pytest.mark.parametrize("how", ["kernel-or-buffer", "buffer"])
@pytest.mark.parametrize(("offset", "length", "bufsize"), [(0, 0, 8), (3, 1000, 7), (100, 5000, 4096), (0, 9999, 1)])
def test_copies_exactly_the_range_after_what_dst_holds(
    tmp_path: Path, how: str, offset: int, length: int, bufsize: int
) -> None:
    data = os.urandom(10_000)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(dst, b"head")
        if how == "buffer":
            fileio.buffered_copy(src, dst, offset, length, bytearray(bufsize))
        else:
            fileio.copy_range(src, dst, offset, length, bytearray(bufsize))
        os.write(dst, b"tail")
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == b"head" + data[offset : offset + length] + b"tail"


def test_a_range_past_the_end_of_the_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * 10)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="source ended after 10 of 20"):
            fileio.buffered_copy(src, dst, 0, 20, bytearray(4))
    finally:
        os.close(src)
        os.close(dst)


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_returns_the_digest_of_the_bytes_copied(tmp_path: Path, kernel: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The checksum comes from the same pass as the copy (buffered) or one read after the
    kernel copied (kernel), and equals the checksum of the bytes themselves."""
    data = os.urandom(50_000)
    (tmp_path / "src").write_bytes(data)
    if not kernel:
        monkeypatch.setattr(fileio, "kernel_copy", lambda *a: 0)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        got = fileio.copy_range(src, dst, 123, 40_000, bytearray(4096), checksum_bytes)
    finally:
        os.close(src)
        os.close(dst)
    assert got == google_crc32c.value(data[123:40_123])
    assert (tmp_path / "dst").read_bytes() == data[123:40_123]


class _Damaged(Exception):
    pass


@pytest.mark.parametrize("crc_trailer", [False, True])  # buffered copy, or pread + the writer's own CRC
def test_a_checked_range_is_summed_in_the_copy_across_parts(tmp_path: Path, crc_trailer: bool) -> None:
    """A range split over two Values (MindSpore's slice size) is still checked once, whole."""
    from zckpt.formats import ckpt as ckpt_mod

    data = np.arange(64, dtype=np.float32)
    src = tmp_path / "chunk"
    src.write_bytes(data.tobytes())
    want = checksum_bytes(data.tobytes())

    def write(expected: int) -> Path:
        check = fileio.RangeCheck(0, data.nbytes, expected, checksum_bytes, lambda got: _Damaged(hex(got)))
        blocks = [ckpt_mod.FileRange(src, 0, 40, check), ckpt_mod.FileRange(src, 40, data.nbytes - 40, check)]
        out = tmp_path / f"out-{expected}.ckpt"
        with ckpt_mod.CkptWriter(out, crc=crc_trailer) as w:
            w.write_blocks("w", "Float32", (64,), iter(blocks))
        return out

    with ckpt_mod.CkptReader(write(want)) as r:
        assert r.array("w").tobytes() == data.tobytes()
    with pytest.raises(_Damaged, match=hex(want)):
        write(want ^ 1)
    assert not list(tmp_path.glob("out-*.tmp-zckpt"))


def test_a_checked_range_fed_out_of_order_is_a_bug() -> None:
    check = fileio.RangeCheck(100, 10, 0, checksum_bytes, lambda got: _Damaged())
    with pytest.raises(AssertionError, match="out of order"):
        check.advance(104, 6, 0)
