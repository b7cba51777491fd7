"""A MindFormers Checkpoint 2.0 iteration directory that appears complete or not at all.

MindFormers resumes from the iteration ``latest_checkpointed_iteration.txt`` names, and
takes any ``iteration_XXXXXXXX/`` with a ``metadata.json`` for a checkpoint. So the rank
files, ``metadata.json`` and ``common.json`` are written into a hidden sibling,
``.iteration_XXXXXXXX.zckpt-<pid>`` (no MindFormers or zckpt reader takes it for an
iteration; the next run of that iteration removes one a killed run left), each synced;
then that directory is synced and renamed into place, its parent synced, and only then is
the tracker written (a new file renamed over the old one). A run that fails before the
rename leaves no iteration and removes its hidden directory; one that fails after it leaves
the previous tracker, naming the previous iteration. An existing iteration of the same
number is replaced only when asked (``overwrite``): swapped with the new one in one step
where the system can (``renameat2``), else renamed aside first; removed once the new one is
in place.

The files themselves are written by the safetensors writer (:mod:`zckpt.write.writers`
row ``mindformers``): MindSpore's ``save_checkpoint(format="safetensors")``, which MindFormers
calls, writes the same header metadata (``{"format": "ms"}``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from zckpt.core.errors import OutputError
from zckpt.core.layout import Box
from zckpt.formats.mindformers import ITER_DIR
from zckpt.formats.strategy import StrategyMap
from zckpt.io import fileio
from zckpt.io.safe_paths import refuse_link
from zckpt.plan.mf_iteration import COMMON_FIELDS, plan_iteration
from zckpt.plan.values import RankExport, TensorSpec
from zckpt.write.boxes import BoxReader, RankResult

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
COMMON = "common.json"


def iteration_name(iteration: int) -> str:
    """MindFormers' ``get_checkpoint_iter_dir``: ``iteration_`` and 8 digits."""
    return f"iteration_{iteration:08d}"


def metadata_text(doc: Mapping[str, Any]) -> bytes:
    """``metadata.json`` as MindFormers' ``save_metadata`` writes it (compact, UTF-8)."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def common_text(doc: Mapping[str, Any]) -> bytes:
    """``common.json`` as ``CommonInfo.save_common`` writes it (indented by 4)."""
    return json.dumps(doc, ensure_ascii=False, indent=4).encode("utf-8")


def common_document(reader: BoxReader, specs: Mapping[str, TensorSpec]) -> dict[str, Any]:
    """``common.json`` from the entries MindFormers' ``CommonInfo`` fields became when read
    (:func:`zckpt.formats.mindformers.common_entries`; a legacy ``CheckpointMonitor`` saves
    the same names): every field, ``null`` where no entry holds it."""
    doc: dict[str, Any] = dict.fromkeys(COMMON_FIELDS)
    items = [(n, Box.full(specs[n].shape)) for n in COMMON_FIELDS
             if n in specs and specs[n].kind == "tensor" and all(d == 1 for d in specs[n].shape)]
    for (name, _), value in zip(items, reader.materialise(items), strict=True):
        doc[name] = value.reshape(-1)[0].item()
    return doc


def source_iteration(paths: Iterable[str | os.PathLike[str]]) -> int | None:
    """The iteration of a MindFormers source: the number of the directory its files are in."""
    found = {int(m.group(1)) for p in paths if (m := ITER_DIR.match(Path(p).parent.name))}
    return found.pop() if len(found) == 1 else None


def choose_iteration(asked: int | None, sources: Iterable[str | os.PathLike[str]], common: Mapping[str, Any]) -> int:
    """The iteration to write: as asked, else the source's (a MindFormers iteration), else
    ``global_step``, else 0."""
    if asked is not None:
        return asked
    found = source_iteration(sources)
    if found is not None:
        return found
    step = common.get("global_step")
    return int(step) if isinstance(step, int) and step >= 0 else 0


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``), so that an
    iteration replaced in place is never missing; ``False`` where the system cannot."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def published(results: Iterable[RankResult], final: Path) -> tuple[RankResult, ...]:
    """The files' results as they are named once the directory is in place."""
    return tuple(replace(r, path=str(final / Path(r.path).name)) for r in results)


