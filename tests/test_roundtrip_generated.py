"""Any M -> N without MindSpore or the fixtures: generated shards, random layouts, bit-exact output.

The expected shards come from ``tests/oracle.py``, an independent re-slicer that reads the
strategy files' raw fields and cuts the generator's global values with numpy, never from
:mod:`zckpt.core.layout` (which generated the inputs: a layout bug would pass a comparison with
itself). The layouts include every kind MindSpore's compiler writes: multi-axis maps (JSON
files hold them expanded), optimizer sharding, ``manual_split`` uneven rows with optimizer
states listed without them, and ``field``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import oracle
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import zckpt
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, encode_strategy_json
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, global_value, strategy_of, with_optimizer_states

DTYPES = ["Float32", "BFloat16", "Float16", "Int32", "Int8", "UInt64", "Bool", "Float64"]
KINDS = {"uneven_prob": 0.3, "field_prob": 0.2}


def _model(rng: np.random.Generator, device_num: int, count: int, *, states: bool = False) -> list[TensorDef]:
    """Shapes whose dimensions are multiples of 2*3*4 so that many layouts fit both sides;
    with ``states``, an Adam state pair for every listed tensor."""
    out = []
    for i in range(count):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(rng.choice([24, 48, 72])) for _ in range(ndim))
        ms_type = DTYPES[i % len(DTYPES)]
        out.append(TensorDef(f"net.p{i}.weight", shape, ms_type, random_layout(rng, shape, device_num, **KINDS)))
    return with_optimizer_states(out) if states else out


def _dst_strategy(rng: np.random.Generator, tensors: list[TensorDef], device_num: int, path: Path) -> StrategyMap:
    """A destination strategy of the same kinds, written as protobuf or (``.json``) JSON."""
    params = [t for t in tensors if not t.name.startswith(("moment1.", "moment2."))]
    dst = [TensorDef(t.name, t.shape, t.ms_type,
                     random_layout(rng, t.shape, device_num, unlisted_prob=0.1 if i else 0.0, **KINDS))
           for i, t in enumerate(params)]  # the first one listed: a strategy file lists at least one parameter
    if len(params) != len(tensors):
        dst = with_optimizer_states(dst)
    smap = strategy_of(dst)
    if path.suffix == ".json":
        path.write_text(encode_strategy_json(smap))
    else:
        path.write_bytes(encode_strategy(smap))
    return smap


def _expected(t: TensorDef, strategy: Path | None, rank: int) -> np.ndarray:
    full = global_value(t.name, t.shape, t.ms_type)
    layouts = oracle.read_layouts(strategy) if strategy is not None else {}
    if t.name not in layouts:
        return full
    return oracle.expected_shard(full, oracle.effective(t.name, layouts), rank)


def _check_files(root: Path, tensors: list[TensorDef], strategy: Path | None, n: int, *, prefix: str = "net.",
                 moments: bool = True) -> int:
    """Every rank file under ``root`` holds the oracle's shard of every tensor, in order."""
    checked = 0
    names = [t.name for t in tensors]
    for r in range(n):
        with CkptReader(root / f"rank_{r}" / f"checkpoint_{r}.ckpt") as got:
            held = [x for x in got.names() if x.startswith(prefix) or (moments and x.startswith("moment"))]
            assert sorted(held) == sorted(names)
            assert [x for x in held if x.startswith(prefix)] == [x for x in names if x.startswith(prefix)]
            for t in tensors:
                exp = _expected(t, strategy, r)
                e = got.entries[t.name]
                assert (e.ms_type, e.shape) == (t.ms_type, exp.shape), f"rank {r} {t.name}"
                assert got.array(t.name).tobytes() == np.ascontiguousarray(exp).tobytes(), f"rank {r} {t.name}"
                checked += 1
    return checked


def _check_output(out: Path, tensors: list[TensorDef], strategy: Path | None, dst_n: int) -> int:
    checked = _check_files(out, tensors, strategy, dst_n)
    with CkptReader(out / "rank_0" / "checkpoint_0.ckpt") as got:
        assert got.array("learning_rate").shape == ()
    return checked


