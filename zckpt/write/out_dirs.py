"""Output directories of ``export`` and ``transform``: which directory a job may write, what
an interrupted or finished run of the same job left there, and what is still to write.

The decisions (:func:`pending_local`, :func:`pending_remote`) only look: the runs act on them
(:func:`resume_or_refuse`, :func:`resume_or_refuse_remote`), and ``--dry-run``
(:mod:`zckpt.jobs.dryrun`) reports them, so both refuse and resume the same way. Which of the
local and remote functions applies is chosen once, by the destination's class
(:mod:`zckpt.write.destinations`); the jobs never call these directly.

While a job runs, the marker ``<out>/.zckpt-export.json`` says which job the directory belongs
to, so that a killed run resumes; a finished run removes it and records the directory outside
it (:mod:`zckpt.write.out_records`), so the directory holds the rank files and nothing else of
zckpt's.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from zckpt.core.errors import OutputError, ZckptError
from zckpt.formats.ckpt import CkptReader
from zckpt.io import locks, remote, safe_paths, streamed_files
from zckpt.io.fileio import fsync_dir, write_atomic
from zckpt.plan.values import RankExport
from zckpt.write import out_records
from zckpt.write.safetensors_rank import output_names

Jobs = list[tuple[RankExport, Path]]


def check_out_dir(out: Path) -> Path:
    """An output directory that can be created or used: a symbolic link to nothing (which
    ``mkdir`` reports only as a bare "File exists") is refused by name."""
    if out.is_symlink() and not out.exists():
        raise OutputError(f"output path is a symbolic link to {os.readlink(out)!r}, which does not exist "
                          "(create that directory, or give another path)", path=out)
    if out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", path=out)
    return out


MARKER = ".zckpt-export.json"


def not_ours(count: int) -> str:
    """Why a destination directory holding other files is refused, and the way out."""
    what = "1 entry" if count == 1 else f"{count} entries"
    return (f"destination directory already holds {what} not written by this same export "
            "(--overwrite replaces them)")


@dataclass(frozen=True)
class Pending:
    """What a run of a job would do in its output directory: the files still to write, and
    whether the directory already holds this job's files (``resumed``) and its marker."""

    todo: Jobs
    resumed: bool
    marked: bool

    @property
    def complete(self) -> bool:
        """A finished run of this same job: nothing to write, nothing to clean up."""
        return self.resumed and not self.todo and not self.marked


def pending_local(out: Path, jobs: Jobs, fingerprint: str, overwrite: bool) -> Pending:
    """The files a run still has to write in a local directory, or the refusal of a directory
    holding other files (unless ``overwrite``). Looks only; changes nothing.

    A directory that already holds files is this same job's when it is interrupted (its
    marker has this fingerprint) or completed (no marker, and its record outside the
    directory, :func:`zckpt.write.out_records.finished_here`, matches what is there). Files complete
    under their final name (the writer names only complete files) and matching the plan are
    then kept."""
    marker = out / MARKER
    halves = set(_marker_temps(out))
    present = [p for p in out.iterdir() if p.name != MARKER and not _lock_file(p) and p not in halves] \
        if out.is_dir() else []
    marked = os.path.lexists(marker)
    if not present or overwrite:
        return Pending(jobs, resumed=False, marked=marked)
    if marked:
        try:
            same = json.loads(safe_paths.read_bytes(marker, OutputError)).get("fingerprint") == fingerprint
        except OutputError:
            raise  # a planted link is refused by name, not taken for another export's marker
        except (OSError, ValueError, AttributeError):
            same = False
    else:
        same = out_records.finished_here(out, _planned(out, jobs), fingerprint)
    if not same:
        raise OutputError(not_ours(len(present)), path=out)
    return Pending([(r, p) for r, p in jobs if not _complete_file(p, r)], resumed=True, marked=marked)


