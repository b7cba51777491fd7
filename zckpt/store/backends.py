"""Where a store lives: a local directory or a remote location, one class each, chosen once when it is opened.

A store is the same document whichever disk holds it; what differs is how its nodes are
reached. A local store (:class:`LocalBackend`) is read and written as files, without
zarr-python: its manifest is the root ``zarr.json`` replaced whole, its progress records
are files (:mod:`zckpt.store.records`), its arrays are defined from
:mod:`zckpt.store.array_documents` and its chunks are raw files (:class:`~zckpt.store.chunk_files.ChunkFiles`).
A remote store (:class:`RemoteBackend`) goes through fsspec and zarr-python's group. Both
satisfy :class:`Backend`; :class:`zckpt.store.store.Store` holds one and never asks which.
A new storage backend is one more class here, chosen in :func:`create` and :func:`open_backend`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from zckpt.core.errors import StoreError
from zckpt.io import fileio, remote
from zckpt.plan.values import TensorSpec
from zckpt.store import packed
from zckpt.store import records as rank_records
from zckpt.store.array_documents import GROUP_DOCUMENT, array_json, write_array_json, write_json
from zckpt.store.chunk_files import ChunkFiles, preallocate_shards
from zckpt.store.manifest import group_attributes, new_manifest, readable_manifest
from zckpt.store.zarr_arrays import fsspec_store

if TYPE_CHECKING:  # zarr-python is imported where it is used, from zckpt.io.zarr_local
    import zarr

Mode = Literal["r", "r+", "a", "w", "w-"]


@dataclass(frozen=True)
class ArrayDefinition:
    """An uncompressed array to define: its node (``tensors/<key>``), entry, chunk shape,
    attributes and, when sharded, inner chunks per shard."""

    node: str
    spec: TensorSpec
    chunks: tuple[int, ...]
    attributes: dict[str, Any]
    per_shard: tuple[int, ...] | None = None


class Backend(Protocol):
    """How a store's nodes are reached (:class:`LocalBackend`, :class:`RemoteBackend`)."""

    path: Path
    """The local directory (for a remote store: its path inside the filesystem, for messages)."""
    url: str
    """The store as the user named it: what tasks reopen and what messages show."""
    location: remote.Location | None
    mode: Mode
    files: ChunkFiles | None
    """The store's raw chunk files (local stores only)."""

    @property
    def group(self) -> zarr.Group: ...

    @property
    def manifest(self) -> dict[str, Any]: ...

    def write_manifest(self, meta: dict[str, Any]) -> None: ...

    def where(self, *parts: str) -> str:
        """A node or chunk of the store as messages name it: a path, or a URL when remote."""
        ...

    def remove(self) -> None: ...

    def io_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Remote stores: network and permission failures become a StoreError naming the URL
        (local stores keep raising OSError as they always did)."""
        ...

    def record_ranks(self) -> set[int]:
        """Source ranks with a progress record (files and format-4 groups)."""
        ...

    def read_records(self, found_in: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Every progress record; ``found_in`` receives the file each rank's was read from."""
        ...

    def write_record(self, rank: int, info: Mapping[str, Any]) -> None: ...

    def write_records(self, infos: Mapping[int, Mapping[str, Any]]) -> None:
        """Several ranks' records, in a store of format 7 (ranks in a row may share a file)."""
        ...

    def forget_records(self, ranks: Sequence[int]) -> None:
        """Remove the record files (format 5 and later) of ``ranks``."""
        ...

    def define_nodes(self, fast: bool) -> None:
        """The ``tensors`` and ``maps`` groups of a store being defined (``fast``: its arrays
        are defined from documents, not through zarr-python)."""
        ...

    def define_arrays(self, arrays: Sequence[ArrayDefinition], packs: Sequence[packed.PackedArray]) -> None:
        """The uncompressed arrays' ``zarr.json`` and, in a local store, its packed arrays
        (:mod:`zckpt.store.packed`)."""
        ...

    def define_records_folder(self) -> None: ...


