"""Read checkpoints without MindSpore: segmented rank directories and single store slices.

A *segmented* checkpoint is one rank's state spread over several ``.ckpt`` files in one
directory (``checkpoint_0_part0.ckpt``, ``checkpoint_0_part1.ckpt``: e.g. one
``transform_checkpoints`` run per source pipeline stage). MindSpore's
``load_segmented_checkpoints`` parses every file completely and merges the dicts in
``glob`` order, so which copy of a repeated entry wins depends on the directory listing.
This module gives:

* :func:`load_segmented_checkpoints`: the drop-in, returning numpy arrays (copies that
  own their memory, as MindSpore's Parameters do) and strings;
* :func:`open_segmented`: a lazy :class:`SegmentedCheckpoint` mapping that indexes the part
  files (headers only) and hands out zero-copy views of the mapped files, so reading one
  parameter reads that parameter's bytes and nothing else;
* :func:`load_slice`: one destination rank's slice of one parameter read straight from a
  zckpt store, touching only the chunks that hold it.

Rules (documented because MindSpore leaves them to chance):

* Parts are ordered by the number after ``_part`` (numerically: ``part2`` before
  ``part10``); files without ``_part`` come first, ties in natural name order.
* A tensor (or MapParameter) present in several parts must be the same in all of them:
  same dtype, same shape, same bytes. Otherwise :class:`~zckpt.core.errors.SourceError` names
  both files: such parts do not belong to one checkpoint and no choice is safe.
* A string entry (``append_dict``) present in several parts takes the value of the lowest
  part; the others are ignored.
* Dictionary order: first appearance, walking the parts in the order above.

bf16 tensors come back as ``ml_dtypes.bfloat16`` arrays (the exact bits, never widened;
MindSpore's ``Tensor`` accepts them); :meth:`SegmentedCheckpoint.dtype` and
:attr:`LoadedCheckpoint.ms_types` give MindSpore's type name of every entry.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from zckpt.core.dtypes import STRING_TYPE, ms_dtype, public_array
from zckpt.core.errors import SourceError, UsageError
from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.entries import EntryInfo
from zckpt.io import remote
from zckpt.io.new_files import NewFile
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.msnet import load_into_network, require_mindspore
from zckpt.plan.export_plan import build_export_plan
from zckpt.plan.values import ExportPlan, RankExport
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.store.reader import StoreReader, check_coverage, reading
from zckpt.store.store import Store

Value = np.ndarray | str
"""A loaded entry: a tensor (numpy array; bf16 as ``ml_dtypes.bfloat16``; MapParameter as its encoded bytes) or a
string."""

_PART = re.compile(r"_part(\d+)")


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def part_order_key(name: str) -> tuple[int, int, tuple[tuple[int, int | str], ...]]:
    """Sort key of a part file name: no ``_part`` first, then by part number, then by name."""
    found = _PART.findall(Path(name).stem)
    if not found:
        return (0, 0, _natural_key(name))
    return (1, int(found[-1]), _natural_key(name))


def list_part_files(ckpt_file_dir: str | os.PathLike[str]) -> list[Path]:
    """The ``.ckpt`` files of a rank directory in part order (hidden names skipped, like ``glob``)."""
    d = Path(ckpt_file_dir)
    if not d.is_dir():
        raise UsageError("checkpoint directory does not exist or is not a directory", path=d)
    with os.scandir(d) as it:
        files = [
            Path(e.path) for e in it if e.name.endswith(".ckpt") and not e.name.startswith(".") and e.is_file()
        ]
    if not files:
        raise SourceError("no .ckpt files in the checkpoint directory", path=d)
    return sorted(files, key=lambda p: part_order_key(p.name))


@dataclass(frozen=True)
class _Located:
    part: int
    entry: EntryInfo


class SegmentedCheckpoint(Mapping[str, Value]):
    """All part files of one rank directory as one read-only mapping ``name -> value``.

    Opening indexes every part (entry headers only; payload bytes are not read, and the CRC
    trailer is not checked unless ``verify_crc``). Entries repeated across parts are
    compared when the mapping is opened (see the module rules), which reads the repeated
    entries' bytes only. ``select`` (a name predicate) leaves entries out before anything
    about them is read.

    Tensor values are read-only numpy views of the mapped files (a tensor MindSpore split
    into several ``Value`` messages, above 512 MiB, is returned as a copy). Views stay valid
    after :meth:`close` (the mapping is released when the last view goes), but do not
    rewrite the files while views exist.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        *,
        verify_crc: bool = False,
        select: Callable[[str], bool] | None = None,
    ) -> None:
        self._files = tuple(Path(f) for f in files)
        self._readers: list[CkptReader] = []
        self._index: dict[str, _Located] = {}
        self._duplicates: dict[str, list[Path]] = {}
        self._closed = False
        try:
            for path in self._files:
                self._readers.append(CkptReader(path, verify_crc=verify_crc))
            for part, reader in enumerate(self._readers):
                for name, entry in reader.entries.items():
                    if select is not None and not select(name):
                        continue
                    self._add(name, part, entry)
        except BaseException:
            self.close()
            raise

    # --- building ---------------------------------------------------------------------
    def _add(self, name: str, part: int, entry: EntryInfo) -> None:
        prev = self._index.get(name)
        if prev is None:
            self._index[name] = _Located(part, entry)
            return
        self._duplicates.setdefault(name, [self._files[prev.part]]).append(self._files[part])
        first, here = self._files[prev.part], self._files[part]
        a, b = prev.entry, entry
        if a.kind != b.kind:
            raise SourceError(
                f"is a {a.kind} in {first} but a {b.kind} in {here}: these parts do not belong together",
                path=here,
                param=name,
            )
        if a.kind == "str":
            return  # strings: the lowest part wins (module rules)
        if (a.ms_type, a.shape) != (b.ms_type, b.shape):
            raise SourceError(
                f"{first} holds {a.ms_type}{list(a.shape)} but {here} holds {b.ms_type}{list(b.shape)}: "
                "two parts hold different versions of this tensor",
                path=here,
                param=name,
            )
        if not self._same_bytes(prev, _Located(part, entry)):
            raise SourceError(
                f"{first} and {here} hold different values of this {a.kind}: the parts do not belong to one "
                "checkpoint (e.g. saved at different steps)",
                path=here,
                param=name,
            )

    def _raw(self, loc: _Located) -> np.ndarray:
        """An entry's payload as flat bytes: a view of the mapped file for one-segment tensors."""
        reader = self._readers[loc.part]
        if loc.entry.kind == "map":
            return np.frombuffer(reader.map_bytes(loc.entry.name), np.uint8)
        return reader.array(loc.entry.name).reshape(-1).view(np.uint8)

    def _same_bytes(self, a: _Located, b: _Located) -> bool:
        return a.entry.nbytes == b.entry.nbytes and bool(np.array_equal(self._raw(a), self._raw(b)))

    # --- Mapping ----------------------------------------------------------------------
    def _where(self, name: str) -> _Located:
        if self._closed:
            raise UsageError("segmented checkpoint is closed", param=name)
        loc = self._index.get(name)
        if loc is None:
            raise KeyError(name)
        return loc

    def __getitem__(self, name: str) -> Value:
        loc = self._where(name)
        reader = self._readers[loc.part]
        if loc.entry.kind == "str":
            return reader.string(name)
        if loc.entry.kind == "map":
            return self._raw(loc)
        return public_array(reader.array(name), loc.entry.ms_type)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    # --- metadata (no payload read) ---------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._index)

    @property
    def files(self) -> tuple[Path, ...]:
        """The part files, in part order."""
        return self._files

    @property
    def duplicates(self) -> Mapping[str, tuple[Path, ...]]:
        """Entries found in several parts, with those parts (the first is the one used)."""
        return {k: tuple(v) for k, v in self._duplicates.items()}

    def dtype(self, name: str) -> str:
        """MindSpore's type name: ``"Float32"``, ``"BFloat16"``, ``"str"`` or ``"map"``."""
        return self._where(name).entry.ms_type

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape (``()`` for scalars and strings)."""
        return self._where(name).entry.shape

    def kind(self, name: str) -> str:
        """``"tensor"``, ``"str"`` or ``"map"``."""
        return self._where(name).entry.kind

    def nbytes(self, name: str) -> int:
        return self._where(name).entry.nbytes

    def file_of(self, name: str) -> Path:
        """The part file whose copy of ``name`` is used."""
        return self._files[self._where(name).part]

    # --- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        for r in self._readers:
            r.close()
        self._readers = []

    def __enter__(self) -> SegmentedCheckpoint:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} entries"
        return f"<SegmentedCheckpoint {len(self._files)} part file(s), {state}>"


def open_segmented(
    ckpt_file_dir: str | os.PathLike[str],
    *,
    verify_crc: bool = False,
    select: Callable[[str], bool] | None = None,
) -> SegmentedCheckpoint:
    """Lazily open every ``.ckpt`` of a rank directory as one mapping (see :class:`SegmentedCheckpoint`)."""
    if not isinstance(ckpt_file_dir, (str, os.PathLike)):
        raise TypeError(f"The ckpt_file_dir should be a str, but got {type(ckpt_file_dir).__name__}.")
    return SegmentedCheckpoint(list_part_files(ckpt_file_dir), verify_crc=verify_crc, select=select)


class LoadedCheckpoint(dict[str, Value]):
    """The dict :func:`load_segmented_checkpoints` returns, plus MindSpore's type of each entry.

    ``ms_types[name]`` is ``"Float32"``, ``"BFloat16"``, ``"str"``
    or ``"map"``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ms_types: dict[str, str] = {}