class IterationDir:
    """The hidden directory an iteration is built in, and its publication."""

    def __init__(self, root: Path, iteration: int, *, overwrite: bool = False, fsync: bool = True) -> None:
        if iteration < 0 or iteration > 99_999_999:
            raise OutputError(f"iteration {iteration} does not fit MindFormers' 8-digit directory name")
        self.root = root
        self.final = root / iteration_name(iteration)
        self.iteration = iteration
        self.overwrite = overwrite
        self.fsync = fsync
        self.building = root / f".{self.final.name}.zckpt-{os.getpid()}"

    def check(self) -> None:
        """Refuse before any writing: an iteration of this number present and no ``overwrite``."""
        if self.final.is_symlink() or self.final.exists() and not self.final.is_dir():
            raise OutputError("is not a directory zckpt may replace", path=self.final)
        if self.final.exists() and not self.overwrite:
            raise OutputError("this iteration exists already (--overwrite replaces it)", path=self.final)

    @contextlib.contextmanager
    def building_dir(self) -> Iterator[Path]:
        """The hidden directory to write into; removed, with all it holds, if the block fails.
        What a killed run of this iteration left (its hidden directories) goes first: the
        caller holds the output directory, so no other run is writing them."""
        self.check()
        self.root.mkdir(parents=True, exist_ok=True)
        refuse_link(self.root, OutputError)
        for stale in self.root.glob(f".{self.final.name}.zckpt-*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
        self.building.mkdir()
        try:
            yield self.building
        except BaseException:
            shutil.rmtree(self.building, ignore_errors=True)
            raise

    def publish(self, metadata: Mapping[str, Any] | None, common: Mapping[str, Any]) -> Path:
        """Write ``metadata.json`` and ``common.json`` beside the rank files, rename the
        directory into place, then write the tracker. The final directory."""
        try:
            if metadata is not None:
                fileio.write_atomic(self.building / METADATA, metadata_text(metadata), fsync=self.fsync)
            fileio.write_atomic(self.building / COMMON, common_text(common), fsync=self.fsync)
            if self.fsync:
                fileio.fsync_dir(self.building)
            old = self.root / f".{self.final.name}.zckpt-old-{os.getpid()}"
            if self.final.exists():
                self.check()
                if exchange(self.building, self.final):  # the old iteration is now the hidden one
                    old = self.building
                else:
                    os.replace(self.final, old)
                    os.replace(self.building, self.final)
            else:
                os.replace(self.building, self.final)
        except BaseException:
            shutil.rmtree(self.building, ignore_errors=True)
            raise
        if self.fsync:
            fileio.fsync_dir(self.root)
        if old.exists():
            shutil.rmtree(old)
        fileio.write_atomic(self.root / TRACKER, str(self.iteration).encode("ascii"), fsync=self.fsync)
        return self.final


class IterationOptions(Protocol):
    """What :func:`build_iteration` reads from ``ExportOptions`` and ``TransformOptions``."""

    @property
    def prefix(self) -> str: ...
    @property
    def remove_redundancy(self) -> bool: ...
    @property
    def iteration(self) -> int | None: ...
    @property
    def overwrite(self) -> bool: ...
    @property
    def fsync(self) -> bool: ...


R = TypeVar("R")


def build_iteration(root: Path, ranks: Sequence[RankExport], specs: Mapping[str, TensorSpec],
                    dst_strategy: StrategyMap | None, common: Mapping[str, Any],
                    sources: Iterable[str | os.PathLike[str]], options: IterationOptions,
                    write: Callable[[list[tuple[RankExport, Path]]], R]) -> tuple[R, Path]:
    """The iteration directory for ``ranks`` below ``root``: its files planned, written by
    ``write`` (export's or transform's tasks) into the hidden directory, then published.
    ``write``'s report and the final directory."""
    it = plan_iteration(ranks, specs, dst_strategy, options.prefix, remove_redundancy=options.remove_redundancy)
    out = IterationDir(root, choose_iteration(options.iteration, sources, common),
                       overwrite=options.overwrite, fsync=options.fsync)
    with out.building_dir() as tmp:
        report = write([(f.rank, tmp / f.name) for f in it.files])
        final = out.publish(it.metadata, common)
    return report, final
