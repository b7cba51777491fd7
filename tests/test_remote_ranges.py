"""Remote source shards read by byte range: no local copy, only the bytes a job needs, faults retried.

moto's S3 server runs on loopback behind a counting, fault-injecting proxy
(``tests/s3_proxy.py``); zckpt reaches the server only through the proxy, so the bytes it
fetched are counted by what crossed the wire. Every result is compared byte for byte with
the same job run on local paths; the temporary directory is watched, so a spool anywhere
would show.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import SourceError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.opener import open_remote, open_shard
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout
from zckpt.io import remote
from zckpt.io.ranged import DEFAULT_POLICY
from zckpt.jobs.file_convert import convert_file
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.loading import ShardSlicer, read_rank
from zckpt.jobs.transform import TransformOptions, plan_transform, transform, transform_rank
from zckpt.sources.strategies import load_strategy
from zckpt.store.store import Store

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import Fault, Proxy, proxied_bucket  # noqa: E402  (after the skips: it needs moto)

BUCKET = "zckpt-ranges"
SRC_N, DST_N = 4, 2
SLACK = 1.1
"""Bytes fetched may exceed the bytes needed by this factor (framing, headers, gaps)."""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Proxy]]:
    """The S3 server (with a bucket) and the proxy zckpt talks to."""
    with proxied_bucket(BUCKET) as served:
        yield served


@pytest.fixture(autouse=True)
def no_spool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No local copy of a remote file exists in zckpt (strategy files are read into memory):
    the temporary directory is watched, and left empty."""
    assert not hasattr(remote, "local_copy") and not hasattr(remote, "local_dir_copy")
    spool = tmp_path / "tmpdir"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    yield spool
    assert not list(spool.iterdir()), "something was left in the temporary directory"


def _tensors() -> list[TensorDef]:
    """Tensors of 128-512 KiB, split by rows over the source ranks (most), by columns (one),
    replicated (one), so that reads are whole rows, parts of rows and replicas."""
    r = SRC_N
    row = make_layout([r, 1], [1, -1])
    col = make_layout([1, r], [-1, 0])
    rep = make_layout([r], [-1, -1])
    return [TensorDef("net.a.weight", (512, 256), "Float32", row),
            TensorDef("net.b.weight", (256, 256), "Float16", row),
            TensorDef("net.c.weight", (128, 512), "Float32", col),
            TensorDef("net.d.weight", (256, 128), "BFloat16", rep),
            TensorDef("net.e.weight", (1024, 64), "Int32", row)]


def _dst_strategy(path: Path) -> Path:
    """Two destination ranks, every tensor split by rows."""
    layouts: dict[str, dict[int, ParamLayout]] = {
        t.name: {0: make_layout([DST_N, 1], [1, -1])} for t in _tensors()}
    path.write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    return path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, server: tuple[Any, Proxy]) -> dict[str, Any]:
    """The job as .ckpt and as .safetensors, local and uploaded to the bucket."""
    fs, _ = server
    root = tmp_path_factory.mktemp("ranges")
    write_model(root / "ckpt", _tensors(), device_num=SRC_N, strings={"note": "ranges"})
    st = root / "safetensors"
    (st).mkdir()
    for r in range(SRC_N):
        (st / f"rank_{r}").mkdir()
        convert_file(root / "ckpt" / f"rank_{r}" / f"checkpoint_{r}.ckpt",
                     st / f"rank_{r}" / f"checkpoint_{r}.safetensors", "safetensors")
    (st / "strategy.ckpt").write_bytes((root / "ckpt" / "strategy.ckpt").read_bytes())
    dst = _dst_strategy(root / "dst_strategy.ckpt")
    out: dict[str, Any] = {"root": root, "dst": dst}
    for kind in ("ckpt", "safetensors"):
        fs.put(str(root / kind), f"{BUCKET}/{kind}", recursive=True)
        out[kind] = (root / kind, f"s3://{BUCKET}/{kind}")
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".zckpt")}


def _payload(files: list[Path]) -> int:
    """Payload bytes of the tensors in ``files`` (what reading them whole needs)."""
    total = 0
    for f in files:
        with open_shard(f, verify_crc=False) as r:
            total += sum(e.nbytes for e in r.entries.values() if e.kind == "tensor")
    return total