def check_prefix(prefix: object, what: str) -> tuple[str, ...] | None:
    """MindSpore's ``_check_prefix``: None, a str, or a non-empty list/tuple of non-empty strs."""
    if prefix is None:
        return None
    if not isinstance(prefix, (str, list, tuple)):
        raise TypeError(f"The type of '{what}' must be string, list[string] or tuple[string], "
                        f"but got {type(prefix).__name__}.")
    items: Sequence[object] = (prefix,) if isinstance(prefix, str) else prefix
    if not items:
        raise UsageError(f"'{what}' can't be empty when it is a list or tuple")
    for i, p in enumerate(items):
        if not isinstance(p, str):
            raise TypeError(f"'{what}' element at index {i} must be a string, but got {type(p).__name__}.")
        if p == "":
            raise UsageError(f"'{what}' can't include ''")
    return tuple(str(p) for p in items)


def name_filter(
    specify_prefix: Iterable[str] | None,
    filter_prefix: Iterable[str] | None,
    choice_func: Callable[[str], bool] | None,
) -> Callable[[str], bool]:
    """The entry predicate of MindSpore's ``load_checkpoint`` (``_whether_load_param``).

    ``specify_prefix`` keeps only names starting with one of its prefixes, ``filter_prefix``
    then drops names starting with one of its; ``choice_func`` applies only when neither
    prefix argument is given (MindSpore: "using either of those two args will override
    choice_func").
    """
    spec = tuple(specify_prefix) if specify_prefix else ()
    filt = tuple(filter_prefix) if filter_prefix else ()
    use_choice = specify_prefix is None and filter_prefix is None and choice_func is not None

    def keep(name: str) -> bool:
        if spec and not name.startswith(spec):
            return False
        if filt and name.startswith(filt):
            return False
        return not (use_choice and choice_func is not None and not choice_func(name))

    return keep


