"""Source-major writing (zckpt/write/group_writer.py): the same bytes as writing destination
files one by one, on every fixture MindSpore compiled, through export and transform, in
.ckpt and safetensors; and each source byte read once where one-by-one reads it many times."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
from ckpt_compare import diff_dirs
from conftest import scenario
from test_e2e_fixtures import PLAIN, _strategy

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.ingest import ingest
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.plan.values import RankExport, Slice
from zckpt.write import group_writer

MODES = {"source_major": 0.0, "one_by_one": math.inf}


def _force(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setattr(group_writer, "GAIN", MODES[mode])
    monkeypatch.setattr(group_writer, "SMALL_PIECE", 0)


def _ranks(expected: Path) -> int:
    return sum(1 for p in expected.iterdir() if p.name.startswith("rank_"))


@pytest.mark.parametrize("path", ["export", "transform"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("sid", PLAIN)
def test_either_order_gives_mindspores_bytes(sid: str, mode: str, path: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, groups_written: list[int]) -> None:
    d = scenario(sid)
    if path == "export":
        ingest(d / "src" / "checkpoints", tmp_path / "s.zarr", _strategy(d / "src"))
    _force(monkeypatch, mode)
    if path == "export":
        export(tmp_path / "s.zarr", tmp_path / "out", _strategy(d / "dst"))
    else:
        transform(d / "src" / "checkpoints", tmp_path / "out", _strategy(d / "src"), _strategy(d / "dst"))
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []
    ranks = _ranks(d / "dst" / "expected")
    assert groups_written == ([ranks] if mode == "source_major" and ranks > 1 else [])


@pytest.mark.parametrize("path", ["export", "transform"])
@pytest.mark.parametrize("sid", ["s02", "s08", "s20"])
def test_safetensors_source_major_equals_one_by_one(sid: str, path: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    groups_written: list[int]) -> None:
    d = scenario(sid)
    if path == "export":
        ingest(d / "src" / "checkpoints", tmp_path / "s.zarr", _strategy(d / "src"))
    got = {}
    for mode in sorted(MODES):
        _force(monkeypatch, mode)
        out = tmp_path / mode
        if path == "export":
            export(tmp_path / "s.zarr", out, _strategy(d / "dst"), options=ExportOptions(format="safetensors"))
        else:
            transform(d / "src" / "checkpoints", out, _strategy(d / "src"), _strategy(d / "dst"),
                      options=TransformOptions(format="safetensors"))
        got[mode] = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}
    assert got["source_major"] == got["one_by_one"] and got["one_by_one"]
    assert groups_written == [len(got["one_by_one"])]
    for rel in got["one_by_one"]:  # and both hold MindSpore's values
        rank = int(rel.parts[0].split("_")[1])
        expected = sorted((d / "dst" / "expected" / f"rank_{rank}").glob("*.ckpt"))[-1]
        with SafetensorsReader(tmp_path / "source_major" / rel) as s, CkptReader(expected) as c:
            for name, e in c.entries.items():
                if e.kind == "tensor":
                    assert s.array(name).tobytes() == c.array(name).tobytes(), name


def _global_tensor_bytes(d: Path) -> int:
    with CkptReader(d / "reference" / "global.ckpt") as r:
        return sum(math.prod(e.dims) * ms_dtype(e.ms_type).storage.itemsize for e in r.entries.values()
                   if e.kind == "tensor")


@pytest.mark.parametrize("sid", ["s02", "s08", "s20"])
def test_each_store_byte_read_once(sid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where destination files share what they read (replicas, column splits), written one by
    one they read more than the model; source-major, at most the model once (the reference
    file, MindSpore's unsharded save, says how many bytes that is)."""
    d = scenario(sid)
    ingest(d / "src" / "checkpoints", tmp_path / "s.zarr", _strategy(d / "src"))
    model = _global_tensor_bytes(d)
    read = {}
    for mode in sorted(MODES):
        _force(monkeypatch, mode)
        rep = export(tmp_path / "s.zarr", tmp_path / mode, _strategy(d / "dst"),
                     options=ExportOptions(helper=False))
        read[mode] = sum(r.read_bytes + r.checked_bytes for r in rep.ranks)
    assert read["one_by_one"] > model >= read["source_major"] > 0, read


