"""Streaming codec for safetensors files, with MindSpore's conventions.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...}``, padded
with spaces), then the tensors' raw little-endian bytes back to back. MindSpore writes and
reads it for ``save_checkpoint(..., format="safetensors")`` and its sharded
``rank_<r>/*.safetensors`` jobs: metadata ``{"format": "ms"}``, optionally
``"crc_num"`` (CRC32 over every tensor's name and bytes, in name order) and, for a tensor
whose MindSpore type safetensors cannot name, ``metadata[name] = <MindSpore type>``.

Reading maps the file and validates the whole header before anything is used (every
offset, size and dtype is checked against the file, so a broken or hostile header gives a
:class:`~zckpt.core.errors.CheckpointFormatError` naming the file and tensor instead of a wrong
view). Tensors come out as zero-copy views of the mapping, through the same access
methods as :class:`~zckpt.formats.ckpt.CkptReader`, so ingest reads either format alike.

Writing streams: the header is computed from the tensors' names, types and shapes (known
from the export plan before any byte is read), written first, then each tensor's bytes in
header order; the file lives under a temporary name until it is complete. Data are laid
out as the ``safetensors`` package lays them out (dtype size descending, then name), so
every tensor is aligned to its element size and, with the same metadata, the file is byte
for byte what ``safetensors.numpy.save_file`` (and so MindSpore) would write.

MindSpore's string entries (``append_dict`` strings) have no tensor form: they are stored
in ``__metadata__`` under ``"zckpt.str:" + name`` (:data:`STRING_PREFIX`), which
MindSpore's loader ignores and zckpt reads back as string entries.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from zckpt.core.dtypes import STRING_TYPE, ms_dtype
from zckpt.core.errors import CheckpointFormatError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.entries import EntryInfo, Segment
from zckpt.io.new_files import Opener, local

SF_TO_MS: dict[str, str] = {
    "BOOL": "Bool",
    "U8": "UInt8",
    "I8": "Int8",
    "I16": "Int16",
    "U16": "UInt16",
    "F16": "Float16",
    "BF16": "BFloat16",
    "I32": "Int32",
    "U32": "UInt32",
    "F32": "Float32",
    "F64": "Float64",
    "I64": "Int64",
    "U64": "UInt64",
}
"""safetensors dtype -> MindSpore ``tensor_type``: a one-to-one map (bf16 stays BF16)."""

MS_TO_SF: dict[str, str] = {v: k for k, v in SF_TO_MS.items()}

_DTYPE_RANK: dict[str, int] = {name: i for i, name in enumerate(SF_TO_MS)}
"""Order of the ``safetensors`` package's ``Dtype`` enum (for the types above); it lays
tensors out by descending rank, then by name."""

MAX_HEADER = 100_000_000
"""Largest header accepted, as the ``safetensors`` package and MindSpore."""

MAX_NDIM = 32
"""Most dims a tensor may have (numpy's limit before numpy 2; MindSpore uses at most 8)."""

MAX_NBYTES = 2**63 - 1
"""numpy refuses shapes whose non-zero dims times the item size exceed this, even when empty."""

STRING_PREFIX = "zckpt.str:"
"""``__metadata__`` key prefix of MindSpore string entries (``append_dict`` strings)."""

MS_METADATA = {"format": "ms"}
"""What MindSpore's ``save_checkpoint(format="safetensors")`` puts in every file."""

_FILLER = "0" * 10
"""Placeholder for ``crc_num`` while the data are streamed (a CRC32 has at most 10 digits)."""


def sf_dtype(ms_type: str, *, path: str | None = None, param: str | None = None) -> str:
    """The safetensors dtype of a MindSpore type; string and map entries have none."""
    try:
        return MS_TO_SF[ms_type]
    except KeyError:
        raise CheckpointFormatError(f"MindSpore type {ms_type!r} has no safetensors dtype", path=path,
                                    param=param) from None


def data_order(tensors: Iterable[tuple[str, str]]) -> list[str]:
    """Names of ``(name, ms_type)`` tensors in the order the ``safetensors`` package writes
    their data: element type from widest to narrowest, then name (so every offset is a
    multiple of the element size)."""
    return [n for n, _ in sorted(tensors, key=lambda t: (-_DTYPE_RANK[MS_TO_SF[t[1]]], t[0]))]


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Header:
    data_start: int
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]
    """``(name, safetensors dtype, shape, begin, end)`` in the order of their data."""
    metadata: dict[str, str]