def load_segmented_checkpoints(
    ckpt_file_dir: str | os.PathLike[str],
    net: object = None,
    strict_load: bool = False,
    filter_prefix: str | Sequence[str] | None = None,
    dec_key: bytes | None = None,
    dec_mode: str = "AES-GCM",
    specify_prefix: str | Sequence[str] | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> LoadedCheckpoint:
    """MindSpore's ``load_segmented_checkpoints`` without MindSpore: ``{name: ndarray | str}``.

    Tensors are numpy arrays that own their memory (bf16 as ``ml_dtypes.bfloat16``;
    ``result.ms_types`` has MindSpore's type names). Entries the prefixes or
    ``choice_func`` leave out are never read. Differences from MindSpore, all deliberate:

    * with ``net`` (a MindSpore ``Cell``) the tensors are also loaded into it with
      ``mindspore.load_param_into_net(net, ..., strict_load)`` (MindSpore is imported only
      then), and the arrays are returned as without it; ``dec_key`` (encrypted files) is
      not supported;
    * repeated entries follow the module rules instead of ``glob`` order, and an empty or
      missing set of part files is an error instead of ``{}``;
    * the "nothing selected" ``ValueError`` is raised when the *merged* result is empty
      (MindSpore raises it as soon as one part has nothing selected).
    """
    if not isinstance(ckpt_file_dir, (str, os.PathLike)):
        raise TypeError(f"The ckpt_file_dir should be a str, but got {type(ckpt_file_dir).__name__}.")
    if net is not None:
        require_mindspore("net")
    if not isinstance(strict_load, bool):
        raise TypeError(f"The strict_load should be a bool, but got {type(strict_load).__name__}.")
    if dec_key is not None and not isinstance(dec_key, bytes):
        raise TypeError(f"The dec_key should be bytes or None, but got {type(dec_key).__name__}.")
    if not isinstance(dec_mode, str):
        raise TypeError(f"The dec_mode should be a str, but got {type(dec_mode).__name__}.")
    if dec_key is not None:
        raise UsageError("encrypted checkpoints (dec_key) are not supported by zckpt")
    if choice_func is not None and not callable(choice_func):
        raise TypeError(f"The choice_func should be callable, but got {type(choice_func).__name__}.")
    keep = name_filter(
        check_prefix(specify_prefix, "specify_prefix"), check_prefix(filter_prefix, "filter_prefix"), choice_func
    )
    out = LoadedCheckpoint()
    with open_segmented(ckpt_file_dir, select=keep) as seg:
        for name in seg:
            value = seg[name]
            out[name] = value if isinstance(value, str) else np.array(value, copy=True)
            out.ms_types[name] = seg.dtype(name)
    if not out:
        raise UsageError(
            "the loaded parameter dict is empty after filter or specify; check 'filter_prefix', "
            "'specify_prefix' and 'choice_func'",
            path=ckpt_file_dir,
        )
    if net is not None:
        load_into_network(net, out, strict_load)
    return out


# --------------------------------------------------------------------------- store slices


@dataclass(frozen=True)
class SliceRead:
    """One destination rank's slice of one store entry, with what it is a slice of."""

    name: str
    rank: int
    ms_type: str
    global_shape: tuple[int, ...]
    box: Box
    array: np.ndarray
    read_bytes: int = 0
    """Bytes read from the store for it: its own, and those read only to be checked or cut
    away (rows of chunks wider than the slice)."""


def read_slice(
    store: str | os.PathLike[str] | Store,
    rank: int,
    strategy: StrategyArg,
    name: str,
    *,
    storage_options: remote.StorageOptions = None,
) -> SliceRead:
    """Read rank ``rank``'s slice of ``name`` under the destination ``strategy`` from a store
    (a path or a URL; ``storage_options``: the filesystem's options).

    Only the chunks the slice overlaps are read, and checked against their recorded CRC-32C
    as export checks them. The slice is the box that ``zckpt export`` would write into that
    rank's file (unlisted entries: the whole value).
    """
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"The rank should be an int, but got {type(rank).__name__}.")
    with reading(store):
        st = store if isinstance(store, Store) else Store.open(store, storage_options=storage_options)
        return _read_slice(st, rank, strategy, name, storage_options)


