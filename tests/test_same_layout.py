"""Shards laid out alike are walked once (:mod:`zckpt.sources.same_layout`), and the plan made
from that guess while the files are read is kept only where every file holds it
(:mod:`zckpt.sources.indexes`, :func:`zckpt.sources.prepare.plan_sources`).

Expected indexes come from walking each file on its own (:class:`CkptReader`), expected values
from the generator's global values, never from the code under test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.core.errors import CheckpointFormatError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import CRC_MAGIC
from zckpt.formats.entries import EntryInfo, Segment
from zckpt.formats.strategy import make_layout
from zckpt.jobs.generate import encode_tensor, write_model, write_pipeline_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.verify import verify
from zckpt.sources import prepare, same_layout
from zckpt.sources.discovery import discover_sources
from zckpt.sources.indexes import IndexReading
from zckpt.sources.same_layout import Layouts, walked_spans
from zckpt.store.store import Store

RANKS = 8
A = TensorDef("a", (64, 16), "Float32", make_layout((RANKS,), [[0], []]))
B = TensorDef("b", (64, 16), "Float32", make_layout((RANKS,), [[0], []]))
"""Two tensors of one shape: their Values can trade places and leave the file's size as it was."""


def _own_indexes(src: Path) -> dict[int, dict[str, object]]:
    out: dict[int, dict[str, object]] = {}
    for rank, path in discover_sources(src).files.items():
        with CkptReader(path) as r:
            out[rank] = dict(r.entries)
    return out


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    walked: list[str] = []
    real = CkptReader.__init__

    def init(self: CkptReader, path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> None:
        walked.append(Path(path).parent.name)
        real(self, path, verify_crc=verify_crc, sparse=sparse)

    monkeypatch.setattr(CkptReader, "__init__", init)
    return walked


def _count_plans(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The indexes each plan of :func:`zckpt.sources.prepare.plan_sources` was made from."""
    planned: list[object] = []
    real = prepare._plan

    def plan(found: prepare.FoundSources, indexes: dict[int, dict[str, EntryInfo]]) -> prepare.PreparedIngest:
        planned.append(indexes)
        return real(found, indexes)

    monkeypatch.setattr(prepare, "_plan", plan)
    return planned


def _count_defines(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One item per store defined (:meth:`Store.define`)."""
    defined: list[str] = []
    real = Store.define

    def define(self: Store, *args: Any, **kwargs: Any) -> None:
        defined.append("store")
        real(self, *args, **kwargs)

    monkeypatch.setattr(Store, "define", define)
    return defined


def _swap_values(path: Path) -> None:
    """Rewrite ``path`` with its entries in reverse order: the same size, other framing."""
    with CkptReader(path) as r:
        arrays = [(n, r.entries[n].ms_type, np.array(r.array(n))) for n in r.names()]
    path.write_bytes(b"".join(bytes(b) for n, t, a in reversed(arrays) for b in encode_tensor(n, t, a)))


def _check_export(store: Path, out: Path) -> None:
    zckpt.export(store, out)
    with CkptReader(out / "rank_0" / "checkpoint_0.ckpt") as r:
        for t in (A, B):
            assert r.array(t.name).tobytes() == global_value(t.name, t.shape, t.ms_type).tobytes(), t.name


def test_walked_spans_are_all_but_the_payloads() -> None:
    index = {"x": EntryInfo("x", "tensor", "Float32", (2,), (Segment(10, 8), Segment(30, 8))),
             "y": EntryInfo("y", "tensor", "Float32", (1,), (Segment(50, 4),))}
    assert walked_spans(index, 60) == ((0, 10), (18, 12), (38, 12), (54, 6))
    assert walked_spans(index, 54) == ((0, 10), (18, 12), (38, 12))


def test_shards_laid_out_alike_are_walked_once_and_planned_from_the_guess(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight ranks of one layout: the first is walked, the other seven take its index after a
    comparison of their framing; the plan made from that guess while the files are read is the
    one kept (made once), and the store holds the global values."""
    src = tmp_path / "src"
    write_model(src, [A, B], device_num=RANKS, scalars=False)
    want = _own_indexes(src)
    walked = _count_walks(monkeypatch)
    planned = _count_plans(monkeypatch)
    reading = IndexReading(discover_sources(src).files, verify_crc=True, order="files")
    reading.start()
    assert walked == ["rank_0"] and reading.guess == want
    assert reading.finish() == want and reading.as_guessed() and reading.layouts.matched == RANKS - 1
    walked.clear()
    zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"))
    assert walked[:1] == ["rank_0"] and len(planned) == 1
    _check_export(tmp_path / "s.zarr", tmp_path / "out")


def test_a_file_of_the_same_size_laid_out_otherwise_is_walked_and_the_plan_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 5 holds its entries in the other order: the same size, so the guess gives it rank
    0's offsets; its framing differs, so it is walked, the guess does not hold and the plan is
    made again from the files. Kept, the guess would have swapped its rows of a and b."""
    src = tmp_path / "src"
    write_model(src, [A, B], device_num=RANKS, scalars=False)
    five = src / "rank_5" / "checkpoint_5.ckpt"
    size = five.stat().st_size
    _swap_values(five)
    assert five.stat().st_size == size
    want = _own_indexes(src)
    assert want[5] != want[0]
    walked = _count_walks(monkeypatch)
    reading = IndexReading(discover_sources(src).files, verify_crc=True, order="files")
    reading.start()
    assert reading.guess is not None and reading.guess[5] == want[0]
    assert reading.finish() == want and not reading.as_guessed()
    assert walked == ["rank_0", "rank_5"]
    planned = _count_plans(monkeypatch)
    defined = _count_defines(monkeypatch)
    report = zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"))
    assert len(planned) == 2 and planned[1] == want and report.complete
    assert defined == ["store", "store"]  # defined from the guess while reading, removed, defined again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr", "src"]
    assert verify(tmp_path / "s.zarr", src, str(src / "strategy.ckpt")).ok
    _check_export(tmp_path / "s.zarr", tmp_path / "out")


@pytest.mark.parametrize("verify_crc", [True, False])
def test_checksums_to_verify_are_verified_in_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         verify_crc: bool) -> None:
    """Files with MindSpore's CRC trailer: verified, each is walked (a payload byte changed in
    rank 6 is found); not verified, they share rank 0's layout though their checksums differ."""
    src = tmp_path / "src"
    write_model(src, [A, B], device_num=RANKS, scalars=False, crc=True)
    six = src / "rank_6" / "checkpoint_6.ckpt"
    with CkptReader(six) as r:
        at = r.entries["a"].segments[0].offset
    data = bytearray(six.read_bytes())
    data[at] ^= 0xFF
    six.write_bytes(bytes(data))
    walked = _count_walks(monkeypatch)
    reading = IndexReading(discover_sources(src).files, verify_crc=verify_crc, order="files")
    reading.start()
    if verify_crc:
        with pytest.raises(CheckpointFormatError, match="crc_num trailer mismatch") as err:
            reading.finish()
        assert "rank_6" in str(err.value)
        assert walked == [f"rank_{r}" for r in range(7)]
    else:
        assert reading.finish()[6] == reading.finish()[0] and reading.as_guessed()
        assert walked == ["rank_0"]


def test_a_trailer_where_the_walked_file_has_payload_is_not_its_layout(tmp_path: Path) -> None:
    """The reader decides where the walk ends by the file's last bytes: a file whose last bytes
    read as a CRC trailer, where the walked file has payload there, is not taken for it
    though every byte between payloads agrees."""
    src = tmp_path / "src"
    write_model(src, [A, B], device_num=RANKS, scalars=False)
    first, other = src / "rank_0" / "checkpoint_0.ckpt", src / "rank_1" / "checkpoint_1.ckpt"
    with CkptReader(first) as r:
        index = dict(r.entries)
    layouts = Layouts()
    layouts.learn(first, index, False)
    assert layouts.index_of(other) == index
    data = bytearray(other.read_bytes())
    data[-17:] = CRC_MAGIC + b"0000000000"
    other.write_bytes(bytes(data))
    assert same_layout.read_spans(other, walked_spans(index, len(data))) == \
        same_layout.read_spans(first, walked_spans(index, len(data)))
    assert layouts.index_of(other) is None


def test_stages_of_one_size_are_each_walked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pipeline stages whose files are of one size but hold other parameters: the first
    file of each stage is walked before the files are read, and the guess holds."""
    stages = [[TensorDef(f"s{s}.w", (32, 8), "Float32", make_layout((4,), [[0], []]))] for s in range(2)]
    model = write_pipeline_model(tmp_path / "src", stages, stage_device_num=4, scalars=False)
    assert len({p.stat().st_size for p in model.rank_files}) == 1
    walked = _count_walks(monkeypatch)
    found = prepare.find_sources(str(model.root), str(model.merged_strategy))
    walked.clear()
    planned = _count_plans(monkeypatch)
    prepared = prepare.plan_sources(found, order="files")
    assert walked == ["rank_0", "rank_4"] and len(planned) == 1
    assert prepared.indexes == _own_indexes(model.root)


def test_a_damaged_header_found_after_the_store_was_defined_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3's first header is damaged in place (same size): the guess gives it rank 0's
    index, the store is defined from it while the files are read, and then the walk of rank 3
    refuses it by name; the store defined meanwhile is removed."""
    src = tmp_path / "src"
    write_model(src, [A, B], device_num=RANKS, scalars=False)
    three = src / "rank_3" / "checkpoint_3.ckpt"
    data = bytearray(three.read_bytes())
    data[0] = 0x12  # the first Value's key: another field
    three.write_bytes(bytes(data))
    defined = _count_defines(monkeypatch)
    with pytest.raises(CheckpointFormatError) as err:
        zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"))
    assert "rank_3" in str(err.value) and defined == ["store"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
