"""MindFormers' per-iteration checkpoint layout ("Checkpoint 2.0", ``use_legacy_format: False``).

MindSpore Transformers (2.1) saves each checkpoint as one directory per iteration
(``mindformers/checkpoint/checkpoint.py`` ``save_checkpoint``, ``metadata.py``, ``utils.py``)::

    checkpoint/
        latest_checkpointed_iteration.txt       the iteration to resume from
        iteration_00000010/                     (older releases: iter_00000010/)
            common.json                         CommonInfo: epoch_num, step_num, global_step, loss_scale, ...
            metadata.json                       every parameter's layout and chunks, and which file holds each
            [prefix-]model-0000000-0000008.safetensors   rank 0's model weights (file index, file count: 7 digits)
            [prefix-]opt-0000000-0000008.safetensors     rank 0's optimizer states
            ...

``metadata.json`` is ``{"state_dict_metadata": {name: {"properties": {"dtype", "replica_id", ...},
"global_shape", "axis_fragmentations", "layout", "chunk": [{"global_offset", "local_shape"}]}},
"storage_data": {"('name', (k,))": [{"file_name", "storage_rank", "rank_group"}]}}``:

* ``layout`` is MindSpore's ``Layout.to_dict()`` of the layout ``get_strategy_metadata``
  reports (``device_matrix``, ``tensor_map`` in MindSpore's axis numbering, several axes on
  one dimension as a list, ``interleaved_parallel``, ``alias_name``, ``rank_list``), or
  ``null`` for a tensor held whole. Optimizer parallel is in it: MindSpore folds the device
  axes a parameter's optimizer shard uses into dimension 0's map (``strategy.py``
  ``_layout_process``), so an optimizer-sharded parameter reads as a multi-axis layout.
* a chunk's ``global_offset`` is not a per-dimension offset but the one-element *slice
  number* of the piece (its coordinates in the ``axis_fragmentations`` grid, row-major), and
  ``local_shape`` the piece's shape (``sharded_tensor.py``
  ``get_sharded_tensor_from_strategy_metadata``);
* ``storage_data`` names the file and the rank (``storage_rank``) that saved each piece.
  Without redundancy removal every rank saves its own pieces into the files numbered by its
  rank; with it (``fully_parallel.py`` ``save_balanced_metadata``) the files are numbered
  by the ranks that received something, so the number in a name need not be the rank.

zckpt reads such a directory as a sharded source: rank ``r`` is the files ``storage_data``
gives to ``r`` (else the files numbered ``r``; files linked from outside the iteration
directory, or names that are not its rank files, are refused), read together by
:class:`MindFormersRankReader`, and the strategy is the metadata's layouts
(:func:`metadata_strategy`), checked against the chunks it records (slice numbers and shapes
the layout cannot produce, a slice listed twice or not at all, or interleaved parallel, are
refused, naming the parameter) and against ``storage_data`` (each record's slice must be the
one the layout gives its ``storage_rank``: zckpt takes a rank's pieces where the layout puts
them). Every file's header must hold the pieces ``metadata.json`` records for it, of its
shapes and dtype. A single card's save (no ``metadata.json``, files ``0000000-0000001``) is
one rank holding its tensors whole. ``common.json``'s numbers become entries of
every rank as MindSpore's own checkpoints hold them (MindFormers' legacy ``CheckpointMonitor``
saves them through ``append_dict``, i.e. ``Tensor(value)``): ``global_step`` an ``Int32``
``(1,)`` (the optimizer's counter), other integers ``Int64`` scalars, floats ``Float32``
scalars (``loss_scale``), ``null`` and non-numbers left out; a rank file that holds the same
name already must hold the same value.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.dtypes import ms_name_for_numpy
from zckpt.core.errors import CheckpointFormatError, LayoutError, SourceError, StrategyError
from zckpt.core.layout import piece_index, resolve
from zckpt.formats.safetensors import MS_METADATA, SafetensorsReader, TensorHeader, header_bytes
from zckpt.formats.shard_reader import SafetensorsSetReader
from zckpt.formats.strategy import ParamLayout, StrategyMap, make_layout

METADATA = "metadata.json"
COMMON = "common.json"
TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter(?:ation)?_(\d+)$")
RANK_FILE = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<rank>\d{7})-(?P<total>\d{7})\.safetensors$")


def find_iteration(root: Path) -> Path | None:
    """The iteration directory ``root`` stands for: ``root`` itself when it holds
    ``metadata.json`` and rank files, else the tracker's iteration, else the highest one."""
    if (root / METADATA).is_file() and any(RANK_FILE.match(p.name) for p in root.iterdir()):
        return root
    if ITER_DIR.match(root.name) and is_single_card(root):
        return root
    iters = iteration_dirs(root)
    if not iters:
        return None
    named = tracked_iteration(root)
    chosen = iters[max(iters) if named is None else named]
    if not (chosen / METADATA).is_file() and not is_single_card(chosen):
        raise CheckpointFormatError(f"iteration directory has no {METADATA} (only a single card's save, files "
                                    "numbered 0000000-0000001, may go without)", path=chosen)
    return chosen


