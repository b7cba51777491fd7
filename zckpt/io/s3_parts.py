"""A streamed multipart upload to S3 with several parts of one file on the wire at once.

s3fs's buffered file (``fs.open(path, "wb")``: ``S3File``) sends a part from the writer's
thread when its buffer fills and waits for the answer (its ``_upload_chunk``, "TODO: concurrent
here" as of s3fs 2026.9): one part of a file in flight, the connection idle while the writer
fills the next. s3fs's concurrent parts (``put_file`` with ``max_concurrency``, through
``_upload_file_part_concurrent``) read a local file from s3fs's event loop: a stream fed by a
writer cannot be read there without stalling every other request of the process on that loop.
So :class:`PartsInFlight` keeps ``S3File`` (starting the multipart upload, completing it, the
one-shot ``PutObject`` of a file below a part, the abort) and replaces only ``_upload_chunk``,
the one thing written by hand: each full part is handed to s3fs's event loop as a task
(``_call_s3("upload_part")``, with s3fs's own retries inside), at most :data:`IN_FLIGHT` of a
file at once; the writer waits only when that many are on the wire. Memory of a file: the part
being filled (up to a part, plus one write of the writer's) and the parts in flight, so at
most ``(IN_FLIGHT + 1) * part`` and one write.

Parts are exactly ``block_size`` bytes but the last (s3fs cuts parts the size of whatever
is buffered when it flushes): an object's multipart ETag (the MD5 of its parts' MD5s, ``-n``)
depends only on its bytes and the part size. A part that fails is retried on the same policy
as a ranged read (:class:`zckpt.io.ranged.RangePolicy`: a transient failure tried again after
a doubling backoff, a request without an answer after ``stall_seconds`` given up); its last
failure is raised by the writer's next call, and :meth:`PartsInFlight.discard` cancels the
parts still in flight, waits until they have ended and aborts the upload: nothing appears
under the name and no upload is left on the server.
"""

from __future__ import annotations

import asyncio
import io
import threading
from concurrent.futures import Future
from typing import Any

from s3fs.core import S3File, S3FileSystem

from zckpt.io.ranged import DEFAULT_POLICY, RangePolicy, transient

__all__ = ["IN_FLIGHT", "PartsInFlight", "S3FileSystem"]

IN_FLIGHT = 4
"""Parts of one file on the wire at once."""

SETTLE_SECONDS = 60.0
"""Longest :meth:`PartsInFlight.discard` waits for cancelled parts to end before it aborts."""


class PartsInFlight(S3File):  # type: ignore[misc]  # (s3fs has no type hints)
    """``S3File`` opened ``"wb"`` as ``fs.open`` opens it, whose full parts go up concurrently
    (see the module doc). ``in_flight``: parts of this file on the wire at once."""

    policy: RangePolicy = DEFAULT_POLICY
    """Retries of a part (those of a ranged read)."""
    buffer: io.BytesIO
    """The part being filled (fsspec's)."""

    def __init__(self, fs: Any, path: str, block_size: int, *, in_flight: int = IN_FLIGHT) -> None:
        kw = dict(fs.s3_additional_kwargs)
        super().__init__(fs, path, "wb", block_size=block_size, acl=kw.get("ACL", False) or kw.get("acl", False),
                         s3_additional_kwargs=kw, requester_pays=fs.requester_pays)
        self.in_flight = in_flight
        self._cond = threading.Condition()
        self._running = 0
        self._sent: list[Future[dict[str, Any]]] = []
        self._failed: BaseException | None = None
        self._stopped = False

    def _upload_chunk(self, final: bool = False) -> bool:
        if final and self.autocommit and not self._sent and self.tell() < self.blocksize:
            self.commit()  # below a part: one PutObject (S3File's)
            return False
        with self.buffer.getbuffer() as view:
            size, pos = len(view), 0
            while size - pos >= self.blocksize or (final and pos < size):
                n = min(self.blocksize, size - pos)
                part = bytes(view[pos : pos + n])
                pos += n
                self._send(part)
            rest = bytes(view[pos:])
        if final:
            self.parts = self._answers()
            self.commit()
        else:
            self.offset += pos
            self.buffer = io.BytesIO(rest)
            self.buffer.seek(0, 2)
        return False  # fsspec's flush keeps self.buffer (as S3File's does)

    def _send(self, data: bytes) -> None:
        """Hand a part to the event loop once fewer than :attr:`in_flight` are on the wire."""
        with self._cond:
            while self._running >= self.in_flight and self._failed is None:
                self._cond.wait()
            self._raise()
            self._running += 1
        number = len(self._sent) + 1
        self._sent.append(asyncio.run_coroutine_threadsafe(self._part(number, data), self.fs.loop))

    async def _part(self, number: int, data: bytes) -> dict[str, Any]:
        """One part with the retries of :attr:`policy`; its ``{"PartNumber", "ETag"}``."""
        try:
            delay = self.policy.backoff
            for attempt in range(self.policy.attempts):
                try:
                    out = await asyncio.wait_for(self._upload_part(number, data), self.policy.stall_seconds or None)
                    return {"PartNumber": number, "ETag": out["ETag"],
                            **({"ChecksumSHA256": out["ChecksumSHA256"]} if "ChecksumSHA256" in out else {})}
                except Exception as err:  # backends raise many unrelated types (botocore, aiohttp, ...)
                    if self._stopped or not transient(err) or attempt + 1 == self.policy.attempts:
                        raise OSError(f"part {number} of the upload failed (after {attempt + 1} tries): "
                                      f"{type(err).__name__}: {err or type(err).__name__}") from err
                await asyncio.sleep(delay)
                delay *= 2
            raise AssertionError("unreachable")
        except BaseException as err:
            with self._cond:
                if self._failed is None and not isinstance(err, asyncio.CancelledError):
                    self._failed = err
            raise
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    async def _upload_part(self, number: int, data: bytes) -> dict[str, Any]:
        out: dict[str, Any] = await self.fs._call_s3(
            "upload_part", self.s3_additional_kwargs, self.req_kw, Bucket=self.bucket, Key=self.key,
            PartNumber=number, UploadId=self.mpu["UploadId"], Body=data)
        return out

    def _answers(self) -> list[dict[str, Any]]:
        """Every part's answer, once all have ended (the first failure raised)."""
        with self._cond:
            while self._running:
                self._cond.wait()
            self._raise()
        return [f.result() for f in self._sent]

    def _raise(self) -> None:
        if self._failed is not None:
            raise self._failed

    def discard(self) -> None:
        """Cancel the parts in flight, wait until they have ended, abort the upload."""
        self._stopped = True
        for f in self._sent:
            f.cancel()
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0, timeout=SETTLE_SECONDS)
        super().discard()
