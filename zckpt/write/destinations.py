"""Where an export or transform writes: a local directory or a remote one, one class each,
chosen once from the path or URL the user gave (:func:`output_dir`), and the same for one
destination file (:func:`output_file`).

The jobs plan their rank files on :attr:`OutputDir.path` and then only ask the destination:
which files are still to write (resume or refuse, :mod:`zckpt.write.out_dirs`), what a task
receives as its target, how a rank folder is made, how a finished run is recorded, what
``--dry-run`` reports. A task publishes its file through :func:`output_file`, which hands the
task's writer the opener of its new files: a local file is written in place (a
:class:`~zckpt.io.new_files.NewFile`, named only when complete, by the publisher where one is
given); a remote file is uploaded as it is written (a multipart upload on S3:
:class:`zckpt.io.streamed_files.Uploads`), so that its final name never holds a partial file and
no byte of it touches local disk.

The mechanics of markers, records and leftovers stay in :mod:`zckpt.write.out_dirs` and
:mod:`zckpt.write.out_records`; a new kind of destination is one more class here, chosen in
:func:`destination` and :func:`output_file`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from zckpt.core.errors import OutputError
from zckpt.formats.shard_reader import INDEX_SUFFIX
from zckpt.io import locks, new_files, remote, streamed_files
from zckpt.io.fileio import Publisher, disk_full_named, write_atomic
from zckpt.write import out_dirs, out_records
from zckpt.write.boxes import RankResult
from zckpt.write.out_dirs import Jobs
from zckpt.write.safetensors_rank import existing_outputs, remote_outputs

WriteAt = Callable[[Path, Publisher | None, new_files.Opener], RankResult]
"""Writes a rank's file at a path, each new file opened by the opener (named through the
publisher, when one is given)."""

WriteParts = Callable[[Path, new_files.Opener], RankResult]
"""Writes a rank's files (a safetensors rank's parts and index) at a path, each opened by the opener."""


class OutputDir(Protocol):
    """An output directory (:class:`LocalOutputDir`, :class:`RemoteOutputDir`)."""

    @property
    def path(self) -> Path:
        """Where the rank files are planned: the local directory, or a remote one's path inside
        its filesystem (:meth:`target` turns a planned file back into what a task writes)."""

    @property
    def url(self) -> str:
        """The directory as reports and messages name it."""

    @property
    def local(self) -> bool:
        """Files are written in place on this machine's disk (a helper process may share the writing)."""

    def check(self) -> None:
        """Refuse a path that cannot be an output directory."""

    def is_file(self) -> bool:
        """The path names a file (MindSpore's functions refuse it with their own error)."""

    def create(self) -> None:
        """Make the directory (where directories exist)."""

    def holding(self) -> contextlib.AbstractContextManager[None]:
        """Hold the directory while a run writes it (and undo a failed run's folders)."""

    def scratch(self) -> tempfile.TemporaryDirectory[str]:
        """A temporary directory for the work behind the files (a temporary store)."""

    def target(self, path: str | Path) -> str:
        """What a task receives for a planned file (:func:`output_file` reopens it)."""

    def resume_or_refuse(self, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
        """The files still to write, the directory made ready (:func:`zckpt.write.out_dirs.resume_or_refuse`)."""

    def would_write(self, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
        """:meth:`resume_or_refuse`'s answer and refusals, changing nothing (``--dry-run``)."""

    def finish(self, jobs: Jobs, fingerprint: str, fsync: bool = True) -> None:
        """Record a successful run and remove its marker."""

    def present(self, jobs: Jobs) -> list[str]:
        """Files a safetensors write of ``jobs`` would replace (file, index or parts)."""

    def finished_as_recorded(self, fingerprint: str) -> bool:
        """The directory holds exactly what the job ``fingerprint`` recorded when it finished."""

    def make_folders(self, paths: Iterable[Path]) -> None:
        """The rank folders of ``paths`` (:func:`zckpt.write.out_dirs.output_folders`)."""

    def check_folders(self, paths: Iterable[Path]) -> None:
        """:meth:`make_folders`' refusals, creating nothing."""

    def remember_all(self, fingerprint: str) -> None:
        """Record every file below the directory as the job's (safetensors)."""

    def probe(self) -> None:
        """Refuse a directory another run holds, without taking it (``--dry-run``)."""

    def free_space(self) -> int | None:
        """Free bytes where the files go (``None``: not known)."""


@dataclass(frozen=True)
class LocalOutputDir:
    """A directory on a local disk, held by a lock while a run writes it."""

    path: Path

    @property
    def url(self) -> str:
        return str(self.path)

    @property
    def local(self) -> bool:
        return True

    def check(self) -> None:
        out_dirs.check_out_dir(self.path)

    def is_file(self) -> bool:
        return self.path.exists() and not self.path.is_dir()

    def create(self) -> None:
        out_dirs.check_out_dir(self.path).mkdir(parents=True, exist_ok=True)

    def holding(self) -> contextlib.AbstractContextManager[None]:
        return out_dirs.writing(self.path)

    def scratch(self) -> tempfile.TemporaryDirectory[str]:
        """Beside the files (the same filesystem)."""
        return _scratch_in(self.path)

    def target(self, path: str | Path) -> str:
        return str(path)

    def resume_or_refuse(self, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
        return out_dirs.resume_or_refuse(self.path, jobs, fingerprint, overwrite)

    def would_write(self, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
        out_dirs.check_out_dir(self.path)
        todo = out_dirs.pending_local(self.path, jobs, fingerprint, overwrite).todo
        self.check_folders(p for _, p in jobs)
        return todo

    def finish(self, jobs: Jobs, fingerprint: str, fsync: bool = True) -> None:
        out_dirs.finish_local(self.path, jobs, fingerprint, fsync)

    def present(self, jobs: Jobs) -> list[str]:
        return [str(p) for _, target in jobs for p in existing_outputs(target)]

    def finished_as_recorded(self, fingerprint: str) -> bool:
        return out_records.finished_as_recorded(self.path, fingerprint)

    def make_folders(self, paths: Iterable[Path]) -> None:
        out_dirs.output_folders(self.path, paths)

    def check_folders(self, paths: Iterable[Path]) -> None:
        out_dirs.check_folders(self.path, paths)

    def remember_all(self, fingerprint: str) -> None:
        out_dirs.drop_temporaries(self.path)
        out_records.remember_all(self.path, fingerprint)

    def probe(self) -> None:
        locks.probe_output(self.path)

    def free_space(self) -> int | None:
        return free_space(self.path)


@dataclass(frozen=True)
class RemoteOutputDir:
    """A directory on an fsspec filesystem: no lock (its marker says whose it is), no folders
    to make (object stores have none), files uploaded as they are written. The uploads a
    killed process left in progress for the planned files are aborted when the run starts
    (:meth:`resume_or_refuse`, :meth:`make_folders`), ends (:meth:`finish`,
    :meth:`remember_all`) and fails (:meth:`holding`)."""

    location: remote.Location
    planned: list[Path] = field(default_factory=list, compare=False, repr=False)
    """The files this run writes (known once it asked what is still to write)."""

    @property
    def local(self) -> bool:
        return False

    @property
    def path(self) -> Path:
        return Path(self.location.path)

    @property
    def url(self) -> str:
        return self.location.url

    def check(self) -> None:
        if self.is_file():
            raise OutputError("output path exists and is not a directory", path=self.url)

    def is_file(self) -> bool:
        return remote.isfile(self.location, OutputError)

    def create(self) -> None:
        pass

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """A failed run aborts the uploads of its files still in progress (those of a task
        killed on a worker, which no exception there reached)."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(OutputError):  # the server may be what failed: the next run aborts them
                out_dirs.abort_orphans(self.location, self.planned)
            raise

    def scratch(self) -> tempfile.TemporaryDirectory[str]:
        """In the local temporary directory."""
        return _scratch_in(None)

    def target(self, path: str | Path) -> str:
        return self.location.url_of(Path(path).as_posix())

    def resume_or_refuse(self, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
        self.planned[:] = [p for _, p in jobs]
        return out_dirs.resume_or_refuse_remote(self.location, jobs, fingerprint, overwrite)

    def would_write(self, jobs: Jobs, fingerprint: str, overwrite: bool) -> Jobs:
        return out_dirs.pending_remote(self.location, jobs, fingerprint, overwrite).todo

    def finish(self, jobs: Jobs, fingerprint: str, fsync: bool = True) -> None:
        out_dirs.finish_remote(self.location, jobs, fingerprint)

    def present(self, jobs: Jobs) -> list[str]:
        return [self.location.url_of(p) for _, target in jobs for p in remote_outputs(self.location, target.as_posix())]

    def finished_as_recorded(self, fingerprint: str) -> bool:
        return False  # not kept: a rerun rewrites a remote safetensors export

    def make_folders(self, paths: Iterable[Path]) -> None:
        """No folders: the uploads a killed run of these files left in progress are aborted."""
        self.planned[:] = list(paths)
        out_dirs.abort_orphans(self.location, self.planned)

    def check_folders(self, paths: Iterable[Path]) -> None:
        pass

    def remember_all(self, fingerprint: str) -> None:
        """Nothing recorded (a rerun rewrites a remote safetensors export); the uploads of its
        files a killed task left in progress are aborted (:func:`zckpt.write.out_dirs.finish_remote`)."""
        out_dirs.abort_orphans(self.location, self.planned)

    def probe(self) -> None:
        pass

    def free_space(self) -> int | None:
        return None


def destination(out_dir: str | Path, storage_options: remote.StorageOptions) -> OutputDir:
    """The output directory named by ``out_dir`` (a URL is remote), not yet checked."""
    if isinstance(out_dir, str) and remote.is_remote(out_dir):
        return RemoteOutputDir(remote.locate(out_dir, storage_options, OutputError))
    return LocalOutputDir(remote.local_path(out_dir))


def output_dir(out_dir: str | Path, storage_options: remote.StorageOptions) -> OutputDir:
    """:func:`destination`, refused when it cannot be an output directory (a file, or a
    symbolic link to nothing)."""
    dest = destination(out_dir, storage_options)
    dest.check()
    return dest


def refuse_present(clash: list[str]) -> None:
    """A safetensors write refuses files present already (:meth:`OutputDir.present`): their
    names are known only once written, so they are not resumed but replaced on request."""
    if clash:
        raise OutputError(f"{len(clash)} output file(s) already exist (--overwrite replaces them)", path=clash[0])


def free_space(path: Path) -> int:
    """Free bytes (for this user) of the filesystem holding ``path`` or, while it does not
    exist, its nearest existing parent."""
    at = path.absolute()
    while not at.exists() and at.parent != at:
        at = at.parent
    return shutil.disk_usage(at).free


class OutputFile(Protocol):
    """One destination file as a task publishes it (:class:`LocalFile`, :class:`RemoteFile`)."""

    @property
    def url(self) -> str:
        """The file as messages name it."""

    def publish(self, write: WriteAt, publisher: Publisher | None = None) -> RankResult:
        """Write the file by ``write`` and make it visible under its name once complete."""

    def publish_parts(self, write: WriteParts) -> RankResult:
        """:meth:`publish` for a write that may leave several files (a safetensors rank's
        parts and index), replacing what an earlier write of this file left."""

    @property
    def folder(self) -> str:
        """The directory holding the file, as messages name it."""

    def is_dir(self) -> bool:
        """The name is taken by a directory."""

    def exists(self) -> bool:
        """The name is taken."""

    def remove(self) -> None:
        """Remove the file, if there is one (what a failed run of several files published)."""

    def scratch(self) -> tempfile.TemporaryDirectory[str]:
        """A temporary directory for the work behind the file (a temporary store)."""


@dataclass(frozen=True)
class LocalFile:
    """A file on a local disk: written in place (the publisher names it only when complete)."""

    path: Path

    @property
    def url(self) -> str:
        return str(self.path)

    def publish(self, write: WriteAt, publisher: Publisher | None = None) -> RankResult:
        with disk_full_named(self.path):
            return write(self.path, publisher, new_files.local)

    def publish_parts(self, write: WriteParts) -> RankResult:
        return self.publish(lambda path, _, files: write(path, files))

    @property
    def folder(self) -> str:
        return str(self.path.parent)

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def exists(self) -> bool:
        return self.path.exists()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def scratch(self) -> tempfile.TemporaryDirectory[str]:
        """Beside the file (the same filesystem); its folder is made."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return _scratch_in(self.path.parent)


@dataclass(frozen=True)
class RemoteFile:
    """A file on an fsspec filesystem: uploaded as it is written, visible under its name only
    once complete (:mod:`zckpt.io.streamed_files`), nothing of it on this machine's disk."""

    url: str
    storage_options: Mapping[str, Any] | None = None

    @property
    def location(self) -> remote.Location:
        return remote.locate(self.url, self.storage_options, OutputError)

    def publish(self, write: WriteAt, publisher: Publisher | None = None) -> RankResult:
        uploads = streamed_files.Uploads(self.location.sibling(""), self._name)
        with remote.named_by_url(uploads.root, self.url):
            result = write(uploads.path, None, uploads)
        return replace(result, path=self.url)

    def publish_parts(self, write: WriteParts) -> RankResult:
        """Each file goes up as it is written (the parts before the index that names them);
        an earlier write's index is removed first (it would name a mix of old and new parts),
        and what that write left that this one did not (e.g. parts of another split) once this
        one is complete. A failed write leaves no part of it or of the earlier write."""
        loc = self.location
        folder = loc.sibling("")
        stale = set(remote_outputs(loc, loc.path))
        for old in sorted(p for p in stale if p.endswith(INDEX_SUFFIX)):
            remote.remove(_beside(loc, old), OutputError)
            stale.discard(old)
        uploads = streamed_files.Uploads(folder, self._name)
        try:
            with remote.named_by_url(uploads.root, folder.url, children=True):
                result = write(uploads.path, uploads)
        except BaseException:
            for p in sorted(({f.path for f in uploads.published} | stale) - {loc.path}):
                with contextlib.suppress(OutputError):
                    remote.remove(_beside(loc, p), OutputError)
            raise
        for p in sorted(stale - {f.path for f in uploads.published}):
            remote.remove(_beside(loc, p), OutputError)
        return replace(result, path=folder.child(Path(result.path).name).url)

    @property
    def folder(self) -> str:
        return self.location.sibling("").url.rstrip("/")

    def is_dir(self) -> bool:
        return remote.isdir(self.location, OutputError)

    def exists(self) -> bool:
        return remote.exists(self.location, OutputError)

    def remove(self) -> None:
        remote.remove(self.location, OutputError)

    def scratch(self) -> tempfile.TemporaryDirectory[str]:
        """In the local temporary directory."""
        return _scratch_in(None)

    @property
    def _name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]


def _beside(loc: remote.Location, path: str) -> remote.Location:
    """The file ``path`` of ``loc``'s filesystem."""
    return remote.Location(loc.url_of(path), loc.fs, path)


def output_file(target: str | Path, storage_options: remote.StorageOptions) -> OutputFile:
    """The destination file named by ``target`` (a URL is remote)."""
    if isinstance(target, str) and remote.is_remote(target):
        return RemoteFile(target, storage_options)
    return LocalFile(remote.local_path(target))


def publish_bytes(out: OutputFile, data: bytes, fsync: bool = True) -> None:
    """A small file written whole as ``out``: on local disk a new file named when complete, on
    object storage one upload (a single ``PUT``), nothing under its name on any failure."""

    def write(path: Path, publisher: Publisher | None, files: new_files.Opener) -> RankResult:
        write_atomic(path, data, fsync=fsync, files=files)
        return RankResult(-1, str(path), 0, len(data))

    out.publish(write)


def _scratch_in(folder: Path | None) -> tempfile.TemporaryDirectory[str]:
    """A temporary directory in ``folder`` (hidden there), or in the local temporary directory."""
    if folder is None:
        return tempfile.TemporaryDirectory(prefix="zckpt-api-")
    return tempfile.TemporaryDirectory(prefix=".zckpt-", dir=folder)