def _unique_pairs(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointFormatError("header lists this key twice", path=path, param=k)
            out[k] = v
        return out

    return hook


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return None
    return list(value)


def parse_header(buf: memoryview, path: Path) -> _Header:
    """Validate a safetensors header against the file size; every problem names the file
    and, when it concerns one, the tensor."""
    size = len(buf)

    def fail(message: str, param: str | None = None) -> CheckpointFormatError:
        return CheckpointFormatError(message, path=path, param=param)

    if size < 8:
        raise fail(f"{size} bytes: too short for a safetensors file (8-byte header length missing)")
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER:
        raise fail(f"safetensors header length {n} exceeds the {MAX_HEADER}-byte limit (not a safetensors file?)")
    if 8 + n > size:
        raise fail(f"safetensors header length {n} runs past the end of the {size}-byte file (truncated?)")
    raw = bytes(buf[8 : 8 + n])
    if not raw.startswith(b"{"):
        raise fail("safetensors header does not start with '{' (not a safetensors file?)")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_pairs(path))
    except UnicodeDecodeError:
        raise fail("safetensors header is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise fail(f"safetensors header is not valid JSON: {err}") from None
    except RecursionError:
        raise fail("safetensors header nests JSON too deeply") from None
    if not isinstance(doc, dict):
        raise fail("safetensors header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail("safetensors __metadata__ must map strings to strings")
    data_len = size - 8 - n
    tensors: list[tuple[str, str, tuple[int, ...], int, int]] = []
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise fail("tensor description is not a JSON object", name)
        dtype = info.get("dtype")
        if not isinstance(dtype, str):
            raise fail("tensor has no dtype string", name)
        if dtype not in SF_TO_MS:
            raise fail(f"safetensors dtype {dtype!r} has no MindSpore equivalent "
                       f"(known: {', '.join(SF_TO_MS)})", name)
        shape = _int_list(info.get("shape"))
        if shape is None or any(d < 0 for d in shape):
            raise fail(f"shape {info.get('shape')!r} is not a list of non-negative integers", name)
        if len(shape) > MAX_NDIM:
            raise fail(f"shape has {len(shape)} dims, more than {MAX_NDIM}", name)
        if math.prod(d for d in shape if d) * ms_dtype(SF_TO_MS[dtype]).storage.itemsize > MAX_NBYTES:
            raise fail(f"shape {shape} x {dtype} overflows int64 (no such tensor can exist)", name)
        offsets = _int_list(info.get("data_offsets"))
        if offsets is None or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
            raise fail(f"data_offsets {info.get('data_offsets')!r} is not [begin, end] with 0 <= begin <= end", name)
        begin, end = offsets
        need = math.prod(shape) * ms_dtype(SF_TO_MS[dtype]).storage.itemsize
        if end - begin != need:
            raise fail(f"data_offsets {offsets} hold {end - begin} bytes but shape {shape} x {dtype} needs {need}",
                       name)
        if end > data_len:
            raise fail(f"data_offsets {offsets} run past the {data_len} data bytes of the file (truncated?)", name)
        tensors.append((name, dtype, tuple(shape), begin, end))
    tensors.sort(key=lambda t: (t[3], t[4]))
    pos = 0
    for name, _, _, begin, end in tensors:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a gap of {begin - pos} bytes before it"
            raise fail(f"data_offsets [{begin}, {end}] {what} (tensors must be back to back)", name)
        pos = end
    if pos != data_len:
        raise fail(f"tensors cover {pos} of the {data_len} data bytes after the header (trailing bytes)")
    return _Header(8 + n, tensors, dict(meta))


class SafetensorsReader(CkptReader):
    """Index of one ``.safetensors`` file with zero-copy access to its tensors.

    Presents the interface of :class:`~zckpt.formats.ckpt.CkptReader` (``entries``,
    ``array``, ``rows``, ``row_bytes_range``, ``fileno``, ``string``, ...): each tensor is a
    single payload segment, so the row and view methods are inherited unchanged. Entries
    come in name order, as ``mindspore.load_checkpoint`` returns them (safetensors keeps no
    entry order: writers lay data out by dtype), then the string entries of the metadata.
    ``verify_crc`` checks MindSpore's ``crc_num`` metadata when the file has one.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        # Not CkptReader.__init__ (that parses protobuf): the same mapping, another index.
        size = self._map_file(path)
        self.content_end = size
        try:
            header = parse_header(self._buf, self.path)
            self.metadata: dict[str, str] = header.metadata
            self.data_start = header.data_start
            self.entries: dict[str, EntryInfo] = self._index_header(header)
            self.has_crc = "crc_num" in self.metadata
            self.crc_expected = self._crc_value() if self.has_crc else None
            if self.has_crc and verify_crc:
                self.verify_crc()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SafetensorsReader:
        return self

    def _index_header(self, header: _Header) -> dict[str, EntryInfo]:
        entries: dict[str, EntryInfo] = {}
        for name, dtype, shape, begin, end in sorted(header.tensors):
            ms_type = SF_TO_MS[dtype]
            declared = header.metadata.get(name)
            if declared is not None and declared != ms_type:
                raise self._fail(
                    f"metadata gives MindSpore type {declared!r} for this {dtype} tensor (e.g. a packed qint4x2); "
                    "zckpt handles only types that safetensors names directly", name)
            seg = Segment(header.data_start + begin, end - begin)
            entries[name] = EntryInfo(name, "tensor", ms_type, shape, (seg,))
        for key in sorted(header.metadata):
            if key.startswith(STRING_PREFIX):
                name = key[len(STRING_PREFIX):]
                if name in entries:
                    raise self._fail("is both a tensor and a string entry of the metadata", name)
                entries[name] = EntryInfo(name, "str", STRING_TYPE, (0,), ())
        return entries

    def _crc_value(self) -> int:
        text = self.metadata["crc_num"]
        if not text.isdigit() or int(text) >= 1 << 32:
            raise self._fail(f"metadata crc_num {text!r} is not a CRC32")
        return int(text)

    def verify_crc(self) -> None:
        """Check MindSpore's ``crc_num``: CRC32 over each tensor's name and bytes, names sorted."""
        got = mindspore_crc(self._buf, [(e.name, e.segments[0]) for e in self.entries.values() if e.kind == "tensor"])
        if got != self.crc_expected:
            raise self._fail(f"metadata crc_num is {self.crc_expected} but the tensors give {got} (file damaged)")

    def string(self, name: str) -> str:
        """Value of a string entry (kept in the metadata, see :data:`STRING_PREFIX`)."""
        e = self.entries[name]
        if e.kind != "str":
            raise self._fail(f"entry is a {e.kind}, not a string", name)
        return self.metadata[STRING_PREFIX + name]

    def map_bytes(self, name: str) -> bytes:
        raise self._fail("safetensors files hold no MapParameter entries", name)

    # Every tensor is one contiguous segment, so the views are computed here directly rather
    # than through CkptReader's multi-segment machinery (whose private state is not set up).
    def _tensor(self, name: str) -> tuple[EntryInfo, np.dtype]:
        e = self.entries.get(name)
        if e is None:
            raise self._fail("no such entry in the checkpoint", name)
        if e.kind != "tensor":
            raise self._fail(f"entry is a {e.kind}, not a tensor", name)
        return e, ms_dtype(e.ms_type).storage

    def array(self, name: str) -> np.ndarray:
        """The whole tensor: a read-only view of the mapping."""
        e, dt = self._tensor(name)
        s = e.segments[0]
        return np.frombuffer(self._span(s.offset, s.length), dtype=dt).reshape(e.shape)

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` along axis 0: a read-only view of the mapping."""
        e, dt = self._tensor(name)
        shape = e.shape
        if not shape:
            return self.array(name)
        if not 0 <= r0 <= r1 <= shape[0]:
            raise self._fail(f"rows [{r0}, {r1}) outside {shape[0]} rows", name)
        row_elems = math.prod(shape[1:])
        off = e.segments[0].offset + r0 * row_elems * dt.itemsize
        flat = np.frombuffer(self._span(off, (r1 - r0) * row_elems * dt.itemsize), dtype=dt)
        return flat.reshape((r1 - r0,) + shape[1:])

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        """File offset and length of rows ``[r0, r1)`` (for file-to-file copies)."""
        e, dt = self._tensor(name)
        shape = e.shape
        if not shape or not 0 <= r0 < r1 <= shape[0]:
            return None
        row_bytes = math.prod(shape[1:]) * dt.itemsize
        if row_bytes == 0:
            return None
        return e.segments[0].offset + r0 * row_bytes, (r1 - r0) * row_bytes

    def row_blocks(self, name: str, max_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(first_row, view)`` blocks of at most ``max_bytes`` (at least one row) along axis 0."""
        e, dt = self._tensor(name)
        shape = e.shape
        row_bytes = math.prod(shape[1:]) * dt.itemsize if shape else 0
        if not shape or row_bytes == 0 or shape[0] == 0:
            yield 0, self.array(name)
            return
        per = max(1, max_bytes // row_bytes)
        for r in range(0, shape[0], per):
            yield r, self.rows(name, r, min(shape[0], r + per))


def mindspore_crc(buf: memoryview | mmap.mmap, tensors: Iterable[tuple[str, Segment]]) -> int:
    """MindSpore's safetensors ``crc_num``: CRC32 of name bytes then tensor bytes, by sorted name."""
    crc = 0
    step = 64 * 1024 * 1024
    for name, seg in sorted(tensors, key=lambda t: t[0]):
        crc = zlib.crc32(name.encode("utf-8"), crc)
        for start in range(seg.offset, seg.offset + seg.length, step):
            crc = zlib.crc32(buf[start : min(start + step, seg.offset + seg.length)], crc)
    return crc


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class TensorHeader:
    """A tensor to be written: its name, MindSpore type and shape (bytes follow later)."""

    name: str
    ms_type: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ms_dtype(self.ms_type).storage.itemsize


def header_bytes(
    tensors: Sequence[TensorHeader], metadata: Mapping[str, str]
) -> tuple[bytes, list[TensorHeader]]:
    """The header (length prefix, JSON, space padding to 8 bytes) and the tensors in data order.

    The JSON is compact and lists ``__metadata__`` first, then the tensors in the order of
    their data, as the ``safetensors`` package writes it.
    """
    by_name = {t.name: t for t in tensors}
    ordered = [by_name[n] for n in data_order((t.name, t.ms_type) for t in tensors)]
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    pos = 0
    for t in ordered:
        doc[t.name] = {"dtype": MS_TO_SF[t.ms_type], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ordered


class SafetensorsWriter:
    """Writes one ``.safetensors`` file as a new file beside it (:class:`~zckpt.io.new_files.NewFile`:
    unnamed where the system allows; or whatever ``files`` opens, e.g. an upload), named on
    :meth:`commit`.

    The tensors are declared up front; their bytes are then streamed with :meth:`write_tensor`
    in :attr:`order` (the header's data order). ``crc`` adds MindSpore's ``crc_num`` to the
    metadata: the header reserves room for it and is rewritten in place once the data are
    written. Leaving the context on an exception drops the new file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[TensorHeader],
        metadata: Mapping[str, str] | None = None,
        *,
        crc: bool = False,
        fsync: bool = True,
        files: Opener = local,
    ) -> None:
        self.path = Path(path)
        names = [t.name for t in tensors]
        for t in tensors:
            if t.name == "__metadata__":
                raise CheckpointFormatError("'__metadata__' cannot name a tensor", path=self.path, param=t.name)
            sf_dtype(t.ms_type, path=str(self.path), param=t.name)
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise CheckpointFormatError("tensor declared twice", path=self.path, param=dup)
        meta = dict(metadata if metadata is not None else MS_METADATA)
        if crc:
            meta["crc_num"] = _FILLER
        self._meta = meta
        self._crc = crc
        self._fsync = fsync
        self._tensors = list(tensors)
        self._header, self.order = header_bytes(self._tensors, meta)
        self._next = 0
        self.bytes_written = 0
        # unnamed until published where the system allows; with crc the header is rewritten last
        self._new = files(self.path, crc)
        self._f: BinaryIO | None = self._new.file
        self._write(self._header)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None and self._f is not None:
            self.commit()
        else:
            self.abort()

    def _write(self, data: bytes | memoryview) -> None:
        assert self._f is not None, "writer already closed"
        self._f.write(data)
        self.bytes_written += len(data) if isinstance(data, bytes) else data.nbytes

    def write_tensor(self, name: str, blocks: Iterable[np.ndarray]) -> None:
        """Stream the next tensor (in :attr:`order`) as consecutive C-order blocks of its bytes."""
        if self._next >= len(self.order) or self.order[self._next].name != name:
            expected = self.order[self._next].name if self._next < len(self.order) else "nothing"
            raise CheckpointFormatError(f"tensor written out of order (expected {expected})", path=self.path,
                                        param=name)
        t = self.order[self._next]
        dt = ms_dtype(t.ms_type).storage
        need = t.nbytes
        for block in blocks:
            arr = np.asarray(block)
            if arr.dtype.itemsize != dt.itemsize or arr.dtype.kind not in "biuf":
                raise CheckpointFormatError(f"block dtype {arr.dtype} does not match {t.ms_type}", path=self.path,
                                            param=name)
            raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            if raw.size > need:
                raise CheckpointFormatError(f"tensor data exceed shape {list(t.shape)}", path=self.path, param=name)
            self._write(raw.data)
            need -= raw.size
        if need:
            raise CheckpointFormatError(f"tensor data ended {need} bytes early", path=self.path, param=name)
        self._next += 1

    def commit(self) -> Path:
        """Finish: check every tensor was written, fill in ``crc_num``, fsync, rename."""
        assert self._f is not None, "writer already closed"
        if self._next != len(self.order):
            missing = [t.name for t in self.order[self._next:]]
            raise CheckpointFormatError(f"{len(missing)} declared tensor(s) never written", path=self.path,
                                        param=missing[0])
        self._f.flush()
        if self._crc:
            self._fill_crc()
        self._f = None
        self._new.publish(self._fsync)
        return self.path

    def _fill_crc(self) -> None:
        assert self._f is not None
        start = len(self._header)
        spans: list[tuple[str, Segment]] = []
        pos = start
        for t in self.order:
            spans.append((t.name, Segment(pos, t.nbytes)))
            pos += t.nbytes
        fd = self._f.fileno()  # open for reading too (the file may have no name to open it by)
        if os.fstat(fd).st_size:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
                crc = mindspore_crc(m, spans)
        else:
            crc = mindspore_crc(memoryview(b""), spans)
        meta = dict(self._meta)
        meta["crc_num"] = str(crc)
        new, _ = header_bytes(self._tensors, meta)
        old_len = len(self._header) - 8
        body = new[8:].rstrip(b" ")
        assert len(body) <= old_len
        self._f.seek(8)
        self._f.write(body + b" " * (old_len - len(body)))
        self._f.seek(0, os.SEEK_END)

    def abort(self) -> None:
        self._f = None
        self._new.discard()
