"""Which file of a ``rank_<r>`` directory is its checkpoint, by MindSpore's rules.

:func:`choose_rank_file` applies MindSpore's rules for choosing a rank directory's file
(refusing where they would be a guess) and keeps the choice (:class:`RankFileChoice`), so
that ingest can report it. These rules work on file names alone: remote directories follow
them as local ones do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zckpt.core.errors import SourceError, UsageError
from zckpt.formats.shard_reader import INDEX_SUFFIX


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