def resume_or_refuse(out: Path, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
    """The files still to write (:func:`pending_local`), with the directory made ready: an
    interrupted run's temporary files removed, the marker written, the rank folders made. A
    directory with nothing left to write is left exactly as it is."""
    for half_written in _marker_temps(out):
        half_written.unlink(missing_ok=True)
    pending = pending_local(out, jobs, fingerprint, overwrite)
    if pending.resumed:
        for stray in out.rglob("*.tmp-zckpt"):
            stray.unlink(missing_ok=True)
        if pending.complete:
            return []
    check_out_dir(out).mkdir(parents=True, exist_ok=True)
    if not overwrite:  # overwriting runs rewrite everything: nothing to resume
        write_atomic(marker_of(out), json.dumps({"fingerprint": fingerprint}).encode("utf-8"))
    output_folders(out, [p for _, p in jobs])  # after the marker: a run killed here resumes
    return pending.todo


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """Hold the local output directory ``out`` exclusively (:func:`zckpt.io.locks.output_writing`)
    while a run writes it; a run that fails before any rank file is published leaves the
    directory as it found it: the folders it made, empty, are removed, its marker too (where no
    earlier run's marker was there to resume), and the directory itself if the run made it."""
    existed = out.is_dir()
    before = set(os.listdir(out)) if existed else set()
    marked = os.path.lexists(out / MARKER)
    try:
        with locks.output_writing(out):
            try:
                yield
            except BaseException:
                _undo(out, before, marked)
                raise
    finally:
        if not existed:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: a failed run that made it


def _undo(out: Path, before: set[str], marked: bool) -> None:
    """The folders a failed run made and left empty are removed; if that leaves nothing new
    but the marker it wrote, the marker goes too (nothing to resume)."""
    new = set(os.listdir(out)) - before
    for name in sorted(new - {MARKER}):
        path = out / name
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.rmdir()
                new.discard(name)
    if new == {MARKER} and not marked:
        with contextlib.suppress(OSError):
            (out / MARKER).unlink()
    with contextlib.suppress(OSError):
        fsync_dir(out)


def marker_of(out: Path) -> Path:
    return out / MARKER


def pending_remote(out: remote.Location, jobs: Jobs, fingerprint: str, overwrite: bool) -> Pending:
    """:func:`pending_local` for a remote directory. A file present under its final name is
    complete (an upload publishes a file only when whole: :mod:`zckpt.io.streamed_files`), so
    it is kept unread; a directory without marker is this job's only if every file there has
    the size and ETag its record says (:func:`zckpt.write.out_records.finished_there`)."""
    marker = out.child(MARKER)
    present = [n for n, _ in remote.listdir(out, OutputError) if n != MARKER]
    marked = remote.exists(marker, OutputError)
    if not present or overwrite:
        return Pending(jobs, resumed=False, marked=marked)
    files = _remote_files(out)
    if marked:
        try:
            same = json.loads(remote.read_bytes(marker, OutputError)).get("fingerprint") == fingerprint
        except (OutputError, ValueError, AttributeError):
            same = False
    else:
        same = out_records.finished_there(files, _planned(Path(out.path), jobs), out.url, fingerprint)
    if not same:
        raise OutputError(not_ours(len(present)), path=out.url)
    todo = [(r, p) for r, p in jobs if p.relative_to(out.path).as_posix() not in files]
    return Pending(todo, resumed=True, marked=marked)


def resume_or_refuse_remote(out: remote.Location, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
    """:func:`resume_or_refuse` for a remote directory (:func:`pending_remote`); the uploads a
    killed run of these files left in progress are aborted (:func:`abort_orphans`)."""
    pending = pending_remote(out, jobs, fingerprint, overwrite)
    abort_orphans(out, [p for _, p in jobs])
    if pending.resumed:
        for stray in sorted(f for f in _remote_files(out) if f.endswith(".tmp-zckpt")):
            remote.remove(out.child(stray), OutputError)
        if pending.complete:
            return []
    if not overwrite:
        remote.write_bytes(out.child(MARKER), json.dumps({"fingerprint": fingerprint}).encode("utf-8"), OutputError)
    return pending.todo


def abort_orphans(out: remote.Location, paths: Iterable[Path]) -> int:
    """Abort the multipart uploads in progress of the planned files ``paths`` below ``out`` (a
    safetensors rank's parts and index too): what a killed run of them left on the server.
    Uploads of other keys are someone else's and left alone. The number aborted."""
    names: dict[str, list[str]] = {}
    for p in paths:
        folder, _, name = p.relative_to(out.path).as_posix().rpartition("/")
        names.setdefault(folder, []).append(name)

    def ours(key: str) -> bool:
        folder, _, name = key.rpartition("/")
        return any(output_names(target, [name]) for target in names.get(folder, ()))

    return streamed_files.abort_uploads(out, ours)


def _lock_file(p: Path) -> bool:
    """The output directory's lock file, where the directory itself cannot be locked
    (:func:`zckpt.io.locks.output_writing`); a link of that name is someone else's entry."""
    return p.name == locks.OUTPUT_LOCK and not p.is_symlink() and p.is_file()


def _planned(out: Path, jobs: Jobs) -> list[str]:
    return [p.relative_to(out).as_posix() for _, p in jobs]


def finish_local(out: Path, jobs: Jobs, fingerprint: str, fsync: bool = True) -> None:
    """The last step of a successful export or transform: remember the directory as this
    job's (outside it: :mod:`zckpt.write.out_records`), then remove the marker, so that the
    directory holds the rank files and nothing else of zckpt's: a task killed on a Dask worker
    and run again elsewhere leaves its file's temporary name behind (the run holds the directory,
    so no other run is writing it), which goes too."""
    drop_temporaries(out)
    out_records.remember(out_records.local_key(out), fingerprint, out_records.local_files(out, _planned(out, jobs)))
    marker = out / MARKER
    if os.path.lexists(marker):
        marker.unlink()
        if fsync:
            fsync_dir(out)


def drop_temporaries(out: Path) -> None:
    """Remove the temporary files below ``out`` at the end of a run that held it: what a task
    killed on a Dask worker (and run again elsewhere) left behind."""
    for folder, _, names in os.walk(out):  # (os.walk: pathlib's rglob took 0.5 s over 512 rank folders)
        for name in names:
            stray = Path(folder, name)
            if name.endswith(".tmp-zckpt") and stray.is_file() and not stray.is_symlink():
                stray.unlink(missing_ok=True)


def finish_remote(out: remote.Location, jobs: Jobs, fingerprint: str) -> None:
    """:func:`finish_local` for a remote directory: its record names the planned files with
    their sizes and ETags as listed there. Uploads of those files still in progress are a
    killed task's (run again elsewhere, on Dask): aborted, as :func:`finish_local` removes
    such a task's temporary file."""
    abort_orphans(out, [p for _, p in jobs])
    wanted = set(_planned(Path(out.path), jobs))
    found: dict[str, list[int | str]] = {k: [size, etag] for k, (size, etag) in _remote_files(out).items()
                                         if k in wanted}
    out_records.remember(out.url, fingerprint, found)
    remote.remove(out.child(MARKER), OutputError)


def _remote_files(out: remote.Location) -> dict[str, tuple[int, str]]:
    """``{path relative to out: (size, ETag)}`` of the files below a remote directory."""
    base = out.path.rstrip("/") + "/"
    return {p[len(base):]: n for p, n in remote.file_identities(out, OutputError).items() if p.startswith(base)}


def _marker_temps(out: Path) -> list[Path]:
    """Temporary files of a marker whose export was killed while writing it: no output was
    written yet (the marker goes first), so they hold nothing and must not make a rerun of the
    same export look like another one's directory."""
    if not out.is_dir():
        return []
    prefix = f".{MARKER}."
    return [p for p in out.iterdir() if p.name.startswith(prefix) and p.name.endswith(".tmp-zckpt")
            and p.is_file() and not p.is_symlink()]


def output_folders(out: Path, paths: Iterable[Path]) -> None:
    """Create the folders of ``paths`` below ``out`` (``rank_<r>/``), refusing by name one
    that is a symbolic link: files written there would land wherever it points."""
    check_out_dir(out).mkdir(parents=True, exist_ok=True)
    for folder in sorted({p.parent for p in paths}):
        if folder != out:
            safe_paths.real_dirs(out, folder.relative_to(out).as_posix(), OutputError, create=True)


def check_folders(out: Path, paths: Iterable[Path]) -> None:
    """:func:`output_folders`' refusals (a rank folder that is a link or not a directory),
    creating nothing (``--dry-run``)."""
    for folder in sorted({p.parent for p in paths}):
        if folder != out:
            safe_paths.real_dirs(out, folder.relative_to(out).as_posix(), OutputError)


def _complete_file(path: Path, rank: RankExport) -> bool:
    """A file written earlier by this export: it parses and holds the planned entries (a
    symbolic link is not one: it is replaced)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with CkptReader(path, verify_crc=True) as r:
            if list(r.entries) != list(rank.names):
                return False
            return all(r.entries[s.name].kind != "tensor" or r.entries[s.name].shape == s.box.shape
                       for s in rank.slices)
    except ZckptError:
        return False