def is_single_card(iteration: Path) -> bool:
    """A one-rank save: no ``metadata.json`` (MindFormers writes none for one card), and rank
    files all numbered ``0000000-0000001``, holding their tensors whole."""
    if (iteration / METADATA).exists():
        return False
    numbers = {(m.group("rank"), m.group("total")) for p in iteration.iterdir() if (m := RANK_FILE.match(p.name))}
    return numbers == {("0000000", "0000001")}


def iteration_dirs(root: Path) -> dict[int, Path]:
    """Iteration number -> its ``iteration_<n>/`` (or ``iter_<n>/``) directory under ``root``."""
    return {int(m.group(1)): p for p in sorted(root.iterdir()) if (m := ITER_DIR.match(p.name)) and p.is_dir()}


def tracked_iteration(root: Path) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names (``None`` without the file);
    refused when it is not a number or names no iteration directory of ``root``."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    try:
        text = tracker.read_bytes()[:4096].decode("utf-8", "replace").strip()
    except OSError as err:
        raise CheckpointFormatError(f"cannot read: {err}", path=tracker) from None
    if not text.isdigit() or int(text) not in iteration_dirs(root):
        raise CheckpointFormatError(f"names iteration {text[:40]!r}, which has no directory here", path=tracker)
    return int(text)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def read_metadata(iteration: Path) -> dict[str, Any]:
    """``metadata.json`` parsed and checked for its two tables (parsed once per version of the
    file: every rank's reader needs ``storage_data``)."""
    where = iteration / METADATA
    try:
        return _parse_metadata(str(where), _stamp(where))
    except OSError as err:
        raise CheckpointFormatError(f"cannot read: {err}", path=where) from None


@functools.lru_cache(maxsize=4)
def _parse_metadata(where: str, stamp: tuple[int, int]) -> dict[str, Any]:
    try:
        doc = json.loads(Path(where).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"not MindFormers checkpoint metadata: {err}", path=where) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("state_dict_metadata"), dict):
        raise CheckpointFormatError("not MindFormers checkpoint metadata: no state_dict_metadata table", path=where)
    storage = doc.get("storage_data", {})
    if not isinstance(storage, dict) or not all(isinstance(v, list) for v in storage.values()):
        raise CheckpointFormatError("storage_data is not a table of shard -> list of files", path=where)
    return doc


def storage_param(key: str) -> str:
    """The parameter of a ``storage_data`` key ``"('name', (k,))"`` (``str`` of a tuple)."""
    try:
        name = ast.literal_eval(key)[0]
    except (ValueError, SyntaxError, TypeError, IndexError, MemoryError, RecursionError):
        return key
    return name if isinstance(name, str) else key


def rank_file_sets(iteration: Path) -> dict[int, tuple[Path, ...]]:
    """Rank -> the files it saved (model file first): as ``storage_data`` records them, else
    by the rank number in the file name."""
    meta = iteration / METADATA
    return _rank_file_sets(str(iteration), _stamp(iteration), _stamp(meta) if meta.is_file() else (0, 0))