def _read_slice(st: Store, rank: int, strategy: StrategyArg, name: str,
                storage_options: remote.StorageOptions = None) -> SliceRead:
    st.check_integrity()
    entry = st.entry(name)
    if entry.kind == "str":
        raise UsageError(f"is a string entry, not a tensor (its value: {entry.value!r})", path=st.path, param=name)
    smap = load_strategy(strategy, storage_options)
    # The whole entry list, as export plans it: a destination layout can depend on other
    # entries (an optimizer state follows its parameter), so one spec alone could differ.
    full = build_export_plan(st.specs(), smap, ranks=[rank])
    slices = tuple(s for s in full.ranks[0].slices if s.name == name)
    if not slices:
        stages = sorted(smap.layouts.get(name, {})) if smap is not None else []
        where = f" (the strategy lists it for pipeline stage(s) {stages})" if stages else ""
        raise UsageError(
            f"destination rank {rank} holds no slice of it under this strategy{where}: "
            "zckpt export would not write it to that rank",
            path=st.path,
            param=name,
        )
    plan = ExportPlan((RankExport(rank, slices),), full.device_num)
    check_coverage(st, plan)
    box = slices[0].box
    reader = StoreReader(st, ExportOptions())
    data = reader.materialise([(name, box)])[0]
    return SliceRead(name, rank, entry.ms_type, entry.shape, box, data, reader.read_bytes + reader.checked_bytes)