@pytest.mark.parametrize("reader", ["zarr", "dask"])
@pytest.mark.parametrize("src_n,dst_n", [(8, 3), (16, 24), (24, 16), (4, 8), (1, 4), (6, 1), (3, 5)])
def test_any_m_to_n(src_n: int, dst_n: int, reader: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(src_n * 100 + dst_n)
    tensors = _model(rng, src_n, 10, states=True)
    model = write_model(tmp_path / "src", tensors, device_num=src_n, strings={"note": "m->n"})
    assert model.strategy_path is not None
    assert _check_files(tmp_path / "src", tensors, model.strategy_path, src_n) == len(tensors) * src_n
    dst = tmp_path / ("dst_strategy.json" if src_n % 2 else "dst_strategy.ckpt")
    _dst_strategy(rng, tensors, dst_n, dst)
    store = tmp_path / "store.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.strategy_path),
                 zckpt.IngestOptions(verify_replicas=True))
    zckpt.export(store, tmp_path / "out", str(dst),
                 options=zckpt.ExportOptions(reader=reader, workers=2, block_bytes=4096))
    assert _check_output(tmp_path / "out", tensors, dst, dst_n) == len(tensors) * dst_n
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.string("note") == "m->n"


def test_json_strategies_and_full_destination(tmp_path: Path) -> None:
    """JSON source (multi-axis maps expanded, uneven tables, field) to one unsharded rank."""
    rng = np.random.default_rng(5)
    tensors = _model(rng, 8, 8, states=True)
    model = write_model(tmp_path / "src", tensors, device_num=8, strategy_format="json")
    assert model.strategy_path is not None and model.strategy_path.suffix == ".json"
    assert _check_files(tmp_path / "src", tensors, model.strategy_path, 8) == len(tensors) * 8
    zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "out"), "checkpoint_",
                                str(model.strategy_path), None)
    assert _check_output(tmp_path / "out", tensors, None, 1) == len(tensors)


def test_split_values_and_crc_sources(tmp_path: Path) -> None:
    """Sources whose tensors MindSpore split over several Values (both split modes), with crc trailers."""
    rng = np.random.default_rng(9)
    tensors = _model(rng, 4, 6)
    for mode in ("rows", "bytes"):
        src = tmp_path / f"src_{mode}"
        model = write_model(src, tensors, device_num=4, crc=True, slice_bytes=512, split=mode)  # type: ignore[arg-type]
        dst = tmp_path / f"dst_{mode}.ckpt"
        _dst_strategy(rng, tensors, 2, dst)
        store = tmp_path / f"{mode}.zarr"
        zckpt.ingest(str(src), store, str(model.strategy_path), zckpt.IngestOptions(block_bytes=1000, chunk_bytes=700))
        zckpt.export(store, tmp_path / f"out_{mode}", str(dst), options=zckpt.ExportOptions(block_bytes=900))
        assert _check_output(tmp_path / f"out_{mode}", tensors, dst, 2) == 12


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), src_n=st.integers(1, 8), dst_n=st.integers(1, 8),
       src_json=st.booleans(), dst_json=st.booleans())
@example(seed=264, src_n=5, dst_n=8, src_json=False, dst_json=True)  # manual split beside an expanded JSON dimension
def test_random_round_trip(seed: int, src_n: int, dst_n: int, src_json: bool, dst_json: bool,
                           tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    tensors = _model(rng, src_n, 4, states=True)
    model = write_model(tmp / "src", tensors, device_num=src_n, strategy_format="json" if src_json else "protobuf")
    dst = tmp / ("dst.json" if dst_json else "dst.ckpt")
    _dst_strategy(rng, tensors, dst_n, dst)
    store = tmp / "s.zarr"
    zckpt.ingest(str(tmp / "src"), store, str(model.strategy_path),
                 zckpt.IngestOptions(chunk_bytes=int(rng.integers(64, 4096))))
    zckpt.export(store, tmp / "out", str(dst), options=zckpt.ExportOptions(block_bytes=int(rng.integers(64, 8192))))
    assert _check_output(tmp / "out", tensors, dst, dst_n) == len(tensors) * dst_n
