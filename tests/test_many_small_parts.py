"""Thousands of small parts per group (a scale-up to hundreds of ranks): gathered writes
(zckpt/io/gathered_writes.py), a band's parts found on arrays (zckpt/write/band_scatter.py),
prices of many boxes on arrays (StoreReader.read_costs) and the choice of source-major order
where the parts are small. Expected bytes come from numpy slicing of the generator's values
and from plain ``pwrite`` calls, not from the code under test."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.io.gathered_writes import GatheredWrites
from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.store.reader import StoreReader
from zckpt.write import group_writer
from zckpt.write.band_scatter import Region, blocks, scatter_blocks, scatter_boxes
from zckpt.write.file_layouts import FileLayout, Segment


def _pieces(size: int, seed: int) -> list[tuple[int, bytes]]:
    """A file cut into pieces of 1 B to 4 KiB at their offsets, and one of 70 000 B (more than
    is gathered: written straight)."""
    rng = random.Random(seed)
    out, at = [], 0
    while at < size:
        n = min(size - at, 70_000 if len(out) == 100 else rng.choice([1, 7, 300, 4096]))
        out.append((at, rng.randbytes(n)))
        at += n
    return out


@pytest.mark.parametrize("order", ["rising", "shuffled"])
def test_gathered_writes_give_the_bytes_of_plain_writes_in_fewer_calls(tmp_path: Path, order: str) -> None:
    pieces = _pieces(1 << 20, 1)
    framing = pieces[::5]  # every fifth piece is framing, written as the data reach it
    data = [p for i, p in enumerate(pieces) if i % 5]
    if order == "shuffled":
        random.Random(2).shuffle(data)
    want = b"".join(b for _, b in pieces)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        os.ftruncate(fd, len(want))
        w = GatheredWrites(fd, framing, limit=64 * 1024)
        for at, b in data:
            w.add(at, memoryview(b))
        w.close()
        assert os.pread(fd, len(want) + 1, 0) == want
    finally:
        os.close(fd)
    if order == "rising":
        assert w.calls <= 2 * len(want) // (64 * 1024) + 2 < len(pieces) // 20, (w.calls, len(pieces))


def _layout(sizes: list[int]) -> FileLayout:
    """A file of one tensor per part, each after 16 bytes of framing."""
    return FileLayout(sum(sizes) + 16, ((0, b"H" * 16),), {"t": (Segment(0, 16, sizes[0]),)}, 1)


@pytest.mark.parametrize("shape,parts", [
    ((40, 6, 3), [Box((0, 0, 0), (10, 6, 3)), Box((10, 0, 0), (40, 6, 3))]),  # whole rows
    ((40, 6, 3), [Box((0, 0, 0), (40, 2, 3)), Box((0, 2, 0), (40, 6, 3))]),  # columns
    ((40, 6, 3), [Box((5, 1, 0), (17, 4, 3)), Box((17, 4, 0), (40, 6, 3)), Box((0, 0, 0), (40, 6, 3))]),
    ((64,), [Box((0,), (3,)), Box((3,), (64,)), Box((10,), (20,))]),
])
@pytest.mark.parametrize("offsets", ["on arrays", "by places"])
def test_a_bands_parts_found_on_arrays_match_box_by_box(tmp_path: Path, shape: tuple[int, ...],
                                                        parts: list[Box], offsets: str) -> None:
    """Bands of 7 rows (most parts start and end inside one): each file gets the C-order bytes
    of its box of the tensor, whether the parts are found on arrays (their file offsets too,
    or through each layout's ``places``) or box by box."""
    from zckpt.io.new_files import NewFile

    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    region = Region("t", Box.full(shape), tuple(enumerate(parts)))
    got = {}
    for way in ("blocks", "boxes"):
        layouts = [_layout([p.size * 4]) for p in parts]
        news = [NewFile(tmp_path / f"{way}{i}") for i in range(len(parts))]
        fills = [GatheredWrites(n.file.fileno(), lay.framing, limit=256) for n, lay in zip(news, layouts, strict=True)]
        for n, lay in zip(news, layouts, strict=True):
            os.ftruncate(n.file.fileno(), lay.size)
        found = blocks(region, 4, layouts if offsets == "on arrays" else ())
        assert found is not None and (found.base is not None) == (offsets == "on arrays")
        for a in range(0, shape[0], 7):
            band = Box((a, *([0] * (len(shape) - 1))), (min(shape[0], a + 7), *shape[1:]))
            data = value[band.slices()]
            if way == "blocks":
                scatter_blocks("t", found, band, data, news, fills, layouts)
            else:
                scatter_boxes(region, band, data, 4, news, fills, layouts)
        for f, n in zip(fills, news, strict=True):
            f.close()
            n.publish(False)
        got[way] = [(tmp_path / f"{way}{i}").read_bytes() for i in range(len(parts))]
    for i, p in enumerate(parts):
        want = b"H" * 16 + np.ascontiguousarray(value[p.slices()]).tobytes()
        assert got["blocks"][i] == got["boxes"][i] == want, i


def test_many_boxes_are_priced_as_one_by_one(tmp_path: Path) -> None:
    """The array pricing of a list of boxes is the sum of each box's price, on row- and
    tile-chunked tensors, with and without checksum checks; chunks of 1 MiB, larger than a
    checksum block, so that a part of a chunk costs its rows and some checksum blocks."""
    import zckpt

    rows, cols = make_layout([8], [0, -1]), make_layout([8], [-1, 0])
    shapes = {"w": (2048, 256), "c": (512, 1024)}
    model = write_model(tmp_path / "src", [TensorDef("w", shapes["w"], "Float32", rows),
                                           TensorDef("c", shapes["c"], "BFloat16", cols)],
                        device_num=8, scalars=False)
    ingest(model.root, tmp_path / "s.zarr", model.strategy_path, IngestOptions(pack_bytes=0, chunk_bytes=1 << 20))
    rng = random.Random(3)
    for verify in (True, False):
        reader = StoreReader(zckpt.open_store(tmp_path / "s.zarr"), ExportOptions(verify_checksums=verify))
        for name, (n0, n1) in shapes.items():
            boxes = []
            for _ in range(40):
                a0, a1 = rng.randrange(n0), rng.randrange(n1)
                boxes.append(Box((a0, a1), (rng.randrange(a0 + 1, n0 + 1), rng.randrange(a1 + 1, n1 + 1))))
            assert reader.read_costs(name, boxes) == sum(reader.read_cost(name, b) for b in boxes) > 0


@pytest.fixture(scope="module")
def scale_up(tmp_path_factory: pytest.TempPathFactory) -> tuple[GeneratedModel, Path, Path]:
    """2 row-split ranks -> 32 ranks holding 2-row slabs."""
    tmp = tmp_path_factory.mktemp("up")
    model = write_model(tmp / "src", [TensorDef(f"w{i}", (64, 32), "Float32", make_layout([2], [0, -1]))
                                      for i in range(4)], device_num=2, scalars=False)
    dst = StrategyMap(layouts={t.name: {0: make_layout([32], [0, -1])} for t in model.tensors})
    (tmp / "dst.ckpt").write_bytes(encode_strategy(dst))
    ingest(model.root, tmp / "s.zarr", model.strategy_path)
    return model, tmp / "dst.ckpt", tmp / "s.zarr"


def _check(model: GeneratedModel, out: Path) -> None:
    for r in range(32):
        with CkptReader(out / f"rank_{r}" / f"checkpoint_{r}.ckpt") as f:
            for t in model.tensors:
                want = model.global_value(t.name)[r * 2:(r + 1) * 2]
                assert f.array(t.name).tobytes() == np.ascontiguousarray(want).tobytes(), (r, t.name)


@pytest.mark.parametrize("path", ["export", "transform"])
@pytest.mark.parametrize("small", [True, False])
def test_small_parts_are_written_source_major_when_that_reads_no_more(
        scale_up: tuple[GeneratedModel, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        path: str, small: bool, groups_written: list[int]) -> None:
    """Written one by one, each of these 32 files reads only its own bytes, as source-major
    does: with parts this small (256 B) the group is chosen all the same; where parts count
    as large, one by one (checksums not checked: a part of a chunk read alone would read a
    checksum block more, and that alone makes the group pay)."""
    model, dst, store = scale_up
    if not small:
        monkeypatch.setattr(group_writer, "SMALL_PIECE", 256)
    out = tmp_path / "out"
    if path == "export":
        export(store, out, dst, options=ExportOptions(helper=False, verify_checksums=False))
    else:
        transform(model.root, out, model.strategy_path, dst, options=TransformOptions(helper=False))
    _check(model, out)
    assert (sum(groups_written) == 32) if small else (groups_written == []), groups_written


def test_a_group_holds_at_most_half_the_files_the_process_may_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """1024 destination files are one group where descriptors allow it (groups cut at 256
    read the chunks at their borders in part, 1.27x what was needed); with a limit of 1024
    open files, at most 448 a group."""
    import resource

    from zckpt.plan.values import RankExport

    ranks = [RankExport(r, ()) for r in range(1024)]
    monkeypatch.setattr(resource, "getrlimit", lambda _: (20000, 20000))
    assert [len(g) for g in group_writer.groups(ranks)] == [1024]
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert group_writer.max_files() == 448
    assert [len(g) for g in group_writer.groups(ranks)] == [342, 342, 340]
