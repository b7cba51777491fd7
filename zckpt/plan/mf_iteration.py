"""What a MindFormers Checkpoint 2.0 iteration written for a destination job holds: its files and ``metadata.json``.

A MindFormers job resumes from ``iteration_XXXXXXXX/`` (:mod:`zckpt.formats.mindformers`
describes the layout) only when ``metadata.json`` describes every piece as MindFormers'
own save would, since its loader (``mindformers/checkpoint/checkpoint.py``
``load_checkpoint`` -> ``ReshardLoader``) finds each piece through that document alone.
This module turns an export plan (which box of each entry every destination rank holds)
and the destination strategy into that description, as pure data:

* the files: per rank a model file and an optimizer file (``[prefix-]model-RRRRRRR-NNNNNNN
  .safetensors``); which entries are optimizer state is decided by name
  (:func:`is_optimizer_state`: ``<state>.<parameter>`` of another entry, ``global_step``),
  as MindFormers' split between the network's and the optimizer's parameters gives them;
  ``common.json``'s numbers (:data:`COMMON_FIELDS`) are left out of the files but for
  ``global_step``, which MindSpore's optimizer holds;
* ``state_dict_metadata``: per listed parameter the layout MindSpore's
  ``get_strategy_metadata`` reports (``strategy.py`` ``_layout_process``: optimizer
  sharding folded into dimension 0's map, :func:`ms_layout_dict`), its pieces' grid
  (``axis_fragmentations``), ``replica_id`` and chunks (slice numbers in the order ranks
  first hold them), parameters in MindSpore's order (:func:`_position`); entries the
  strategy does not list are in the files only, as MindFormers leaves ``global_step``;
  with no strategy (one rank) every entry is recorded whole (``layout`` null), where
  MindFormers writes no ``metadata.json``: it loads either, and zckpt reads such a
  directory back only through it;
* ``storage_data``: which file holds each piece. Without redundancy removal every rank saves
  its own pieces; with it (``remove_redundancy``) each piece is saved once, by the rank
  MindFormers' ``distribute_shards`` picks (fewest holders first, then larger pieces, then
  the shard id; the least loaded holder), and files are numbered over the ranks that save
  something, per file kind, as ``save_balanced_metadata`` numbers them. An entry the
  strategy does not list is one more whole piece there, saved once too (MindFormers leaves
  it out: its ``global_step`` comes back from ``common.json``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError
from zckpt.core.layout import Box
from zckpt.formats.strategy import ParamLayout, StrategyMap
from zckpt.plan.values import RankExport, Slice, TensorSpec

COMMON_FIELDS = ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size", "consumed_samples",
                 "ckpt_status")
"""MindFormers' ``CommonInfo`` fields, in the order ``common.json`` lists them."""
OPTIMIZER_SCALARS = frozenset({"global_step", "learning_rate", "beta1_power", "beta2_power"})
KINDS = ("model", "opt")


def file_name(prefix: str, kind: str, index: int, total: int) -> str:
    """MindFormers' ``get_checkpoint_name`` plus the suffix: ``[prefix-]kind-IIIIIII-NNNNNNN.safetensors``."""
    stem = f"{kind}-{index:07d}-{total:07d}"
    return f"{prefix}-{stem}.safetensors" if prefix else f"{stem}.safetensors"


def is_optimizer_state(name: str, names: Mapping[str, object] | frozenset[str]) -> bool:
    """An optimizer's entry: ``<state>.<parameter>`` of another entry, or one of its scalars."""
    head, _, rest = name.partition(".")
    return name in OPTIMIZER_SCALARS or (bool(head) and rest in names)


def common_only(spec: TensorSpec) -> bool:
    """A ``common.json`` number, not saved in the files (``global_step`` is, by the optimizer)."""
    return spec.name in COMMON_FIELDS and spec.name != "global_step" and math.prod(spec.shape) <= 1


# --------------------------------------------------------------------------- MindSpore's layout


