"""Locate the source shards of a MindSpore job on disk.

MindSpore's layout is ``SRC_DIR/rank_<r>/<anything>.ckpt``; when a rank directory holds
several ``.ckpt`` files the last one in lexicographic order is the checkpoint, as in
``mindspore.transform_checkpoints``. Sharded safetensors jobs (``rank_<r>/*.safetensors``)
are found the same way. Where those rules would be a guess (``net-9_100.ckpt`` against
``net-10_100.ckpt``, ranks from different steps) zckpt refuses and asks for MindSpore's
``file_suffix``; every choice among several files is kept in :class:`SourceSet` for the
report (see :func:`zckpt.formats.rank_files.choose_rank_file`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zckpt.core.errors import SourceError
from zckpt.formats.entries import EntryInfo
from zckpt.formats.opener import check_single_format, open_indexed, open_remote, open_shard
from zckpt.formats.rank_files import RankFileChoice, choose_rank_file
from zckpt.formats.shard_reader import ShardReader
from zckpt.io import remote
from zckpt.sources.layouts import discover_other_layout

_RANK_DIR = re.compile(r"^rank_(\d+)$")

SourceFile = Path | str
"""A local shard path, or the URL of a remote one (``s3://...``)."""


@dataclass(frozen=True)
class SourceSet:
    """The source files of a job: ``{rank: file}`` and, per rank directory, which file was
    chosen among how many (so that a choice among several is reported, never silent)."""

    files: dict[int, SourceFile]
    choices: dict[int, RankFileChoice] = field(default_factory=dict)

    def several(self) -> dict[int, RankFileChoice]:
        """The ranks whose directory held more than one candidate."""
        return {r: c for r, c in self.choices.items() if c.several}


def discover_rank_files(
    src_dir: str | Path, storage_options: remote.StorageOptions = None, file_suffix: str | None = None
) -> dict[int, SourceFile]:
    """Map rank id to its checkpoint file; refuses a directory with no rank files."""
    return discover_sources(src_dir, storage_options, file_suffix).files


def discover_sources(
    src_dir: str | Path, storage_options: remote.StorageOptions = None, file_suffix: str | None = None
) -> SourceSet:
    """:func:`discover_rank_files` with the choice made in each rank directory.

    ``file_suffix`` is MindSpore's: only files ending in ``<file_suffix>.ckpt`` (or
    ``.safetensors``) count, and every rank directory must hold one.
    """
    if isinstance(src_dir, str) and remote.is_remote(src_dir):
        return discover_remote(src_dir, storage_options, file_suffix)
    root = remote.local_path(src_dir)
    if not root.is_dir():
        raise SourceError("source checkpoint directory does not exist or is not a directory", path=root)
    other = discover_other_layout(root)  # MindSpore's unified directory, MindFormers' iterations
    if other is not None:
        return SourceSet(dict(sorted(other.items())))
    out: dict[int, SourceFile] = {}
    choices: dict[int, RankFileChoice] = {}
    dirs: dict[int, str] = {}
    for child in sorted(root.iterdir()):
        m = _RANK_DIR.match(child.name)
        if not m or not child.is_dir():
            continue
        names = [p.name for p in child.iterdir() if p.is_file()]
        found = choose_rank_file(names, child.name, str(child), file_suffix)  # as MindSpore does, never a guess
        if found is not None:
            rank = _claim_rank(dirs, m, child.name, root)
            out[rank] = child / found.name
            choices[rank] = found
    return _checked(out, choices, root)


def discover_remote(url: str, storage_options: remote.StorageOptions, file_suffix: str | None = None) -> SourceSet:
    """:func:`discover_sources` on an fsspec directory: same naming rules, URLs as results."""
    root = remote.locate(url, storage_options, SourceError)
    if not remote.isdir(root, SourceError):
        raise SourceError("source checkpoint directory does not exist or is not a directory", path=url)
    out: dict[int, SourceFile] = {}
    choices: dict[int, RankFileChoice] = {}
    dirs: dict[int, str] = {}
    for name, is_dir in sorted(remote.listdir(root, SourceError)):
        m = _RANK_DIR.match(name)
        if not m or not is_dir:
            continue
        sub = root.child(name)
        files = [n for n, d in remote.listdir(sub, SourceError) if not d]
        found = choose_rank_file(files, name, sub.url, file_suffix)
        if found is not None:
            rank = _claim_rank(dirs, m, name, url)
            out[rank] = sub.child(found.name).url
            choices[rank] = found
    return _checked(out, choices, url)


def _claim_rank(dirs: dict[int, str], m: re.Match[str], name: str, root: str | Path) -> int:
    """The rank a ``rank_<r>`` directory holds, refusing a second directory of the same
    rank (``rank_1`` and ``rank_01``): which of them is current cannot be told."""
    rank = int(m.group(1))
    other = dirs.setdefault(rank, name)
    if other != name:
        raise SourceError(f"directories {other!r} and {name!r} both hold rank {rank}: zckpt will not guess which "
                          "is current (remove or rename the stale one)", path=root)
    return rank


def _checked(out: dict[int, SourceFile], choices: dict[int, RankFileChoice], root: str | Path) -> SourceSet:
    if not out:
        raise SourceError("no rank_<r>/*.ckpt or rank_<r>/*.safetensors files found", path=root)
    check_single_format(out, root)
    check_same_step(choices, root)
    return SourceSet(dict(sorted(out.items())), dict(sorted(choices.items())))


_EPOCH_STEP = re.compile(r"-(\d+)_(\d+)\.(?:ckpt|safetensors)$")
"""``ModelCheckpoint``'s file names: ``<prefix>-<epoch>_<step>.ckpt``."""


def check_same_step(choices: Mapping[int, RankFileChoice], root: str | Path) -> None:
    """Refuse ranks whose chosen files are from different training steps.

    When every chosen name has ``ModelCheckpoint``'s ``-<epoch>_<step>`` ending and the ranks
    disagree on it (a rank that stopped saving earlier, or a directory holding a newer file
    than the others), the job would be mixed from several steps; MindSpore would mix them
    silently.
    """
    steps = {r: _EPOCH_STEP.search(c.name) for r, c in choices.items()}
    if len(steps) < 2 or any(m is None for m in steps.values()):
        return
    by_step: dict[tuple[int, int], list[int]] = {}
    for r, m in steps.items():
        assert m is not None
        by_step.setdefault((int(m.group(1)), int(m.group(2))), []).append(r)
    if len(by_step) > 1:
        parts = "; ".join(f"ranks {rs} from epoch {e} step {st}" for (e, st), rs in sorted(by_step.items()))
        raise SourceError(
            f"the chosen rank files are from different training steps ({parts}): a job mixed from several steps is "
            "not a checkpoint; choose one step for every rank with --file-suffix (file_suffix=, e.g. "
            f"'{max(by_step)[0]}_{max(by_step)[1]}') or remove the other files", path=root)


def check_rank_map(
    files: Mapping[int, str | Path], storage_options: remote.StorageOptions = None
) -> dict[int, SourceFile]:
    """Validate an explicit ``{rank: file}`` map (MindSpore's checkpoint_files_map)."""
    out: dict[int, SourceFile] = {}
    for rank, path in files.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise SourceError(f"rank key {rank!r} must be a non-negative int")
        if isinstance(path, str) and remote.is_remote(path):
            if not remote.isfile(remote.locate(path, storage_options, SourceError), SourceError):
                raise SourceError(f"checkpoint file of rank {rank} does not exist", path=path)
            out[rank] = path
            continue
        p = remote.local_path(path)
        if not p.is_file():
            raise SourceError(f"checkpoint file of rank {rank} does not exist", path=p)
        out[rank] = p
    return dict(sorted(out.items()))


@contextlib.contextmanager
def open_source(
    path: SourceFile, storage_options: remote.StorageOptions = None, *, verify_crc: bool = True,
    index: Mapping[str, EntryInfo] | None = None, sparse: bool = False,
) -> Iterator[ShardReader]:
    """Open a source shard, local or remote (a reader context).

    A remote shard is read by byte range where it lies (:mod:`zckpt.formats.remote_shard`:
    its framing walked, payloads fetched when asked for; no local copy, no CRC check). ``index``:
    the shard's entries as planning parsed them (not parsed again, see
    :func:`zckpt.formats.opener.open_indexed`). ``sparse``: opened for its index only
    (:func:`zckpt.formats.opener.open_shard`).
    """
    if not (isinstance(path, str) and remote.is_remote(path)):
        with open_shard(path, verify_crc=verify_crc, sparse=sparse) if index is None else \
                open_indexed(path, index) as reader:
            yield reader
        return
    with open_remote(path, storage_options, index=index, sparse=sparse) as reader:
        yield reader
