"""Byte ranges of a remote object, read where they lie: no local copy of the object.

A remote source shard can be tens of GiB of which a destination needs a tenth; copying it
whole to local disk first (as zckpt once did) costs that disk and reads every byte.
:class:`RangedObject` reads ranges instead: neighbouring ranges closer than
:attr:`RangePolicy.gap_bytes` are read as one request, large ones are cut in parts of
:attr:`RangePolicy.part_bytes`, at most :attr:`RangePolicy.in_flight` requests run at once
(threads: fsspec's synchronous calls are safe from several threads), and a transient failure
(connection reset, 5xx / SlowDown, a stalled or cut-short body) is retried with a doubling
backoff before it becomes a zckpt error naming the object. :class:`BlockBytes` is the same
object seen as an indexable byte string fetched in small blocks, for format walks that
only touch framing bytes (a ``.ckpt`` header walk steps over the payloads).

Which client: fsspec (s3fs, gcsfs, ...) is the one every other remote path of zckpt uses,
so one storage option reaches all; a ranged ``cat_file`` from a pool of threads measured
as fast as s3fs's own batched ``cat_ranges`` on the same ranges (``bench/bench_remote.py``).
"""

from __future__ import annotations

import errno
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import PosixPath
from typing import TypeVar

from zckpt.core.errors import ZckptError
from zckpt.io.remote import Location

KiB, MiB = 1024, 1024 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class RangePolicy:
    """How ranges are grouped into requests and how failures are retried."""

    gap_bytes: int = 32 * KiB
    """Ranges this close are read as one request (the gap is read and dropped)."""
    part_bytes: int = 8 * MiB
    """Largest single request: a longer range is read as parts in parallel."""
    in_flight: int = 8
    """Most requests running at once per object."""
    attempts: int = 4
    """Tries of a request before it fails."""
    backoff: float = 0.2
    """Seconds before the first retry, doubled before each next one."""
    stall_seconds: float = 120.0
    """A request taking longer is given up and retried (a stalled response)."""
    block_bytes: int = 1 * KiB
    """Block of a :class:`BlockBytes` walk (a ``.ckpt`` Value's framing fits in one)."""


DEFAULT_POLICY = RangePolicy()


class ShortRead(OSError):
    """The server sent fewer bytes than the range asked for (a body cut short)."""


TRANSIENT_ERRNOS = frozenset({errno.EREMOTEIO, errno.EIO, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                              errno.EAGAIN, errno.EBUSY, errno.EPIPE})
"""What s3fs and gcsfs raise for a 5xx answer (``EREMOTEIO``) and for broken connections."""


def transient(err: BaseException) -> bool:
    """Whether a failed request may succeed when tried again: network errors, timeouts, short
    bodies and 5xx / throttling answers; not a missing object or a refused credential."""
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, ShortRead, FutureTimeout)):
        return True
    if isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS:
        return True
    text = f"{type(err).__name__} {err}".lower()
    marks = ("slowdown", "serviceunavailable", "service unavailable", "internalerror", "internal error",
             "try again", "reduce your request rate", "503", "500", "502", "504", "reset", "timeout",
             "timed out", "payload", "incomplete", "connection", "throttl", "broken pipe")
    return any(m in text for m in marks)


READ_AHEAD_BYTES = 1 * MiB
"""Most a :class:`BlockBytes` miss fetches (after misses that follow each other)."""
WASTE_FLOOR = 512
"""A gap this short is always read through (a ``.ckpt``'s framing between two payloads)."""