def ms_layout_dict(layout: ParamLayout, rank_list: Sequence[int]) -> dict[str, Any]:
    """``Layout.to_dict()`` of the layout MindSpore's ``get_strategy_metadata`` reports for
    ``layout`` (``StrategyLayout._layout_process``, ported: the optimizer shard's device axes
    join dimension 0's map, a partial optimizer shard may split a device axis in two)."""
    dev = list(layout.dev_matrix)
    tmap = [list(axes) if axes else [-1] for axes in layout.tensor_map]
    opt = layout.opt_shard_size
    if opt == 0:
        new_dev, new_map = dev, tmap
    else:
        new_dev, counter, new_map, full = _dev_mat_for_opt(opt, dev, tmap)
        used = _used(new_dev, new_map)
        n = len(new_dev)
        unused = [n - i - 1 for i, u in enumerate(used) if not u and (full or i > counter)]
        first = [a for a in new_map[0] + unused if a != -1] if new_map else []
        new_map = [first or [-1], *new_map[1:]]
    out: list[int | list[int]] = []
    for axes in new_map:
        if len(axes) == 1 or all(a == -1 for a in axes):
            out.append(axes[0] if len(axes) == 1 else -1)
        else:
            out.append(list(axes))
    alias = [chr(ord("a") + i) for i in range(len(new_dev))]
    return {"device_matrix": list(new_dev), "tensor_map": out, "interleaved_parallel": False, "alias_name": alias,
            "rank_list": list(rank_list)}


def _used(dev: Sequence[int], tmap: Sequence[Sequence[int]]) -> list[bool]:
    axes = {a for axes in tmap for a in axes if a != -1}
    return [(len(dev) - i - 1) in axes for i in range(len(dev))]


