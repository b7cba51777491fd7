"""``unified_safetensors`` with URLs for its sources, its strategy and its output directory.

moto's S3 server runs on loopback behind the counting, fault-injecting proxy
(``tests/s3_proxy.py``). The job (13 MiB over two ranks, as in ``test_streaming_writes``) is
merged into two parts of about 6.5 MiB, each uploaded in 5 MiB parts; every directory
written to S3 is compared byte for byte with the same job written locally. Nothing may touch
local disk on the way (``test_transform_urls.no_local_disk``: no temporary file or directory,
no upload of a local file), and nothing may be made in the working directory (no ``s3:``
folder).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zckpt
from zckpt.core.errors import OutputError
from zckpt.jobs import unified
from zckpt.jobs.generate import write_model

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import Fault, Proxy, proxied_bucket  # noqa: E402  (after the skips: it needs moto)
from test_streaming_writes import SRC_N, _remote_tree, _tensors  # noqa: E402  (the same job)
from test_transform_urls import no_local_disk  # noqa: E402, F401  (autouse: nothing on local disk)

BUCKET = "zckpt-unified-urls"
PART_BYTES = 7 << 20
"""Two parts of the 13 MiB job, each above S3's 5 MiB part: uploaded in two parts."""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Proxy]]:
    """The S3 server (``fs`` talks to it directly) and the proxy zckpt talks to."""
    with proxied_bucket(BUCKET) as served:
        yield served


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Parts of :data:`PART_BYTES`; run in an empty directory that must stay empty."""
    monkeypatch.setattr(unified, "PART_BYTES", PART_BYTES)
    monkeypatch.chdir(tmp_path)
    yield
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmpdir"], "something was made in the working directory"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, server: tuple[Any, Proxy]) -> dict[str, Any]:
    """The sources as ``.ckpt`` and as ``.safetensors`` (local, and copied to S3 with the
    strategy) and their unified directories written locally."""
    fs, _ = server
    root = tmp_path_factory.mktemp("unified-urls")
    write_model(root / "ckpt", _tensors(), device_num=SRC_N, strings={"note": "unified"})
    strategy = root / "ckpt" / "strategy.ckpt"
    shutil.copytree(root / "ckpt", root / "st", ignore=shutil.ignore_patterns("strategy.ckpt"))
    for f in sorted((root / "st").rglob("*.ckpt")):
        zckpt.ckpt_to_safetensors(str(f))
        f.unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(unified, "PART_BYTES", PART_BYTES)
        for fmt in ("ckpt", "st"):
            zckpt.unified_safetensors(str(root / fmt), str(strategy), str(root / f"local-{fmt}"))
    for fmt in ("ckpt", "st"):
        for p in sorted((root / fmt).rglob("*")):
            if p.is_file() and p.name != "strategy.ckpt":
                fs.pipe_file(f"{BUCKET}/{fmt}/{p.relative_to(root / fmt).as_posix()}", p.read_bytes())
    fs.pipe_file(f"{BUCKET}/strategy.ckpt", strategy.read_bytes())
    return {"root": root, "strategy": strategy, "s3_strategy": f"s3://{BUCKET}/strategy.ckpt"}


def _local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _uploads(fs: Any, prefix: str) -> list[str]:
    """Keys of the multipart uploads in progress under ``prefix`` (asked of the server)."""
    page = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix.split("/", 1)[1])
    return sorted(u["Key"] for u in page.get("Uploads") or [])


def test_the_local_directory_has_two_parts(job: dict[str, Any]) -> None:
    """(What the other tests rely on: two parts, each uploaded in more than one part.)"""
    for fmt in ("ckpt", "st"):
        tree = _local_tree(job["root"] / f"local-{fmt}")
        assert sorted(tree) == ["hyper_param.safetensors", "param_name_map.json", "part0.safetensors",
                                "part1.safetensors"]
        assert all(len(tree[f"part{i}.safetensors"]) > 5 << 20 for i in range(2))
    assert _local_tree(job["root"] / "local-ckpt") == _local_tree(job["root"] / "local-st")


@pytest.mark.parametrize("fmt", ["ckpt", "st"])
def test_s3_to_s3_equals_the_local_directory(server: tuple[Any, Proxy], job: dict[str, Any], fmt: str) -> None:
    """Sources, strategy and output on S3: the local run's bytes, the source shards fetched at
    most 1.1x what the parts hold (read by range where they are: no store, no local copy),
    each file sent once, no upload left in progress."""
    fs, proxy = server
    proxy.reset_counts()
    out = f"{BUCKET}/out-{fmt}"
    zckpt.unified_safetensors(f"s3://{BUCKET}/{fmt}", job["s3_strategy"], f"s3://{out}", max_process_num=2,
                              storage_options=proxy.options())
    want = _local_tree(job["root"] / f"local-{fmt}")
    assert _remote_tree(fs, out) == want
    needed = json.loads(want["param_name_map.json"])["metadata"]["total_size"]
    fetched = proxy.fetched(f"/{BUCKET}/{fmt}/rank_")
    assert needed <= fetched <= 1.1 * needed, (fetched, needed)
    assert sum(n for p, n in proxy.uploaded.items() if f"/{out}/" in p) == sum(len(b) for b in want.values())
    assert _uploads(fs, out) == []


def test_local_sources_to_s3(server: tuple[Any, Proxy], job: dict[str, Any]) -> None:
    """Local sources and strategy, the directory on S3: the local run's bytes, streamed."""
    fs, proxy = server
    proxy.reset_counts()
    out = f"{BUCKET}/from-local"
    zckpt.unified_safetensors(str(job["root"] / "ckpt"), str(job["strategy"]), f"s3://{out}",
                              storage_options=proxy.options())
    want = _local_tree(job["root"] / "local-ckpt")
    assert _remote_tree(fs, out) == want
    assert sum(n for p, n in proxy.uploaded.items() if f"/{out}/" in p) == sum(len(b) for b in want.values())
    assert _uploads(fs, out) == []