def load_slice(
    store_path: str | os.PathLike[str] | Store,
    rank: int,
    strategy: StrategyArg,
    name: str,
) -> np.ndarray:
    """Destination rank ``rank``'s slice of parameter ``name``, read from a zckpt store.

    ``strategy`` is the destination strategy (file, per-rank directory, StrategyMap, or
    ``None`` for one rank with whole tensors). Reads only the store chunks that overlap the
    slice; bf16 comes back as ``ml_dtypes.bfloat16``.
    """
    got = read_slice(store_path, rank, strategy, name)
    return public_array(got.array, got.ms_type)


def as_float(values: np.ndarray, ms_type: str) -> np.ndarray:
    """Numbers for display: bf16 bits widened to float32 exactly, other types unchanged."""
    if ms_type == "BFloat16":
        bits = values.view(np.uint16) if values.dtype.itemsize == 2 else values
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return values


def describe_slice(s: SliceRead) -> tuple[dict[str, Any], list[str]]:
    """A JSON document and human lines summarising a slice (``zckpt load``)."""
    storage = ms_dtype(s.ms_type).storage if s.ms_type not in ("map", STRING_TYPE) else np.dtype("u1")
    doc: dict[str, Any] = {
        "name": s.name,
        "rank": s.rank,
        "dtype": s.ms_type,
        "storage_dtype": str(storage),
        "shape": list(s.array.shape),
        "global_shape": list(s.global_shape),
        "box": s.box.to_json(),
        "nbytes": int(s.array.nbytes),
        "read_bytes": s.read_bytes,
    }
    vals = as_float(s.array, s.ms_type) if s.ms_type != "map" else s.array
    if vals.size and vals.dtype.kind in "biuf":
        as_num = vals.astype(np.float64)
        finite = np.isfinite(as_num)
        doc["min"] = float(np.min(as_num))
        doc["max"] = float(np.max(as_num))
        doc["mean"] = float(np.mean(as_num[finite])) if finite.any() else math.nan
        doc["non_finite"] = int(as_num.size - int(finite.sum()))
    stored = f" (stored as {storage})" if s.ms_type == "BFloat16" else ""
    lines = [
        f"{s.name}: {s.ms_type}{stored}, shape {list(s.array.shape)} of global {list(s.global_shape)}, "
        f"box {s.box.to_json()} (destination rank {s.rank})",
    ]
    if s.array.nbytes:
        lines.append(f"  read {s.read_bytes} bytes from the store for its {s.array.nbytes} "
                     f"({s.read_bytes / s.array.nbytes:.2f}x)")
    if "min" in doc:
        lines.append(
            f"  min {doc['min']:.6g}, max {doc['max']:.6g}, mean {doc['mean']:.6g}, non-finite {doc['non_finite']}"
        )
    return doc, lines


def save_npy(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    """Write ``array`` as ``.npy`` under a temporary name, then rename (no half-written file)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError("--out is a directory; give a file name", path=p)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = NewFile(p)
    try:
        np.save(new.file, np.ascontiguousarray(array), allow_pickle=False)
        new.publish(fsync=False)
    except BaseException:
        new.discard()
        raise
    return p


__all__ = [
    "LoadedCheckpoint",
    "SegmentedCheckpoint",
    "SliceRead",
    "list_part_files",
    "load_segmented_checkpoints",
    "load_slice",
    "open_segmented",
    "read_slice",
]