@functools.lru_cache(maxsize=4)
def _rank_file_sets(where: str, _dir: tuple[int, int], _meta: tuple[int, int]) -> dict[int, tuple[Path, ...]]:
    iteration = Path(where)
    files = {p.name: m for p in iteration.iterdir() if (m := RANK_FILE.match(p.name)) and p.is_file()}
    inside = iteration.resolve()
    for name in files:
        if (iteration / name).is_symlink() and (iteration / name).resolve().parent != inside:
            raise CheckpointFormatError(f"is a symbolic link to {os.readlink(iteration / name)!r}, out of its "
                                        "iteration directory: the files metadata.json names must be in it",
                                        path=iteration / name)
    owner: dict[str, int] = {}
    if (iteration / METADATA).is_file():
        for key, records in read_metadata(iteration).get("storage_data", {}).items():
            for rec in records:
                try:
                    fname, rank = str(rec["file_name"]), int(rec["storage_rank"])
                except (KeyError, TypeError, ValueError):
                    raise CheckpointFormatError(f"storage_data record {rec!r} has no file_name and storage_rank",
                                                path=iteration / METADATA, param=storage_param(key)) from None
                if fname not in files:
                    raise CheckpointFormatError(f"storage_data names {fname!r}, which is not a rank file of this "
                                                "iteration", path=iteration / METADATA, param=storage_param(key))
                if owner.setdefault(fname, rank) != rank:
                    raise CheckpointFormatError(f"storage_data gives {fname} to ranks {owner[fname]} and {rank}",
                                                path=iteration / METADATA, param=storage_param(key))
    per_rank: dict[int, dict[str, Path]] = {}
    totals: dict[str, set[int]] = {}
    for name, m in sorted(files.items()):
        kind = m.group("kind")
        kinds = per_rank.setdefault(owner.get(name, int(m.group("rank"))), {})
        if kind in kinds:
            raise CheckpointFormatError(f"two {kind} files belong to one rank ({kinds[kind].name}, {name}); "
                                        "keep one prefix", path=iteration)
        kinds[kind] = iteration / name
        totals.setdefault(kind, set()).add(int(m.group("total")))
    for kind, seen in totals.items():
        if len(seen) > 1:
            raise CheckpointFormatError(f"{kind} files disagree on the file count: {sorted(seen)}", path=iteration)
    return {r: tuple(kinds[k] for k in ("model", "opt") if k in kinds) for r, kinds in sorted(per_rank.items())}


def rank_files(iteration: Path) -> dict[int, Path]:
    """Rank -> the file standing for it (its model file, else its optimizer file)."""
    return {r: paths[0] for r, paths in rank_file_sets(iteration).items()}


def is_rank_file(path: Path) -> bool:
    """A MindFormers rank file in an iteration directory (``metadata.json`` beside it, or a
    single card's save)."""
    return RANK_FILE.match(path.name) is not None and ((path.parent / METADATA).is_file() or (
        ITER_DIR.match(path.parent.name) is not None and is_single_card(path.parent)))


def common_entries(iteration: Path) -> dict[str, np.ndarray]:
    """``common.json``'s numbers as the entries MindSpore's checkpoints hold for them."""
    where = iteration / COMMON
    if not where.is_file():
        return {}
    try:
        doc = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointFormatError(f"cannot read MindFormers' common info: {err}", path=where) from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError("is not a JSON object (MindFormers' CommonInfo)", path=where)
    out: dict[str, np.ndarray] = {}
    for key, value in doc.items():
        if isinstance(value, bool):
            out[key] = np.array(value, np.bool_)
        elif isinstance(value, int):
            dtype = np.int32 if key == "global_step" else np.int64
            if not np.iinfo(dtype).min <= value <= np.iinfo(dtype).max:
                raise CheckpointFormatError(f"{value} does not fit {np.dtype(dtype).name}", path=where, param=key)
            out[key] = np.array([value] if key == "global_step" else value, dtype)
        elif isinstance(value, float):
            out[key] = np.array(value, np.float32)
    return out


class CommonInfoReader(SafetensorsReader):
    """``common.json``'s entries served as a small in-memory safetensors file (so that they go
    through the same reader interface as the rank files)."""

    def __init__(self, path: str | os.PathLike[str], entries: Mapping[str, np.ndarray]) -> None:
        heads = [TensorHeader(n, ms_name_for_numpy(a.dtype), tuple(a.shape)) for n, a in entries.items()]
        head, order = header_bytes(heads, MS_METADATA)
        self._image = head + b"".join(np.ascontiguousarray(entries[t.name]).tobytes() for t in order)
        super().__init__(path, verify_crc=False)

    def _map_file(self, path: str | os.PathLike[str]) -> int:
        self.path = Path(path)
        self._file = io.BytesIO()
        self._map = None
        self._buf = memoryview(self._image)
        return len(self._image)


