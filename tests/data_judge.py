"""Judging the *data* zckpt reads through damaged strategies, with readers it does not share.

A fuzzer that only asks "did it crash?" passes a strategy that zckpt accepts and then
reads wrongly. Here every outcome is judged: either a zckpt error, or files whose every
tensor equals what an independent reader says they must hold:

* the shards and the output files are decoded with the protobuf classes alone
  (:func:`read_ckpt`: no :mod:`zckpt.formats.ckpt`);
* the layouts are read from the strategy file's raw fields and applied by
  :mod:`oracle` (no :mod:`zckpt.core.layout`, no :mod:`zckpt.formats.strategy`).

Source side (:func:`judge_source`): the job is converted with a mutated source strategy to
one unsharded file; every source rank's shard must then be the oracle's slice, under the
mutated layout, of the global tensor zckpt produced (an unlisted entry: the whole tensor on
every rank). Destination side (:func:`judge_destination`): the job is converted with its
own source strategy to a mutated destination strategy; each rank file must hold, for every
parameter, the oracle's slice of the true global tensor, and every parameter listed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import oracle

from zckpt.core.errors import ZckptError
from zckpt.third_party.mindspore_proto import ms_checkpoint_pb2 as ckpt_pb
from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

DTYPES = {"Float32": np.float32, "Float16": np.float16, "Int32": np.int32, "Int64": np.int64, "Float64": np.float64}

DEVICES = 4
TENSORS: dict[str, tuple[tuple[int, ...], list[int], list[list[int]], int]] = {
    # name: (global shape, dev_matrix, tensor_map (one list of axes per dim), opt_weight_shard_size)
    "w": ((8, 12), [2, 2], [[1], [0]], 0),
    "c": ((8, 12), [2, 2], [[], [0]], 0),
    "b": ((12,), [2, 2], [[1]], 0),
    "o": ((8, 4), [2, 2], [[], []], 2),
    "moments.w": ((8, 12), [2, 2], [[1], [0]], 0),
}
"""The job the judges convert: tensor-parallel splits, a replicated axis, optimizer parallel."""


def global_of(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Every element distinct, so that a misplaced block shows."""
    seed = sum(name.encode()) * 1000
    values = np.arange(int(np.prod(shape)), dtype=np.float32) + np.float32(seed)  # numpy 1 would give float64
    return values.reshape(shape)


def _layout(dev: list[int], tmap: list[list[int]], opt: int) -> oracle.Layout:
    return {"dev": dev, "map": tmap, "tshape": None, "opt": opt, "split": [], "offset": []}


def _encode_ckpt(values: dict[str, np.ndarray]) -> bytes:
    msg = ckpt_pb.Checkpoint()
    for name, arr in values.items():
        v = msg.value.add()
        v.tag = name
        v.tensor.dims.extend(arr.shape)
        v.tensor.tensor_type = "Float32" if arr.dtype == np.float32 else "Int32"
        v.tensor.tensor_content = np.ascontiguousarray(arr).tobytes()
    return msg.SerializeToString()


def strategy_bytes() -> bytes:
    """The job's strategy file, built from protobuf messages directly."""
    msg = pb.ParallelStrategyMap()
    msg.current_stage = 0
    for name, (_, dev, tmap, opt) in TENSORS.items():
        item = msg.parallel_layout_item.add()
        item.param_name = name
        lay = item.parallel_layouts
        lay.dev_matrix.add().dim.extend(dev)
        lay.tensor_map.add().dim.extend(axes[0] if axes else -1 for axes in tmap)
        lay.field = 0
        lay.opt_weight_shard_step = 1 if opt else 0
        lay.opt_weight_shard_size = opt
    return msg.SerializeToString()


def write_job(root: Path) -> Path:
    """``root/rank_<r>/checkpoint_<r>.ckpt`` cut by the oracle, and ``root/strategy.ckpt``."""
    for r in range(DEVICES):
        values = {n: oracle.expected_shard(global_of(n, s), _layout(d, m, o), r) for n, (s, d, m, o) in TENSORS.items()}
        values["learning_rate"] = np.array(0.5, dtype=np.float32)
        path = root / f"rank_{r}" / f"checkpoint_{r}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_encode_ckpt(values))
    (root / "strategy.ckpt").write_bytes(strategy_bytes())
    return root


