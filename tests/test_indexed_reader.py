"""A shard reopened with the index planning parsed (ingest tasks): the same bytes as a fresh
parse, and a clear refusal when the file shrank in between."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from zckpt.core.errors import CheckpointFormatError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.opener import open_indexed

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SHARD = EXAMPLE / "src" / "checkpoints" / "rank_3" / "checkpoint_3.ckpt"


def test_indexed_reader_reads_what_a_parse_reads() -> None:
    with CkptReader(SHARD) as parsed:
        index = dict(parsed.entries)
        tensors = {n: np.array(parsed.array(n)) for n, e in index.items() if e.kind == "tensor"}
        strings = {n: parsed.string(n) for n, e in index.items() if e.kind == "str"}
    assert tensors
    with open_indexed(SHARD, index) as reader:
        assert reader.entries == index
        for name, want in tensors.items():
            assert np.array_equal(reader.array(name), want) and reader.array(name).dtype == want.dtype
            if want.ndim:
                assert np.array_equal(reader.rows(name, 0, want.shape[0]), want)
        assert {n: reader.string(n) for n in strings} == strings


def test_indexed_reader_refuses_a_shard_that_shrank(tmp_path: Path) -> None:
    shard = tmp_path / "checkpoint_3.ckpt"
    shutil.copy(SHARD, shard)
    with CkptReader(shard) as parsed:
        index = dict(parsed.entries)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointFormatError, match="changed after planning"):
        open_indexed(shard, index)