class MindFormersRankReader(SafetensorsSetReader):
    """One rank of a MindFormers iteration: its model and optimizer files, and ``common.json``."""

    def _files(self) -> tuple[Path, ...]:
        for paths in rank_file_sets(self.path.parent).values():
            if self.path in paths:
                return paths
        raise CheckpointFormatError("is not a rank file of its iteration directory", path=self.path)

    def _read_index(self) -> dict[str, str]:
        out: dict[str, str] = {}
        held: dict[str, np.ndarray] = {}
        common = common_entries(self.path.parent)
        meta = self.path.parent / METADATA
        stamp = _stamp(meta) if meta.is_file() else (0, 0)
        pieces, stored = _pieces_held(str(self.path.parent), stamp), _stored_in(str(self.path.parent), stamp)
        for p in self._files():
            with SafetensorsReader(p, verify_crc=False) as r:
                if missing := sorted(stored.get(p.name, set()) - set(r.entries)):
                    raise CheckpointFormatError(f"{METADATA}'s storage_data puts a piece of it in this file, which "
                                                "does not hold it", path=p, param=missing[0])
                for n, e in r.entries.items():
                    if e.kind != "tensor":
                        continue
                    if n in out:
                        raise CheckpointFormatError(f"is in {out[n]} and in {p.name}", path=self.path, param=n)
                    out[n] = p.name
                    if n in pieces:
                        pieces[n].check(p, e.ms_type, e.shape)
                    if n in common:
                        held[n] = r.array(n).copy()
        self._common = {n: v for n, v in common.items() if n not in held}
        for n, value in common.items():
            if n not in held:
                out[n] = COMMON
            elif held[n].shape != value.shape or not np.array_equal(held[n], value):
                raise CheckpointFormatError(f"{out[n]} holds {held[n].tolist()} but {COMMON} says {value.tolist()}",
                                            path=self.path.parent, param=n)
        return out

    def _open_part(self, fname: str, verify_crc: bool) -> SafetensorsReader:
        if fname == COMMON:
            return CommonInfoReader(self.path.parent / COMMON, self._common)
        return super()._open_part(fname, verify_crc)


@dataclass(frozen=True)
class _Piece:
    """What ``metadata.json`` says every file's piece of one parameter is: its data type, and
    its shape (each chunk's ``local_shape``, and the layout's cut of ``global_shape``)."""

    name: str
    dtype: str | None
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """``(what says it, shape)``: every shape a piece must have."""

    def check(self, file: Path, ms_type: str, shape: tuple[int, ...]) -> None:
        if self.dtype is not None and ms_type.lower() != self.dtype.lower():
            raise SourceError(f"holds a {ms_type} piece but {METADATA} gives the parameter dtype {self.dtype}",
                              path=file, param=self.name)
        for what, want in self.shapes:
            if tuple(shape) != want:
                raise SourceError(f"holds a piece of shape {list(shape)} but {what} is {list(want)} (the pieces "
                                  f"the files hold must be those {METADATA} records)", path=file, param=self.name)


@functools.lru_cache(maxsize=4)
def _stored_in(where: str, _meta: tuple[int, int]) -> dict[str, set[str]]:
    """File name -> the parameters ``storage_data`` says it holds a piece of."""
    iteration = Path(where)
    if not (iteration / METADATA).is_file():
        return {}
    out: dict[str, set[str]] = {}
    for key, records in read_metadata(iteration).get("storage_data", {}).items():
        for rec in records:
            if isinstance(rec, dict) and isinstance(rec.get("file_name"), str):
                out.setdefault(rec["file_name"], set()).add(storage_param(key))
    return out


