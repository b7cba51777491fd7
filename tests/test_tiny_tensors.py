"""Many tiny tensors: packed into one array per data type, each still its own logical tensor.

Expected values come from :func:`zckpt.jobs.generate_model.global_value` (the generator's own
deterministic values) and destination slices from ``tests/oracle.py``, which re-slices them
from the destination strategy file's raw fields without :mod:`zckpt.core.layout`, so neither the
store code nor the layout maths under test computes what they are compared with.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import oracle
import pytest
import zarr

import zckpt
from zckpt.core.errors import StoreError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import encode_strategy, make_layout
from zckpt.jobs.generate import write_model, write_pipeline_model
from zckpt.jobs.generate_model import TensorDef, global_value, strategy_of
from zckpt.jobs.ingest import IngestOptions
from zckpt.jobs.segmented import load_slice
from zckpt.jobs.verify import verify
from zckpt.store.store import Store

KINDS = (((5,), "Float32"), ((4, 6), "BFloat16"), ((3,), "Int8"), ((), "Float64"), ((7,), "Bool"),
         ((2, 2, 2), "Float16"), ((1,), "UInt64"))
SPLIT0 = make_layout((2,), (0, -1))
"""Rows split over two ranks."""


def _tiny(count: int) -> list[TensorDef]:
    """``count`` tiny tensors of mixed types and ranks, a few listed as replicated."""
    out = []
    for i in range(count):
        shape, ms_type = KINDS[i % len(KINDS)]
        listed = make_layout((2,), (-1,) * len(shape)) if i % 50 == 0 else None
        out.append(TensorDef(f"blocks.{i // 8}.t{i % 8}", shape, ms_type, listed))
    return out


def _model(root: Path, count: int) -> list[TensorDef]:
    """Two source ranks: ``count`` tiny tensors (whole on both ranks), a small tensor split
    over the ranks and a large one."""
    defs = [*_tiny(count), TensorDef("small.split", (8, 4), "Float32", SPLIT0),
            TensorDef("big", (512, 64), "Float32", SPLIT0)]
    write_model(root, defs, device_num=2)
    return defs


def _dst_defs(defs: list[TensorDef]) -> list[TensorDef]:
    """The destination: two ranks, each tiny tensor with an even first dimension split by rows."""
    return [TensorDef(t.name, t.shape, t.ms_type,
                      make_layout((2,), (0,) + (-1,) * (len(t.shape) - 1)) if t.shape and t.shape[0] % 2 == 0
                      else None) for t in defs]


def _files(root: Path) -> int:
    return sum(len(fs) for _, _, fs in os.walk(root))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TensorDef]]:
    root = tmp_path_factory.mktemp("tiny")
    defs = _model(root / "src", 1100)
    zckpt.ingest(str(root / "src"), root / "s.zarr", str(root / "src" / "strategy.ckpt"))
    return root, defs


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.asarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def test_store_files_do_not_grow_with_the_number_of_tiny_tensors(
        built: tuple[Path, list[TensorDef]], tmp_path: Path) -> None:
    root, _ = built
    _model(tmp_path / "src", 2200)
    zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", str(tmp_path / "src" / "strategy.ckpt"))
    few, many = _files(root / "s.zarr"), _files(tmp_path / "s.zarr")
    assert few == many < 40, (few, many)
    assert (root / "s.zarr" / "packed" / "bfloat16").is_dir()


def test_each_tiny_tensor_loads_exactly(built: tuple[Path, list[TensorDef]]) -> None:
    root, defs = built
    st = Store.open(root / "s.zarr")
    for t in defs[::7] + defs[-2:]:
        got = np.asarray(st.array(t.name)[...])
        assert _same(got, global_value(t.name, t.shape, t.ms_type)), t.name
        assert st.entry(t.name).shape == t.shape
    assert st.entry("blocks.0.t0").offset is not None
    assert st.entry("small.split").offset is None and st.entry("big").offset is None  # split: arrays of their own


def test_export_slices_tiny_tensors_exactly(built: tuple[Path, list[TensorDef]], tmp_path: Path) -> None:
    root, defs = built
    dst = _dst_defs(defs)
    (tmp_path / "dst.ckpt").write_bytes(encode_strategy(strategy_of(dst)))
    zckpt.export(root / "s.zarr", tmp_path / "out", str(tmp_path / "dst.ckpt"))
    layouts = oracle.read_layouts(tmp_path / "dst.ckpt")
    for rank in range(2):
        with CkptReader(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            names = set(r.entries)
            for t in dst:
                assert t.name in names, t.name
                want = oracle.cut(global_value(t.name, t.shape, t.ms_type), layouts, t.name, rank)
                assert _same(np.asarray(r.array(t.name)), want), (t.name, rank)


def test_load_slice_of_a_packed_tensor(built: tuple[Path, list[TensorDef]], tmp_path: Path) -> None:
    root, defs = built
    t = next(d for d in defs if d.ms_type == "BFloat16")
    dst = _dst_defs(defs)
    (tmp_path / "dst.ckpt").write_bytes(encode_strategy(strategy_of(dst)))
    got = load_slice(root / "s.zarr", 1, str(tmp_path / "dst.ckpt"), t.name)
    assert t.shape[0] % 2 == 0, "a tensor the destination splits"
    want = oracle.cut(global_value(t.name, t.shape, t.ms_type), oracle.read_layouts(tmp_path / "dst.ckpt"), t.name, 1)
    assert np.asarray(got).view(np.uint16).tobytes() == want.tobytes()


def test_zarr_python_reads_a_packed_tensor_as_the_docs_say(built: tuple[Path, list[TensorDef]]) -> None:
    root, defs = built
    group = zarr.open_group(str(root / "s.zarr"), mode="r")
    entries = {e["name"]: e for e in group.attrs["zckpt"]["entries"]}
    for t in defs[:14]:
        e = entries[t.name]
        n = math.prod(e["shape"])
        flat = np.asarray(group[e["key"]][e["offset"]: e["offset"] + n])
        got = flat.reshape(e["shape"])
        want = global_value(t.name, t.shape, t.ms_type)
        assert got.tobytes() == want.tobytes(), t.name


def test_verify_and_export_refuse_a_flipped_byte_in_a_packed_tensor(
        built: tuple[Path, list[TensorDef]], tmp_path: Path) -> None:
    root, defs = built
    assert verify(root / "s.zarr").ok
    import shutil

    shutil.copytree(root / "s.zarr", tmp_path / "s.zarr")
    st = Store.open(tmp_path / "s.zarr")
    victim = next(d for d in defs if d.ms_type == "Float32" and d.shape)
    key, offset, _ = st.chunk_info(victim.name).at or ("", 0, 0)
    path = tmp_path / "s.zarr" / st.entry(victim.name).key / key
    with open(path, "r+b") as f:
        f.seek(offset + 2)
        byte = f.read(1)
        f.seek(offset + 2)
        f.write(bytes([byte[0] ^ 0x10]))
    report = verify(tmp_path / "s.zarr")
    assert not report.ok
    assert any(m.param == victim.name for m in report.mismatches)
    with pytest.raises(StoreError, match="checksum") as err:
        zckpt.export(tmp_path / "s.zarr", tmp_path / "out", None)
    assert victim.name in str(err.value)
    with pytest.raises(StoreError, match="checksum"):
        Store.open(tmp_path / "s.zarr").array(victim.name)


@pytest.mark.parametrize("key, refusal", [("tensors/../../outside", "not a plain relative name"),
                                          ("packed/another_type", "packed array of its type")])
def test_manifest_cannot_place_a_packed_tensor_outside_its_array(
        built: tuple[Path, list[TensorDef]], tmp_path: Path, key: str, refusal: str) -> None:
    root, defs = built
    import shutil

    shutil.copytree(root / "s.zarr", tmp_path / "s.zarr")
    meta_path = tmp_path / "s.zarr" / "zarr.json"
    doc = json.loads(meta_path.read_text())
    for e in doc["attributes"]["zckpt"]["entries"]:
        if e["name"] == defs[0].name:
            e["key"] = key
    meta_path.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=refusal):  # on opening the store, or on locating the tensor
        Store.open(tmp_path / "s.zarr").chunk_info(defs[0].name)
    try:
        report = verify(tmp_path / "s.zarr")
    except StoreError as err:
        assert refusal in str(err)
    else:
        assert not report.ok


def test_packing_off_gives_an_array_per_tensor(tmp_path: Path) -> None:
    defs = _model(tmp_path / "src", 1100)
    zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", str(tmp_path / "src" / "strategy.ckpt"),
                 IngestOptions(pack_bytes=0))
    assert not (tmp_path / "s.zarr" / "packed").exists()
    assert _files(tmp_path / "s.zarr") > 2 * 1100
    st = Store.open(tmp_path / "s.zarr")
    for t in defs[::97]:
        assert _same(np.asarray(st.array(t.name)[...]), global_value(t.name, t.shape, t.ms_type)), t.name


def _stage(stage: int, count: int) -> list[TensorDef]:
    out = []
    for i in range(count):
        shape, ms_type = KINDS[i % len(KINDS)]
        out.append(TensorDef(f"stage{stage}.t{i}", shape, ms_type, make_layout((1,), (-1,) * len(shape))))
    return out


def test_pipeline_stages_write_their_own_ranges_and_resume(tmp_path: Path) -> None:
    """Two pipeline stages (ranks 0 and 1) write disjoint ranges of the same packed arrays;
    an ingest interrupted after rank 0 resumes by rewriting rank 1's ranges alone."""
    stages = [_stage(0, 600), _stage(1, 600)]
    model = write_pipeline_model(tmp_path / "src", stages, stage_device_num=1)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.merged_strategy))
    st = Store.open(store)
    assert {st.entry(t.name).writer for t in stages[1]} == {1}
    assert st.entry(stages[0][0].name).key == st.entry(stages[1][0].name).key  # one packed array, two writers
    # the state of a run killed after rank 0: rank 1's ranges never written, its record absent
    for t in stages[1]:
        info = st.chunk_info(t.name)
        assert info.at is not None and info.folder is not None
        with open(info.folder / info.at[0], "r+b") as f:
            f.seek(info.at[1])
            f.write(b"\xa5" * info.inner_bytes)

    (store / "progress" / "rank_1.json").unlink()
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["zckpt"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(doc))
    report = zckpt.ingest(str(tmp_path / "src"), store, str(model.merged_strategy))
    assert report.resumed and report.ranks_read
    st = Store.open(store)
    for t in stages[0][::5] + stages[1][::5]:
        assert _same(np.asarray(st.array(t.name)[...]), global_value(t.name, t.shape, t.ms_type)), t.name
    assert verify(store).ok


def test_packing_places_tensors_without_crossing_a_chunk_border() -> None:
    """Hand-worked placement: 16-element chunks (a 64-byte limit of float32), tensors of 5."""
    from zckpt.core.layout import Box
    from zckpt.plan.values import TensorSpec
    from zckpt.store.packed import plan_packing

    tensors = [TensorSpec(f"t{i}", "tensor", "Float32", (5,)) for i in range(7)]
    tensors += [TensorSpec("split", "tensor", "Float32", (4,)), TensorSpec("large", "tensor", "Float32", (17,))]
    writers = {t.name: [(0, Box.full(t.shape))] for t in tensors}
    writers["split"] = [(0, Box((0,), (2,))), (1, Box((2,), (4,)))]
    plan = plan_packing(tensors, writers, limit=64, chunk_bytes=40, count=1)
    assert [plan.slots[f"t{i}"].offset for i in range(7)] == [0, 5, 10, 16, 21, 26, 32]
    assert "split" not in plan.slots and "large" not in plan.slots
    (array,) = plan.arrays
    assert (array.key, array.length, array.chunk) == ("packed/float32", 37, 16)
    assert not plan_packing(tensors, writers, limit=64, chunk_bytes=40, count=8).slots  # only 7 qualify
