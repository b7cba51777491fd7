"""Output files written straight to object storage as the writers produce them: no local copy.

A remote rank file used to be written to a local temporary file and uploaded once complete:
twice the I/O, and local disk the size of a rank file. Here the writers' bytes go to fsspec's
buffered file (``fs.open(path, "wb", block_size=PART)``; on S3 a multipart upload fed a part
each time :data:`PART` bytes are buffered), which publishes the object under its final name
only when the upload completes (``close``) and is aborted on any failure (``discard``): a
final name never holds a partial object. The writers append front to back (a remote output is
written destination-major, one file at a time per task; source-major groups, which write at
offsets of many files at once, are for local outputs). The writers get these files from an
:class:`Uploads`, handed to them as the opener of their new files
(:data:`zckpt.io.new_files.Opener`) in place of the local one.

A part goes up while the writer produces the next, and memory stays bounded per file being
written. On S3 the file is a :class:`zckpt.io.s3_parts.PartsInFlight`: up to
:data:`~zckpt.io.s3_parts.IN_FLIGHT` (4) parts of a file on the wire at once from s3fs's
event loop (s3fs's own file sends one at a time), parts of exactly :data:`PART` bytes but the
last; at most ``(IN_FLIGHT + 1) * PART`` bytes per file (the parts in flight and the one being
filled: 80 MiB) and one write of the writer's (a band at most); a process writes as many
files at once as it runs tasks (one per worker thread). Elsewhere (GCS: fsspec's file
sends a part synchronously) a thread per file feeds fsspec's file: the bytes waiting for that
thread (:data:`PART`, or one larger write), the part being filled (as much again) and, while
it goes up, the client's copy of it.

Written by hand here is only what fsspec does not do: a multipart upload whose process was
killed outlives it on the server (invisible, billed, never completed). :func:`abort_uploads`
lists the uploads in progress under an output directory and aborts those of the files a job
plans (``list_multipart_uploads`` / ``abort_multipart_upload`` through s3fs's ``call_s3``:
s3fs itself lists a whole bucket's uploads, without a prefix or paging).

A file whose head is rewritten once the rest is written (a safetensors header holding
MindSpore's ``crc_num``, computed over the tensors in name order) cannot stream: it is written
to a local temporary file and uploaded once complete (:class:`SpooledFile`), the one case that
spools. On filesystems whose files show before they are closed (not in :data:`WHOLE_ON_CLOSE`:
``memory://``, ...) a file is streamed to ``<name>.tmp-zckpt`` and moved into place.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from zckpt.core.errors import OutputError
from zckpt.io import remote
from zckpt.io.new_files import NewFile, Unpublished

PART = 16 * 1024 * 1024
"""Bytes buffered per file before they go up as one part (S3 wants at least 5 MiB per part but
the last; 10 000 parts at most: files up to 156 GiB)."""

S3 = frozenset({"s3", "s3a"})
WHOLE_ON_CLOSE = frozenset({*S3, "gs", "gcs"})
"""Filesystems whose files written by ``open("wb")`` appear only when closed (S3's multipart
uploads, GCS's resumable uploads)."""


class _Upload:
    """The writers' file object over fsspec's. Every failure is an :class:`OutputError` naming
    the URL, raised by the writer's call or its next one. ``threaded``: the writers' bytes are
    copied (they reuse their buffers) and handed to a thread of the file that feeds fsspec's,
    so that a part goes up while the writer produces the next one; at most :data:`PART` bytes
    wait (more only for one larger write). Without it (S3: :class:`~zckpt.io.s3_parts.PartsInFlight`
    sends its parts from s3fs's event loop already) they go straight to fsspec's file."""

    def __init__(self, raw: Any, url: str, threaded: bool) -> None:
        self.raw = raw
        self.url = url
        self.size = 0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._waiting = 0
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._feed, name="zckpt-upload", daemon=True)
            self._thread.start()

    def write(self, data: bytes | memoryview) -> int:
        if self._thread is None:
            self._raise()
            try:
                n = int(self.raw.write(data))
            except BaseException as err:
                self._error = err
                self._raise()
                raise
            self.size += n
            return n
        chunk = bytes(data)
        with self._cond:
            while self._waiting and self._waiting + len(chunk) > PART and self._error is None:
                self._cond.wait()
            self._raise()
            self._chunks.append(chunk)
            self._waiting += len(chunk)
            self._cond.notify_all()
        self.size += len(chunk)
        return len(chunk)

    def flush(self) -> None:
        """Nothing: parts go up as they fill (fsspec's ``flush`` would force a short part)."""

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        pass

    def finish(self, *, drop: bool = False) -> None:
        """Wait until every byte written is handed to fsspec's file (with ``drop``: drop what
        waits), then raise a failure of the thread."""
        if self._thread is not None:
            with self._cond:
                if drop:
                    self._chunks.clear()
                self._done = True
                self._cond.notify_all()
            self._thread.join()
        if not drop:
            self._raise()

    def _feed(self) -> None:
        while True:
            with self._cond:
                while not self._chunks and not self._done:
                    self._cond.wait()
                if not self._chunks:
                    return
                chunk = self._chunks.popleft()
            try:
                self.raw.write(chunk)
            except BaseException as err:  # handed to the writer (its next call raises it)
                with self._cond:
                    self._error = err
                    self._chunks.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._waiting -= len(chunk)
                self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            with remote.remote_errors(OutputError, self.url, "cannot upload"):
                raise self._error


