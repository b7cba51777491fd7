"""Any M -> N without MindSpore or the fixtures: generated shards, random layouts, bit-exact output.

The expected destination shard is recomputed from the generator's global values and the
destination layout, never read back from zckpt's own output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zckpt
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy
from zckpt.generate import TensorDef, global_value, random_layout, write_model
from zckpt.layout import Box, rank_box, resolve

DTYPES = ["Float32", "BFloat16", "Float16", "Int32", "Int8", "UInt64", "Bool", "Float64"]


def _model(rng: np.random.Generator, device_num: int, count: int) -> list[TensorDef]:
    """Shapes whose dimensions are multiples of 2*3*4 so that many layouts fit both sides."""
    out = []
    for i in range(count):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(rng.choice([24, 48, 72])) for _ in range(ndim))
        ms_type = DTYPES[i % len(DTYPES)]
        out.append(TensorDef(f"net.p{i}.weight", shape, ms_type, random_layout(rng, shape, device_num)))
    return out


def _dst_strategy(rng: np.random.Generator, tensors: list[TensorDef], device_num: int, path: Path) -> StrategyMap:
    layouts: dict[str, dict[int, ParamLayout]] = {}
    for t in tensors:
        lay = random_layout(rng, t.shape, device_num, unlisted_prob=0.1)
        if lay is not None:
            layouts[t.name] = {0: lay}
    smap = StrategyMap(layouts=layouts)
    path.write_bytes(encode_strategy(smap))
    return smap


def _check_output(out: Path, tensors: list[TensorDef], smap: StrategyMap | None, dst_n: int) -> int:
    checked = 0
    for r in range(dst_n):
        f = out / f"rank_{r}" / f"checkpoint_{r}.ckpt"
        with CkptReader(f) as got:
            assert [t.name for t in tensors] == [n for n in got.names() if n.startswith("net.")]
            for t in tensors:
                full = global_value(t.name, t.shape, t.ms_type)
                lay = smap.layout(t.name) if smap is not None else None
                box = Box.full(t.shape) if lay is None else rank_box(resolve(lay, t.shape), r)
                exp = full[box.slices()]
                e = got.entries[t.name]
                assert (e.ms_type, e.shape) == (t.ms_type, exp.shape), t.name
                assert got.array(t.name).tobytes() == np.ascontiguousarray(exp).tobytes(), f"rank {r} {t.name}"
                checked += 1
            assert got.array("learning_rate").shape == ()
    return checked


@pytest.mark.parametrize("reader", ["zarr", "dask"])
@pytest.mark.parametrize("src_n,dst_n", [(8, 3), (16, 24), (24, 16), (4, 8), (1, 4), (6, 1), (3, 5)])
def test_any_m_to_n(src_n: int, dst_n: int, reader: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(src_n * 100 + dst_n)
    tensors = _model(rng, src_n, 10)
    model = write_model(tmp_path / "src", tensors, device_num=src_n, strings={"note": "m->n"})
    smap = _dst_strategy(rng, tensors, dst_n, tmp_path / "dst_strategy.ckpt")
    store = tmp_path / "store.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.strategy_path),
                 zckpt.IngestOptions(verify_replicas=True))
    zckpt.export(store, tmp_path / "out", str(tmp_path / "dst_strategy.ckpt"),
                 options=zckpt.ExportOptions(reader=reader, workers=2, block_bytes=4096))
    assert _check_output(tmp_path / "out", tensors, smap, dst_n) == 10 * dst_n
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.string("note") == "m->n"


def test_json_strategies_and_full_destination(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    tensors = _model(rng, 8, 8)
    model = write_model(tmp_path / "src", tensors, device_num=8, strategy_format="json")
    assert model.strategy_path is not None and model.strategy_path.suffix == ".json"
    zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "out"), "checkpoint_",
                                str(model.strategy_path), None)
    assert _check_output(tmp_path / "out", tensors, None, 1) == 8


def test_split_values_and_crc_sources(tmp_path: Path) -> None:
    """Sources whose tensors MindSpore split over several Values (both split modes), with crc trailers."""
    rng = np.random.default_rng(9)
    tensors = _model(rng, 4, 6)
    for mode in ("rows", "bytes"):
        src = tmp_path / f"src_{mode}"
        model = write_model(src, tensors, device_num=4, crc=True, slice_bytes=512, split=mode)  # type: ignore[arg-type]
        smap = _dst_strategy(rng, tensors, 2, tmp_path / f"dst_{mode}.ckpt")
        store = tmp_path / f"{mode}.zarr"
        zckpt.ingest(str(src), store, str(model.strategy_path), zckpt.IngestOptions(block_bytes=1000, chunk_bytes=700))
        zckpt.export(store, tmp_path / f"out_{mode}", str(tmp_path / f"dst_{mode}.ckpt"),
                     options=zckpt.ExportOptions(block_bytes=900))
        assert _check_output(tmp_path / f"out_{mode}", tensors, smap, 2) == 12


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), src_n=st.integers(1, 8), dst_n=st.integers(1, 8))
def test_random_round_trip(seed: int, src_n: int, dst_n: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    tensors = _model(rng, src_n, 4)
    model = write_model(tmp / "src", tensors, device_num=src_n)
    smap = _dst_strategy(rng, tensors, dst_n, tmp / "dst.ckpt")
    store = tmp / "s.zarr"
    zckpt.ingest(str(tmp / "src"), store, str(model.strategy_path),
                 zckpt.IngestOptions(chunk_bytes=int(rng.integers(64, 4096))))
    zckpt.export(store, tmp / "out", str(tmp / "dst.ckpt"),
                 options=zckpt.ExportOptions(block_bytes=int(rng.integers(64, 8192))))
    assert _check_output(tmp / "out", tensors, smap, dst_n) == 4 * dst_n
