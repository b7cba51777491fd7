"""Progress of ingest and export, per rank and per parameter, wherever the tasks run.

A task reports ``(parameter, bytes)`` ticks through a :data:`Report` callable bound to
its place in the run. In this process that is the view's own method; on a Dask cluster
it is :class:`DaskTopic`, which logs each tick as a Dask worker event that the client
receives through ``Client.subscribe_topic`` (Dask's own event channel: no extra server, no
shared files). The client shows the ticks as bars (tqdm) or as JSON lines on stderr.

Ticks are throttled in the task (:class:`Ticker`): at most about five a second per task,
each carrying the bytes done since the last one and the parameter reached.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from zckpt.core.errors import UsageError

MIB = 1024 * 1024
"""Bars count MiB, as every summary does (tqdm's own scaling mixes 1000 and 1024)."""

TICK_SECONDS = 0.2
"""Least time between two ticks of one task."""

OFF = "off"
BARS = "bars"
JSON = "json"


Report = Callable[[str, int], None]
"""``report(param, nbytes)``: ``nbytes`` more of a task's work done, up to parameter ``param``."""


def mode_of(progress: bool | str) -> str:
    """``True`` means bars (the API's historical boolean), ``False`` nothing."""
    if progress is True:
        return BARS
    if progress is False or progress is None:
        return OFF
    if progress not in (OFF, BARS, JSON):
        raise UsageError(f"progress must be one of off, bars, json, got {progress!r}")
    return str(progress)


@dataclass(frozen=True)
class DaskTopic:
    """Sends task ``task``'s ticks from the Dask worker running it to the client subscribed
    to ``topic``."""

    topic: str
    task: int

    def __call__(self, param: str, nbytes: int) -> None:
        from distributed import get_worker

        get_worker().log_event(self.topic, {"task": self.task, "param": param, "nbytes": nbytes})


@dataclass
class Ticker:
    """Throttles one task's ticks: accumulates bytes and sends them at most every
    ``interval`` seconds (and at :meth:`close`): a model of 100 000 small parameters
    must not send 100 000 events through the scheduler."""

    report: Report | None
    interval: float = field(default_factory=lambda: TICK_SECONDS)
    _pending: int = 0
    _param: str = ""
    _last: float = field(default_factory=time.monotonic)

    def add(self, param: str, nbytes: int) -> None:
        if self.report is None:
            return
        self._pending += nbytes
        self._param = param
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._send(now)

    def close(self) -> None:
        if self.report is not None and self._pending:
            self._send(time.monotonic())

    def _send(self, now: float) -> None:
        assert self.report is not None
        self.report(self._param, self._pending)
        self._pending = 0
        self._last = now


@dataclass
class _Task:
    label: str
    total: int
    done: int = 0
    param: str = ""
    finished: bool = False
    bar: Any = None


class View:
    """What the client shows for one phase: an overall bar plus a bar per task in progress
    (``rank 3``) naming the parameter it has reached (``bars``), or one JSON object per line
    on ``stream`` (``json``). Ticks may come from Dask's event thread, hence the lock; a
    task's ticks that arrive after it finished are ignored (its remainder was counted then)."""

    def __init__(self, mode: str, phase: str, tasks: Sequence[tuple[str, int]], stream: TextIO | None = None) -> None:
        """``tasks``: each task's label and its size in bytes, in run order."""
        self.mode = mode
        self.phase = phase
        self.tasks = [_Task(label, total) for label, total in tasks]
        self.total = sum(t.total for t in self.tasks)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()
        self._bar = self._new_bar(self.phase, self.total, 0) if mode == BARS else None

    def reporter(self, task: int) -> Report:
        """The report callable of task ``task`` when it runs in this process."""
        return lambda param, nbytes: self.tick(task, param, nbytes)

    def on_event(self, event: tuple[float, Any]) -> None:
        """A ``Client.subscribe_topic`` handler: ``(timestamp, message)`` from :class:`DaskTopic`."""
        msg = event[1]
        if isinstance(msg, dict):
            self.tick(int(msg.get("task", -1)), str(msg.get("param", "")), int(msg.get("nbytes", 0)))

    def tick(self, task: int, param: str, nbytes: int) -> None:
        with self._lock:
            if not 0 <= task < len(self.tasks) or self.tasks[task].finished:
                return
            state = self.tasks[task]
            n = max(0, min(nbytes, state.total - state.done))
            state.done += n
            state.param = param
            self._advance(state, n)

    def finish(self, task: int) -> None:
        """Task ``task`` has returned: whatever its ticks did not count is done too."""
        with self._lock:
            state = self.tasks[task]
            if state.finished:
                return
            n = state.total - state.done
            state.done = state.total
            state.finished = True
            self._advance(state, n)
            if state.bar is not None:
                state.bar.close()
                state.bar = None

    def close(self) -> None:
        with self._lock:
            for state in self.tasks:
                if state.bar is not None:
                    state.bar.close()
                    state.bar = None
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _advance(self, state: _Task, n: int) -> None:
        self.done += n
        if self.mode == JSON:
            self.stream.write(json.dumps({
                "event": "progress", "phase": self.phase, "task": state.label, "param": state.param,
                "task_bytes_done": state.done, "task_bytes_total": state.total, "task_done": state.finished,
                "bytes_done": self.done, "bytes_total": self.total,
            }) + "\n")
            self.stream.flush()
        elif self.mode == BARS and self._bar is not None:
            self._bar.update(n / MIB)
            if state.bar is None and not state.finished:
                state.bar = self._new_bar(f"  {state.label}", state.total,
                                          1 + sum(1 for t in self.tasks if t.bar is not None))
            if state.bar is not None:
                state.bar.set_postfix_str(state.param, refresh=False)
                state.bar.update(n / MIB)

    def _new_bar(self, label: str, total: int, position: int) -> Any:
        try:
            from tqdm import tqdm
        except ImportError:
            return _NoBar()
        return tqdm(total=total / MIB, desc=label, unit="MiB", unit_scale=False, file=self.stream,
                    leave=False, position=position, dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} MiB [{elapsed}<{remaining}, {rate_fmt}{postfix}]")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass
