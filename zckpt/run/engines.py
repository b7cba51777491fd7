"""Where work runs: in this process, on a Dask LocalCluster, or on an existing Dask cluster.

zckpt's work units are whole files (one source rank for ingest, one destination file for
export): each is independent, writes disjoint chunks or its own file, and is bounded in
memory by ``block_bytes``. This module only maps a top-level function over such units
with Dask distributed (never a home-made cluster) and reports progress.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from zckpt.core.errors import UsageError
from zckpt.run.progress import OFF, DaskTopic, View, mode_of

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
T = TypeVar("T")
R = TypeVar("R")


class RunOptions(Protocol):
    """What :class:`Engine` reads from ``IngestOptions`` and ``ExportOptions``."""

    @property
    def workers(self) -> int: ...
    @property
    def scheduler(self) -> str | None: ...
    @property
    def processes(self) -> bool: ...


P = TypeVar("P")


def travelling(path: P, scheduler: str | None) -> P:
    """``path`` as the workers of ``scheduler`` must be given it: a relative local path made
    absolute, since a Dask worker started elsewhere (another host, another directory) reads it
    from its own working directory (``file s.zarr: not a zarr store`` there, and a half-made
    output here). URLs, objects (an open store) and every path of a run without a scheduler
    are returned as they are."""
    if scheduler is None:
        return path
    if isinstance(path, Mapping):
        return cast(P, {k: travelling(v, scheduler) for k, v in path.items()})
    if isinstance(path, str) and _SCHEME.match(path) and not path.lower().startswith("file://"):
        return path
    if isinstance(path, (str, os.PathLike)):
        text: str = os.fspath(cast("str | os.PathLike[str]", path))
        text = text[len("file://"):] if text.lower().startswith("file://") else text
        absolute = os.path.abspath(text)
        return cast(P, absolute if isinstance(path, str) else Path(absolute))
    return path


@dataclass(frozen=True)
class Engine:
    """How to run tasks: ``workers`` > 1 starts a LocalCluster of that many workers;
    ``scheduler`` connects to a running Dask scheduler (``tcp://host:8786``) instead.

    Local workers are threads of this process unless ``processes``: zckpt's tasks spend
    their time in system calls (``copy_file_range``, ``pread``/``write``) that release the
    GIL, and thread workers start in a fraction of the ~2 s a cluster of worker processes
    takes, which is a third of a 1 GiB job (bench/RESULTS.md)."""

    workers: int = 1
    scheduler: str | None = None
    processes: bool = False

    @classmethod
    def of(cls, options: RunOptions) -> Engine:
        """The engine an ingest's or an export's options ask for."""
        return cls(options.workers, options.scheduler, options.processes)

    def share(self, nbytes: int) -> int:
        """Each task's part of a per-process memory bound: local thread workers share one
        process, so ``N`` of them get ``1/N`` each; worker processes each get the whole."""
        if self.scheduler is None and self.workers > 1 and not self.processes:
            return max(1, nbytes // self.workers)
        return nbytes

    def check(self) -> None:
        if self.workers < 1:
            raise UsageError(f"workers must be at least 1, got {self.workers}")
        if self.scheduler is not None and self.workers > 1:
            raise UsageError("give either a scheduler address or a number of local workers, not both")


MiB = 1024 * 1024


@dataclass(frozen=True)
class Budget:
    """How a memory bound turns into step sizes.

    Ingest holds at most one write batch being encoded (``block_bytes``, plus zarr's copy of
    it); export holds one batch of slices, the band being written and the chunks zarr is
    decoding (at most ``chunk_bytes`` each, a few at a time). A quarter of the bound per
    batch and a sixteenth per chunk keep the sum under the bound.
    """

    max_bytes: int
    block_bytes: int
    chunk_bytes: int


def memory_budget(max_bytes: int, block_mb: int | None = None, chunk_mb: int | None = None) -> Budget:
    if max_bytes < 16 * MiB:
        raise UsageError(f"--max-mem must be at least 16 MiB, got {max_bytes} bytes")
    block = block_mb * MiB if block_mb else max_bytes // 4
    chunk = chunk_mb * MiB if chunk_mb else min(64 * MiB, max_bytes // 16)
    return Budget(max_bytes, block, chunk)


@contextmanager
def dask_client(engine: Engine) -> Iterator[Any]:
    """A ``distributed.Client`` for the engine, or ``None`` to run in this process."""
    engine.check()
    if engine.scheduler is None and engine.workers == 1:
        yield None
        return
    try:
        from distributed import Client, LocalCluster
    except ImportError as err:  # a dependency of zckpt: only a damaged environment lacks it
        raise UsageError(f"Dask distributed, a dependency of zckpt, cannot be imported ({err}); reinstall zckpt "
                         "(pip install zckpt)") from None
    if engine.scheduler is not None:
        try:
            client = Client(engine.scheduler)
        except (OSError, ValueError) as err:  # unreachable (a timeout), or not an address
            raise UsageError(f"cannot reach the Dask scheduler {engine.scheduler}: {err}",
                             param="--scheduler") from err
        try:
            yield client
        finally:
            client.close()
        return
    cluster = LocalCluster(
        n_workers=engine.workers, threads_per_worker=1, processes=engine.processes, dashboard_address=None,
        memory_limit=0,
    )
    client = Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def threads_of(client: Any) -> int:
    """How many tasks a cluster runs at once: the threads of its workers (at least one)."""
    return max(1, sum(int(n) for n in client.nthreads().values()))


def scheduler_threads(address: str) -> int:
    """:func:`threads_of` the cluster of a running scheduler, asked of it (connected, read,
    closed): what a dry run plans a run on it for."""
    with dask_client(Engine(scheduler=address)) as client:
        return threads_of(client)


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wants_overlap(flag: bool | None) -> bool:
    """Whether a task runs its reads on a second thread: as asked, or (``None``, auto) when a
    task running alone has a core to spare for it."""
    return flag if flag is not None else usable_cpus() > 1


def overlap_for(flag: bool | None, client: Any) -> bool:
    """Resolve auto overlap (``None``) for the tasks a client is about to run.

    A task's second thread pays only if a core is free for it: each host must run fewer
    tasks at once than it has cores. Two thread workers on 2 cores, each with a second
    thread, exported the 4 GiB benchmark in 3.8-4.1 s; without, 3.0-3.5 s (bench/RESULTS.md).
    """
    if flag is not None:
        return flag
    if client is None:
        return wants_overlap(None)
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # older distributed: no argument, every worker listed
        info = client.scheduler_info()
    return cores_to_spare(info.get("workers", {}), client.run(usable_cpus))


def cores_to_spare(workers: Mapping[str, Mapping[str, Any]], cpus: Mapping[str, int]) -> bool:
    """Whether every host runs fewer tasks at once (its workers' threads) than it has
    cores; ``workers`` is a scheduler's worker table, ``cpus`` each worker's usable cores."""
    tasks: dict[str, int] = {}
    cores: dict[str, int] = {}
    for address, info in workers.items():
        host = str(info.get("host", address))
        tasks[host] = tasks.get(host, 0) + int(info.get("nthreads", 1))
        cores[host] = min(cores.get(host, cpus.get(address, 1)), cpus.get(address, 1))
    return bool(tasks) and all(tasks[h] < cores[h] for h in tasks)


def run_all(
    fn: Callable[..., R],
    units: Sequence[T],
    *args: Any,
    client: Any,
    label: str,
    size: Callable[[T], int] = lambda _: 1,
    name: Callable[[T], str] = lambda _: "",
    progress: bool | str = False,
    aside: tuple[int, Callable[[], list[R]]] | None = None,
) -> list[R]:
    """``[fn(unit, *args, report=...) for unit in units]``, on the cluster when there is one.

    ``aside``: ``(first, results)``, without a cluster: the units from ``first`` on run
    elsewhere (:mod:`zckpt.run.helper`) and ``results()`` waits for theirs once this process has
    run its own; the view counts them done then.

    Each task gets a ``report(param, nbytes)`` callable (``None`` when progress is off)
    that feeds the view of this phase (:mod:`zckpt.run.progress`): directly in this process,
    through Dask's worker events on a cluster. Results come back in ``units`` order; the
    first failure is raised as it was raised in the task (zckpt errors keep their class
    and message).
    """
    if not units:
        return []
    mode = mode_of(progress)
    view = View(mode, label, [(name(u), size(u)) for u in units]) if mode != OFF else None
    topic: str | None = None
    try:
        if client is None:
            first = aside[0] if aside is not None else len(units)
            out = []
            for i, u in enumerate(units[:first]):
                out.append(fn(u, *args, report=view.reporter(i) if view is not None else None))
                if view is not None:
                    view.finish(i)
            if aside is not None:
                out.extend(aside[1]())
                if view is not None:
                    for i in range(first, len(units)):
                        view.finish(i)
            return out
        if aside is not None:
            raise ValueError("units run aside only without a cluster")
        from distributed import as_completed

        if view is not None:
            topic = f"zckpt-progress-{uuid.uuid4().hex}"
            client.subscribe_topic(topic, view.on_event)
        futures = [client.submit(fn, u, *args, report=DaskTopic(topic, i) if topic else None, pure=False)
                   for i, u in enumerate(units)]
        index = {f.key: i for i, f in enumerate(futures)}
        results: list[Any] = [None] * len(units)
        try:
            for fut in as_completed(futures):
                i = index[fut.key]
                results[i] = fut.result()
                if view is not None:
                    view.finish(i)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return results
    finally:
        if topic is not None:
            client.unsubscribe_topic(topic)
        if view is not None:
            view.close()