@pytest.mark.parametrize("path", ["export", "transform"])
def test_groups_as_dask_tasks_give_mindspores_bytes(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    groups_written: list[int]) -> None:
    """With two Dask workers, a task is a group of files (here cut in two)."""
    d = scenario("s02")
    monkeypatch.setattr(group_writer, "GAIN", 0.0)
    monkeypatch.setattr(group_writer, "SPLIT_COST", math.inf)
    if path == "export":
        ingest(d / "src" / "checkpoints", tmp_path / "s.zarr", _strategy(d / "src"))
        export(tmp_path / "s.zarr", tmp_path / "out", _strategy(d / "dst"), options=ExportOptions(workers=2))
    else:
        transform(d / "src" / "checkpoints", tmp_path / "out", _strategy(d / "src"), _strategy(d / "dst"),
                  options=TransformOptions(workers=2))
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []
    assert sorted(groups_written) == [4, 4]


@pytest.mark.parametrize("sid", ["s02", "s08", "s16", "s20"])
def test_bands_smaller_than_a_slice_land_at_their_offsets(sid: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          groups_written: list[int]) -> None:
    """A few hundred bytes at a time: every slice arrives in several bands, most starting
    inside it, in .ckpt and safetensors, from the store and from the shards."""
    d = scenario(sid)
    _force(monkeypatch, "source_major")
    ingest(d / "src" / "checkpoints", tmp_path / "s.zarr", _strategy(d / "src"))
    export(tmp_path / "s.zarr", tmp_path / "e", _strategy(d / "dst"), options=ExportOptions(block_bytes=512))
    transform(d / "src" / "checkpoints", tmp_path / "t", _strategy(d / "src"), _strategy(d / "dst"),
              options=TransformOptions(block_bytes=512))
    for out in ("e", "t"):
        assert diff_dirs(d / "dst" / "expected", tmp_path / out) == [], out
    assert len(groups_written) == 2


