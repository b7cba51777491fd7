"""The Zarr v3 store: every checkpoint entry in global coordinates.

Layout (readable without zckpt, see docs/store-format.md)::

    STORE.zarr/zarr.json              group; attributes["zckpt"] = manifest (entries, source, state)
    STORE.zarr/tensors/<key>/         one array per tensor entry, full logical shape
    STORE.zarr/maps/<key>/            MapParameter entries: their encoded bytes (uint8)

Array keys are the entry names percent-encoded so that no name can escape the store
(:func:`zckpt.store.manifest.encode_key`). BFloat16 arrays have Zarr's extension data type
``bfloat16`` (format version 2 and later; version 1 stored them as ``uint16``); zckpt reads and
writes them as their ``uint16`` bit patterns (:func:`zckpt.store.zarr_arrays.bits_view`), as it
does every other bf16 value. Each array's attributes say which source rank wrote which box
("writers"); a region is present when its writer's rank has its progress record (see
:mod:`zckpt.store.records`). Chunks divide the source shard shape, so two writers never touch
the same chunk.

:class:`Store` composes the pieces: where the store lives (:mod:`zckpt.store.backends`, local
or remote, chosen once when it is opened), its manifest (:mod:`zckpt.store.manifest`) and its
digests (:mod:`zckpt.store.integrity`), progress records and the checksum records they hold
(:mod:`zckpt.store.chunk_records`), chunk layouts (:mod:`zckpt.store.geometry`), local chunk
files (:mod:`zckpt.store.chunk_files`) and arrays opened through zarr-python
(:mod:`zckpt.store.zarr_arrays`). What stays here is the store's own contract: defining it,
recording progress, sealing, and which regions are present.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box
from zckpt.io import remote
from zckpt.io.checksums import ChunkSums
from zckpt.plan.values import TensorSpec
from zckpt.store import integrity, packed
from zckpt.store import records as rank_records
from zckpt.store.array_documents import entry_attributes
from zckpt.store.backends import ArrayDefinition, Backend, LocalBackend, create, open_backend
from zckpt.store.chunk_files import ChunkFiles, misplaced_pack
from zckpt.store.chunk_records import Checked, ChunkRecords
from zckpt.store.geometry import ChunkInfo
from zckpt.store.manifest import SHARDED_LAYOUTS, EntryRecord, encode_key, entry_records
from zckpt.store.remote_chunks import RemoteChunks
from zckpt.store.zarr_arrays import OpenArrays, create_arrays, gather, verify_remote_chunks

if TYPE_CHECKING:  # zarr-python is imported where it is used, from zckpt.io.zarr_local
    import zarr


class Store:
    """A zckpt store opened for reading or being written by ingest."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.path = backend.path
        """The local directory (for a remote store: its path inside the filesystem, for messages)."""
        self.location = backend.location
        """Where a remote store lives (``None`` for a local directory)."""
        self.url = backend.url
        """The store as the user named it: what tasks reopen and what messages show."""
        self._files = backend.files
        self.objects = RemoteChunks(backend.location) if backend.location is not None else None
        """A remote store's chunk objects, read by byte range (``None`` for a local directory)."""
        self._entries: dict[str, EntryRecord] | None = None
        self._writers: dict[str, list[tuple[int, Box]]] = {}
        self._arrays = OpenArrays(self.where, self.url)
        self._ingested: set[int] | None = None
        self._chunk_info: dict[str, ChunkInfo] = {}
        self._records = ChunkRecords(self._progress_attributes, self._check_record,
                                     lambda name: self._entry_map().get(name))
        self._version: int | None = None
        self._trusted = False
        self._digested: tuple[dict[str, Any], str] | None = None
        self._record_files: dict[int, str] = {}
        """Per source rank, the file its progress record was read from (for messages)."""

    @classmethod
    def attach(
        cls, path: Path, entries: Iterable[EntryRecord], infos: Mapping[str, ChunkInfo], version: int
    ) -> Store:
        """A local store as an ingest task writes it, from what its plan already knows (its
        entries and their chunk layouts): zarr opens it only if a write needs zarr (scalars,
        MapParameters), so that hundreds of rank tasks do not each open the store."""
        store = cls(LocalBackend(path, mode="r+"))
        store._entries = {e.name: e for e in entries}
        store._chunk_info = dict(infos)
        store._version = version
        return store

    @property
    def group(self) -> zarr.Group:
        return self._backend.group

    @property
    def version(self) -> int:
        """The store's format version (its manifest's ``version``)."""
        if self._version is None:
            self._version = int(self.manifest.get("version", 0))
        return self._version

    # --- creation -----------------------------------------------------------------
    @property
    def is_remote(self) -> bool:
        return self.location is not None

    def where(self, *parts: str) -> str:
        """A node or chunk of the store as messages name it: a path, or a URL when remote."""
        return self._backend.where(*parts)

    @classmethod
    def create(
        cls, path: str | Path, *, overwrite: bool = False, storage_options: remote.StorageOptions = None
    ) -> Store:
        return cls(create(path, overwrite, storage_options))

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: Literal["r", "r+", "a"] = "r",
        storage_options: remote.StorageOptions = None,
    ) -> Store:
        return cls(open_backend(path, mode, storage_options))

    def remove(self) -> None:
        """Delete the whole store (an ingest that found bad input leaves nothing behind)."""
        self._backend.remove()

    # --- manifest ------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        return self._backend.manifest

    def _update(self, **changes: Any) -> None:
        meta = dict(self.manifest)
        meta.update(changes)
        self._backend.write_manifest(meta)
        if "entries" in changes:
            self._entries = None

    def _entry_map(self) -> dict[str, EntryRecord]:
        if self._entries is None:
            self._entries = entry_records(self.manifest, self.where("zarr.json"))
        return self._entries

    def check_links(self) -> None:
        """Refuse, by name, a symbolic link anywhere in a local store's array folders (a
        listing per folder, no ``stat`` per file): for commands such as ``info`` that
        describe a store without reading its chunks, which every read checks anyway."""
        if self._files is not None:
            self._files.check_links(self.entries())

    def entries(self) -> list[EntryRecord]:
        return list(self._entry_map().values())

    def entry(self, name: str) -> EntryRecord:
        e = self._entry_map().get(name)
        if e is None:
            raise StoreError("no such entry in the store", path=self.url, param=name)
        return e

    def specs(self) -> list[TensorSpec]:
        return [e.spec() for e in self.entries()]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def ingested_ranks(self) -> set[int]:
        """Source ranks whose writes are complete: one progress record each (:mod:`zckpt.store.records`),
        so that parallel ingest workers never write the same key."""
        if self._ingested is None:
            self._ingested = self._backend.record_ranks()
        return set(self._ingested)

    def define(
        self,
        tensors: Sequence[TensorSpec],
        writers: Mapping[str, Sequence[tuple[int, Box]]],
        chunks: Mapping[str, tuple[int, ...]],
        strings: Mapping[str, str],
        source: Mapping[str, Any],
        compressors: Any = None,
        fingerprint: str | None = None,
        shards: Mapping[str, tuple[int, ...]] | None = None,
        packing: packed.PackPlan | None = None,
    ) -> None:
        """Create every array (no data yet) and write the manifest.

        Uncompressed arrays get their ``zarr.json`` from a template that zarr itself
        rendered for the dtype, with shape, chunks and attributes filled in: creating
        thousands of arrays through zarr's API costs milliseconds each. An array named in
        ``shards`` (inner chunks per shard; local uncompressed stores only) is sharded: each
        shard file is created at its final size with its index, so that writers only fill
        their byte ranges. Tensors ``packing`` places get no array: their bytes live in a
        packed array (:mod:`zckpt.store.packed`) and their manifest entry says where.
        """
        shards = dict(shards or {})
        slots = packing.slots if packing is not None else {}
        if (shards or slots) and (self._files is None or compressors is not None):
            raise StoreError("sharded and packed arrays are written to local uncompressed stores only", path=self.url)
        records: list[EntryRecord] = []
        pending: list[tuple[str, str, TensorSpec, tuple[int, ...], dict[str, Any]]] = []
        fast = compressors is None
        defined: list[ArrayDefinition] = []
        self._backend.define_nodes(fast)
        for t in tensors:
            if t.kind == "str":
                records.append(EntryRecord(t.name, t.kind, t.ms_type, t.shape, "", strings[t.name], t.stages, t.note))
                continue
            slot = slots.get(t.name)
            if slot is not None:
                records.append(EntryRecord(t.name, t.kind, t.ms_type, t.shape, slot.key, None, t.stages, t.note,
                                           slot.offset, slot.writer))
                continue
            node = f"{'tensors' if t.kind == 'tensor' else 'maps'}/{encode_key(t.name)}"
            attrs = entry_attributes(t, writers.get(t.name, ()))
            if fast:
                defined.append(ArrayDefinition(node, t, chunks[t.name], {"zckpt": attrs}, shards.get(t.name)))
            else:
                pending.append((t.name, node, t, chunks[t.name], attrs))
            records.append(EntryRecord(t.name, t.kind, t.ms_type, t.shape, node, None, t.stages, t.note))
            self._writers[t.name] = list(writers.get(t.name, ()))
        self._backend.define_arrays(defined, packing.arrays if packing is not None else ())
        if pending:  # compressed: through zarr-python (imported only then)
            for name, arr in create_arrays(self.group, pending, compressors):
                self._arrays.keep(name, arr)
        self._backend.define_records_folder()
        self._seal_manifest(entries=[r.to_json() for r in records], source=dict(source), fingerprint=fingerprint)
        self._entries = {r.name: r for r in records}  # as the manifest now says: not parsed back

    # --- integrity (zckpt.store.integrity) --------------------------------------------------
    def _seal_manifest(self, **changes: Any) -> None:
        """Write the manifest digest (with ``changes``) in one update of the manifest."""
        meta = dict(self.manifest)
        meta.update(changes)
        seal = integrity.sealed(meta)
        self._update(**changes, integrity=seal)
        self._digested = ({k: meta.get(k) for k in integrity.MANIFEST_KEYS}, seal["manifest"])

    def _known_digest(self) -> str | None:
        """The manifest digest this process computed, while the digested parts of the
        manifest are still those very objects (hashing 100 000 entries again costs a second)."""
        if self._digested is None:
            return None
        parts, digest = self._digested
        return digest if all(self.manifest.get(k) is v for k, v in parts.items()) else None

    def unseal(self) -> None:
        """Mark the store incomplete again, its record digests dropped: some of its source
        ranks are about to be redone. Stores without digests are only unmarked."""
        if integrity.checked(self.manifest):
            self._seal_manifest(complete=False)
        else:
            self._update(complete=False)

    def identity(self) -> str | None:
        """The content identity of the store (:func:`zckpt.store.integrity.identity`): read from
        the manifest when complete, from the progress records otherwise."""
        if self.complete:
            return integrity.identity(self.manifest)
        return integrity.identity(self.manifest, self.progress_records())

    def check_integrity(self) -> None:
        """Refuse (by name) a store whose manifest was never written, was edited since its
        ingest, is marked complete without the sealed digests of its checksum records, or
        whose records lost their checksums or changed since. Once per command: readers call
        it before planning (:func:`zckpt.store.reader.check_coverage`); tasks that read records
        then check only that each rank's checksums are there."""
        if not self._trusted:
            try:
                integrity.refuse_unsealed(self.manifest, self.ingested_ranks(), self.url)
            except StoreError as err:
                named = None
                if "manifest differs" in err.message:  # which entry, when its array tells
                    named = integrity.damaged_entry(self.entries(), self.array, lambda: self.group, self.where)
                if named is None:
                    raise
                raise StoreError(f"{err.message}; {named.message}", path=named.path, param=named.param) from None
            if integrity.checked(self.manifest):  # each record against its sealed digest, once per command
                for rank, attrs in self._progress_attributes():
                    integrity.check_record(self.manifest, rank, attrs, self.record_where(rank))
            self._trusted = True

    def check_arrays(self) -> None:
        """Every array's ``zarr.json`` against its manifest entry and what the format requires
        (which :meth:`chunk_info` checks on first use), for commands that hand the metadata to
        other readers without reading the data (``consolidate``)."""
        for e in self.entries():
            if e.kind != "str" and e.offset is None:
                self.chunk_info(e.name)

    def progress_records(self) -> dict[int, dict[str, Any]]:
        """Every source rank's progress record (its attributes: bytes, checksum records,
        source identity), as stored."""
        return dict(self._progress_attributes())

    def forget_ranks(self, ranks: Iterable[int]) -> None:
        """Remove the progress records of ``ranks`` (their writes will be redone)."""
        ranks = list(ranks)
        if self.version < rank_records.FILE_VERSION:
            for r in ranks:
                with contextlib.suppress(KeyError):
                    del self.group[f"progress/rank_{r}"]
        else:
            self._backend.forget_records(ranks)
        self._ingested = None

    def write_many(self, items: Sequence[tuple[str, tuple[slice, ...], np.ndarray]]) -> None:
        """Write several regions concurrently (one event-loop round trip, I/O overlapped)."""
        self.prefetch(name for name, _, _ in items)
        with self._backend.io_errors("cannot write"):
            gather([self.array(name)._async_array.setitem(sel, data) for name, sel, data in items])

    def read_many(self, items: Sequence[tuple[str, tuple[slice, ...]]]) -> list[np.ndarray]:
        """Read several regions concurrently."""
        self.prefetch(name for name, _ in items)
        with self._backend.io_errors("cannot read"):
            out = gather([self.array(name)._async_array.getitem(sel) for name, sel in items])
        return [np.asarray(x) for x in out]

    def prefetch(self, names: Iterable[str]) -> None:
        """Remote stores: open every array of ``names`` not opened yet, concurrently (each
        open is a round trip; one after another they dominate small transfers). Local stores
        open arrays on first use, as before."""
        if self._files is not None:
            return
        todo = [self.entry(n) for n in dict.fromkeys(names) if self._arrays.get(n) is None]
        todo = [e for e in todo if e.kind != "str"]
        if todo:
            self._arrays.open_many(self.group, todo, self._backend.mode)

    def mark_ingested(self, rank: int, **info: Any) -> None:
        """Write rank ``rank``'s progress record (in one atomic write: a crash can never
        leave a rank marked done without the checksums that prove its chunks). A store of
        format 4 or older being resumed keeps its zarr group records."""
        if self.version < rank_records.FILE_VERSION:
            self.group.create_group(f"progress/rank_{rank}", attributes=dict(info), overwrite=True)
        else:
            self._backend.write_record(rank, info)
        self._ingested = None

    def mark_ingested_many(self, infos: Mapping[int, Mapping[str, Any]]) -> None:
        """Write the progress records of several ranks (``{rank: info}``, each as
        :meth:`mark_ingested` takes it): in a local store of format 7, ranks in a row share
        one file (:func:`zckpt.store.records.write_many`); elsewhere one record each."""
        if self.version >= rank_records.GROUP_VERSION:
            self._backend.write_records(infos)
            self._ingested = None
            return
        for rank in sorted(infos):
            self.mark_ingested(rank, **infos[rank])

    def mark_complete(self) -> None:
        problems = self.coverage_problems()
        if problems:
            raise StoreError("store is not complete: " + "; ".join(problems[:10]), path=self.url)
        if not integrity.checked(self.manifest):
            self._update(complete=True)
            return
        self._update(complete=True, integrity=integrity.sealed(self.manifest, self.progress_records(),
                                                               self._known_digest()))

    # --- data ------------------------------------------------------------------------
    def array(self, name: str) -> zarr.Array[Any]:
        cached = self._arrays.get(name)
        if cached is not None:
            return cached
        e = self.entry(name)
        if e.kind == "str":
            raise StoreError("string entries have no array", path=self.url, param=name)
        if e.offset is None:
            return self._arrays.open(self.group, e, self._backend.mode)
        # a packed tensor: its bytes, checked, in an array of its own in memory, for the occasional
        # reader (``load --param``, replica checks); export and verify read them directly (:meth:`chunk_at`)
        info = self.chunk_info(e.name)  # packed tensors are placed in local stores only (packed_place)
        self.verify_chunks(e.name, Box.full(e.shape))
        return self._arrays.packed(e, ChunkFiles.read_packed(info, e.name), self.writers(e.name))

    def data_type(self, name: str) -> str:
        """The Zarr data type an array is stored with: ``"bfloat16"`` for BFloat16 (``"uint16"``
        in stores of format version 1), else the numpy name of its storage (``"float32"``, ...)."""
        got = self._arrays.data_type(name)
        if got is None:
            self.array(name)
            got = self._arrays.data_type(name)
            assert got is not None
        return got

    def chunk_info(self, name: str) -> ChunkInfo:
        """Shape, chunk shape and chunk encoding of an array, read from its ``zarr.json``
        alone (opening a zarr array costs a millisecond or more; a store has thousands)."""
        info = self._chunk_info.get(name)
        if info is None and self.entry(name).offset is not None:
            info = self._chunk_info[name] = self._packed_info(self.entry(name))
        if info is None:
            e = self.entry(name)
            folder = self._files.folder(e) if self._files is not None else None
            doc: Any = None
            if self._files is not None:
                doc = self._files.array_document(e, self.where(e.key, "zarr.json"))
            else:
                self.prefetch([name])
                doc = self.array(name).metadata.to_dict()  # the zarr.json the open just read
            if doc is None:
                arr = self.array(name)
                doc = {"shape": arr.shape, "chunk_grid": {"configuration": {"chunk_shape": arr.chunks}},
                       "codecs": [], "chunk_key_encoding": {}}
            itemsize = 1 if e.kind != "tensor" else ms_dtype(e.ms_type).storage.itemsize
            info = ChunkInfo.from_json(doc, folder, itemsize)
            self._chunk_info[name] = info
        return info

    def _packed_info(self, e: EntryRecord) -> ChunkInfo:
        """A packed tensor's one chunk: where it lies in its packed array's chunk file."""
        folder, key, at, chunk_bytes = self.packed_place(e)
        itemsize = ms_dtype(e.ms_type).storage.itemsize
        return ChunkInfo(e.shape, e.shape, True, ".", folder, None, itemsize, (key, at, chunk_bytes))

    def packed_place(self, e: EntryRecord) -> tuple[Path, str, int, int]:
        """``(packed array folder, chunk key, byte offset, chunk file bytes)`` of a packed
        tensor (:meth:`zckpt.store.chunk_files.ChunkFiles.packed_place`; local stores only)."""
        if self._files is None:
            raise misplaced_pack(e, self.url)
        return self._files.packed_place(e, self.url)

    def assume_layout(self, name: str, chunks: tuple[int, ...], per_shard: tuple[int, ...] | None) -> None:
        """Take an array's chunk layout from the ingest plan instead of its ``zarr.json``
        (an ingest task writes into every array; reading each one's metadata per source
        rank costs more than the data at hundreds of ranks). Only for local stores of this
        format, whose arrays ingest defines raw with ``.``-separated keys; others are read."""
        if self._files is None or name in self._chunk_info or self.version not in SHARDED_LAYOUTS:
            return
        e = self.entry(name)
        if e.kind != "tensor" or not e.shape or e.offset is not None:
            return
        self._chunk_info[name] = ChunkInfo(e.shape, tuple(chunks), True, ".", self._files.folder(e), per_shard,
                                           ms_dtype(e.ms_type).storage.itemsize)

    def raw_chunk_file(self, name: str, coords: Sequence[int]) -> Path | None:
        """Path of a chunk whose stored bytes are the raw C-order little-endian values
        (uncompressed, bytes codec only), or ``None`` when chunks are encoded otherwise.
        In a sharded array: the shard file holding the inner chunk (see :meth:`chunk_at`).

        Such chunks can be filled from and copied to checkpoint files without decoding.
        """
        at = self.chunk_at(name, coords)
        return None if at is None else at[1]

    def chunk_at(self, name: str, coords: Sequence[int]) -> tuple[str, Path, int, int] | None:
        """``(file key, file, byte offset, file size)`` of a raw (inner) chunk, or ``None`` when
        chunks are encoded otherwise. In a remote store the file is the chunk's object
        (an :class:`~zckpt.io.ranged.ObjectPath`: its URL), read through :attr:`objects`."""
        if self._files is None:
            if self.objects is None:
                return None
            return self.objects.chunk_at(self.entry(name).key, self.chunk_info(name), coords)
        return self._files.chunk_at(name, self.chunk_info(name), coords)

    def chunk_files(self, name: str, box: Box) -> list[tuple[str, Path]]:
        """``(file key, file)`` of every chunk (or shard) file ``box`` touches (raw local
        stores; else empty)."""
        info = self.chunk_info(name)
        return [] if self._files is None else self._files.chunk_files(info, box)

    def files_of(self, names: Iterable[str]) -> list[Path]:
        """Every file holding the bytes of the tensors ``names``, in their order, each once
        (raw local stores; else empty): what reading them whole reads."""
        if self._files is None:
            return []
        out: dict[Path, None] = {}
        for name in names:
            e = self.entry(name)
            if e.kind == "tensor":
                out.update((p, None) for _, p in self._files.files_of(self.chunk_info(name), Box.full(e.shape)))
        return list(out)

    def chunk_keys(self, name: str, box: Box) -> list[str]:
        """Keys of every chunk ``box`` touches when chunks are stored raw (local or remote)."""
        return self.chunk_info(name).keys_in(box)

    # --- checksum records (zckpt.store.chunk_records) ----------------------------------
    def checksums(self) -> dict[str, dict[str, ChunkSums]]:
        """Checksums of every chunk, as recorded by the source rank that wrote it
        (:meth:`zckpt.store.chunk_records.ChunkRecords.checksums`)."""
        return self._records.checksums()

    def _progress_attributes(self) -> list[tuple[int, dict[str, Any]]]:
        """``(rank, attributes)`` of every progress record, in rank order."""
        found = self._backend.read_records(self._record_files)
        return [(r, found[r]) for r in sorted(found)]

    def _check_record(self, rank: int, attrs: dict[str, Any]) -> None:
        integrity.check_record(self.manifest, rank, attrs, self.record_where(rank),
                               digest=False)  # digests: once per command, check_integrity

    def record_where(self, rank: int) -> str:
        """The file holding source rank ``rank``'s progress record, as messages name it (a
        range file, a format-4 group's ``zarr.json``, or the rank's own file)."""
        return self.where(*self._record_files.get(rank, f"{rank_records.FOLDER}/{rank_records.file_name(rank)}")
                          .split("/"))

    def record_owner(self, name: str) -> str:
        """Under which name the checksum records of entry ``name`` are filed
        (:meth:`zckpt.store.chunk_records.ChunkRecords.record_owner`)."""
        return self._records.record_owner(name)

    def records_in(self, name: str, file_key: str) -> list[tuple[str, ChunkSums]]:
        """``(record key, sums)`` of every checksum record of one chunk or shard file, in
        file order (a chunk file has one record covering it, a shard one per run)."""
        return self._records.records_in(name, file_key)

    def records_over(self, name: str, file_key: str, start: int, stop: int) -> list[tuple[str, ChunkSums]]:
        """The records of :meth:`records_in` that bytes ``[start, stop)`` of the file meet."""
        return self._records.records_over(name, file_key, start, stop)

    def verify_chunks(self, name: str, box: Box, done: Checked | None = None) -> int:
        """Check every recorded block of every chunk ``box`` touches; raise naming parameter
        and chunk. Returns the bytes checked. ``done`` (blocks already checked) avoids
        re-reading a chunk, and receives the blocks checked here."""
        if self._files is None:
            expected = self.checksums().get(name, {})
            return verify_remote_chunks(self.group, self.url, self.entry(name), self.chunk_info(name).chunks,
                                        self.chunk_keys(name, box), expected, done)
        owner = self.record_owner(name)
        info = self.chunk_info(name)
        return self._files.verify(name, owner, info, box, lambda file_key: self._records_of(name, info, file_key),
                                  done)

    def _records_of(self, name: str, info: ChunkInfo, file_key: str) -> list[tuple[str, ChunkSums]]:
        """The records of a chunk file that hold ``name``'s bytes: a packed tensor's run
        only (its packed chunk holds thousands of others), else all of them."""
        if info.at is not None:
            return self.records_over(name, file_key, info.at[1], info.at[1] + info.inner_bytes)
        return self.records_in(name, file_key)

    def writers(self, name: str) -> list[tuple[int, Box]]:
        e = self.entry(name)
        if e.offset is not None:
            return [(int(e.writer or 0), Box.full(e.shape))]
        if name not in self._writers:
            meta: Any = self.array(name).attrs.get("zckpt", {})
            self._writers[name] = [(int(r), Box.from_json(b)) for r, b in meta.get("writers", [])]
        return self._writers[name]

    def missing_in(self, name: str, box: Box, done: Set[int] | None = None) -> list[int]:
        """Source ranks whose region of ``box`` is not in the store yet ([-1] = nobody has it);
        ``done``: the ranks ingested, when the caller has them."""
        done = self.ingested_ranks() if done is None else done
        covered = 0
        missing: list[int] = []
        for r, b in self.writers(name):
            part = b.overlap(box) if box.ndim else b.size
            if box.ndim and not part:
                continue
            if r in done:
                covered += part
            else:
                missing.append(r)
        if not missing and covered < box.size:
            return [-1]
        return missing

    def coverage_problems(self, names: Iterable[str] | None = None) -> list[str]:
        problems = []
        known, done = self._entry_map(), self.ingested_ranks()
        # only the entries asked for: verify asks entry by entry, 100 000s of them
        for e in known.values() if names is None else [known[n] for n in dict.fromkeys(names) if n in known]:
            if e.kind == "str" or (e.writer is not None and e.writer in done):  # a packed tensor: one writer
                continue
            miss = self.missing_in(e.name, Box.full(e.shape), done)
            if miss == [-1]:
                problems.append(f"{e.name}: part of the tensor is held by no source rank")
            elif miss:
                problems.append(f"{e.name}: not yet ingested from source rank(s) {miss}")
        return problems
