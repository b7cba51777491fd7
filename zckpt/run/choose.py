"""Where a phase's work runs, chosen in one place for ingest, export and transform.

A phase's tasks run in this process, on a Dask LocalCluster or on a Dask cluster
(:mod:`zckpt.run.engines`); in this process, a helper process may take part of them
(:mod:`zckpt.run.helper`), each task may read on a second thread (overlap), and finished
files may be synced by a publisher thread (:class:`~zckpt.io.fileio.Publisher`). These
choices depend on each other (no helper beside a cluster, no overlap thread beside a
helper by default), so they are made here, once, from the phase's options and sizes;
the phases only say what they run (:meth:`Placement.run`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from zckpt.io.fileio import Publisher
from zckpt.run.engines import Engine, RunOptions, dask_client, run_all, scheduler_threads, threads_of
from zckpt.run.helper import Helper, hand_over, overlap_beside, start, wanted

T = TypeVar("T")
R = TypeVar("R")


class PlaceOptions(RunOptions, Protocol):
    """What :func:`placement` reads of a phase's options (``IngestOptions``, ``ExportOptions``)."""

    @property
    def helper(self) -> bool | None: ...
    @property
    def overlap(self) -> bool | None: ...


@dataclass
class Placement:
    """Where one phase runs: the engine (its Dask client open inside :meth:`running`), the
    helper process and the publisher, if any."""

    engine: Engine
    helper: Helper | None
    publisher: Publisher | None
    overlap_flag: bool | None
    client: Any = None
    """The ``distributed.Client`` the tasks run on inside :meth:`running`; ``None``: this process."""

    @contextmanager
    def running(self) -> Iterator[Any]:
        """The engine open (a LocalCluster started, a cluster connected) for the block: its
        client, or ``None`` to run in this process. Opened apart from :func:`placement` so
        that a phase starts no cluster before it knows it has tasks to run."""
        with dask_client(self.engine) as client:
            self.client = client
            try:
                yield client
            finally:
                self.client = None

    def tasks(self) -> int:
        """How many tasks run at once where this phase runs (inside :meth:`running`): the
        threads of the cluster's workers (a scheduler's or a LocalCluster's), two beside a
        helper process, else one. Source-major groups are cut for this many: cut for
        ``--workers`` (1 with ``--scheduler``), a cluster ran every file of a job as one task
        on one worker while the others idled."""
        if self.helper is not None:
            return 2
        if self.client is not None:
            return threads_of(self.client)
        return self.engine.workers

    def share(self, nbytes: int) -> int:
        """Each task's part of a per-process memory bound (:meth:`Engine.share`)."""
        return self.engine.share(nbytes)

    def overlap(self, helped: bool = True) -> bool:
        """Whether each task reads on a second thread (:func:`zckpt.run.helper.overlap_beside`);
        ``helped=False`` once the helper process was given nothing (one group of files that
        share their reads): this process then has the second core to itself."""
        return overlap_beside(self.overlap_flag, self.client, self.helper if helped else None)

    def hand_over(self, units: Sequence[Any], sizes: Sequence[int], fn: Callable[..., list[R]], *args: Any,
                  step: int = 1) -> tuple[int, Callable[[], list[R]]] | None:
        """The helper's share of ``units`` (:func:`zckpt.run.helper.hand_over`): the ``aside`` of :meth:`run`."""
        return hand_over(self.helper, units, sizes, fn, *args, step=step)

    def run(self, fn: Callable[..., R], units: Sequence[T], *args: Any, label: str,
            size: Callable[[T], int] = lambda _: 1, name: Callable[[T], str] = lambda _: "",
            progress: bool | str = False, aside: tuple[int, Callable[[], list[R]]] | None = None) -> list[R]:
        """:func:`zckpt.run.engines.run_all` of ``fn`` over ``units`` where this phase runs."""
        return run_all(fn, units, *args, client=self.client, label=label, size=size, name=name, progress=progress,
                       aside=aside)


def takes_helper(options: PlaceOptions, *, helper_possible: bool, nbytes: int, ranks: int) -> bool:
    """Whether :func:`placement` starts a helper process for a phase of these sizes (``--dry-run``
    asks too, to plan the same tasks)."""
    engine = Engine.of(options)
    in_process = engine.scheduler is None and engine.workers == 1
    return helper_possible and in_process and wanted(options.helper, options.workers, options.scheduler, nbytes,
                                                     ranks)


def planned_tasks(options: PlaceOptions, *, helper: bool) -> int:
    """:meth:`Placement.tasks` of a phase, for a dry run that starts nothing: two beside a
    helper process (``helper``: :func:`takes_helper`); with a scheduler, its workers' threads,
    asked of it (connected, read, closed; a :class:`~zckpt.core.errors.UsageError` when it cannot
    be reached); else ``--workers`` (a LocalCluster of that many one-thread workers, or this
    process)."""
    if helper:
        return 2
    engine = Engine.of(options)
    engine.check()
    return scheduler_threads(engine.scheduler) if engine.scheduler is not None else engine.workers


@contextmanager
def placement(options: PlaceOptions, *, helper_possible: bool = False, nbytes: int = 0, ranks: int = 0,
              modules: Sequence[str] = (), fsync: bool | None = None) -> Iterator[Placement]:
    """Where a phase moving ``nbytes`` between ``ranks`` (the more of its source and
    destination ranks) runs, opened until the end of the block.

    A helper process (its tasks need ``modules``) is started at once when the phase may take
    one (``helper_possible``: local files, more than one task), runs in this process alone
    (no Dask workers or cluster) and wants one (:func:`zckpt.run.helper.wanted`). With
    ``fsync`` given (``True`` or ``False``), a publisher syncs the files tasks in this process
    finish. On leaving, the helper is stopped before the publisher finishes (when this process
    failed, no file of the helper's is published)."""
    engine = Engine.of(options)
    with contextlib.ExitStack() as stack:
        publisher = stack.enter_context(Publisher(fsync)) if fsync is not None else None
        started = None
        if takes_helper(options, helper_possible=helper_possible, nbytes=nbytes, ranks=ranks):
            started = start(modules)
            if started is not None:
                stack.enter_context(started)
        yield Placement(engine, started, publisher, options.overlap)
