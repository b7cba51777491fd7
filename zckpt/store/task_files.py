"""What the ingest tasks running in one process share while they write a store: its shard
files opened once, a thread that starts writing back what they wrote and a thread that
writes their progress records in groups; a task run elsewhere (a Dask worker) opens its own.

Kept apart from :mod:`zckpt.store.chunk_writer`, which writes one rank whoever shares what.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zckpt.io.fileio import SharedFiles, WriteBehind
from zckpt.store.chunk_writer import open_chunk_file

if TYPE_CHECKING:
    from zckpt.store.store import Store


RECORD_FILES = 32
"""Progress record files an ingest run in one process aims at (format 7): each holds the
records of ``ceil(ranks / RECORD_FILES)`` ranks in a row, written once all of them are done
(a crash redoes at most that many ranks); jobs of up to 32 ranks keep one file per rank."""


@dataclass
class InProcess:
    """What the tasks of an ingest that run in this process share: the store's shard files
    (opened once), the thread that starts writing back what they wrote, and the thread that
    writes their progress records (each group of ``group`` ranks in one file, after their
    bytes, while the next ranks are copied: creating and renaming 512 record files cost
    0.5-0.75 s of CPU at 512 ranks)."""

    files: SharedFiles
    behind: WriteBehind
    group: int = 1
    records: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "zckpt-records"))
    pending: list[Future[None]] = field(default_factory=list)
    done: list[tuple[Store, int, Callable[[], dict[str, Any]]]] = field(default_factory=list)

    def record(self, store: Store, rank: int, info: Callable[[], dict[str, Any]]) -> None:
        """Record ``rank`` done (its record is ``info()``, computed on the record thread) once
        ``group`` ranks are."""
        self.done.append((store, rank, info))
        if len(self.done) >= self.group:
            self._flush()

    def _flush(self) -> None:
        batch, self.done = self.done, []
        if batch:
            self.pending.append(self.records.submit(
                lambda: batch[-1][0].mark_ingested_many({rank: info() for _, rank, info in batch})))

    def wait_records(self) -> None:
        """Write the records of the ranks done and wait until every record is written;
        raise the first failure."""
        self._flush()
        self.records.shutdown(wait=True)
        for f in self.pending:
            f.result()


def _shard_file_limit() -> int:
    """Shard files kept open at once: a quarter of this process's descriptor limit, at most 1 024."""
    try:
        import resource  # optional: Unix only (ImportError below)

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 4))


@contextmanager
def shard_files(in_process: bool, ranks: int = 1) -> Iterator[InProcess | None]:
    """The store's shard files opened once for every task run in this process while the
    ingest runs, with a thread that starts writing back what the tasks wrote
    (:class:`~zckpt.io.fileio.WriteBehind`), closed after; ``False``: tasks run on a cluster and
    open their own (:func:`task_files`)."""
    if not in_process:
        yield None
        return
    with SharedFiles(lambda p: open_chunk_file(p, False), _shard_file_limit()) as files, \
            WriteBehind(files) as behind:
        shared = InProcess(files, behind, max(1, -(-ranks // RECORD_FILES)))
        try:
            yield shared
        except BaseException:
            with contextlib.suppress(Exception):  # the records of ranks done still count on resume
                shared.wait_records()
            raise
        else:
            shared.wait_records()


@contextmanager
def task_files(shared: InProcess | None) -> Iterator[SharedFiles]:
    """The shard files a task writes through: the ingest's own in this process, else the
    task's (closed when it ends)."""
    if shared is not None:
        yield shared.files
        return
    with SharedFiles(lambda p: open_chunk_file(p, False), _shard_file_limit()) as own:
        yield own