@pytest.mark.parametrize("kind", ["ckpt", "safetensors"])
def test_transform_reads_ranges_only(server: tuple[Any, Proxy], jobs: dict[str, Any], tmp_path: Path,
                                     kind: str) -> None:
    """``transform`` from S3 sources: the same files as from local ones, every byte fetched
    counted by the proxy and within 1.1x of what the destination files hold."""
    _, proxy = server
    local, url = jobs[kind]
    opts = proxy.options()
    transform(local, tmp_path / "local", local / "strategy.ckpt", jobs["dst"])
    proxy.reset_counts()
    transform(url, tmp_path / "remote", f"{url}/strategy.ckpt", jobs["dst"],
              options=TransformOptions(storage_options=opts))
    assert _tree(tmp_path / "remote") == _tree(tmp_path / "local")
    plan = plan_transform(local, local / "strategy.ckpt", jobs["dst"], verify_crc=False)
    sizes = {t.name: ms_dtype(t.ms_type).storage.itemsize for t in plan.source.tensors if t.kind == "tensor"}
    needed = sum(s.box.size * sizes.get(s.name, 0) for r in plan.export.ranks for s in r.slices)
    fetched = proxy.fetched(f"/{BUCKET}/{kind}/")
    assert needed <= fetched <= SLACK * needed, (fetched, needed)


def test_one_rank_reads_its_own_ranges(server: tuple[Any, Proxy], jobs: dict[str, Any], tmp_path: Path) -> None:
    """``transform_checkpoint_by_rank`` and ``load_distributed_checkpoint``'s reader for one
    destination rank fetch about that rank's bytes: half of the job, not all of it."""
    _, proxy = server
    local, url = jobs["ckpt"]
    files = {r: local / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in range(SRC_N)}
    urls = {r: f"{url}/rank_{r}/checkpoint_{r}.ckpt" for r in range(SRC_N)}
    transform_rank(files, 1, tmp_path / "local.ckpt", local / "strategy.ckpt", jobs["dst"])
    proxy.reset_counts()
    zckpt.transform_checkpoint_by_rank(1, urls, str(tmp_path / "remote.ckpt"), f"{url}/strategy.ckpt",
                                       str(jobs["dst"]), storage_options=proxy.options())
    assert (tmp_path / "remote.ckpt").read_bytes() == (tmp_path / "local.ckpt").read_bytes()
    with CkptReader(tmp_path / "local.ckpt") as r:
        needed = sum(e.nbytes for e in r.entries.values() if e.kind == "tensor")
    fetched = proxy.fetched(f"/{BUCKET}/ckpt/")
    assert needed <= fetched <= SLACK * needed, (fetched, needed)
    assert needed < 0.6 * _payload(list(files.values()))

    dst = load_strategy(jobs["dst"])
    with ShardSlicer(files, local / "strategy.ckpt") as slicer:
        want = read_rank(slicer, dst, 0)
    proxy.reset_counts()
    with ShardSlicer(urls, f"{url}/strategy.ckpt", proxy.options()) as slicer:
        got = read_rank(slicer, dst, 0)
    assert want.keys() == got.keys()
    for k in want:
        assert np.array_equal(np.asarray(want[k]), np.asarray(got[k])) if not isinstance(want[k], str) else \
            want[k] == got[k], k
    needed = sum(np.asarray(v).nbytes for v in want.values() if not isinstance(v, str))
    fetched = proxy.fetched(f"/{BUCKET}/ckpt/")
    assert needed <= fetched <= SLACK * needed, (fetched, needed)


def test_ingest_from_s3_sources(server: tuple[Any, Proxy], jobs: dict[str, Any], tmp_path: Path) -> None:
    """Ingest of S3 sources into a local store: the same arrays as from local sources; the
    bytes fetched are those of the ranks the plan reads (one replica each) and their headers."""
    _, proxy = server
    local, url = jobs["ckpt"]
    zckpt.ingest(str(local), str(tmp_path / "local.zarr"), str(local / "strategy.ckpt"))
    proxy.reset_counts()
    zckpt.ingest(url, str(tmp_path / "remote.zarr"), f"{url}/strategy.ckpt",
                 options=zckpt.IngestOptions(storage_options=proxy.options()))
    a, b = Store.open(str(tmp_path / "local.zarr")), Store.open(str(tmp_path / "remote.zarr"))
    for e in a.entries():
        if e.kind == "tensor":
            assert np.asarray(a.array(e.name)[...]).tobytes() == np.asarray(b.array(e.name)[...]).tobytes(), e.name
    shapes = {t.name: t.shape for t in _tensors()}
    items = {t.name: ms_dtype(t.ms_type).storage.itemsize for t in _tensors()}
    needed = sum(math.prod(shapes[n]) * items[n] for n in shapes)
    fetched = proxy.fetched(f"/{BUCKET}/ckpt/")
    # the replicated tensor is read from one rank and spot-checked on the others (sampled ends)
    assert needed <= fetched <= SLACK * needed, (fetched, needed)


FAULTS = ["reset", "500", "503", "slowdown", "stall", "short"]


