"""A Dask worker preload for tests: every file zckpt publishes waits a moment first (so a
test can kill the worker in the middle of its tasks), and new files are written under a
temporary name as on a filesystem without unnamed files (NFS), so a killed task leaves one.

Used as ``dask worker ... --preload tests/dask_slow_worker.py``; the delay in seconds comes
from ``ZCKPT_TEST_PUBLISH_DELAY``.
"""

from __future__ import annotations

import os
import time
from typing import Any


def dask_setup(worker: Any) -> None:
    from zckpt.io import new_files

    delay = float(os.environ.get("ZCKPT_TEST_PUBLISH_DELAY", "0.3"))
    new_files.UNNAMED = False
    publish = new_files.NewFile.publish

    def slow_publish(self: new_files.NewFile, fsync: bool, *, sync_dir: bool = True) -> None:
        time.sleep(delay)
        publish(self, fsync, sync_dir=sync_dir)

    new_files.NewFile.publish = slow_publish  # type: ignore[method-assign]