def read_ckpt(path: Path) -> dict[str, np.ndarray]:
    """A ``.ckpt`` decoded by protobuf alone (continuation values appended; MindSpore's
    ``crc_num`` trailer, 7 bytes and a 10-byte CRC, left out)."""
    data = path.read_bytes()
    if len(data) >= 17 and data[-17:-10] == b"crc_num":
        data = data[:-17]
    msg = ckpt_pb.Checkpoint.FromString(data)
    parts: dict[str, list[bytes]] = {}
    meta: dict[str, tuple[list[int], str]] = {}
    for v in msg.value:
        parts.setdefault(v.tag, []).append(v.tensor.tensor_content)
        meta.setdefault(v.tag, (list(v.tensor.dims), v.tensor.tensor_type))
    out = {}
    for tag, chunks in parts.items():
        dims, ms_type = meta[tag]
        out[tag] = np.frombuffer(b"".join(chunks), dtype=DTYPES[ms_type]).reshape(dims)
    return out


_PREFIX = re.compile(r"^([0-9]+)-(.+)$", re.DOTALL)


def oracle_layouts(path: Path) -> dict[str, oracle.Layout] | None:
    """The oracle's reading of a strategy file; ``None`` when it cannot judge one (a
    pipeline stage other than 0, or fields it does not model)."""
    try:
        raw = oracle.read_layouts(path)
    except Exception:  # noqa: BLE001 - the oracle is strict, not defensive: an input it cannot read is unjudged
        return None
    if raw and all(_PREFIX.match(n) for n in raw):  # merge_pipeline_strategys names: "<stage>-<name>"
        stages = {int(_PREFIX.match(n).group(1)) for n in raw}  # type: ignore[union-attr]
        if stages != {0}:
            return None
        raw = {_PREFIX.match(n).group(2): lay for n, lay in raw.items()}  # type: ignore[union-attr]
    return raw