def test_a_damaged_chunk_stops_the_group_and_publishes_none_of_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A group is read as one: a chunk failing its checksum stops it, and none of its files
    appears (each is a new file until the whole group is written)."""
    d = scenario("s02")
    ingest(d / "src" / "checkpoints", tmp_path / "s.zarr", _strategy(d / "src"))
    chunks = [p for p in sorted((tmp_path / "s.zarr").rglob("c*")) if p.is_file() and p.stat().st_size > 64]
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0x01
    chunks[0].write_bytes(bytes(data))
    _force(monkeypatch, "source_major")
    with pytest.raises(StoreError, match="fails its checksum"):
        export(tmp_path / "s.zarr", tmp_path / "out", _strategy(d / "dst"))
    assert not list((tmp_path / "out").rglob("*.ckpt"))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # as it was found


@pytest.mark.parametrize("path", ["export", "transform"])
def test_the_order_follows_what_reading_costs(path: str, tmp_path: Path, groups_written: list[int]) -> None:
    """By default, source-major where files written one by one would read the same bytes
    several times (s08: destination files that share their sources' rows), one by one where
    each file reads only its own bytes (s04), through the store and from the shards."""
    for sid in ("s04", "s08"):
        d = scenario(sid)
        out = tmp_path / sid
        if path == "export":
            ingest(d / "src" / "checkpoints", tmp_path / f"{sid}.zarr", _strategy(d / "src"))
            rep = export(tmp_path / f"{sid}.zarr", out, _strategy(d / "dst"), options=ExportOptions(helper=False))
        else:
            rep = transform(d / "src" / "checkpoints", out, _strategy(d / "src"), _strategy(d / "dst"),
                            options=TransformOptions(helper=False))
        assert diff_dirs(d / "dst" / "expected", out) == []
        assert bool(groups_written) == (sid == "s08"), (sid, groups_written, rep.bytes_read)
        groups_written.clear()


def test_a_source_reader_prices_whole_source_rows(tmp_path: Path) -> None:
    """Rows 0-7 of an (8, 6) tensor in four shards of two rows: a box of rows 1-4 and
    columns 0-2 takes rows of three shards, each read whole (6 columns). An (8, 8) tensor
    in four shards of two columns: a box of columns 0-2 takes the rows of the first two."""
    from zckpt.core.layout import Box
    from zckpt.formats.strategy import make_layout
    from zckpt.jobs.generate import write_model
    from zckpt.jobs.generate_model import TensorDef
    from zckpt.jobs.transform import plan_transform, union_boxes
    from zckpt.sources.reader import SourceReader

    model = write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32", make_layout((4,), [0, -1])),
                                           TensorDef("c", (8, 8), "Float32", make_layout((4,), [-1, 0]))],
                        device_num=4, scalars=False)
    plan = plan_transform(model.root, model.strategy_path, None)
    with SourceReader(union_boxes(plan, plan.export.ranks), 1 << 20) as reader:
        assert reader.read_costs("w", [Box((1, 0), (5, 3))]) == 4 * 6 * 4
        assert reader.read_costs("w", [Box((1, 0), (5, 3)), Box((6, 3), (8, 6))]) == (4 + 2) * 6 * 4
        assert reader.read_costs("w", [Box((0, 0), (8, 6))]) == 8 * 6 * 4
        assert reader.read_costs("c", [Box((1, 0), (5, 3))]) == 2 * 4 * 2 * 4


def test_regions_read_each_distinct_run_once_and_skip_the_gaps() -> None:
    """Replicas count once when a group's slices are checked for covering their bounding box:
    rows [0, 2) held twice and rows [4, 6) once leave rows [2, 4) unread (two runs), and
    positions stay the files' own, in the files' order."""
    def rank(r: int, rows: tuple[int, int]) -> RankExport:
        return RankExport(r, (Slice("w", Box((rows[0], 0), (rows[1], 4))), Slice("s", Box((), ()))))

    ranks = [rank(0, (0, 2)), rank(1, (4, 6)), rank(2, (0, 2))]
    got = group_writer.regions(ranks, {"w": "tensor", "s": "tensor"})
    assert [(g.name, g.box) for g in got] == [("w", Box((0, 0), (2, 4))), ("w", Box((4, 0), (6, 4))),
                                              ("s", Box((), ()))]
    assert [i for i, _ in got[0].parts] == [0, 2] and [i for i, _ in got[1].parts] == [1]
    assert [i for i, _ in got[2].parts] == [0, 1, 2]
    tiled = group_writer.regions([rank(0, (0, 2)), rank(1, (2, 6)), rank(2, (0, 2))], {"w": "tensor", "s": "tensor"})
    assert [(g.name, g.box) for g in tiled] == [("w", Box((0, 0), (6, 4))), ("s", Box((), ()))]
    assert [i for i, _ in tiled[0].parts] == [0, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_regions_of_random_slices_are_boxes_their_parts_fill(seed: int) -> None:
    """Whatever cells of a grid a group holds (1-3 dimensions, replicas, gaps, some cells
    held by no file), each tensor's regions are boxes that their parts fill exactly, hold
    each part once in the files' order, each part inside its region, and the arrays each
    region carries (positions, starts, stops) are its parts; no element is read twice: the
    regions of a tensor do not meet."""
    rng = random.Random(seed)
    for _ in range(150):
        nd = rng.choice([1, 2, 3])
        shape = [rng.choice([4, 6, 8]) for _ in range(nd)]
        cuts = [sorted({0, n, *rng.sample(range(1, n), rng.randint(0, 3) if d == 0 or rng.random() < 0.4 else 0)})
                for d, n in enumerate(shape)]
        ranks = []
        for r in range(rng.randint(1, 10)):
            cell = [rng.randrange(len(c) - 1) for c in cuts]
            box = Box(tuple(c[i] for c, i in zip(cuts, cell, strict=True)),
                      tuple(c[i + 1] for c, i in zip(cuts, cell, strict=True)))
            ranks.append(RankExport(r, (Slice("t", box),)))
        got = group_writer.regions(ranks, {"t": "tensor"})
        held = [(r.rank, r.slices[0].box) for r in ranks]
        assert sorted(p for g in got for p in g.parts) == sorted(held)
        seen = np.zeros(shape, dtype=np.int64)
        for g in got:
            assert list(g.parts) == sorted(g.parts, key=lambda p: p[0])
            filled = np.zeros(shape, dtype=bool)
            for _, box in g.parts:
                assert all(g.box.start[d] <= box.start[d] and box.stop[d] <= g.box.stop[d] for d in range(nd))
                filled[box.slices()] = True
            region = np.zeros(shape, dtype=bool)
            region[g.box.slices()] = True
            assert (filled == region).all()
            seen[g.box.slices()] += 1
            assert g.corners is not None
            pos, lo, hi = g.corners
            assert [(int(p), Box(tuple(a), tuple(b))) for p, a, b in zip(pos, lo.tolist(), hi.tolist(), strict=True)] \
                == list(g.parts)
        assert seen.max() <= 1