def _open(location: remote.Location, at: str) -> tuple[Any, bool]:
    """fsspec's buffered file at ``at`` (on S3 one that sends :data:`~zckpt.io.s3_parts.IN_FLIGHT`
    parts at once), and whether it needs a thread feeding it (:class:`_Upload`)."""
    if location.protocol in S3:
        from zckpt.io import s3_parts  # (s3fs is optional: only S3 outputs need it)

        if isinstance(location.fs, s3_parts.S3FileSystem):
            return s3_parts.PartsInFlight(location.fs, at, PART), False
    return location.fs.open(at, "wb", block_size=PART), True


class StreamedFile:
    """A file uploaded as it is written (an :class:`~zckpt.io.new_files.Unpublished`): named
    ``path`` for the writers (a path that exists nowhere), ``location`` on the server."""

    def __init__(self, path: Path, location: remote.Location, on_publish: Callable[[remote.Location], None]) -> None:
        self.path = path
        self.location = location
        self._on_publish = on_publish
        self._at = location.path if location.protocol in WHOLE_ON_CLOSE else location.path + ".tmp-zckpt"
        with remote.remote_errors(OutputError, location.url, "cannot upload"):
            raw, threaded = _open(location, self._at)
        self._upload = _Upload(raw, location.url, threaded)
        self.file = cast(BinaryIO, self._upload)

    def publish(self, fsync: bool, *, sync_dir: bool = True) -> None:
        """Complete the upload: the object appears under its final name now, whole."""
        try:
            self._upload.finish()
            with remote.remote_errors(OutputError, self.location.url, "cannot upload"):
                self._upload.raw.close()
                if self._at != self.location.path:
                    self.location.fs.mv(self._at, self.location.path)
        except BaseException:
            self.discard()
            raise
        self._on_publish(self.location)

    def discard(self) -> None:
        """Abort the upload (nothing appears; the server drops the parts sent)."""
        self._upload.finish(drop=True)
        raw = self._upload.raw
        with contextlib.suppress(Exception):  # the server may be what failed: the next run aborts it
            raw.discard()
        with contextlib.suppress(Exception):
            raw.closed = True  # not flushed again when collected
        if self._at != self.location.path:
            with contextlib.suppress(Exception):
                remote.remove(remote.Location(self.location.url + ".tmp-zckpt", self.location.fs, self._at),
                              OutputError)


class SpooledFile:
    """A file written to a local temporary file and uploaded once complete: for a file whose
    head is rewritten last (an :data:`~zckpt.io.new_files.Opener`'s ``head_last``)."""

    def __init__(self, path: Path, location: remote.Location, on_publish: Callable[[remote.Location], None]) -> None:
        self.path = path
        self.location = location
        self._on_publish = on_publish
        self._tmp = Path(tempfile.mkdtemp(prefix="zckpt-out-"))
        self._new = NewFile(self._tmp / path.name)
        self.file = self._new.file

    def publish(self, fsync: bool, *, sync_dir: bool = True) -> None:
        try:
            self._new.publish(False)
            remote.upload(self._new.path, self.location, OutputError)
        finally:
            self.discard()
        self._on_publish(self.location)

    def discard(self) -> None:
        self._new.discard()
        shutil.rmtree(self._tmp, ignore_errors=True)


class Uploads:
    """The opener of a remote output's new files (a :data:`~zckpt.io.new_files.Opener`, handed
    to the writers): each file the writer makes below :attr:`path`'s folder goes to ``folder``
    on the server under the same relative name, streamed (:class:`StreamedFile`) or, with its
    head rewritten last, spooled (:class:`SpooledFile`). :attr:`path` is where the writer
    writes ``name``: a local path that exists nowhere (a writer's look for files already there
    finds none), which names the files it writes beside it (a safetensors rank's parts and
    index) and the errors about them (:func:`zckpt.io.remote.named_by_url`)."""

    def __init__(self, folder: remote.Location, name: str) -> None:
        self.folder = folder
        self.root = Path(tempfile.gettempdir(), f"zckpt-stream-{uuid.uuid4().hex}")
        self.path = self.root / name
        self.published: list[remote.Location] = []
        """The files published so far."""

    def __call__(self, path: Path, head_last: bool) -> Unpublished:
        if not path.is_relative_to(self.root):
            raise OutputError(f"a new file outside the upload folder {self.folder.url}", path=path)
        where = self.folder.child(*path.relative_to(self.root).parts)
        kind = SpooledFile if head_last else StreamedFile
        return kind(path, where, self.published.append)


def abort_uploads(out: remote.Location, ours: Callable[[str], bool]) -> int:
    """Abort the multipart uploads in progress below ``out`` whose keys (relative to ``out``)
    are ``ours``: what a killed run left; others' uploads are left alone. The number aborted
    (0 where the filesystem has no multipart uploads)."""
    if out.protocol not in S3:
        return 0
    bucket, _, prefix = out.path.partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    aborted = 0
    with remote.remote_errors(OutputError, out.url, "cannot list the uploads in progress"):
        for key, upload in _uploads(out.fs, bucket, prefix):
            if ours(key[len(prefix):]):
                out.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
                aborted += 1
    return aborted


def _uploads(fs: Any, bucket: str, prefix: str) -> Iterator[tuple[str, str]]:
    """``(key, upload id)`` of each multipart upload in progress under ``prefix``, page by page."""
    marks: dict[str, str] = {}
    while True:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marks)
        for u in page.get("Uploads") or []:
            yield str(u["Key"]), str(u["UploadId"])
        if not page.get("IsTruncated"):
            return
        marks = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
