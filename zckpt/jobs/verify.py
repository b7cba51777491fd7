"""``zckpt verify``: prove a store (and optionally its sources and exports) intact, by reading.

Three independent checks, each reporting every mismatch it finds instead of stopping at
the first, so that one run says everything that is wrong:

* **store** -- the manifest against the arrays and every chunk against its size, its
  recorded CRC-32C and zarr's decoding (:mod:`zckpt.jobs.verify_store`);
* **sources** -- every source shard equals its box of the store, byte for byte, replicas
  included: the check that finds a store edited with its digests recomputed;
* **exports** -- every destination rank file holds exactly the entries the export plan
  gives it, with the store's bytes (these two: :mod:`zckpt.jobs.verify_files`).

This module opens the store and runs the checks in that order into one
:class:`~zckpt.jobs.verify_report.VerifyReport`. Nothing is written. Memory is bounded by
``block_bytes`` (plus one row when a row is wider, and one chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from zckpt.formats.strategy import StrategyMap
from zckpt.io import remote
from zckpt.jobs.verify_files import check_export, check_sources
from zckpt.jobs.verify_report import MiB, VerifyReport
from zckpt.jobs.verify_store import check_store
from zckpt.store.reader import reading
from zckpt.store.store import Store


def verify(
    store_path: str | Path,
    src: str | Path | None = None,
    src_strategy: str | Path | StrategyMap | None = None,
    *,
    against: str | Path | None = None,
    dst_strategy: str | Path | StrategyMap | None = None,
    prefix: str = "checkpoint_",
    any_order: bool = False,
    block_bytes: int = 64 * MiB,
    storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> VerifyReport:
    """Check the store, then (``src``) the sources against it, then (``against``) an export.

    The store may be a URL (``s3://...``; ``storage_options`` configure its filesystem): its
    chunks are fetched through zarr's store API. ``src`` and ``against`` are compared as
    local files only.
    A store that cannot be opened at all raises its :class:`~zckpt.core.errors.StoreError`;
    everything else found is collected in the report.
    """
    remote.require_local("zckpt verify", sources=src, exports=against)
    with reading(store_path):
        store = Store.open(store_path, storage_options=storage_options)
        report = VerifyReport(store.url)
        check_store(store, report, block_bytes=block_bytes)
        if src is not None:
            check_sources(store, src, src_strategy, report, block_bytes=block_bytes, file_suffix=file_suffix,
                          choice_func=choice_func)
        if against is not None:
            check_export(store, against, dst_strategy, report, prefix=prefix, block_bytes=block_bytes,
                         any_order=any_order)
    return report