@functools.lru_cache(maxsize=4)
def _pieces_held(where: str, _meta: tuple[int, int]) -> dict[str, _Piece]:
    """Every parameter of an iteration's ``metadata.json`` as :class:`_Piece` (none without
    the file). A record malformed enough that no shape follows from it is left to
    :func:`metadata_strategy`, which refuses it naming what is wrong."""
    iteration = Path(where)
    if not (iteration / METADATA).is_file():
        return {}
    out: dict[str, _Piece] = {}
    for name, meta in read_metadata(iteration)["state_dict_metadata"].items():
        if not isinstance(meta, dict):
            continue
        shapes: list[tuple[str, tuple[int, ...]]] = []
        chunks = meta.get("chunk")
        try:
            local = {tuple(int(x) for x in c["local_shape"]) for c in chunks} if isinstance(chunks, list) else set()
        except (KeyError, TypeError, ValueError):
            local = set()
        if len(local) == 1:
            shapes.append(("its chunks' local_shape", next(iter(local))))
        try:
            shape = tuple(int(d) for d in meta["global_shape"])
            pieces = _pieces(_layout(name, meta["layout"], iteration / METADATA)[1]) if meta.get("layout") else None
        except (KeyError, TypeError, ValueError, StrategyError):
            pass
        else:
            if pieces is None:
                shapes.append(("global_shape (held whole: no layout)", shape))
            elif len(pieces) == len(shape):
                shapes.append((f"the layout's cut of global_shape {list(shape)} into {list(pieces)}",
                               tuple(s // n for s, n in zip(shape, pieces, strict=True))))
        props = meta.get("properties")
        dtype = props.get("dtype") if isinstance(props, dict) else None
        out[name] = _Piece(name, dtype if isinstance(dtype, str) else None, tuple(shapes))
    return out


def _layout(name: str, lay: Any, where: Path) -> tuple[int, ParamLayout]:
    if not isinstance(lay, dict) or "device_matrix" not in lay or "tensor_map" not in lay:
        raise StrategyError("metadata gives no layout (device_matrix, tensor_map)", path=where, param=name)
    if lay.get("interleaved_parallel"):
        raise StrategyError("interleaved_parallel layouts are not supported", path=where, param=name)
    layout = make_layout(lay["device_matrix"], lay["tensor_map"], path=where, param=name)
    ranks = lay.get("rank_list") or list(range(layout.device_num))
    if len(ranks) != layout.device_num or sorted(ranks) != list(range(min(ranks), min(ranks) + len(ranks))):
        raise StrategyError(f"rank_list {ranks} is not one pipeline stage of {layout.device_num} consecutive ranks",
                            path=where, param=name)
    if min(ranks) % layout.device_num:
        raise StrategyError(f"rank_list {ranks} does not start a pipeline stage", path=where, param=name)
    return min(ranks) // layout.device_num, layout


def _pieces(layout: ParamLayout) -> tuple[int, ...]:
    """Pieces per tensor dimension (MindSpore's ``_DistributedTensorInfo.sharding_strategy``)."""
    dev = layout.dev_matrix
    return tuple(math.prod(dev[len(dev) - 1 - a] for a in axes) for axes in layout.tensor_map)


def _check_chunks(name: str, meta: dict[str, Any], shape: tuple[int, ...], pieces: tuple[int, ...],
                  where: Path) -> None:
    """Each chunk must be a piece of the layout: slice number in range, the piece's shape."""
    local = tuple(s // p for s, p in zip(shape, pieces, strict=True))
    frags = meta.get("axis_fragmentations")
    if frags is not None and tuple(int(f) for f in frags) != pieces:
        raise StrategyError(f"axis_fragmentations {list(frags)} are not the layout's pieces {list(pieces)}",
                            path=where, param=name)
    chunks = meta.get("chunk", [])
    if not isinstance(chunks, list):
        raise StrategyError("chunk is not a list", path=where, param=name)
    slices = []
    for chunk in chunks:
        try:
            offset = [int(x) for x in chunk["global_offset"]]
            got = tuple(int(x) for x in chunk["local_shape"])
        except (KeyError, TypeError, ValueError):
            raise StrategyError(f"chunk {chunk!r} has no global_offset and local_shape", path=where,
                                param=name) from None
        if len(offset) != 1 or not 0 <= offset[0] < math.prod(pieces) or got != local:
            raise StrategyError(f"chunk (slice {offset}, shape {list(got)}) is not a piece of its layout, which cuts "
                                f"{list(shape)} into {list(pieces)} pieces of {list(local)} (an optimizer split or "
                                "an interleaved layout zckpt cannot derive): refused", path=where, param=name)
        slices.append(offset[0])
    if chunks and sorted(slices) != list(range(math.prod(pieces))):
        raise StrategyError(f"chunks give slices {sorted(slices)[:64]}: each of the layout's {math.prod(pieces)} "
                            "pieces must be listed once", path=where, param=name)


def parameter_layout(name: str, meta: Any, where: Path) -> tuple[tuple[int, ...], tuple[int, ParamLayout] | None]:
    """One ``state_dict_metadata`` entry's global shape and ``(pipeline stage, layout)``
    (``None``: held whole), checked against its chunks; refused with a :class:`StrategyError`
    naming the parameter (interleaved parallel, chunks the layout cannot produce, ...)."""
    if not isinstance(meta, dict):
        raise StrategyError("entry is not a JSON object", path=where, param=name)
    try:
        shape = tuple(int(d) for d in meta.get("global_shape", ()))
    except (TypeError, ValueError):
        raise StrategyError(f"global_shape {meta.get('global_shape')!r} is not a list of ints", path=where,
                            param=name) from None
    if meta.get("layout") is None:
        _check_chunks(name, meta, shape, (1,) * len(shape), where)
        return shape, None
    stage, layout = _layout(name, meta["layout"], where)
    try:
        resolve(layout, shape, param=name)
    except LayoutError as err:
        raise StrategyError(err.message, path=where, param=name) from None
    _check_chunks(name, meta, shape, _pieces(layout), where)
    return shape, (stage, layout)


Checked = tuple[tuple[int, ...], tuple[int, ParamLayout] | None]
"""A parameter's global shape and ``(stage, layout)`` (:func:`parameter_layout`)."""


def storage_problems(doc: dict[str, Any], checked: Mapping[str, Checked], where: Path) -> Iterator[StrategyError]:
    """Each ``storage_data`` record that contradicts the layouts: a slice number other than the
    one the parameter's layout gives the record's ``storage_rank`` (zckpt takes a rank's pieces
    where its layout puts them), a rank outside the parameter's stage, a key naming no
    parameter. Parameters of ``state_dict_metadata`` missing from ``checked`` are skipped."""
    names = doc["state_dict_metadata"]
    cuts: dict[str, Any] = {}
    for key, records in doc.get("storage_data", {}).items():
        try:
            name, (piece,) = ast.literal_eval(key)
            piece = int(piece)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            name = piece = None
        if not isinstance(name, str) or name not in names:
            yield StrategyError(f"storage_data key {key[:200]!r} is not (parameter, (slice,)) of a parameter "
                                f"{METADATA} describes", path=where, param=name if isinstance(name, str) else None)
            continue
        if name not in checked:
            continue
        for rec in records:
            rank = rec.get("storage_rank") if isinstance(rec, dict) else None
            want = _slice_of(name, checked[name], rank, cuts) if isinstance(rank, int) else None
            if want != piece:
                held = f"the layout gives rank {rank} slice {want}" if want is not None else \
                    f"rank {rank!r} holds no slice of it (its layout's ranks: {_stage_ranks(checked[name])})"
                yield StrategyError(f"storage_data says rank {rank!r} saved slice {piece}, but {held}: storage_data "
                                    "and the layout disagree", path=where, param=name)


def _stage_ranks(checked: Checked) -> str:
    staged = checked[1]
    if staged is None:
        return "all"
    stage, layout = staged
    return f"{stage * layout.device_num}-{(stage + 1) * layout.device_num - 1}"


def _slice_of(name: str, checked: Checked, rank: int, cuts: dict[str, Any]) -> int | None:
    """The slice number (row-major in the layout's pieces) a rank holds, ``None`` outside the stage."""
    shape, staged = checked
    if staged is None:
        return 0
    stage, layout = staged
    local = rank - stage * layout.device_num
    if not 0 <= local < layout.device_num:
        return None
    if name not in cuts:
        cuts[name] = resolve(layout, shape, param=name)
    index = piece_index(cuts[name], local)[0]
    return int(np.ravel_multi_index(index, _pieces(layout))) if index else 0


def metadata_strategy(iteration: Path) -> StrategyMap:
    """The source strategy a MindFormers iteration records, checked against its chunks and
    against ``storage_data``. Tensors held whole (``layout`` ``null``) are left unlisted, as
    unsharded entries are."""
    where = iteration / METADATA
    doc = read_metadata(iteration)
    checked = {name: parameter_layout(name, meta, where) for name, meta in doc["state_dict_metadata"].items()}
    for problem in storage_problems(doc, checked, where):
        raise problem
    layouts: dict[str, dict[int, ParamLayout]] = {}
    for name, (_, staged) in checked.items():
        if staged is not None:
            layouts.setdefault(name, {})[staged[0]] = staged[1]
    return StrategyMap(layouts, (str(where),))