def test_s3_sources_to_a_local_directory(server: tuple[Any, Proxy], job: dict[str, Any],
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sources on S3, the directory local; the split of the parts over machines holds."""
    _, proxy = server
    out = tmp_path_factory.mktemp("local-out") / "u"
    for k in (1, 2):
        zckpt.unified_safetensors(f"s3://{BUCKET}/st", job["s3_strategy"], str(out), split_dst_file=(k, 2),
                                  storage_options=proxy.options())
    assert _local_tree(out) == _local_tree(job["root"] / "local-st")


def test_an_upload_fault_fails_by_name_and_leaves_nothing(server: tuple[Any, Proxy], job: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 on every upload of part 1: an OutputError naming the object; nothing left under
    any final name (part 0, if complete, removed; an earlier run's map removed before the
    parts, as it would name a mix of old and new parts), no upload left in progress."""
    fs, proxy = server
    out = f"{BUCKET}/fault"
    fs.pipe_file(f"{out}/param_name_map.json", b"{}")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    proxy.faults = [Fault(f"/{out}/part1.safetensors", "500", method="PUT")]
    try:
        with pytest.raises(OutputError, match="cannot upload") as caught:
            zckpt.unified_safetensors(f"s3://{BUCKET}/ckpt", job["s3_strategy"], f"s3://{out}",
                                      storage_options=proxy.options())
    finally:
        proxy.faults = []
    assert caught.value.path == f"s3://{out}/part1.safetensors"
    assert proxy.injected["500"] > 0
    fs.invalidate_cache()
    assert fs.find(out) == []
    assert _uploads(fs, out) == []


def test_a_failed_local_run_leaves_nothing(job: dict[str, Any], tmp_path_factory: pytest.TempPathFactory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on local disk: part 1 fails, part 0 (if complete) is removed, an earlier
    run's map too, no temporary name is left."""
    out = tmp_path_factory.mktemp("failed")
    (out / "param_name_map.json").write_text("{}")
    write_whole = unified.write_whole

    def failing(target: str, *args: Any, **kwargs: Any) -> Any:
        if target.endswith("part1.safetensors"):
            raise OutputError("injected", path=target)
        return write_whole(target, *args, **kwargs)

    monkeypatch.setattr(unified, "write_whole", failing)
    with pytest.raises(OutputError, match="injected"):
        zckpt.unified_safetensors(str(job["root"] / "ckpt"), str(job["strategy"]), str(out))
    assert list(out.iterdir()) == []
