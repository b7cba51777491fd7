"""``zckpt plan --src``: per destination rank, the source files and bytes it reads, checked
against a count made with the independent oracle (tests/oracle.py) on global index arrays,
and against a case small enough to follow by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import oracle
import pytest

from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
ITEMSIZE = {"Float32": 4, "Int32": 4, "Float16": 2, "BFloat16": 2}


def _plan(src: Path, src_s: Path, dst_s: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert cli_main(["plan", "--src-strategy", str(src_s), "--dst-strategy", str(dst_s), "--src", str(src),
                     "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _global_shape(shard: tuple[int, ...], lay: oracle.Layout, rank: int) -> tuple[int, ...]:
    dev = lay["dev"]
    out = [n * math.prod(dev[len(dev) - 1 - a] for a in axes if a >= 0) for n, axes in zip(shard, lay["map"],
                                                                                            strict=True)]
    parts, _ = oracle._opt_part(lay, rank)
    if parts > 1:
        out[0] *= parts
    return tuple(out)


def _expected(src: Path, src_s: Path, dst_s: Path, n_src: int, n_dst: int) -> dict[int, dict[int, tuple[int, int]]]:
    """Per destination rank, per source rank: (bytes taken, bytes read). Each element is
    read from the lowest source rank holding it; a source row meeting the destination's
    elements is read whole."""
    src_l, dst_l = oracle.read_layouts(src_s), oracle.read_layouts(dst_s)
    files = {r: next((src / f"rank_{r}").glob("*.ckpt")) for r in range(n_src)}
    with CkptReader(files[0]) as r0:
        entries = {n: (e.kind, e.ms_type, e.shape) for n, e in r0.entries.items()}
    out: dict[int, dict[int, list[int]]] = {d: {} for d in range(n_dst)}
    for name, (kind, ms_type, shard) in entries.items():
        if kind != "tensor":
            continue
        size = ITEMSIZE[ms_type]
        shape = _global_shape(shard, src_l[name], 0) if name in src_l else shard
        index = np.arange(math.prod(shape)).reshape(shape)
        held = {r: (oracle.expected_shard(index, oracle.effective(name, src_l), r) if name in src_l else index)
                for r in range(n_src)}
        writer = np.full(index.size, -1)
        for r in reversed(range(n_src)):
            writer[held[r].reshape(-1)] = r
        for d in range(n_dst):
            want = (oracle.expected_shard(index, oracle.effective(name, dst_l), d) if name in dst_l else index)
            need = np.zeros(index.size, dtype=bool)
            need[want.reshape(-1)] = True
            for s in np.unique(writer[want.reshape(-1)]).tolist():
                mine = held[s].reshape(-1)
                taken = int(np.count_nonzero(need[mine] & (writer[mine] == s)))
                rows = held[s].reshape(held[s].shape[0], -1) if held[s].ndim else held[s].reshape(1, 1)
                meets = (need[rows] & (writer[rows] == s)).any(axis=1)
                got = out[d].setdefault(s, [0, 0])
                got[0] += taken * size
                got[1] += int(np.count_nonzero(meets)) * rows.shape[1] * size
    return {d: {s: (a, b) for s, (a, b) in per.items()} for d, per in out.items()}


@pytest.mark.parametrize("forward", [True, False])
def test_reads_match_the_oracle(forward: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """8 -> 4 (bundled example), and 4 -> 8 reading the 4-rank job back, where destination
    slices take half of the source rows (read amplification above 1)."""
    src_s, dst_s = EXAMPLE / "src" / "strategy.ckpt", EXAMPLE / "dst" / "strategy.ckpt"
    src, n_src, n_dst = EXAMPLE / "src" / "checkpoints", 8, 4
    if not forward:
        src_s, dst_s, src, n_src, n_dst = dst_s, src_s, EXAMPLE / "dst" / "expected", 4, 8
    doc = _plan(src, src_s, dst_s, capsys)
    want = _expected(src, src_s, dst_s, n_src, n_dst)
    got = {int(d): {s["rank"]: (s["bytes"], s["read"]) for s in v["sources"]} for d, v in doc["reads"].items()}
    assert got == want
    held = sum(v["held"] for v in doc["reads"].values())
    read = sum(b for per in want.values() for _, b in per.values())
    assert held == sum(a for per in want.values() for a, _ in per.values())
    assert doc["read_amplification"] == pytest.approx(read / held, abs=1e-6)
    assert (doc["read_amplification"] > 1.2) is not forward
    assert set(doc["ranks"]) == {str(d) for d in range(n_dst)}  # MindSpore's rank lists stay


def test_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    """``layer2.weight`` (48 x 48 Float32): rows in 8 pieces of 6 on the source, 4 pieces of
    12 on the destination, so destination rank d reads source ranks 2d and 2d+1, 6 rows of
    48 values = 1 152 bytes from each, and takes whole rows (no amplification)."""
    src_s, dst_s = EXAMPLE / "src" / "strategy.ckpt", EXAMPLE / "dst" / "strategy.ckpt"
    assert cli_main(["plan", "--src-strategy", str(src_s), "--dst-strategy", str(dst_s),
                     "--src", str(EXAMPLE / "src" / "checkpoints"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    from zckpt.jobs.reads import plan_reads
    from zckpt.jobs.transform import plan_transform
    from zckpt.plan.values import RankExport

    plan = plan_transform(EXAMPLE / "src" / "checkpoints", src_s, dst_s, verify_crc=False)
    for r in plan.export.ranks:
        only = RankExport(r.rank, tuple(s for s in r.slices if s.name == "layer2.weight"))
        got = plan_reads(plan.__class__(plan.source, plan.export.__class__((only,), 4), plan.src_strategy,
                                        plan.dst_strategy, plan.indexes), 1 << 20)
        assert {s.rank: (s.bytes, s.read) for s in got.ranks[r.rank]} == {2 * r.rank: (1152, 1152),
                                                                          2 * r.rank + 1: (1152, 1152)}
    assert doc["bytes_held"] == doc["bytes_read"] and doc["read_amplification"] == 1.0
    assert cli_main(["plan", "--src-strategy", str(src_s), "--dst-strategy", str(dst_s),
                     "--src", str(EXAMPLE / "src" / "checkpoints"), "--rank", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("destination rank 2: holds") and "read amplification 1.00" in text
    assert "source rank 4:" in text and "rank_4/checkpoint_4.ckpt" in text


def test_file_suffix_needs_src(capsys: pytest.CaptureFixture[str]) -> None:
    src_s = str(EXAMPLE / "src" / "strategy.ckpt")
    assert cli_main(["plan", "--src-strategy", src_s, "--file-suffix", "1_1"]) == 2
    assert "--src" in capsys.readouterr().err
