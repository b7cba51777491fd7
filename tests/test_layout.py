"""Sharding maths: property tests on random layouts, an independent slicing oracle, fixtures.

Layouts come from :func:`zckpt.jobs.generate_layouts.random_layout`, which draws every kind MindSpore
produces; the properties must hold for all of them. The oracle re-derives MindSpore's
slicing with numpy index arithmetic (as the fixtures' ``make/verify_layout.py`` does, but
extended to several axes per dimension) instead of boxes, so a shared mistake is unlikely.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zckpt.core.errors import LayoutError
from zckpt.core.layout import (
    Box,
    all_boxes,
    fraction_box,
    global_shape,
    normalized_shape,
    opt_shard_axes,
    rank_box,
    replica_groups,
    resolve,
    tiles,
)
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import ParamLayout, StrategyMap, make_layout, read_strategy
from zckpt.jobs.generate_layouts import random_layout, valid_opt_sizes

DEVICE_NUMS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def shapes(draw: st.DrawFn, device_num: int, max_elems: int = 6000) -> tuple[int, ...]:
    """Shapes whose dimensions often, but not always, divide by parts of ``device_num``."""
    ndim = draw(st.integers(0, 4))
    factors = sorted({d for d in range(1, 2 * device_num + 1) if (2 * device_num) % d == 0})
    dims = []
    for _ in range(ndim):
        f = draw(st.sampled_from(factors))
        dims.append(f * draw(st.sampled_from([1, 1, 2, 3, 5])))
    while math.prod(dims) > max_elems:
        i = dims.index(max(dims))
        dims[i] = max(1, dims[i] // 2)
    return tuple(dims)


@st.composite
def layout_cases(draw: st.DrawFn) -> tuple[ParamLayout, tuple[int, ...]]:
    device_num = draw(st.sampled_from(DEVICE_NUMS))
    shape = draw(shapes(device_num))
    seed = draw(st.integers(0, 2**32 - 1))
    lay = random_layout(np.random.default_rng(seed), shape, device_num)
    assert lay is not None
    return lay, shape


def oracle_slice(arr: np.ndarray, lay: ParamLayout, rank: int) -> np.ndarray:
    """MindSpore's slicing, re-derived with numpy: tensor-parallel, then optimizer split."""
    dev = lay.dev_matrix
    coord = np.unravel_index(rank, dev)
    index: list[slice] = []
    for d, axes in enumerate(lay.tensor_map):
        count, k = 1, 0
        for a in axes:  # outermost first: mixed radix
            ax = len(dev) - 1 - a
            k = k * dev[ax] + int(coord[ax])
            count *= dev[ax]
        size = arr.shape[d] // count
        index.append(slice(k * size, (k + 1) * size))
    part = arr[tuple(index)]
    used = {len(dev) - 1 - a for axes in lay.tensor_map for a in axes}
    repeated = [i for i, n in enumerate(dev) if i not in used and n > 1]
    need = lay.opt_shard_size
    if need == -1:
        need = math.prod(dev[i] for i in repeated)
    if need <= 1:
        return part
    digits: list[tuple[int, int]] = []  # (radix, digit), innermost first
    for ax in reversed(repeated):
        take = min(dev[ax], need)
        digits.append((take, int(coord[ax]) % take))
        need //= take
        if need == 1:
            break
    piece = 0
    total = 1
    for radix, digit in reversed(digits):
        piece = piece * radix + digit
        total *= radix
    rows = part.shape[0] // total
    return part[piece * rows : (piece + 1) * rows]


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(layout_cases())
def test_boxes_tile_the_tensor_once_per_replica(case: tuple[ParamLayout, tuple[int, ...]]) -> None:
    lay, shape = case
    sh = resolve(lay, shape)
    boxes = all_boxes(sh)
    assert len(boxes) == lay.device_num
    distinct = sorted(set(boxes))
    count = np.zeros(shape, dtype=np.int64)
    for b in distinct:
        assert b.shape == sh.shard_shape
        assert Box.full(shape).contains(b)
        count[b.slices()] += 1
    assert np.all(count == 1), "distinct boxes must partition the tensor"
    groups = replica_groups(sh)
    assert sorted(r for g in groups for r in g) == list(range(lay.device_num))
    assert len(groups) == len(distinct)
    assert {len(g) for g in groups} == {lay.device_num // len(distinct)}
    for g in groups:
        assert len({boxes[r] for r in g}) == 1


@SETTINGS
@given(layout_cases())
def test_rank_box_matches_independent_slicing(case: tuple[ParamLayout, tuple[int, ...]]) -> None:
    lay, shape = case
    arr = np.arange(math.prod(shape)).reshape(shape)
    sh = resolve(lay, shape)
    for rank in range(lay.device_num):
        assert np.array_equal(arr[rank_box(sh, rank).slices()], oracle_slice(arr, lay, rank)), rank


@SETTINGS
@given(layout_cases())
def test_global_shape_inverts_the_shard_shape(case: tuple[ParamLayout, tuple[int, ...]]) -> None:
    lay, shape = case
    sh = resolve(lay, shape)
    assert global_shape(lay, sh.shard_shape) == shape
    assert math.prod(sh.shard_shape) * len(set(all_boxes(sh))) == math.prod(shape)


@SETTINGS
@given(layout_cases())
def test_resolve_refuses_shapes_that_do_not_divide(case: tuple[ParamLayout, tuple[int, ...]]) -> None:
    lay, shape = case
    sh = resolve(lay, shape)
    for d, split in enumerate(sh.dim_splits):
        if split > 1:
            bad = list(shape)
            bad[d] += 1
            with pytest.raises(LayoutError, match=f"dimension {d}"):
                resolve(lay, bad)
    if sh.opt_size > 1:
        bad = list(shape)
        bad[0] += sh.dim_splits[0]  # still splits evenly, but not into the optimizer pieces
        with pytest.raises(LayoutError, match="optimizer"):
            resolve(lay, bad)
    with pytest.raises(LayoutError, match="tensor_map has"):
        resolve(lay, (*shape, 1))


@st.composite
def layout_families(draw: st.DrawFn) -> tuple[list[ParamLayout | None], tuple[int, ...]]:
    """Several layouts (possibly for different device counts) of one shape."""
    nums = draw(st.lists(st.sampled_from(DEVICE_NUMS), min_size=1, max_size=3))
    shape = draw(shapes(math.lcm(*nums), max_elems=20000))
    lays: list[ParamLayout | None] = []
    for n in nums:
        seed = draw(st.integers(0, 2**32 - 1))
        lays.append(random_layout(np.random.default_rng(seed), shape, n, unlisted_prob=0.1))
    return lays, shape


@SETTINGS
@given(layout_families())
def test_normalized_shape_fits_every_layout_and_scales(case: tuple[list[ParamLayout | None], tuple[int, ...]]) -> None:
    lays, shape = case
    norm = normalized_shape(*lays, ndim=len(shape))
    assert len(norm) == len(shape)
    for n, s in zip(norm, shape, strict=True):
        assert s % n == 0, "the normalized shape divides every shape all layouts fit"
    for lay in lays:
        if lay is None:
            continue
        small = resolve(lay, norm)
        real = resolve(lay, shape)
        for rank in range(lay.device_num):
            assert fraction_box(rank_box(small, rank), norm) == fraction_box(rank_box(real, rank), shape)


@SETTINGS
@given(
    st.lists(st.integers(1, 30), min_size=0, max_size=3).flatmap(
        lambda shp: st.tuples(
            st.just(tuple(shp)),
            st.tuples(*[st.integers(0, n - 1) for n in shp]),
            st.tuples(*[st.integers(0, n) for n in shp]),
            st.tuples(*[st.integers(1, 8) for _ in shp]),
        )
    )
)
def test_tiles_partition_a_box_on_an_aligned_grid(
    case: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]],
) -> None:
    shape, lo, hi, tile = case
    start = tuple(min(a, b) for a, b in zip(lo, hi, strict=True))
    stop = tuple(max(a + 1, b) for a, b in zip(lo, hi, strict=True))
    box = Box(start, stop)
    count = np.zeros(tuple(s + 1 for s in shape), dtype=np.int64)
    n = 0
    for t in tiles(box, tile):
        n += 1
        assert box.contains(t) and t.size > 0
        for a, b, size in zip(t.start, t.stop, tile, strict=True):
            assert a // size == (b - 1) // size, "a tile never crosses a grid line"
        count[t.slices()] += 1
    inside = np.zeros_like(count)
    inside[box.slices()] = 1
    assert np.array_equal(count, inside)
    assert n == math.prod((b - 1) // s - a // s + 1 for a, b, s in zip(box.start, box.stop, tile, strict=True))


@SETTINGS
@given(st.sampled_from(DEVICE_NUMS), st.integers(0, 2**32 - 1))
def test_valid_opt_sizes_agree_with_resolve(device_num: int, seed: int) -> None:
    """The generator's independent rule and zckpt's opt_shard_axes accept the same sizes."""
    rng = np.random.default_rng(seed)
    lay = random_layout(rng, (device_num * 4, 3), device_num, allow_opt=False)
    assert lay is not None
    used = {len(lay.dev_matrix) - 1 - a for axes in lay.tensor_map for a in axes}
    valid = set(valid_opt_sizes(lay.dev_matrix, used))
    repeated = math.prod(n for i, n in enumerate(lay.dev_matrix) if i not in used)
    for size in range(2, repeated + 1):
        trial = make_layout(lay.dev_matrix, [list(a) for a in lay.tensor_map], opt_shard_size=size)
        try:
            axes = opt_shard_axes(trial)
        except LayoutError:
            assert size not in valid, size
        else:
            assert size in valid, size
            assert math.prod(s for _, s in axes) == size
    full = make_layout(lay.dev_matrix, [list(a) for a in lay.tensor_map], opt_shard_size=-1)
    assert math.prod(s for _, s in opt_shard_axes(full)) == repeated


# --------------------------------------------------------------------------- examples


def test_random_layout_produces_every_kind_mindspore_makes() -> None:
    rng = np.random.default_rng(2024)
    seen: set[str] = set()
    for _ in range(400):
        lay = random_layout(rng, (48, 24, 16), 16, unlisted_prob=0.05)
        if lay is None:
            seen.add("unlisted")
            continue
        resolve(lay, (48, 24, 16))
        used = {len(lay.dev_matrix) - 1 - a for axes in lay.tensor_map for a in axes}
        if any(len(a) > 1 for a in lay.tensor_map):
            seen.add("multi-axis")
        if any(not a for a in lay.tensor_map):
            seen.add("unsplit dim")
        if 0 not in used and len(lay.dev_matrix) > 1 and lay.dev_matrix[0] > 1:
            seen.add("left replication axis")
        if 1 in lay.dev_matrix:
            seen.add("size-1 axis")
        if lay.opt_shard_size == -1:
            seen.add("opt all")
        axes = opt_shard_axes(lay)
        if len(axes) >= 2:
            seen.add("opt over several axes")
        if any(s < lay.dev_matrix[i] for i, s in axes):
            seen.add("opt axis larger than needed")
        if not axes:
            seen.add("no opt")
    assert seen == {
        "unlisted",
        "multi-axis",
        "unsplit dim",
        "left replication axis",
        "size-1 axis",
        "opt all",
        "opt over several axes",
        "opt axis larger than needed",
        "no opt",
    }


def test_random_layout_respects_its_switches() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        lay = random_layout(rng, (64, 64), 8, allow_opt=False, allow_multi_axis=False)
        assert lay is not None
        assert lay.opt_shard_size == 0
        assert all(len(a) <= 1 for a in lay.tensor_map)
    assert random_layout(rng, (4,), 4, unlisted_prob=1.0) is None


def test_known_boxes_from_mindspore_fixtures() -> None:
    """Hand-checked cases: s01 dst layer1.weight and s09 src layer1.weight."""
    s01 = make_layout((2, 2), [[0], []], opt_shard_size=-1)  # (32, 48)
    sh = resolve(s01, (32, 48))
    assert [b.start[0] for b in all_boxes(sh)] == [0, 16, 8, 24]
    assert {b.shape for b in all_boxes(sh)} == {(8, 48)}
    s09 = make_layout((2, 4), [[], []], opt_shard_size=2)  # (32, 48): axis of 4 gives a factor 2
    sh = resolve(s09, (32, 48))
    assert [b.start[0] for b in all_boxes(sh)] == [0, 16, 0, 16, 0, 16, 0, 16]
    assert opt_shard_axes(s09) == ((1, 2),)
    multi = make_layout((2, 3), [[1, 0]])  # one dimension split by both axes, outer first
    assert [rank_box(resolve(multi, (12,)), r).start for r in range(6)] == [(0,), (2,), (4,), (6,), (8,), (10,)]
    swapped = make_layout((2, 3), [[0, 1]])
    assert [rank_box(resolve(swapped, (12,)), r).start for r in range(6)] == [(0,), (4,), (8,), (2,), (6,), (10,)]


def test_invalid_optimizer_sizes_are_refused() -> None:
    with pytest.raises(LayoutError, match="exceeds"):
        opt_shard_axes(make_layout((2, 2), [[0], []], opt_shard_size=4))
    with pytest.raises(LayoutError, match="does not fit"):
        opt_shard_axes(make_layout((2, 3), [[]], opt_shard_size=2))
    with pytest.raises(LayoutError, match="0-d"):
        resolve(make_layout((4,), [], opt_shard_size=-1), ())


# --------------------------------------------------------------------------- fixtures

# (scenario, side) pairs whose shards come from a non-pipeline job; s06/s07 sources are
# pipeline jobs whose layouts depend on the stage; they are left to pipeline-aware tests.
FIXTURE_SIDES = [
    ("s01", "src"),
    ("s01", "dst"),
    ("s02", "src"),
    ("s02", "dst"),
    ("s03", "src"),
    ("s03b", "src"),
    ("s03b", "dst"),
    ("s04", "src"),
    ("s04", "dst"),
    ("s05", "src"),
    ("s05", "dst"),
    ("s06", "dst"),
    ("s07", "dst"),
    ("s08", "src"),
    ("s08", "dst"),
    ("s09", "src"),
    ("s09", "dst"),
    ("s10", "src"),
    ("s10", "dst"),
    ("s11", "src"),
    ("s11", "dst"),
    ("s12", "src"),
    ("s12", "dst"),
    ("s14", "src"),
    ("s14", "dst"),
    ("s15", "src"),
    ("s15", "dst"),
]
# Listed nowhere but sharded (fixtures README): no layout can be derived from the strategy.
UNLISTED_BUT_SHARDED = {("s12", "step_table")}


@pytest.mark.fixtures
@pytest.mark.parametrize(("sid", "side"), FIXTURE_SIDES, ids=[f"{s}-{d}" for s, d in FIXTURE_SIDES])
def test_reference_sliced_by_rank_box_equals_every_shard(fixtures_dir: Path, sid: str, side: str) -> None:
    root = fixtures_dir / sid
    shard_root = root / ("src/checkpoints" if side == "src" else "dst/expected")
    if not shard_root.is_dir():
        pytest.skip(f"{sid} has no {side} shards")
    strategy_file = root / side / "strategy.ckpt"
    smap = read_strategy(strategy_file) if strategy_file.is_file() else StrategyMap(layouts={})
    rank_dirs = sorted(shard_root.glob("rank_*"), key=lambda p: int(p.name.split("_")[1]))
    if smap.layouts:
        assert len(rank_dirs) == smap.device_num()
    else:
        assert len(rank_dirs) == 1, "a side without strategy file is one unsharded rank"
    compared = 0
    with CkptReader(root / "reference" / "global.ckpt") as ref:
        for rank_dir in rank_dirs:
            rank = int(rank_dir.name.split("_")[1])
            (path,) = rank_dir.glob("*.ckpt")
            with CkptReader(path) as shard:
                # pipeline references also hold accu_grads.*, which a non-pipeline job lacks
                assert set(shard.names()) <= set(ref.names()), path
                for name in shard.names():
                    if shard.entries[name].kind != "tensor":
                        continue
                    got = shard.array(name)
                    full = ref.array(name)
                    lay = smap.layout(name)
                    if (sid, name) in UNLISTED_BUT_SHARDED:
                        assert lay is None and got.shape != full.shape
                        continue
                    if lay is None:
                        expect = full
                    else:
                        sh = resolve(lay, full.shape, param=name)
                        expect = full[rank_box(sh, rank).slices()]
                        assert global_shape(lay, got.shape) == full.shape
                    assert got.dtype == expect.dtype
                    assert got.shape == expect.shape, (rank, name)
                    assert got.tobytes() == expect.tobytes(), (rank, name)
                    compared += 1
    assert compared > 0


def test_overlap_counts_the_elements_two_boxes_share() -> None:
    """Against a brute-force count on a grid (boxes may reach outside each other, be empty or 0-d)."""
    import random

    rng = random.Random(67)
    for _ in range(500):
        nd = rng.randint(0, 3)
        starts = [[rng.randint(0, 5) for _ in range(nd)] for _ in range(2)]
        a, b = (Box(tuple(s), tuple(x + rng.randint(0, 4) for x in s)) for s in starts)
        grid = np.zeros((10,) * nd, dtype=np.int8)
        grid[a.slices()] += 1
        grid[b.slices()] += 1
        assert a.overlap(b) == int((grid == 2).sum()) == b.overlap(a), (a, b)