def coalesce(ranges: Sequence[tuple[int, int]], gap: int, part: int) -> list[tuple[int, int]]:
    """``(start, stop)`` requests covering ``(offset, length)`` ranges: sorted, merged where the gap
    between them is at most ``gap`` and small next to the request, cut so none is longer than
    ``part`` (unless one range is)."""
    spans = sorted((o, o + n) for o, n in ranges if n > 0)
    merged: list[list[int]] = []
    for a, b in spans:
        # a gap is read only when it is short next to what it joins: at most 1/16 of the
        # request (framing between payloads always), so reads stay within ~6 % of what is asked
        if merged and a - merged[-1][1] <= min(gap, max(WASTE_FLOOR, (b - merged[-1][0]) // 16)):
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out: list[tuple[int, int]] = []
    for a, b in merged:
        out.extend((s, min(b, s + part)) for s in range(a, b, part))
    return out


class ObjectPath(PosixPath):
    """An object's URL where readers keep a ``Path`` (error messages, names): ``str()`` gives
    the URL back, not the ``s3:/bucket/...`` a path would make of it."""

    _url: str

    def __new__(cls, url: str) -> ObjectPath:
        self = super().__new__(cls, url)
        self._url = url
        return self

    def __str__(self) -> str:
        return getattr(self, "_url", None) or super().__str__()

    def __fspath__(self) -> str:
        return str(self)


class Pools:
    """The threads running requests (``"requests"``: each with its retries) and single tries
    (``"tries"``: watched for a stall by the request's thread), ``size`` of each, made on
    first use. Objects that share one (the chunks of a store) run at most ``size`` requests
    at once between them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def get(self, which: str) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(which)
            if pool is None:
                pool = self._pools[which] = ThreadPoolExecutor(self.size, thread_name_prefix=f"zckpt-{which}")
            return pool

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


class RangedObject:
    """One remote object read by byte ranges (see the module doc). Thread safe; counts the
    requests and bytes it fetched. ``pools``: threads shared with other objects (else its
    own, ended by :meth:`close`)."""

    def __init__(self, loc: Location, err_cls: type[ZckptError], size: int | None = None,
                 policy: RangePolicy = DEFAULT_POLICY, pools: Pools | None = None) -> None:
        self.loc = loc
        self.url = loc.url
        self.err_cls = err_cls
        self.policy = policy
        self._own_pools = pools is None
        self._pools = Pools(policy.in_flight) if pools is None else pools
        self._lock = threading.Lock()
        self.requests = 0
        self.fetched_bytes = 0
        self.size = self._size() if size is None else size

    def _size(self) -> int:
        info = self._retried(lambda: dict(self.loc.fs.info(self.loc.path)), "cannot read the object's size")
        return int(info.get("size") or 0)

    def close(self) -> None:
        if self._own_pools:
            self._pools.close()

    def _executor(self, which: str = "requests") -> ThreadPoolExecutor:
        return self._pools.get(which)

    def _fail(self, what: str, err: BaseException) -> ZckptError:
        detail = str(err) or type(err).__name__
        return self.err_cls(f"{what}: {type(err).__name__}: {detail}", path=self.url)

    def _retried(self, call: Callable[[], T], what: str, *, request: bool = False) -> T:
        """``call()`` with the retries of the policy: a transient failure is tried again after
        a doubling backoff, the last one becomes a zckpt error naming the object. ``request``:
        each try counts as a request."""
        delay = self.policy.backoff
        for attempt in range(self.policy.attempts):
            if request:
                with self._lock:
                    self.requests += 1
            try:
                return call()
            except ZckptError:
                raise
            except Exception as err:  # backends raise many unrelated types (botocore, aiohttp, ...)
                if not transient(err) or attempt + 1 == self.policy.attempts:
                    raise self._fail(f"{what} (after {attempt + 1} tries)", err) from err
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _get_once(self, start: int, stop: int) -> bytes:
        data = self.loc.fs.cat_file(self.loc.path, start=start, end=stop)
        if len(data) != stop - start:
            raise ShortRead(f"bytes [{start}, {stop}) answered with {len(data)} bytes")
        return bytes(data)

    def _get(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` in one request, retried; a request that stalls past
        :attr:`RangePolicy.stall_seconds` counts as failed (its thread is left to end)."""
        once = self._watched if self.policy.stall_seconds else self._get_once
        data = self._retried(lambda: once(start, stop), f"cannot read bytes [{start}, {stop}) of the object",
                             request=True)
        with self._lock:
            self.fetched_bytes += len(data)
        return data

    def _watched(self, start: int, stop: int) -> bytes:
        """One request on a worker thread, given up after the stall timeout."""
        fut: Future[bytes] = self._executor("tries").submit(self._get_once, start, stop)
        try:
            return fut.result(timeout=self.policy.stall_seconds)
        except FutureTimeout:
            fut.cancel()
            raise TimeoutError(f"no answer within {self.policy.stall_seconds:g} s") from None

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise self.err_cls(f"byte range {offset}+{length} lies outside the object of {self.size} bytes "
                               "(did it change?)", path=self.url)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` (parts in parallel when long)."""
        return self.read_many([(offset, length)])[0]

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, length)``, read in coalesced requests, at most
        :attr:`RangePolicy.in_flight` at once."""
        return read_objects([(self, ranges)])[0]


def read_objects(reads: Sequence[tuple[RangedObject, Sequence[tuple[int, int]]]]) -> list[list[bytes]]:
    """The bytes of each ``(offset, length)`` of each object: each object's ranges read in
    coalesced requests, the requests of all of them on the first object's pool (at most
    :attr:`RangePolicy.in_flight` at once; objects sharing their :class:`Pools` share that bound)."""
    planned = []
    for obj, ranges in reads:
        for o, n in ranges:
            obj._check(o, n)
        planned.append(coalesce(ranges, obj.policy.gap_bytes, obj.policy.part_bytes))
    todo = [(i, r) for i, requests in enumerate(planned) for r in requests]
    got: dict[tuple[int, tuple[int, int]], bytes] = {}
    if len(todo) == 1:
        i, r = todo[0]
        got[(i, r)] = reads[i][0]._get(*r)
    elif todo:
        pool = reads[0][0]._executor()
        futures = [((i, r), pool.submit(reads[i][0]._get, *r)) for i, r in todo]
        try:
            for k, fut in futures:
                got[k] = fut.result()
        finally:
            for _, fut in futures:
                fut.cancel()
    out = []
    for i, ((_, ranges), requests) in enumerate(zip(reads, planned, strict=True)):
        mine = {r: got[(i, r)] for r in requests}
        out.append([_cut(requests, [r[0] for r in requests], mine, o, n) for o, n in ranges])
    return out


def _cut(requests: list[tuple[int, int]], starts: list[int], got: dict[tuple[int, int], bytes],
         offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` from the answers of the requests covering them."""
    if length == 0:
        return b""
    import bisect  # (stdlib; only the multi-request path needs it)

    i = bisect.bisect_right(starts, offset) - 1
    parts = []
    pos, stop = offset, offset + length
    while pos < stop:
        a, b = requests[i]
        parts.append(got[(a, b)][pos - a : min(stop, b) - a])
        pos = min(stop, b)
        i += 1
    return parts[0] if len(parts) == 1 else b"".join(parts)


class BlockBytes:
    """A remote object as a read-only byte string, fetched in blocks on first touch: ``buf[i]``
    is an int, ``buf[a:b]`` bytes, as the ``.ckpt`` and safetensors walks use a mapping.

    A miss fetches one block (a ``.ckpt`` Value's framing, the payload stepped over); misses
    that follow each other fetch twice as many blocks each time, up to
    :data:`READ_AHEAD_BYTES` (a file of small tensors is walked in few requests). Recent blocks
    are kept, so a walk reads each block once."""

    def __init__(self, obj: RangedObject, block: int | None = None) -> None:
        self.obj = obj
        self.block = block or obj.policy.block_bytes
        self.keep = max(64, 2 * READ_AHEAD_BYTES // self.block)
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._next_miss = -1
        self._ahead = 1

    def __len__(self) -> int:
        return self.obj.size

    def _blk(self, i: int) -> bytes:
        got = self._blocks.get(i)
        if got is not None:
            self._blocks.move_to_end(i)
            return got
        last = (self.obj.size - 1) // self.block
        self._ahead = min(self._ahead * 2, READ_AHEAD_BYTES // self.block) if i == self._next_miss else 1
        stop = min(last + 1, i + self._ahead)
        start = i * self.block
        data = self.obj.read(start, min(stop * self.block, self.obj.size) - start)
        for k in range(i, stop):
            self._blocks[k] = data[(k - i) * self.block : (k - i + 1) * self.block]
        self._next_miss = stop
        while len(self._blocks) > self.keep:
            self._blocks.popitem(last=False)
        return self._blocks[i]

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, slice):
            a, b, _ = key.indices(self.obj.size)
            return self.cached(a, b - a) if b > a else b""
        if not 0 <= key < self.obj.size:
            raise IndexError(key)
        return self._blk(key // self.block)[key % self.block]

    def cached(self, offset: int, length: int) -> bytes:
        """Bytes of a short range through the blocks (one request when they are not held),
        a long one straight from the object."""
        first, last = offset // self.block, (offset + length - 1) // self.block
        if last - first > 2 and not all(i in self._blocks for i in range(first, last + 1)):
            return self.obj.read(offset, length)
        data = b"".join(self._blk(i) for i in range(first, last + 1))
        return data[offset - first * self.block : offset - first * self.block + length]

    def held(self, offset: int, length: int) -> bytes | None:
        """The range when every block of it is held already (no request), else ``None``."""
        if length <= 0:
            return b""
        first, last = offset // self.block, (offset + length - 1) // self.block
        if not all(i in self._blocks for i in range(first, last + 1)):
            return None
        data = b"".join(self._blocks[i] for i in range(first, last + 1))
        return data[offset - first * self.block : offset - first * self.block + length]
