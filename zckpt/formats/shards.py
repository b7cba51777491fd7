"""One entry point for reading a source shard, whatever its format.

A MindSpore job saves each rank either as ``.ckpt`` (protobuf) or as ``.safetensors``;
zckpt may also have split a rank's safetensors file into parts listed by an HF-style
``<name>.safetensors.index.json``. :func:`open_shard` picks the reader from the file (its
suffix, else its first bytes), and every reader offers the
:class:`~zckpt.formats.ckpt.CkptReader` interface, so ingest does not care which it got.

:func:`choose_rank_file` applies MindSpore's rules for choosing a rank directory's file
(refusing where they would be a guess), and
:func:`check_single_format` refuses a job that mixes ``.ckpt`` and ``.safetensors`` files,
as ``mindspore.transform_checkpoints`` does (it could not tell which set is current).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from zckpt.errors import CheckpointFormatError, SourceError, UsageError
from zckpt.formats.ckpt import CkptReader, EntryInfo
from zckpt.formats.safetensors import SafetensorsReader

INDEX_SUFFIX = ".safetensors.index.json"
"""A split safetensors checkpoint: ``<name>.safetensors.index.json`` with a ``weight_map``."""

ShardReader = CkptReader
"""The interface every shard reader offers (``entries``, ``array``, ``rows``, ``string``, ...)."""


def shard_format(path: str | os.PathLike[str]) -> str:
    """``"ckpt"``, ``"safetensors"`` or ``"safetensors-index"``: by suffix, else by content.

    A safetensors file starts with an 8-byte length and then ``{``; a ``.ckpt`` starts with a
    protobuf field, never ``{`` at byte 8 (that would be a 1-byte length field for byte 9).
    """
    p = Path(path)
    if p.name.endswith(INDEX_SUFFIX):
        return "safetensors-index"
    if p.name == "param_name_map.json":
        return "safetensors-unified"  # MindSpore's unified directory (zckpt.formats.unified)
    if p.suffix == ".safetensors" and _is_mindformers_rank(p):
        return "safetensors-mindformers"  # a rank of a MindFormers iteration (zckpt.formats.mindformers)
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix == ".ckpt":
        return "ckpt"
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError:
        return "ckpt"  # let the reader report the problem with its own message
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(p):
        return "safetensors"
    return "ckpt"


def open_shard(path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> CkptReader:
    """Open a source shard with the reader its format needs (use as a context manager);
    ``sparse``: for its index only (:class:`CkptReader`; other formats keep their headers
    together at the start)."""
    fmt = shard_format(path)
    if fmt == "safetensors":
        return SafetensorsReader(path, verify_crc=verify_crc)
    if fmt == "safetensors-index":
        return SafetensorsSetReader(path, verify_crc=verify_crc)
    if fmt == "safetensors-unified":
        from zckpt.formats.unified import UnifiedSafetensorsReader

        return UnifiedSafetensorsReader(path, verify_crc=verify_crc)
    if fmt == "safetensors-mindformers":
        from zckpt.formats.mindformers import MindFormersRankReader

        return MindFormersRankReader(path, verify_crc=verify_crc)
    return CkptReader(path, verify_crc=verify_crc, sparse=sparse)


def open_indexed(path: str | os.PathLike[str], entries: Mapping[str, EntryInfo]) -> CkptReader:
    """Open a source shard whose index was parsed before (a ``.ckpt``: mapped, not walked
    again; other formats are opened as :func:`open_shard` does, without their CRC check)."""
    if shard_format(path) == "ckpt":
        return CkptReader.indexed(path, entries)
    return open_shard(path, verify_crc=False)


def _is_mindformers_rank(path: Path) -> bool:
    from zckpt.formats.mindformers import is_rank_file

    return is_rank_file(path)


def _numbers_key(name: str) -> list[int]:
    """MindSpore's ``_extract_last_two_numbers``: the last two integers in a file name."""
    return [int(x) for x in re.findall(r"\d+", name)][-2:]


def latest_by_numbers(names: Sequence[str], path_of: Callable[[str], str] = str) -> tuple[list[str], list[int]]:
    """The names whose last two numbers (MindSpore's ``-<epoch>_<step>`` key, read from
    ``path_of(name)``) are largest, in the order given, and those numbers. Several names
    mean a tie, which MindSpore settles by its directory listing's order."""
    keys = {n: _numbers_key(path_of(n)) for n in names}
    best = max(keys.values())
    return [n for n in names if keys[n] == best], best


@dataclass(frozen=True)
class RankFileChoice:
    """Which checkpoint file a ``rank_<r>`` directory contributes, and why.

    Kept so that the choice is never silent: ingest reports it (text and JSON) whenever a
    directory held several candidates.
    """

    name: str
    candidates: tuple[str, ...]
    """Every checkpoint file of the directory's format, sorted (``name`` is one of them)."""
    rule: str
    """How ``name`` was chosen, in words (``"only file"``, ``"last in lexicographic order ..."``)."""

    @property
    def several(self) -> bool:
        return len(self.candidates) > 1


def pick_rank_file(rank_dir: Path, file_suffix: str | None = None) -> Path | None:
    """The checkpoint of one ``rank_<r>`` directory, as MindSpore chooses it (see
    :func:`choose_rank_file`); ``None`` when the directory holds no checkpoint."""
    found = choose_rank_file(_listing(rank_dir), rank_dir.name, str(rank_dir), file_suffix)
    return None if found is None else rank_dir / found.name


def _listing(rank_dir: Path) -> list[str]:
    return [p.name for p in rank_dir.iterdir() if p.is_file()]


def pick_rank_name(names: Sequence[str], dir_name: str, where: str, file_suffix: str | None = None) -> str | None:
    """The name :func:`choose_rank_file` picks among ``names``, or ``None``."""
    found = choose_rank_file(names, dir_name, where, file_suffix)
    return None if found is None else found.name


def choose_rank_file(
    names: Sequence[str], dir_name: str, where: str, file_suffix: str | None = None
) -> RankFileChoice | None:
    """The checkpoint among a ``rank_<r>`` directory's file names, as MindSpore chooses it,
    or a refusal where MindSpore's choice would be a guess.

    MindSpore 2.10 (``transform_checkpoints``) takes the last ``.ckpt`` in lexicographic order,
    and the ``.safetensors`` whose last two numbers (``-<epoch>_<step>``) are largest; with
    ``file_suffix`` (``unified_safetensors``) only names ending in ``<file_suffix>.<format>``
    count, narrowed by its ``_find_most_matching_file`` rules. Files starting with ``.`` are
    not candidates (MindSpore globs ``*``). zckpt follows these rules but refuses when they
    are not a clear answer: several ``.ckpt`` files whose last in lexicographic order is not
    also the latest by epoch and step (``ModelCheckpoint`` keeps several: MindSpore would take
    ``net-9_100.ckpt`` over ``net-10_100.ckpt``), or safetensors files tied on their numbers
    (MindSpore's pick then depends on the directory listing's order). A split checkpoint's
    index file stands for its parts. A directory holding both formats is refused. Works on
    names alone, so remote directories (listed through fsspec) follow the same rules.
    """
    names = [n for n in names if not n.startswith(".")]
    ckpts = sorted(n for n in names if n.endswith(".ckpt"))
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    sts = sorted(n for n in names if n.endswith(".safetensors"))
    if ckpts and (sts or indexes):
        raise SourceError(
            "rank directory holds both .ckpt and .safetensors files; MindSpore refuses such a source as well "
            "(keep one format per job)", path=where)
    if indexes:  # a split checkpoint: its parts are .safetensors files too, but the index stands for them
        return _choose_index(indexes, where, file_suffix)
    fmt, found = ("ckpt", ckpts) if ckpts else ("safetensors", sts)
    if not found:
        return None
    if file_suffix is not None:
        return choose_by_suffix(found, fmt, where, file_suffix)
    if len(found) == 1:
        return RankFileChoice(found[0], tuple(found), "only file")
    newest, best = latest_by_numbers(found, lambda n: f"{dir_name}/{n}")
    hint = ("choose one with --file-suffix (file_suffix=, e.g. the '<epoch>_<step>' of the file you want) or keep "
            "one checkpoint per rank directory")
    if fmt == "ckpt":
        if newest != [found[-1]]:
            latest = newest[0] if len(newest) == 1 else f"one of {newest} (tied)"
            raise SourceError(
                f"rank directory holds {len(found)} .ckpt files {found}: MindSpore's transform_checkpoints takes "
                f"the last in lexicographic order ({found[-1]}), but the latest by epoch and step is {latest}; "
                f"zckpt will not guess which you mean: {hint}", path=where)
        return RankFileChoice(found[-1], tuple(found), "last in lexicographic order, also the latest by epoch/step "
                                                       "(MindSpore's choice)")
    if len(newest) > 1:
        raise SourceError(
            f"rank directory holds {len(found)} .safetensors files and {newest} tie on their last two numbers "
            f"{best}: MindSpore's pick among them depends on the directory listing's order; {hint}", path=where)
    return RankFileChoice(newest[0], tuple(found), "largest last two numbers (epoch, step), MindSpore's choice")


def _choose_index(indexes: list[str], where: str, file_suffix: str | None) -> RankFileChoice:
    if file_suffix is not None:
        stems = {n[: -len(INDEX_SUFFIX)] + ".safetensors": n for n in indexes}
        picked = choose_by_suffix(sorted(stems), "safetensors", where, file_suffix)
        return RankFileChoice(stems[picked.name], tuple(indexes), picked.rule)
    if len(indexes) > 1:
        raise SourceError(f"rank directory holds {len(indexes)} split-checkpoint index files "
                          f"({', '.join(indexes)}); keep one or choose with --file-suffix", path=where)
    return RankFileChoice(indexes[0], tuple(indexes), "only split-checkpoint index")


_SUFFIX_FORMS = (
    (re.compile(r"^_?\d+-\d+_\d+$"), "_", True),  # _<task>-<epoch>_<step>
    (re.compile(r"^-?\d+_\d+$"), "-", False),  # -<epoch>_<step>
    (re.compile(r"^_?\d+$"), "_", False),  # _<step>
)
"""MindSpore's ``_find_most_matching_file`` patterns: (form, separator it adds when the
suffix lacks it, whether ``rank<suffix>`` names are excluded)."""


def choose_by_suffix(found: Sequence[str], fmt: str, where: str, file_suffix: str) -> RankFileChoice:
    """MindSpore's ``file_suffix`` selection: names ending in ``<file_suffix>.<fmt>``; when
    several do, the suffix read as ``_<task>-<epoch>_<step>``, ``-<epoch>_<step>`` or ``_<step>``
    (the separator added when missing), then the shortest matching name; a tie is refused."""
    if not isinstance(file_suffix, str) or not file_suffix:
        raise UsageError(f"file_suffix must be a non-empty str, got {file_suffix!r}")
    matched = [n for n in found if n.endswith(f"{file_suffix}.{fmt}")]
    if not matched:
        raise SourceError(f"no .{fmt} file ends with file_suffix {file_suffix!r}.{fmt} (files: {found})", path=where)
    rule = f"file_suffix {file_suffix!r}"
    if len(matched) == 1:
        return RankFileChoice(matched[0], tuple(found), rule)
    for form, sep, no_rank in _SUFFIX_FORMS:
        if not form.match(file_suffix):
            continue
        full = file_suffix if file_suffix.startswith(sep) else sep + file_suffix
        narrowed = [n for n in matched if n.endswith(f"{full}.{fmt}")
                    and not (no_rank and n.endswith(f"rank{full}.{fmt}"))]
        shortest = [n for n in narrowed if len(n) == min((len(m) for m in narrowed), default=0)]
        if len(shortest) == 1:
            why = "" if len(narrowed) == 1 else ", the shortest such name"
            return RankFileChoice(shortest[0], tuple(found), f"{rule} (ends with {full}.{fmt}{why})")
        raise SourceError(
            f"file_suffix {file_suffix!r} does not single out one file: names ending with {full}.{fmt}: "
            f"{narrowed or 'none'} (MindSpore refuses this too; give the longest common suffix)", path=where)
    raise SourceError(f"{len(matched)} .{fmt} files end with {file_suffix!r}: {matched}; give a longer file_suffix "
                      "(MindSpore refuses this too)", path=where)


def check_single_format(files: Mapping[int, str | Path], root: str | Path) -> None:
    """Refuse a job whose ranks are saved in different formats (MindSpore refuses it too)."""
    kinds = {r: "safetensors" if shard_format(p).startswith("safetensors") else "ckpt" for r, p in files.items()}
    if len(set(kinds.values())) > 1:
        ck = sorted(r for r, k in kinds.items() if k == "ckpt")
        st = sorted(r for r, k in kinds.items() if k != "ckpt")
        raise SourceError(
            f"source directory mixes .ckpt (ranks {ck}) and .safetensors (ranks {st}) checkpoints; MindSpore refuses "
            "such a source as well (keep one format per job)", path=root)


class SafetensorsSetReader(SafetensorsReader):
    """A rank saved as several safetensors parts plus an HF-style index (``weight_map``).

    Entries are the union of the parts' (in part order); reads go to the part holding the
    tensor. Tensors then live in several files, so :meth:`row_bytes_range` says ``None`` and
    ingest copies through memory instead of file to file.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        # No mapping of its own: every read is delegated to a part's reader.
        self.path = Path(path)
        self._parts: list[SafetensorsReader] = []
        self._owner: dict[str, SafetensorsReader] = {}
        try:
            weight_map = self._read_index()
            files: dict[str, list[str]] = {}
            for name, fname in weight_map.items():
                files.setdefault(fname, []).append(name)
            self.entries: dict[str, EntryInfo] = {}
            self.metadata: dict[str, str] = {}
            for fname, names in files.items():
                part = self._open_part(fname, verify_crc)
                self._parts.append(part)
                tensors = {n for n, e in part.entries.items() if e.kind == "tensor"}
                if tensors != set(names):
                    extra = sorted(tensors - set(names)) or sorted(set(names) - tensors)
                    raise CheckpointFormatError(
                        f"weight_map and part {fname} disagree on which tensors it holds", path=self.path,
                        param=extra[0])
                for n, e in part.entries.items():
                    if n in self._owner:
                        raise CheckpointFormatError(f"entry is in two parts (also in {fname})", path=self.path,
                                                    param=n)
                    self._owner[n] = part
                    self.entries[n] = e
                self.metadata.update(part.metadata)
        except BaseException:
            self.close()
            raise
        self.has_crc = any(p.has_crc for p in self._parts)
        self.crc_expected = None

    def _open_part(self, fname: str, verify_crc: bool) -> SafetensorsReader:
        """The reader of one part named by the index (a file beside it)."""
        return SafetensorsReader(self.path.parent / fname, verify_crc=verify_crc)

    def _read_index(self) -> dict[str, str]:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointFormatError(f"cannot read split-checkpoint index: {err}", path=self.path) from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointFormatError("index has no weight_map of tensor name -> file name", path=self.path)
        for name, fname in wm.items():
            if Path(fname).name != fname or not fname.endswith(".safetensors"):
                raise CheckpointFormatError(f"weight_map names {fname!r}, not a .safetensors file beside the index",
                                            path=self.path, param=name)
        return dict(wm)

    def __enter__(self) -> SafetensorsSetReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for p in self._parts:
            p.close()

    def _part(self, name: str) -> SafetensorsReader:
        try:
            return self._owner[name]
        except KeyError:
            raise CheckpointFormatError("no such entry", path=self.path, param=name) from None

    def release_pages(self) -> None:
        for p in self._parts:
            p.release_pages()

    def verify_crc(self) -> None:
        for p in self._parts:
            if p.has_crc:
                p.verify_crc()

    def fileno(self) -> int:
        raise CheckpointFormatError("a split checkpoint has no single file descriptor", path=self.path)

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        return None

    def array(self, name: str) -> np.ndarray:
        return self._part(name).array(name)

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        return self._part(name).rows(name, r0, r1)

    def row_blocks(self, name: str, max_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        yield from self._part(name).row_blocks(name, max_bytes)

    def string(self, name: str) -> str:
        return self._part(name).string(name)