class LocalBackend:
    """A store in a local directory, read and written as files."""

    location: remote.Location | None = None

    def __init__(self, path: Path, mode: Mode) -> None:
        self.path = path
        self.url = str(path)
        self.mode: Mode = "r" if mode == "r" else "r+"
        self.files: ChunkFiles | None = ChunkFiles(path)
        self._group: zarr.Group | None = None
        self._manifest: dict[str, Any] | None = None
        """The manifest as this process last wrote it (not through zarr)."""
        self._other_attrs: dict[str, Any] | None = None
        """The root group's attributes besides the manifest, as this process last wrote them."""

    @classmethod
    def create(cls, p: Path, overwrite: bool) -> LocalBackend:
        if p.exists():
            if not overwrite:
                raise StoreError("store already exists (--overwrite replaces it)", path=p)
            if (p / "zarr.json").is_file() or not any(p.iterdir()):
                shutil.rmtree(p)
            else:
                raise StoreError("refusing to overwrite a directory that is not a zarr store", path=p)
        p.mkdir(parents=True)
        backend = cls(p, mode="w-")
        backend._other_attrs = {}
        backend.write_manifest(new_manifest())
        return backend

    @classmethod
    def open(cls, p: Path, mode: Mode) -> LocalBackend:
        if not (p / "zarr.json").is_file():
            raise StoreError("not a zarr store (no zarr.json)", path=p)
        attrs = group_attributes(p)
        meta = readable_manifest(attrs.get("zckpt"), p)
        backend = cls(p, mode=mode)
        backend._manifest = meta
        backend._other_attrs = {k: v for k, v in attrs.items() if k != "zckpt"}
        return backend

    @property
    def group(self) -> zarr.Group:
        if self._group is None:
            from zckpt.io.zarr_local import ConfinedStore, zarr

            try:
                self._group = zarr.open_group(ConfinedStore(self.path, read_only=self.mode == "r"),
                                              mode=self.mode, zarr_format=3)
            except Exception as err:  # zarr raises several unrelated types for a broken store
                raise StoreError(f"cannot open zarr store: {err}", path=self.path) from None
        return self._group

    @property
    def manifest(self) -> dict[str, Any]:
        if self._manifest is not None:
            return self._manifest
        meta = self.group.attrs.get("zckpt")
        assert isinstance(meta, dict)
        return meta

    def write_manifest(self, meta: dict[str, Any]) -> None:
        """Write the root ``zarr.json`` (the group, its attributes holding the manifest) as
        compact JSON in one atomic replace. zarr's attribute update copies and indents the
        whole document: with 100 000 entries, seconds per write. The group object is
        reopened when next needed, from this file. A consolidated copy of the metadata
        (``zckpt consolidate``) is dropped: it would no longer match."""
        if self._other_attrs is None:
            self._other_attrs = {k: v for k, v in self.group.attrs.items() if k != "zckpt"}
        doc = {"attributes": {**self._other_attrs, "zckpt": meta}, "zarr_format": 3, "node_type": "group"}
        fileio.write_atomic(self.path / "zarr.json", rank_records.canonical(doc), fsync=False)
        self._manifest = meta
        self._group = None

    def where(self, *parts: str) -> str:
        return str(self.path.joinpath(*parts))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def io_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record_ranks(self) -> set[int]:
        return rank_records.local_ranks(self.path)

    def read_records(self, found_in: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Record files and format-4 groups, read as plain JSON (opening hundreds of groups
        through zarr costs more than parsing them)."""
        assert self.files is not None
        self.files.confined.folder(rank_records.FOLDER)
        return rank_records.read_local(self.path, found_in)

    def write_record(self, rank: int, info: Mapping[str, Any]) -> None:
        rank_records.write(self.path, rank, info)

    def write_records(self, infos: Mapping[int, Mapping[str, Any]]) -> None:
        rank_records.write_many(self.path, infos)

    def forget_records(self, ranks: Sequence[int]) -> None:
        rank_records.forget_local(self.path, ranks)

    def define_nodes(self, fast: bool) -> None:
        for folder in ("tensors", "maps"):
            write_json(self.path / folder, GROUP_DOCUMENT)

    def define_arrays(self, arrays: Sequence[ArrayDefinition], packs: Sequence[packed.PackedArray]) -> None:
        """Each array's ``zarr.json``; a sharded or packed array's files at their final size."""
        for a in arrays:
            t = a.spec
            write_array_json(self.path / a.node, t.ms_type, t.kind, t.shape, a.chunks, a.attributes, a.per_shard)
            if a.per_shard is not None:
                preallocate_shards(self.path / a.node, t, a.chunks, a.per_shard)
        for pack in packs:
            where = self.path / pack.key
            write_array_json(where, pack.ms_type, "tensor", (pack.length,), (pack.chunk,),
                             {"zckpt": {"kind": "packed", "ms_dtype": pack.ms_type}})
            packed.preallocate(where, pack)

    def define_records_folder(self) -> None:
        write_json(self.path / rank_records.FOLDER, rank_records.folder_document())


class RemoteBackend:
    """A store at a remote location, through fsspec and zarr-python."""

    files: ChunkFiles | None = None

    def __init__(self, location: remote.Location, group: zarr.Group, mode: Mode) -> None:
        self.location: remote.Location | None = location
        self._location = location
        self.path = Path(location.path)
        self.url = location.url
        self.mode: Mode = "r" if mode == "r" else "r+"
        self._group = group

    @classmethod
    def create(cls, url: str, overwrite: bool, storage_options: remote.StorageOptions) -> RemoteBackend:
        loc = remote.locate(url, storage_options, StoreError)
        children = remote.listdir(loc, StoreError)
        if children or remote.isfile(loc, StoreError):
            if not overwrite:
                raise StoreError("store already exists (--overwrite replaces it)", path=url)
            if ("zarr.json", False) not in children:
                raise StoreError("refusing to overwrite a location that is not a zarr store", path=url)
            remote.remove(loc, StoreError, recursive=True)
        from zckpt.io.zarr_local import zarr

        with remote.remote_errors(StoreError, url, "cannot create zarr store"):
            group = zarr.open_group(fsspec_store(url, storage_options, read_only=False), mode="w-", zarr_format=3)
            group.attrs["zckpt"] = new_manifest()
        return cls(loc, group, mode="w-")

    @classmethod
    def open(cls, url: str, mode: Mode, storage_options: remote.StorageOptions) -> RemoteBackend:
        loc = remote.locate(url, storage_options, StoreError)
        if not remote.isfile(loc.child("zarr.json"), StoreError):
            raise StoreError("not a zarr store (no zarr.json)", path=url)
        from zckpt.io.zarr_local import zarr

        with remote.remote_errors(StoreError, url, "cannot open zarr store"):
            group = zarr.open_group(fsspec_store(url, storage_options, read_only=mode == "r"), mode=mode,
                                    zarr_format=3)
            meta = group.attrs.get("zckpt")
        readable_manifest(meta, url)
        return cls(loc, group, mode=mode)

    @property
    def group(self) -> zarr.Group:
        return self._group

    @property
    def manifest(self) -> dict[str, Any]:
        meta = self.group.attrs.get("zckpt")
        assert isinstance(meta, dict)
        return meta

    def write_manifest(self, meta: dict[str, Any]) -> None:
        self.group.attrs["zckpt"] = meta

    def where(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])

    def remove(self) -> None:
        with contextlib.suppress(StoreError):
            remote.remove(self._location, StoreError, recursive=True)

    def io_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return remote.remote_errors(StoreError, self.url, what)

    def record_ranks(self) -> set[int]:
        return set(self._records(read=False, found_in={}))

    def read_records(self, found_in: dict[int, str]) -> dict[int, dict[str, Any]]:
        return self._records(read=True, found_in=found_in)

    def _records(self, *, read: bool, found_in: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Record files and format-4 groups; with ``read=False`` only which ranks have one
        (the documents are left empty)."""
        folder = self._location.child(rank_records.FOLDER)
        try:
            present = remote.listdir(folder, StoreError)
        except StoreError:
            return {}
        out: dict[int, dict[str, Any]] = {}
        files: dict[str, tuple[int, int]] = {}
        for name, is_dir in present:
            span = rank_records.ranks_of(name)
            if span is not None and not is_dir:
                files[name] = span
                continue
            got = rank_records.rank_of(name)
            if got is None or got[1] or not is_dir:
                continue
            if not read:
                out[got[0]] = {}
            else:
                from zckpt.io.zarr_local import zarr

                node = self.group[f"{rank_records.FOLDER}/{name}"]
                out[got[0]] = dict(node.attrs) if isinstance(node, zarr.Group) else {}
                found_in[got[0]] = f"{rank_records.FOLDER}/{name}/zarr.json"
        if files and read:
            with remote.remote_errors(StoreError, self.url, "cannot read progress records"):
                fetched = folder.fs.cat([folder.child(n).path for n in files])
            by_name = {str(k).rstrip("/").rsplit("/", 1)[-1]: v for k, v in fetched.items()}
            for name in sorted(files):
                got_docs = rank_records.decode_named(by_name.get(name, b""), name,
                                                     self.where(rank_records.FOLDER, name))
                out.update(got_docs)
                found_in.update(dict.fromkeys(got_docs, f"{rank_records.FOLDER}/{name}"))
        else:
            out.update({rank: {} for first, last in files.values() for rank in range(first, last + 1)})
        return out

    def write_record(self, rank: int, info: Mapping[str, Any]) -> None:
        remote.write_bytes(self._location.child(rank_records.FOLDER).child(rank_records.file_name(rank)),
                           rank_records.encode(rank, info), StoreError)

    def write_records(self, infos: Mapping[int, Mapping[str, Any]]) -> None:
        for rank in sorted(infos):
            self.write_record(rank, infos[rank])

    def forget_records(self, ranks: Sequence[int]) -> None:
        folder = self._location.child(rank_records.FOLDER)
        try:
            names = [n for n, is_dir in remote.listdir(folder, StoreError) if not is_dir]
        except StoreError:
            names = []

        def remove(name: str) -> None:
            with contextlib.suppress(StoreError):
                remote.remove(folder.child(name), StoreError)

        rank_records.forget(names, ranks, read=lambda n: remote.read_bytes(folder.child(n), StoreError),
                            write=lambda n, data: remote.write_bytes(folder.child(n), data, StoreError),
                            remove=remove, where=lambda n: self.where(rank_records.FOLDER, n))

    def define_nodes(self, fast: bool) -> None:
        if fast:
            for folder in ("tensors", "maps"):
                self.group.require_group(folder)

    def define_arrays(self, arrays: Sequence[ArrayDefinition], packs: Sequence[packed.PackedArray]) -> None:
        """Every array's ``zarr.json`` in concurrent puts (packed arrays are local only)."""
        if packs:
            raise StoreError("sharded and packed arrays are written to local uncompressed stores only", path=self.url)
        if not arrays:
            return
        docs = {f"{a.node}/zarr.json": array_json(a.spec.ms_type, a.spec.kind, a.spec.shape, a.chunks,
                                                  a.attributes).encode("utf-8") for a in arrays}
        loc = self._location
        with remote.remote_errors(StoreError, self.url, "cannot write array metadata"):
            loc.fs.pipe({loc.child(k).path: v for k, v in docs.items()})

    def define_records_folder(self) -> None:
        rank_records.define_folder(self.group)


def create(path: str | Path, overwrite: bool, storage_options: remote.StorageOptions) -> Backend:
    """A new, empty store's backend: remote for a URL, else a local directory."""
    if isinstance(path, str) and remote.is_remote(path):
        return RemoteBackend.create(path, overwrite, storage_options)
    return LocalBackend.create(remote.local_path(path), overwrite)


def open_backend(path: str | os.PathLike[str], mode: Mode, storage_options: remote.StorageOptions) -> Backend:
    """An existing store's backend, refused unless zckpt wrote it in a version this zckpt reads."""
    if isinstance(path, str) and remote.is_remote(path):
        return RemoteBackend.open(path, mode, storage_options)
    return LocalBackend.open(remote.local_path(path), mode)
