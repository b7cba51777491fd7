"""The independent re-slicer (``tests/oracle.py``) is itself checked against MindSpore.

Its expected shards are what the round-trip tests compare zckpt with, so it must agree with
what MindSpore's compiler cut: every shard of every non-pipeline side of the fixtures
(reference/global.ckpt re-sliced by the oracle from the raw strategy fields).
"""

from __future__ import annotations

import numpy as np
import oracle
import pytest
from conftest import scenario

from zckpt.formats.ckpt import CkptReader

SIDES = [(s, side) for s in ("s01", "s02", "s05", "s08", "s09", "s10", "s11", "s14", "s15", "s16", "s17", "s18",
                             "s19", "s20") for side in ("src", "dst")]


@pytest.mark.parametrize(("sid", "side"), SIDES, ids=[f"{s}-{d}" for s, d in SIDES])
def test_oracle_cuts_what_mindspore_cut(sid: str, side: str) -> None:
    d = scenario(sid)
    strategy = next((d / side / n for n in ("strategy.ckpt", "strategy.json") if (d / side / n).is_file()), None)
    if strategy is None:
        pytest.skip(f"{sid} {side} is one unsharded rank")
    layouts = oracle.read_layouts(strategy)
    root = d / ("src/checkpoints" if side == "src" else "dst/expected")
    checked = 0
    with CkptReader(d / "reference" / "global.ckpt") as ref:
        for rank_dir in sorted(root.glob("rank_*")):
            rank = int(rank_dir.name.split("_")[1])
            with CkptReader(next(rank_dir.glob("*.ckpt"))) as shard:
                for name in shard.names():
                    if name not in layouts or shard.entries[name].kind != "tensor":
                        continue
                    want = oracle.expected_shard(ref.array(name), oracle.effective(name, layouts), rank)
                    got = shard.array(name)
                    assert got.shape == want.shape, (rank, name)
                    assert got.tobytes() == np.ascontiguousarray(want).tobytes(), (rank, name)
                    checked += 1
    assert checked > 0


def test_oracle_rules_on_small_cases() -> None:
    """Hand-worked cases of each rule (fixtures README), independent of any fixture."""
    g = np.arange(48).reshape(12, 4)
    # ("mp","sp") on dev (2,4,2) for a 1-D dim: piece = mp*4 + sp; mp = axis 0, sp = axis 1
    multi = {"dev": [2, 4, 2], "map": [[0, 1], [-1]], "tshape": None, "opt": 0, "split": [], "offset": []}
    rows = [int(oracle.expected_shard(np.arange(16).reshape(16, 1), multi, r)[0, 0]) for r in range(16)]
    # rank r = dp*8 + sp*2 + mp -> piece mp*4 + sp of size 2
    assert rows == [2 * ((r % 2) * 4 + (r // 2) % 4) for r in range(16)]
    # manual split rows 5/7 on 2 ranks
    manual = {"dev": [2], "map": [[0], [-1]], "tshape": None, "opt": 0, "split": [5, 7], "offset": [0, 5]}
    assert [oracle.expected_shard(g, manual, r).shape for r in range(2)] == [(5, 4), (7, 4)]
    # optimizer shard over the innermost free axis
    opt = {"dev": [2, 2], "map": [[-1], [1]], "tshape": None, "opt": 2, "split": [], "offset": []}
    assert oracle.expected_shard(g, opt, 1)[0, 0] == 6 * 4  # rank 1: dev coord (0,1): cols 0-1, rows 6..11
    # JSON expanded (12,4), dim 0 over (axis 1 of size 2, axis 0 of size 3): tensor_shape [2,6,4]
    exp = {"dev": [2, 3], "map": [[1], [0], [-1]], "tshape": [2, 6, 4], "opt": 0, "split": [], "offset": []}
    # rank r: coord (r//3, r%3); piece = (r//3)*3 + r%3 = r, 2 rows each
    assert [oracle.expected_shard(g, exp, r).tolist() for r in range(6)] == [g[2 * r:2 * r + 2].tolist()
                                                                             for r in range(6)]


def test_effective_takes_the_tables_split() -> None:
    base = {"dev": [2], "map": [[0], [-1]], "tshape": None, "opt": 0}
    layouts = {"t": {**base, "split": [3, 5], "offset": [0, 3]}, "moment1.t": {**base, "split": [], "offset": []}}
    assert oracle.effective("moment1.t", layouts)["split"] == [3, 5]
    other = {**layouts, "moment2.t": {**base, "dev": [1, 2], "split": [], "offset": []}}
    assert oracle.effective("moment2.t", other)["split"] == []  # another layout: not the table's


def test_cut_and_pieces() -> None:
    """An unlisted name is held whole; ``pieces`` counts the optimizer parts on dimension 0."""
    g = np.arange(48).reshape(12, 4)
    lay = {"dev": [2, 2], "map": [[-1], [1]], "tshape": None, "opt": 2, "split": [], "offset": []}
    assert oracle.cut(g, {"w": lay}, "other", 3) is g
    assert oracle.cut(g, {"w": lay}, "w", 1).tolist() == oracle.expected_shard(g, lay, 1).tolist()
    assert oracle.pieces(lay) == [2, 2]
    multi = {"dev": [2, 4, 2], "map": [[0, 1], [-1]], "tshape": None, "opt": -1, "split": [], "offset": []}
    assert oracle.pieces(multi) == [8 * 2, 1]  # the free axis of size 2 shards the optimizer state
