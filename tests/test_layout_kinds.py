"""The layout kinds of issue 14, rule by rule, on hand-worked cases (fixtures README, "Notes for zckpt").

Expected boxes are written out by hand from MindSpore's rules, not computed by zckpt.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import zckpt
from zckpt.core.layout import Box, global_shape, rank_box, resolve
from zckpt.formats.strategy import (
    StrategyMap,
    encode_strategy_json,
    expand_layout,
    fold_layout,
    make_layout,
    read_strategy,
)
from zckpt.plan.entry_layouts import with_owner_split
from zckpt.plan.ranklist import fold_pairs, rank_list_for_transform_maps


def _json_layout(tmp_path: Path, item: dict[str, object]) -> zckpt.ParamLayout:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"parallel_layout_item": {"w": {"field": 0, "opt_weight_shard_size": 0,
                                                              "opt_weight_shard_step": 0, **item}}}))
    lay = read_strategy(path).layout("w")
    assert lay is not None
    return lay


def test_json_expanded_map_folds_first_axis_most_significant(tmp_path: Path) -> None:
    # (32,48) over ("tp","dp") on dev [2,4] (dp=2, tp=4): tensor_shape [4,8,48], tensor_map [0,1,-1]
    lay = _json_layout(tmp_path, {"dev_matrix": [2, 4], "tensor_map": [0, 1, -1], "tensor_shape": [4, 8, 48]})
    assert fold_layout(lay, (32, 48)).tensor_map == ((0, 1), ())
    sh = resolve(lay, (32, 48))
    # rank r has dp = r // 4, tp = r % 4; piece = tp * 2 + dp of 4 rows
    for r in range(8):
        piece = (r % 4) * 2 + r // 4
        assert rank_box(sh, r) == Box((4 * piece, 0), (4 * piece + 4, 48))
    assert global_shape(lay, (4, 48)) == (32, 48)


def test_json_size_one_axis_dropped_still_gives_a_dimension(tmp_path: Path) -> None:
    # (48,) over ("b","a") with b of size 1 dropped from dev_matrix [2]: [1,48] / [-1,0]
    lay = _json_layout(tmp_path, {"dev_matrix": [2], "tensor_map": [-1, 0], "tensor_shape": [1, 48]})
    assert [rank_box(resolve(lay, (48,)), r) for r in range(2)] == [Box((0,), (24,)), Box((24,), (48,))]
    assert global_shape(lay, (24,)) == (48,)
    # (32,48) over ("a","b") -> [2,16,48] / [0,-1,-1]: two pieces of 16 rows
    lay2 = _json_layout(tmp_path, {"dev_matrix": [2], "tensor_map": [0, -1, -1], "tensor_shape": [2, 16, 48]})
    assert global_shape(lay2, (16, 48)) == (32, 48)
    assert rank_box(resolve(lay2, (32, 48)), 1) == Box((16, 0), (32, 48))


def test_json_layout_that_cannot_be_a_box_is_refused(tmp_path: Path) -> None:
    # dim 0 of size 4 on an axis of 2, followed by a split dim: a rank's rows would not be contiguous
    lay = _json_layout(tmp_path, {"dev_matrix": [2, 2], "tensor_map": [1, 0], "tensor_shape": [4, 8]})
    with pytest.raises(zckpt.LayoutError, match="not contiguous") as err:
        resolve(lay, (32,), param="w")
    assert "'w'" in str(err.value)


def test_json_shard_that_fits_several_global_shapes_is_refused(tmp_path: Path) -> None:
    # every expanded dim is one piece per device: a (1,1) shard fits (8,4) and (16,2)
    lay = _json_layout(tmp_path, {"dev_matrix": [2, 2, 8], "tensor_map": [0, 1, 2], "tensor_shape": [8, 2, 2]})
    with pytest.raises(zckpt.LayoutError, match="fits several") as err:
        global_shape(lay, (1, 1), param="w")
    assert "'w'" in str(err.value)


def test_json_writer_expands_like_mindspore(tmp_path: Path) -> None:
    lay = make_layout((2, 4), [[], [0, 1]], tensor_shape=(48, 24))  # dim 1 over (axis 0 = 4, axis 1 = 2)
    assert expand_layout(lay) == ([48, 4, 6], [-1, 0, 1])
    path = tmp_path / "w.json"
    path.write_text(encode_strategy_json(StrategyMap(layouts={"w": {0: lay}})))
    item = json.loads(path.read_text())["parallel_layout_item"]["w"]
    assert (item["tensor_shape"], item["tensor_map"]) == ([48, 4, 6], [-1, 0, 1])
    back = read_strategy(path).layout("w")
    assert back is not None
    assert [rank_box(resolve(back, (48, 24)), r) for r in range(8)] == [
        rank_box(resolve(lay, (48, 24)), r) for r in range(8)]


def test_manual_split_state_takes_its_tables_split() -> None:
    table = make_layout((4,), [[0], []], param_split_shape=[10, 30, 5, 19], indices_offset=[0, 10, 40, 45])
    state = make_layout((4,), [[0], []])
    other = make_layout((2, 2), [[0], []])
    layouts = {"t": {0: table}, "moment1.t": {0: state}, "moment2.t": {0: other}}
    got = with_owner_split("moment1.t", layouts["moment1.t"], layouts)[0]
    assert [rank_box(resolve(got, (64, 32)), r).shape for r in range(4)] == [(10, 32), (30, 32), (5, 32), (19, 32)]
    assert with_owner_split("moment2.t", layouts["moment2.t"], layouts)[0] == other  # another layout: untouched


def test_manual_split_one_count_per_row_piece() -> None:
    """MindSpore 2.10 writes a (4, 2) manual_split table on 8 devices with 4 counts (one per
    dimension-0 piece; dev_matrix (4, 2), map [[1], [0]]), as compiled here with its dryrun."""
    lay = make_layout((4, 2), [[1], [0]], param_split_shape=[10, 30, 5, 19], indices_offset=[0, 10, 40, 45])
    sh = resolve(lay, (64, 32))
    rows = [(0, 10), (10, 40), (40, 45), (45, 64)]
    assert [rank_box(sh, r) for r in range(8)] == [
        Box((rows[r // 2][0], 16 * (r % 2)), (rows[r // 2][1], 16 * (r % 2) + 16)) for r in range(8)]
    per_slice = make_layout((4, 2), [[1], [0]], param_split_shape=[10, 10, 30, 30, 5, 5, 19, 19])
    assert [rank_box(resolve(per_slice, (64, 32)), r) for r in range(8)] == [rank_box(sh, r) for r in range(8)]


def test_uneven_split_with_optimizer_shard_is_refused_by_name() -> None:
    """MindSpore's compiler cannot produce it (docs/layouts.md); a file that states it is refused."""
    lay = make_layout((2, 2), [[0], []], opt_shard_size=2, param_split_shape=[3, 5, 3, 5][:2],
                      indices_offset=[0, 3])
    with pytest.raises(zckpt.LayoutError, match="unevenly split") as err:
        resolve(lay, (8, 4), param="table")
    assert "'table'" in str(err.value)