@dataclass(frozen=True)
class Verdict:
    outcome: str
    """``"refused"``, ``"same"`` (accepted, data equal to the oracle's), ``"unjudged"`` or ``"WRONG"``."""
    detail: str = ""


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shapes and bytes (a NaN payload is a value like any other)."""
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _slice(g: np.ndarray, lay: oracle.Layout | None, rank: int) -> np.ndarray:
    if lay is None:
        return g
    return oracle.expected_shard(g, lay, rank)


def _attempt(run: Callable[[], object]) -> Verdict | None:
    try:
        run()
    except ZckptError as err:
        return Verdict("refused", str(err))
    return None


def candidates(name: str, layouts: dict[str, oracle.Layout]) -> list[oracle.Layout | None]:
    """The readings of ``name`` a shard's shape may prove, in zckpt's documented order
    (docs/layout-kinds.md): an optimizer state the strategy does not list takes its
    parameter's layout, with or without the optimizer split, else it is whole; a listed
    state whose shards are not optimizer-split (MindSpore's accu_grads) is read without it."""
    owner = next((name[len(p):] for p in oracle.STATE_PREFIXES if name.startswith(p) and name[len(p):] in layouts),
                 None)
    if name in layouts:
        own = oracle.effective(name, layouts)
        return [own, {**own, "opt": 0}] if owner is not None else [own]
    if owner is not None:
        lay = oracle.effective(owner, layouts)
        return [lay, {**lay, "opt": 0}, None]
    return [None]


def _held_as(whole: np.ndarray, shards: dict[int, np.ndarray], cands: list[oracle.Layout | None]) -> str | None:
    """``None`` when the shards are the oracle's slices of ``whole`` under the first reading
    whose shapes fit every rank, else what differs."""
    for lay in cands:
        try:
            want = {r: _slice(whole, lay, r) for r in shards}
        except Exception:  # noqa: BLE001 - a reading the oracle cannot apply does not fit
            continue
        if all(want[r].shape == held.shape for r, held in shards.items()):
            bad = [r for r, held in shards.items() if not same_bytes(want[r], held)]
            return f"ranks {bad} hold other values than the output read with the strategy" if bad else None
    return f"no reading of the strategy gives the shard shapes {[h.shape for h in shards.values()]}"


def judge_source(job: Path, strategy: Path, out: Path, *, verify_replicas: bool = False) -> Verdict:
    """Convert ``job`` read with ``strategy`` to one unsharded rank and judge the tensors
    (every rank's shard, replicas included: a damaged replica that the conversion does not
    read is only refused with ``verify_replicas``)."""
    from zckpt.jobs.transform import TransformOptions, transform

    options = TransformOptions(overwrite=True, fsync=False, verify_replicas=verify_replicas)
    refused = _attempt(lambda: transform(job, out, strategy, None, options=options))
    if refused is not None:
        return refused
    layouts = oracle_layouts(strategy)
    if layouts is None:
        return Verdict("unjudged", "the oracle cannot read this strategy")
    whole = read_ckpt(out / "rank_0" / "checkpoint_0.ckpt")
    shards: dict[str, dict[int, np.ndarray]] = {}
    for r in range(DEVICES):
        try:
            held_by_rank = read_ckpt(job / f"rank_{r}" / f"checkpoint_{r}.ckpt")
        except Exception as err:  # noqa: BLE001 - protobuf cannot decode what zckpt accepted: no independent reading
            return Verdict("unjudged", f"protobuf cannot decode rank {r}'s shard: {err!r}")
        for name, held in held_by_rank.items():
            shards.setdefault(name, {})[r] = held
    for name, held in shards.items():
        if name not in whole:
            return Verdict("WRONG", f"{name} is missing from the output")
        problem = _held_as(whole[name], held, candidates(name, layouts))
        if problem is not None:
            return Verdict("WRONG", f"{name}: {problem}")
    return Verdict("same")


def destination_reading(name: str, layouts: dict[str, oracle.Layout],
                        shapes: dict[str, np.ndarray]) -> oracle.Layout | None:
    """How a destination holds ``name`` (docs/layout-kinds.md): its listed layout
    (``accu_grads.*`` without the optimizer split), or, unlisted, its parameter's layout when
    it has the parameter's shape, else whole."""
    if name in layouts:
        lay = oracle.effective(name, layouts)
        return {**lay, "opt": 0} if name.startswith("accu_grads.") else lay
    owner = next((name[len(p):] for p in oracle.STATE_PREFIXES if name.startswith(p) and name[len(p):] in layouts),
                 None)
    if owner is not None and shapes[owner].shape == shapes[name].shape:
        return oracle.effective(owner, layouts)
    return None


def judge_destination(job: Path, strategy: Path, out: Path) -> Verdict:
    """Convert ``job`` (its own strategy) to the destination ``strategy`` and judge every rank file."""
    from zckpt.jobs.transform import TransformOptions, transform

    refused = _attempt(lambda: transform(job, out, job / "strategy.ckpt", strategy,
                                         options=TransformOptions(overwrite=True, fsync=False)))
    if refused is not None:
        return refused
    layouts = oracle_layouts(strategy)
    if layouts is None:
        return Verdict("unjudged", "the oracle cannot read this strategy")
    files = sorted(out.glob("rank_*/*.ckpt"))
    truth = {n: global_of(n, s) for n, (s, _, _, _) in TENSORS.items()}
    for f in files:
        rank = int(f.parent.name.split("_")[1])
        got = read_ckpt(f)
        for name in layouts:
            if name in truth and name not in got:
                return Verdict("WRONG", f"{f.name} lacks {name}, which the destination strategy lists")
        for name, held in got.items():
            if name not in truth:
                continue
            lay = destination_reading(name, layouts, truth)
            try:
                want = _slice(truth[name], lay, rank)
            except Exception as err:  # noqa: BLE001
                return Verdict("unjudged", f"oracle: {name}: {err!r}")
            if not same_bytes(want, held):
                return Verdict("WRONG", f"rank {rank}: {name} is {held.shape}, the oracle's slice is {want.shape}")
    return Verdict("same")


def judge_shard(job: Path, rank: int, data: bytes, scratch: Path) -> Verdict:
    """Replace ``rank``'s shard by ``data`` in a copy of ``job`` and judge the conversion
    read with the job's own strategy, every replica compared (a damaged replica is not
    read by default), a shard that protobuf cannot decode unjudged."""
    import shutil

    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(job, scratch)
    (scratch / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").write_bytes(data)
    return judge_source(scratch, scratch / "strategy.ckpt", scratch.parent / (scratch.name + "-out"),
                        verify_replicas=True)
