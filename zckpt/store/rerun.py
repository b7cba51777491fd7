"""What an ingest rerun into an existing store of the same ingest has to do.

A rerun (same sources, no ``--overwrite``) finds the store complete, interrupted, or
damaged in ways it can mend: source ranks whose progress record is gone (removed by hand),
lost its checksums or no longer matches the digest sealed with the store, and ranks whose
source file changed since it was read. Each such rank is redone: its record is dropped, its
boxes are copied again and the store is sealed anew, so the rerun ends with a store that
``zckpt verify`` finds intact. A damaged manifest cannot be mended this way (it defines what
the ranks write): it is refused, naming ``--overwrite``.

A complete store with nothing to redo needs no writing: :func:`complete_already` checks it
under the readers' shared lock, so that a no-op rerun is not refused while an export reads
the store, and takes the writer's lock only when there is work.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from pathlib import Path
from typing import TYPE_CHECKING

from zckpt.core.errors import StoreError
from zckpt.io import locks
from zckpt.store import integrity

if TYPE_CHECKING:
    from zckpt.store.store import Store


def to_redo(store: Store, required: Set[int], rank_files: Mapping[int, str]) -> dict[int, str]:
    """Source ranks of ``store`` (holding this very ingest) to ingest again, with why.
    ``required``: the ranks the ingest reads; ``rank_files``: their files now."""
    manifest = store.manifest
    try:
        integrity.refuse_unsealed(manifest, store.ingested_ranks(), store.url, records=False)
    except StoreError as err:
        raise StoreError(f"{err.message}; rerun the ingest with --overwrite to write it again",
                         path=err.path, param=err.param) from None
    out: dict[int, str] = {}
    records = store.progress_records()
    if store.complete:  # an interrupted store simply lacks the records of the ranks still to do
        sealed = (manifest.get("integrity") or {}).get("records")
        expected = set(required) | ({int(r) for r in sealed} if isinstance(sealed, dict) else set())
        for rank in sorted(expected - set(records)):
            out[rank] = f"its progress record ({store.record_where(rank)}) is missing"
    for rank, record in records.items():
        try:
            integrity.check_record(manifest, rank, record, store.record_where(rank), digest=store.complete)
        except StoreError as err:
            out[rank] = err.message.removesuffix(": the store is damaged")
            continue
        path = rank_files.get(rank)
        why = None if path is None else integrity.source_change(record.get("source"), path)
        if why is not None:
            out[rank] = why
    return dict(sorted(out.items()))


def unsealed(store: Store) -> bool:
    """Whether a store marked complete, with nothing to redo (:func:`to_redo` checked its
    manifest and each record), still fails the readers' check of its seal: marked complete
    by hand, its records never sealed. Sealing it again (after the coverage check) is all it
    needs."""
    try:
        integrity.check_sealed(store.manifest, store.ingested_ranks(), store.url)
    except StoreError:
        return True
    return False


def complete_already(path: Path, fingerprint: str, required: Set[int], rank_files: Mapping[int, str]) -> Store | None:
    """The local store at ``path`` when it holds this ingest (``fingerprint``), complete and
    with nothing to redo (:func:`to_redo`), checked under the shared lock of its readers;
    ``None`` when there is work (or no such store), which the caller then does under the
    exclusive lock, checking again."""
    from zckpt.store.store import Store  # the store's modules: loaded while the sources are read (jobs.ingest)

    if not (path / "zarr.json").is_file():
        return None
    with locks.store_reading(path):
        try:
            store = Store.open(path)
        except StoreError:
            return None
        if store.manifest.get("fingerprint") != fingerprint or not store.complete:
            return None
        if to_redo(store, required, rank_files) or unsealed(store):
            return None
        store.ingested_ranks()
        return store