def test_field_changes_no_box() -> None:
    lay = make_layout((2, 4), [[1], [0]], opt_shard_size=0)
    for f in (2, 6, 39):
        with_field = dataclasses.replace(lay, field_size=f)
        assert [rank_box(resolve(with_field, (48, 48)), r) for r in range(8)] == [
            Box(((r // 4) * 24, (r % 4) * 12), ((r // 4) * 24 + 24, (r % 4) * 12 + 12)) for r in range(8)]


def test_rank_list_folds_json_against_protobuf() -> None:
    """An expanded (4,8,48) fits (32,48) and (4,384) against a 2-D protobuf map: the files cannot
    tell which, so the rank list covers both."""
    src = make_layout((2, 4), [0, 1, -1], tensor_shape=(4, 8, 48))
    dst = make_layout((2,), [[0], []])
    pairs = fold_pairs(src, dst, "w")
    assert sorted(p[0].tensor_shape or () for p in pairs) == [(4, 384), (32, 48)]
    assert all(p[1] == dst for p in pairs)
    assert fold_pairs(src, None, "w") == [(src, None)]
    # (32,48): dst rank 0 holds rows 0-15 = pieces 0..3 (piece = tp*2 + dp): ranks with tp in {0, 1}
    # (4,384): rows 0-1 = tp 0: ranks 0 and 4; the union is every rank with tp < 2
    got = rank_list_for_transform_maps(0, StrategyMap({"w": {0: src}}), StrategyMap({"w": {0: dst}}))
    assert {0, 1, 4, 5} <= set(got)


def test_load_distributed_checkpoint_refuses_a_field_reorder() -> None:
    """MindSpore's load_distributed_checkpoint reorders field>1 rows when merging; zckpt names the parameter."""
    from zckpt.jobs.loading import refuse_field_reorder

    plain = make_layout((2, 2), [[1], []])
    train = StrategyMap({"w": {0: dataclasses.replace(plain, field_size=2)}, "b": {0: plain},
                         "one": {0: dataclasses.replace(plain, field_size=1)}})
    with pytest.raises(zckpt.LayoutError, match="field 2") as err:
        refuse_field_reorder(train, {"w", "b"})
    assert "'w'" in str(err.value)
    refuse_field_reorder(train, {"b", "one"})  # field 1 reorders nothing; parameters not loaded do not count
    refuse_field_reorder(None, {"w"})
