"""Per-block chunk checksums (zckpt.io.checksums): summing in pieces, spans, range checks."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zckpt.io.checksums import BlockSummer, ChunkSums, Mismatch, SpanCheck, block_sums, file_sums


class _Bad(Exception):
    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(str(mismatch))
        self.mismatch = mismatch


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=700), block=st.integers(1, 97), cuts=st.lists(st.integers(0, 700)))
def test_summing_in_any_pieces_gives_the_sums_of_the_blocks(data: bytes, block: int, cuts: list[int]) -> None:
    summer = BlockSummer(block, 0)
    edges = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    for a, b in zip(edges, edges[1:], strict=False):
        summer.feed(a, data[a:b])
    want = [google_crc32c.value(data[i : i + block]) for i in range(0, len(data), block)] or [0]
    assert summer.result() == block_sums(data, block) == want


def test_zlib_crc32_blocks_for_old_stores() -> None:
    data = os.urandom(300)
    assert block_sums(data, 128, "crc32") == [zlib.crc32(data[i : i + 128]) for i in (0, 128, 256)]


def test_file_sums_match_the_bytes(tmp_path: Path) -> None:
    data = os.urandom(5000)
    (tmp_path / "c").write_bytes(data)
    assert file_sums(tmp_path / "c", 1024, buffer=bytearray(300)) == (block_sums(data, 1024), 5000)
    assert file_sums(tmp_path / "c", None) == ([google_crc32c.value(data)], 5000)


def test_spans_cover_the_blocks_a_range_touches() -> None:
    sums = ChunkSums("crc32c", (1, 2, 3, 4), 100)
    assert sums.span(150, 250, 350) == (100, 300)
    assert sums.span(0, 350, 350) == (0, 350)
    assert sums.span(300, 340, 350) == (300, 350)
    assert list(sums.blocks_in(99, 101, 350)) == [0, 1]
    whole = ChunkSums("crc32c", (7,))  # one sum per chunk (stores before blocks)
    assert whole.span(10, 20, 350) == (0, 350) and list(whole.blocks_in(10, 20, 350)) == [0]


def test_a_chunk_of_another_size_than_its_record_is_a_mismatch() -> None:
    data = os.urandom(300)
    sums = ChunkSums("crc32c", tuple(block_sums(data, 100)), 100)
    assert sums.check_whole(data) is None
    short = sums.check_whole(data[:250])
    assert short is not None and short.got is not None  # last block differs
    longer = sums.check_whole(data + b"x")
    assert longer is not None and longer.got is None and "size does not match its 3 recorded" in str(longer)
    flipped = bytearray(data)
    flipped[150] ^= 1
    bad = sums.check_whole(bytes(flipped))
    assert bad is not None and bad.block == 1 and "block 1 of 3, bytes 100-200" in str(bad)


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 600), block=st.integers(1, 130), lo=st.integers(0, 599), n=st.integers(0, 600),
       damaged=st.integers(0, 599))
def test_a_span_check_catches_damage_exactly_in_the_blocks_it_covers(
    tmp_path_factory: pytest.TempPathFactory, size: int, block: int, lo: int, n: int, damaged: int
) -> None:
    """The range's bytes come from the reader (fed in two parts), the edges of its first and
    last block from the file: damage anywhere in a covered block fails, elsewhere not."""
    lo = min(lo, size - 1)
    hi = min(size, lo + max(1, n))
    damaged = damaged % size
    data = os.urandom(size)
    sums = ChunkSums("crc32c", tuple(block_sums(data, block)), block)
    stored = bytearray(data)
    stored[damaged] ^= 0x20
    path = tmp_path_factory.mktemp("c") / "chunk"
    path.write_bytes(bytes(stored))
    covered = lo // block <= damaged // block <= (hi - 1) // block
    check = SpanCheck(path, sums, size, lo, hi - lo, _Bad)
    assert check.extra == (lo - lo // block * block) + (min(size, -(-hi // block) * block) - hi)
    mid = (lo + hi) // 2
    try:
        check.feed(lo, bytes(stored[lo:mid]))
        check.feed(mid, bytes(stored[mid:hi]))
    except _Bad as err:
        assert covered
        assert err.mismatch.block == damaged // block
    else:
        assert not covered
