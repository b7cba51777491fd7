"""One exception hierarchy for everything zckpt refuses.

Every error carries the file and the parameter it is about (when known) so that a user
can act on the message alone. The classes also derive from the builtin exception that
MindSpore raises in the same situation, so code written against ``mindspore`` keeps
catching what it used to catch after swapping the import.
"""

from __future__ import annotations

from os import PathLike


class ZckptError(Exception):
    """Base class: ``str(err)`` names the file and parameter involved."""

    def __init__(
        self,
        message: str,
        *,
        path: str | PathLike[str] | None = None,
        param: str | None = None,
    ) -> None:
        self.message = message
        self.path = None if path is None else str(path)
        self.param = param
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"file {self.path}")
        if self.param is not None:
            where.append(f"parameter {self.param!r}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


class CheckpointFormatError(ZckptError, ValueError):
    """A ``.ckpt`` file is truncated, corrupt or holds something zckpt cannot represent."""


class StrategyError(ZckptError, ValueError):
    """A strategy file cannot be read, or a layout is inconsistent."""


class LayoutError(ZckptError, ValueError):
    """A layout does not fit a tensor (shape not divisible, axis out of range, ...)."""


class SourceError(ZckptError, ValueError):
    """The set of source shards is incomplete or inconsistent (missing rank, replicas differ)."""


class StoreError(ZckptError, ValueError):
    """The Zarr store is missing, foreign, or incomplete."""


class OutputError(ZckptError, ValueError):
    """The output location cannot be written (exists, not a directory, ...)."""


class UsageError(ZckptError, ValueError):
    """Arguments are invalid."""


class CommandLineError(UsageError):
    """The command line itself is wrong (options that do not go together, a value of the wrong
    form), found before any file is read: exit code 2, as argparse's own errors. A refusal of
    what the files hold, or of a path that is not there, is any other error: exit code 1."""


class DiskFullError(ZckptError, OSError):
    """The device (or quota) holding a file zckpt writes is full: the error names that file.
    Nothing it leaves looks complete: temporary files are removed, a store stays marked
    incomplete (rerun the ingest once space is freed: it resumes, or starts anew when the
    disk was full before any data was written)."""
