"""Reading the indexes of a job's source shards, in the order that keeps the disk busy.

Planning needs every shard's index (where each entry's payload lies); the copy that follows
needs every payload. With a cold page cache the headers lie between payloads on the disk, so
the order in which they are walked, the files are read ahead
(:mod:`zckpt.io.read_ahead`) and the plan is made decides how long the disk waits for the
CPU and the CPU for the disk:

- **Large entries** (:data:`HEADERS_FIRST_BYTES`): every header is walked first (the others'
  asked for together, from the first file's layout), then the files are read ahead while the
  plan is made.
- **Small entries** (hundreds of data-parallel ranks): walking a header costs more than the
  bytes around it, so the files are read ahead first and walked after. The first file of each
  pipeline stage is walked before (its headers alone): the other files of that stage and size
  are expected to be laid out alike (:mod:`zckpt.sources.same_layout`), so that a plan can be
  made from that guess while the disk reads (:meth:`IndexReading.guess`); :meth:`IndexReading.finish`
  then checks each file against it (or walks it) and says whether the guess held.

A walk that faults pages in holds the interpreter's lock, so that the thread asking for the
next windows waits on it and the disk on both: nothing is walked while the files are read
ahead (a 256-rank transform walking each file as soon as it was asked for: medians of 3.88 and
4.09 s against 3.61 s, alternating cold runs). Files too large to be read ahead whole are
walked sparsely: only the pages of their headers come from the disk.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from pathlib import Path

from zckpt.formats.ckpt import CkptReader
from zckpt.formats.entries import EntryInfo
from zckpt.io import read_ahead, remote
from zckpt.io.read_ahead import Order, ReadAhead
from zckpt.sources.discovery import SourceFile, open_source
from zckpt.sources.same_layout import Layouts, file_size

Index = dict[str, EntryInfo]

HEADERS_FIRST_BYTES = 256 * 1024
"""Mean bytes per entry of a source file from which every header is walked before the files
are read ahead. A header alone costs one random read (cold, here: 50-70 us per entry with its
parsing); reading ahead whole files first puts the last file's headers behind every byte of
the job (about 1.5 s for 2 GiB), and the plan, and whatever waits for it, behind those. At
this size the walk takes a fraction of the read (16 ranks of 128 MiB: 4 512 entries in
0.3 s), and the planning that follows runs while the disk reads the files: the main process of
a 16 -> 1 024 rank transform spent 29% of its time waiting for the last index (cold, alternating
runs: 6.04-6.32 s, walking the headers first 4.92-5.14 s). Below it (256 data-parallel ranks of
8 MiB: 44 544 entries, 2.2 s walked apart) the files are read ahead first."""

HEADER_BYTES = 512
"""Bytes before each payload asked for ahead of the walk (:func:`zckpt.io.read_ahead.read_headers`):
the ``Value`` header (tag, dims, type) lies there; a longer one is read by the walk itself."""

MAX_GROUPS = 16
"""Most groups (pipeline stage and file size) whose first file is walked before the files are
read ahead; a job with more walks its files after, with no guess to plan from."""


def header_spans(index: Mapping[str, EntryInfo]) -> list[tuple[int, int]]:
    """Where the headers of a file laid out as ``index`` lie: the :data:`HEADER_BYTES` before
    each payload, as ``(offset, length)``, in file order."""
    return sorted({(max(0, s.offset - HEADER_BYTES), min(HEADER_BYTES, s.offset))
                   for e in index.values() for s in e.segments})


class IndexReading:
    """The indexes of ``files`` being read (see the module doc): :meth:`start`, then
    :meth:`finish` (:func:`zckpt.sources.prepare.plan_sources` plans between the two).

    ``group``: which files may share a layout (the pipeline stage of a rank); ``order``: how
    the job reads the files after planning (:data:`zckpt.io.read_ahead.Order`): a job that
    reads only their starts has nothing read ahead once their headers were walked."""

    def __init__(self, files: Mapping[int, SourceFile], *, verify_crc: bool,
                 storage_options: remote.StorageOptions = None, order: Order = "starts",
                 group: Callable[[int], Hashable] = lambda rank: None) -> None:
        self.files, self.verify_crc, self.storage_options = dict(files), verify_crc, storage_options
        self.order, self.group = order, group
        self.layouts = Layouts()
        self.done: dict[int, Index] = {}
        self.guess: dict[int, Index] | None = None
        """Every file's index as expected from the first file of its group, once :meth:`start`
        made one (``None`` where a file is remote, a checksum is verified, or the groups are many)."""
        self._ahead: ReadAhead | None = None
        self._sparse = True

    def start(self, while_reading: Callable[[], object] | None = None) -> None:
        """Walk what is walked first and start reading the files ahead; ``while_reading`` runs
        once the disk was given work (ingest imports Zarr there)."""
        local = [p for p in self.files.values() if isinstance(p, Path)]
        items = list(self.files.items())
        rank, first = items[0] if items else (0, None)
        if not isinstance(first, Path):
            self._read_ahead(local, while_reading)
            return
        whole = self._walk(rank, first, sparse=True)
        if not whole and _large_entries(first, len(self.done[rank])):
            read_ahead.read_headers([p for r, p in items[1:] if isinstance(p, Path)], header_spans(self.done[rank]))
            for rank, path in items[1:]:
                self._index(rank, path, sparse=True)
            if self.order != "starts":
                read_ahead.read_soon(local, order=self.order)
            if while_reading is not None:
                while_reading()
            return
        if not whole:
            self._walk_firsts(items[1:])
        self._read_ahead(local, while_reading)
        self.guess = self._guessed()

    def finish(self) -> dict[int, Index]:
        """Every file's own index, once the files were read (see the module doc)."""
        try:
            if self._ahead is not None and len(self.done) < len(self.files):
                self._ahead.join()  # see the module doc
            for rank, path in self.files.items():
                if rank not in self.done:
                    self._index(rank, path, sparse=self._sparse)
        except BaseException:
            if self._ahead is not None:
                self._ahead.stop()  # a refused file: nothing more is read
            raise
        return {rank: self.done[rank] for rank in self.files}

    def as_guessed(self) -> bool:
        """Whether every index :meth:`finish` gave is the one :attr:`guess` expected."""
        return self.guess is not None and all(self.done.get(r) == i for r, i in self.guess.items())

    def _read_ahead(self, local: list[Path], while_reading: Callable[[], object] | None) -> None:
        self._ahead = read_ahead.read_soon(local, order=self.order) if local else None
        self._sparse = bool(local) and self._ahead is None  # headers lie between payloads
        if while_reading is not None:
            try:
                while_reading()
            except BaseException:
                if self._ahead is not None:
                    self._ahead.stop()
                raise

    def _walk_firsts(self, items: list[tuple[int, SourceFile]]) -> None:
        """Walk the first file of each group not walked yet (at most :data:`MAX_GROUPS`)."""
        firsts: dict[tuple[int | None, Hashable], tuple[int, Path]] = {}
        for rank, path in items:
            if isinstance(path, Path):
                firsts.setdefault((file_size(path), self.group(rank)), (rank, path))
        if len(firsts) + 1 > MAX_GROUPS:
            return
        for (size, group), (rank, path) in firsts.items():
            if size is not None and (size, group) not in self.layouts.known:
                self._walk(rank, path, sparse=True)

    def _guessed(self) -> dict[int, Index] | None:
        out: dict[int, Index] = {}
        for rank, path in self.files.items():
            known = self.done.get(rank)
            size = file_size(path) if known is None and isinstance(path, Path) else None
            if size is not None:
                layout = self.layouts.known.get((size, self.group(rank)))
                known = dict(layout.index) if layout is not None else None
            if known is None:
                return None
            out[rank] = known
        return out

    def _index(self, rank: int, path: SourceFile, sparse: bool) -> None:
        """The index of ``path``: a known layout's where the file shares it
        (:mod:`zckpt.sources.same_layout`), else walked."""
        if isinstance(path, Path):
            known = self.layouts.index_of(path, self.group(rank))
            if known is not None:
                self.done[rank] = dict(known)
                return
        self._walk(rank, path, sparse)

    def _walk(self, rank: int, path: SourceFile, sparse: bool) -> bool:
        """Walk ``path`` for its index and keep its layout where it is a local ``.ckpt`` whose
        checksum was not verified; whether it was (which read every byte)."""
        with open_source(path, self.storage_options, verify_crc=self.verify_crc, sparse=sparse) as r:
            self.done[rank] = index = dict(r.entries)
            whole = r.has_crc and self.verify_crc
            if isinstance(path, Path) and type(r) is CkptReader and not whole:  # not a subclass: see same_layout
                self.layouts.learn(path, index, r.has_crc, self.group(rank))
        return whole


def _large_entries(path: Path, entries: int) -> bool:
    """Whether the entries of ``path`` hold :data:`HEADERS_FIRST_BYTES` each on average (a file
    that cannot be looked at is reported by its walk: here it is only a choice of order)."""
    size = file_size(path)
    return size is not None and size >= HEADERS_FIRST_BYTES * max(1, entries)