def _dev_mat_for_opt(opt: int, dev: list[int], tmap: list[list[int]]) -> tuple[list[int], int, list[list[int]], bool]:
    used_num = math.prod(dev[len(dev) - a - 1] for axes in tmap for a in axes if a != -1)
    total = math.prod(dev)
    if opt == -1 or used_num * opt == total:
        return dev, -1, tmap, True
    remain = total // (used_num * opt)
    used = _used(dev, tmap)
    counter, real = -1, 1
    for axis, value in enumerate(dev):
        if used[axis]:
            continue
        if real == remain:
            return dev, counter, tmap, False
        if real < remain:
            counter, real = axis, real * value
            continue
        break
    else:
        if real == remain:
            return dev, counter, tmap, False
    first = remain // (real // dev[counter])
    new_dev = dev[:counter] + [first, dev[counter] // first] + dev[counter + 1:]
    flag = len(new_dev) - 1 - counter
    return new_dev, counter, [[a if a < flag or a == -1 else a + 1 for a in axes] for axes in tmap], False


# --------------------------------------------------------------------------- the iteration


@dataclass(frozen=True)
class MfFile:
    """One file of the iteration: its name and what it holds (``rank``: the rank saving it)."""

    name: str
    kind: str
    rank: RankExport


@dataclass(frozen=True)
class IterationPlan:
    files: tuple[MfFile, ...]
    metadata: dict[str, Any]
    common: tuple[str, ...]
    """Entries that go to ``common.json``."""


@dataclass(frozen=True)
class _Piece:
    name: str
    slice_no: int
    box: Box
    holders: tuple[int, ...]


def _grid(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> tuple[tuple[int, ...], dict[Box, int]]:
    """The pieces' grid (``axis_fragmentations``) and each box's slice number (row-major)."""
    local = boxes[0].shape
    if any(b.shape != local for b in boxes) or any(s and (d % s) for d, s in zip(shape, local, strict=True)):
        raise OutputError("the destination pieces are not one even grid, which MindFormers' metadata.json cannot "
                          f"describe: pieces {sorted({b.shape for b in boxes})} of {list(shape)}", param=name)
    frags = tuple(d // s if s else 1 for d, s in zip(shape, local, strict=True))
    numbers: dict[Box, int] = {}
    for b in boxes:
        index = 0
        for start, s, f in zip(b.start, local, frags, strict=True):
            if s and start % s:
                raise OutputError(f"piece {b.to_json()} is off the grid of {list(local)} pieces", param=name)
            index = index * f + (start // s if s else 0)
        numbers[b] = index
    return frags, numbers


def plan_iteration(ranks: Sequence[RankExport], specs: Mapping[str, TensorSpec], strategy: StrategyMap | None,
                   prefix: str, *, remove_redundancy: bool = False,
                   is_optimizer: Callable[[str], bool] | None = None) -> IterationPlan:
    """The iteration's files and ``metadata.json`` for the destination ``ranks`` (every rank of the job)."""
    names = frozenset(specs)
    opt_of = is_optimizer or (lambda n: is_optimizer_state(n, names))
    for spec in specs.values():
        if spec.kind != "tensor" and not common_only(spec):
            raise OutputError(f"a {spec.kind} entry has no place in a MindFormers checkpoint (its files hold "
                              "tensors)", param=spec.name)
    common = tuple(n for n, spec in specs.items() if common_only(spec))
    device_num = max((r.rank for r in ranks), default=0) + 1
    held: dict[str, dict[int, Box]] = {}
    for r in ranks:
        for s in r.slices:
            if s.name not in common:
                held.setdefault(s.name, {})[r.rank] = s.box
    recorded = sorted((n for n in held if strategy is None or n in strategy.layouts),
                      key=lambda n: _position(n, names))
    state: dict[str, Any] = {}
    pieces: dict[int, list[_Piece]] = {r.rank: [] for r in ranks}
    for name in recorded:
        spec, by_rank = specs[name], held[name]
        frags, numbers = _grid(name, spec.shape, list(by_rank.values()))
        holders: dict[int, list[int]] = {}
        for rank, box in sorted(by_rank.items()):
            holders.setdefault(numbers[box], []).append(rank)
        layout_doc = None
        replica: list[int] | int = 0
        if strategy is not None:
            stages = strategy.layouts[name]
            stage_of = min(by_rank) // next(iter(stages.values())).device_num
            lay = stages.get(stage_of) or next(iter(stages.values()))
            first = stage_of * lay.device_num
            rank_list = list(range(first, first + lay.device_num))
            layout_doc = ms_layout_dict(lay, rank_list)
            seen: dict[int, int] = {}
            replica = []
            for rank in rank_list:
                k = numbers.get(by_rank[rank]) if rank in by_rank else None
                replica.append(seen.get(k, 0) if k is not None else 0)
                if k is not None:
                    seen[k] = seen.get(k, 0) + 1
        chunks: list[dict[str, Any]] = []
        done: set[int] = set()
        for rank, box in sorted(by_rank.items()):
            k = numbers[box]
            if k not in done:
                done.add(k)
                chunks.append({"global_offset": [k], "local_shape": list(box.shape)})
            pieces[rank].append(_Piece(name, k, box, tuple(holders[k])))
        state[name] = {
            "properties": {"dtype": spec.ms_type.lower(),
                           "replica_id": replica, "allow_shape_mismatch": False, "allow_to_save": True},
            "global_shape": list(spec.shape), "axis_fragmentations": list(frags), "layout": layout_doc,
            "chunk": chunks}
    unrecorded = {r.rank: [s for s in r.slices if s.name not in common and s.name not in state] for r in ranks}
    files, storage = (_balanced if remove_redundancy else _per_rank)(
        pieces, unrecorded, specs, opt_of, prefix, device_num)
    return IterationPlan(tuple(files), {"state_dict_metadata": state, "storage_data": storage}, common)


def _position(name: str, names: frozenset[str]) -> tuple[str, bool, str]:
    """Where MindSpore's strategy metadata lists ``name``: by parameter, the parameter before
    its optimizer states (``x``, ``adam_m.x``, ``adam_v.x``)."""
    head, _, rest = name.partition(".")
    base = rest if head and rest in names else name
    return base, base != name, name


def _shard_id(name: str, k: int) -> str:
    """MindFormers' ``get_sharded_tensor_shard_id``: ``str(('name', (k,)))``."""
    return str((name, (k,)))


def _per_rank(pieces: Mapping[int, list[_Piece]], unrecorded: Mapping[int, list[Slice]],
              specs: Mapping[str, TensorSpec], opt_of: Callable[[str], bool], prefix: str,
              device_num: int) -> tuple[list[MfFile], dict[str, list[dict[str, Any]]]]:
    """Every rank saves its own pieces into the files numbered by its rank."""
    files: list[MfFile] = []
    storage: dict[str, list[dict[str, Any]]] = {}
    for rank in sorted(pieces):
        for kind in KINDS:
            mine = [p for p in pieces[rank] if opt_of(p.name) == (kind == "opt")]
            extra = [s for s in unrecorded.get(rank, ()) if opt_of(s.name) == (kind == "opt")]
            if not mine and not extra:
                continue
            fname = file_name(prefix, kind, rank, device_num)
            files.append(MfFile(fname, kind, RankExport(rank, tuple(Slice(p.name, p.box) for p in mine) +
                                                        tuple(extra))))
        for p in pieces[rank]:
            fname = file_name(prefix, "opt" if opt_of(p.name) else "model", rank, device_num)
            storage.setdefault(_shard_id(p.name, p.slice_no), []).append(
                {"file_name": fname, "storage_rank": rank, "rank_group": list(p.holders)})
    return files, storage


def _balanced(pieces: Mapping[int, list[_Piece]], unrecorded: Mapping[int, list[Slice]],
              specs: Mapping[str, TensorSpec], opt_of: Callable[[str], bool], prefix: str,
              device_num: int) -> tuple[list[MfFile], dict[str, list[dict[str, Any]]]]:
    """Each piece saved once (``fully_parallel.py`` ``distribute_shards``), per file kind; an
    entry no metadata records is one whole piece among the others, so that it is saved too."""
    files: list[MfFile] = []
    storage: dict[str, list[dict[str, Any]]] = {}
    for kind in KINDS:
        coverage: dict[str, list[int]] = {}
        size: dict[str, int] = {}
        what: dict[str, tuple[str, Box, bool]] = {}
        for rank in sorted(pieces):
            held = [(p.name, p.slice_no, p.box, True) for p in pieces[rank]]
            held += [(x.name, 0, x.box, False) for x in unrecorded.get(rank, ())]
            for name, k, box, recorded in held:
                if opt_of(name) == (kind == "opt"):
                    sid = _shard_id(name, k)
                    coverage.setdefault(sid, []).append(rank)
                    size[sid] = box.size * ms_dtype(specs[name].ms_type).storage.itemsize
                    what[sid] = (name, box, recorded)
        loads = dict.fromkeys(range(device_num), 0)
        assigned: dict[int, dict[str, list[int]]] = {}
        for sid, group in sorted(((k, sorted(v)) for k, v in coverage.items()),
                                 key=lambda item: (len(item[1]), -size[item[0]], item[0])):
            chosen = min(group, key=lambda r: loads[r])
            assigned.setdefault(chosen, {})[sid] = group
            loads[chosen] += size[sid]
        total = len(assigned)
        for index, rank in enumerate(sorted(assigned)):
            fname = file_name(prefix, kind, index, total)
            slices = []
            for sid, group in assigned[rank].items():
                name, box, recorded = what[sid]
                slices.append(Slice(name, box))
                if recorded:
                    storage.setdefault(sid, []).append({"file_name": fname, "storage_rank": rank,
                                                        "rank_group": group})
            files.append(MfFile(fname, kind, RankExport(rank, tuple(slices))))
    return files, storage