@pytest.mark.parametrize("kind", FAULTS)
def test_transient_faults_are_retried(server: tuple[Any, Proxy], jobs: dict[str, Any], tmp_path: Path,
                                      kind: str) -> None:
    """Two failures of each kind on the ranged reads of one shard: retried with backoff, and
    the output is the same as without them."""
    _, proxy = server
    local, url = jobs["ckpt"]
    transform(local, tmp_path / "local", local / "strategy.ckpt", jobs["dst"])
    proxy.reset_counts()
    fault = Fault(f"/{BUCKET}/ckpt/rank_2/", kind, times=2, stall_seconds=4)
    proxy.faults = [fault]
    try:
        transform(url, tmp_path / "remote", f"{url}/strategy.ckpt", jobs["dst"],
                  options=TransformOptions(storage_options=proxy.options()))
    finally:
        proxy.faults = []
    assert proxy.injected[kind] == 2
    assert _tree(tmp_path / "remote") == _tree(tmp_path / "local")


@pytest.mark.parametrize(("kind", "payloads"), [("reset", False), ("slowdown", True), ("short", True)])
def test_lasting_fault_names_the_object(server: tuple[Any, Proxy], jobs: dict[str, Any], tmp_path: Path,
                                        kind: str, payloads: bool, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault that does not go away, on every read of one shard or on its payload reads only
    (planning done, files being written): a few tries, then a one-line error naming the object;
    the output directory holds no rank file (every destination rank needs that shard)."""
    _, proxy = server
    _, url = jobs["ckpt"]
    bad = f"{url}/rank_2/checkpoint_2.ckpt"
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries off: zckpt's are counted
    proxy.reset_counts()
    proxy.faults = [Fault(f"/{BUCKET}/ckpt/rank_2/", kind, min_length=32 * 1024 if payloads else 0)]
    out = tmp_path / "out"
    try:
        code = cli_main(["transform", url, "--src-strategy", f"{url}/strategy.ckpt", "--dst-strategy",
                         str(jobs["dst"]), "--out", str(out), "--quiet",
                         *[f"--storage-option={k}={v}" for k, v in _cli_options(proxy).items()]])
    finally:
        proxy.faults = []
    err = capsys.readouterr().err
    assert code == 1, err
    assert bad in err and "tries" in err, err
    # zckpt's tries; the HTTP client may resend once on a reset (a pooled connection may be stale)
    assert DEFAULT_POLICY.attempts <= proxy.injected[kind] <= 2 * DEFAULT_POLICY.attempts, proxy.injected
    assert not [p for p in out.rglob("*") if p.suffix == ".ckpt" or "tmp" in p.name], sorted(out.rglob("*"))
    if payloads:  # the failure came after planning, on a payload's range
        a, b = map(int, re.search(r"cannot read bytes \[(\d+), (\d+)\)", err).groups())  # type: ignore[union-attr]
        assert b - a >= 32 * 1024, err


def _cli_options(proxy: Proxy) -> dict[str, str]:
    """The proxy's options as ``--storage-option`` values (JSON for the nested ones)."""
    import json

    return {k: (json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in proxy.options().items()}


def test_missing_object_is_not_retried(server: tuple[Any, Proxy], jobs: dict[str, Any]) -> None:
    """A missing object is an error at once (no retries), naming it."""
    _, proxy = server
    proxy.reset_counts()
    url = f"s3://{BUCKET}/nowhere/checkpoint_0.ckpt"
    with pytest.raises(SourceError, match="nowhere/checkpoint_0.ckpt"):
        open_remote(url, proxy.options())
    assert sum(proxy.requests.values()) <= 3


def test_split_safetensors_rank_by_range(server: tuple[Any, Proxy], jobs: dict[str, Any], tmp_path: Path) -> None:
    """A rank saved as several safetensors parts and an index: read by range like one file."""
    fs, proxy = server
    local, _ = jobs["ckpt"]
    transform(local, tmp_path / "split", local / "strategy.ckpt", jobs["dst"],
              options=TransformOptions(format="safetensors", max_file_bytes=256 * 1024))
    index = next((tmp_path / "split").rglob("*.safetensors.index.json"))
    fs.put(str(index.parent), f"{BUCKET}/split", recursive=True)
    url = f"s3://{BUCKET}/split/{index.name}"
    with open_shard(index, verify_crc=False) as want, open_remote(url, proxy.options()) as got:
        assert list(got.entries) == list(want.entries)
        for name, e in want.entries.items():
            if e.kind == "tensor":
                assert got.array(name).tobytes() == want.array(name).tobytes(), name
                if e.shape and e.shape[0] > 1:
                    assert got.rows(name, 1, 2).tobytes() == want.rows(name, 1, 2).tobytes(), name
