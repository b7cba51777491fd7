"""Output files streamed to object storage: multipart uploads fed as the writers write.

moto's S3 server runs on loopback behind the counting, fault-injecting proxy
(``tests/s3_proxy.py``); zckpt reaches the server only through the proxy, which counts the
bytes sent. Every output is compared byte for byte with the same job written locally. The
upload of a local copy (``remote.upload``) fails the test if used, and the temporary
directory is looked at each time a streamed file is published (when a spool would hold all
of it). Parts are 5 MiB (S3's least) so that the rank files of a few MiB go up in several.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import OutputError
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout
from zckpt.io import remote, streamed_files
from zckpt.io.ranged import RangePolicy
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.write.destinations import output_dir

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import Fault, Proxy, proxied_bucket  # noqa: E402  (after the skips: it needs moto)

from zckpt.io import s3_parts  # noqa: E402  (after the skips: it needs s3fs)

BUCKET = "zckpt-streams"
SRC_N, DST_N = 2, 2
PART = 5 * 1024 * 1024
MARKER = ".zckpt-export.json"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Proxy]]:
    """The S3 server (with a bucket; ``fs`` talks to it directly) and the proxy zckpt talks to."""
    with proxied_bucket(BUCKET) as served:
        yield served


@pytest.fixture(autouse=True)
def no_spool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Parts of :data:`PART`; no upload of a local copy; the temporary directory holds no
    rank file whenever a streamed file is published (a job's temporary store may be there)."""
    monkeypatch.setattr(streamed_files, "PART", PART)
    monkeypatch.setattr(remote, "upload", _refuse)
    spool = tmp_path / "tmpdir"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    publish = streamed_files.StreamedFile.publish

    def watched(self: streamed_files.StreamedFile, fsync: bool, *, sync_dir: bool = True) -> None:
        spooled = [p for p in spool.rglob("*") if p.is_file() and p.name.startswith(("checkpoint_", ".checkpoint_"))]
        assert not spooled, f"{spooled} on local disk while {self.location.url} is uploaded"
        publish(self, fsync, sync_dir=sync_dir)

    monkeypatch.setattr(streamed_files.StreamedFile, "publish", watched)
    yield spool
    assert not [p for p in spool.rglob("*") if p.is_file()], "something was left in the temporary directory"


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError(f"a local copy was uploaded: {args}")


def _tensors() -> list[TensorDef]:
    """About 13 MiB split by rows over the source ranks: destination files of 6.5 MiB."""
    row = make_layout([SRC_N, 1], [1, -1])
    return [TensorDef("net.a.weight", (1024, 1024), "Float32", row),
            TensorDef("net.b.weight", (1024, 1024), "Float32", row),
            TensorDef("net.c.weight", (1024, 2048), "Float16", row),
            TensorDef("net.d.weight", (512, 1024), "BFloat16", row),
            TensorDef("net.e.bias", (256,), "Int32", make_layout([SRC_N], [-1]))]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sources, a store of them, a destination strategy, and the local outputs."""
    root = tmp_path_factory.mktemp("streams")
    write_model(root / "src", _tensors(), device_num=SRC_N, strings={"note": "streams"})
    layouts: dict[str, dict[int, ParamLayout]] = {
        t.name: {0: make_layout([DST_N, 1], [1, -1]) if len(t.shape) == 2 else make_layout([DST_N], [0])}
        for t in _tensors()}
    (root / "dst.ckpt").write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    src, src_strategy, dst = str(root / "src"), str(root / "src" / "strategy.ckpt"), str(root / "dst.ckpt")
    zckpt.ingest(src, str(root / "store.zarr"), src_strategy)
    for name, fmt, split in (("ckpt", "ckpt", 0), ("st", "safetensors", 0), ("split", "safetensors", 3 << 20)):
        zckpt.export(str(root / "store.zarr"), str(root / name), dst,
                     options=zckpt.ExportOptions(format=fmt, max_file_bytes=split))
    zckpt.transform_checkpoints(src, str(root / "tr"), "checkpoint_", src_strategy, dst)
    return {"root": root, "src": root / "src", "src_strategy": root / "src" / "strategy.ckpt",
            "dst": root / "dst.ckpt", "store": root / "store.zarr"}


def _local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _remote_tree(fs: Any, root: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p[len(root) + 1:]: fs.cat_file(p) for p in sorted(fs.find(root)) if not p.endswith(MARKER)}


def _uploads(fs: Any, prefix: str) -> list[str]:
    """Paths of the multipart uploads in progress under ``prefix`` (asked of the server)."""
    page = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=_key(prefix))
    return sorted(f"{BUCKET}/{u['Key']}" for u in page.get("Uploads") or [])


def _start_upload(fs: Any, path: str) -> Any:
    return fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key=_key(path))


def _abort_upload(fs: Any, path: str, upload: Any) -> None:
    fs.call_s3("abort_multipart_upload", Bucket=BUCKET, Key=_key(path), UploadId=upload["UploadId"])


def _key(path: str) -> str:
    return path.split("/", 1)[1]


def _puts(proxy: Proxy, where: str) -> int:
    return sum(n for k, n in proxy.requests.items() if k.startswith("PUT ") and where in k)


@pytest.mark.parametrize(("name", "fmt", "split"), [("ckpt", "ckpt", 0), ("st", "safetensors", 0),
                                                    ("split", "safetensors", 3 << 20)])
def test_export_streams_to_s3(server: tuple[Any, Proxy], job: dict[str, Path], name: str, fmt: str,
                              split: int) -> None:
    """``export`` to S3: the same bytes as the local export, each file sent once (bytes sent =
    bytes of the files), files above a part as a multipart upload, no upload left in progress."""
    fs, proxy = server
    proxy.reset_counts()
    out = f"{BUCKET}/export-{name}"
    zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]),
                 options=zckpt.ExportOptions(format=fmt, max_file_bytes=split, storage_options=proxy.options()))
    want = _local_tree(job["root"] / name)
    assert _remote_tree(fs, out) == want
    files = sum(len(b) for b in want.values())
    sent = sum(n for p, n in proxy.uploaded.items() if f"/{out}/rank_" in p)
    assert sent == files, (sent, files)
    for rel, b in want.items():  # a multipart upload is started and completed (2 POSTs) for files above a part
        assert proxy.requests[f"POST /{out}/{rel}"] == (2 if len(b) > PART else 0), (rel, proxy.requests)
    assert any(len(b) > PART for b in want.values()) if not split else len(want) > 2 * DST_N, sorted(want)
    assert _uploads(fs, out) == []


def test_transform_api_streams_to_s3(server: tuple[Any, Proxy], job: dict[str, Path]) -> None:
    """``transform_checkpoints`` into an S3 directory (the direct path): the rank
    files are streamed, identical to the local transform's."""
    fs, proxy = server
    out = f"{BUCKET}/transform"
    zckpt.transform_checkpoints(str(job["src"]), f"s3://{out}", "checkpoint_", str(job["src_strategy"]),
                                str(job["dst"]), storage_options=proxy.options())
    assert _remote_tree(fs, out) == _local_tree(job["root"] / "tr")
    assert _uploads(fs, out) == []


def test_failed_upload_leaves_nothing_and_the_rerun_resumes(server: tuple[Any, Proxy], job: dict[str, Path],
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 on every part of rank 1's file: exit 1 naming the object, nothing under its name,
    its upload aborted; the rerun writes only that file and ends byte-identical."""
    fs, proxy = server
    out = f"{BUCKET}/failed"
    bad = f"s3://{out}/rank_1/checkpoint_1.ckpt"
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    proxy.faults = [Fault(f"/{out}/rank_1/", "500", method="PUT")]
    try:
        code = cli_main(["export", str(job["store"]), "--strategy", str(job["dst"]), "--out", f"s3://{out}",
                         "--quiet", *_cli_options(proxy)])
    finally:
        proxy.faults = []
    err = capsys.readouterr().err
    assert code == 1, err
    assert bad in err and "cannot upload" in err, err
    assert proxy.injected["500"] >= 1
    fs.invalidate_cache()
    assert not fs.exists(bad[5:])
    assert fs.exists(f"{out}/rank_0/checkpoint_0.ckpt")
    assert _uploads(fs, out) == []
    proxy.reset_counts()
    again = zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]),
                         options=zckpt.ExportOptions(storage_options=proxy.options()))
    assert [r.rank for r in again.ranks] == [1]
    assert _puts(proxy, "/rank_0/") == 0 and _puts(proxy, "/rank_1/") >= 2
    assert _remote_tree(fs, out) == _local_tree(job["root"] / "ckpt")


def test_failed_part_aborts_its_upload(server: tuple[Any, Proxy], job: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``transform_checkpoint_by_rank`` to an S3 file (no output directory around it): a 500 on
    its parts is an :class:`OutputError` naming the object; the upload is aborted by the
    writer itself, nothing is under the name."""
    fs, proxy = server
    path = f"{BUCKET}/by-rank/checkpoint_1.ckpt"
    files = {r: str(job["src"] / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(SRC_N)}
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    proxy.faults = [Fault("/by-rank/", "500", method="PUT")]
    try:
        with pytest.raises(OutputError, match="cannot upload") as caught:
            zckpt.transform_checkpoint_by_rank(1, files, f"s3://{path}", str(job["src_strategy"]), str(job["dst"]),
                                               storage_options=proxy.options())
    finally:
        proxy.faults = []
    assert caught.value.path == f"s3://{path}"
    fs.invalidate_cache()
    assert not fs.exists(path) and _uploads(fs, f"{BUCKET}/by-rank") == []
    zckpt.transform_checkpoint_by_rank(1, files, f"s3://{path}", str(job["src_strategy"]), str(job["dst"]),
                                       storage_options=proxy.options())
    assert fs.cat_file(path) == (job["root"] / "tr" / "rank_1" / "checkpoint_1.ckpt").read_bytes()


def test_failed_part_of_a_split_rank_leaves_none_of_its_files(server: tuple[Any, Proxy], job: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A split safetensors rank whose second part fails: its first part (already complete) is
    removed again and no index is written: nothing of the rank looks like a (short) model."""
    fs, proxy = server
    out = f"{BUCKET}/split-failed"
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    proxy.faults = [Fault("/rank_1/checkpoint_1-00002-of-", "500", method="PUT")]
    try:
        with pytest.raises(OutputError, match="cannot upload") as caught:
            zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]),
                         options=zckpt.ExportOptions(format="safetensors", max_file_bytes=3 << 20,
                                                     storage_options=proxy.options()))
    finally:
        proxy.faults = []
    assert "rank_1/checkpoint_1-00002-of-" in str(caught.value.path)
    fs.invalidate_cache()
    assert not fs.exists(f"{out}/rank_1"), fs.find(f"{out}/rank_1")
    assert _uploads(fs, out) == []


def _cli_options(proxy: Proxy) -> list[str]:
    return [f"--storage-option={k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in proxy.options().items()]


KILLED = """
import json, sys
import zckpt
from zckpt.io import streamed_files
streamed_files.PART = int(sys.argv[4])
options = zckpt.ExportOptions(storage_options=json.loads(sys.argv[5]))
zckpt.export(sys.argv[1], sys.argv[2], sys.argv[3], options=options)
"""


def test_killed_run_leaves_no_orphaned_upload(server: tuple[Any, Proxy], job: dict[str, Path]) -> None:
    """An export SIGKILLed while rank 1's first part is on the wire: no object under its name,
    its multipart upload in progress on the server; the rerun aborts it (and only it: another
    upload under the directory is left), writes rank 1 alone and ends byte-identical."""
    fs, proxy = server
    out = f"{BUCKET}/killed"
    foreign = _start_upload(fs, f"{out}/notes/other.bin")
    proxy.faults = [Fault(f"/{out}/rank_1/", "stall", method="PUT", stall_seconds=60)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(job["store"]), f"s3://{out}", str(job["dst"]),
                              str(PART), json.dumps(proxy.options())], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not proxy.injected["stall"] and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.injected["stall"], child.stderr.read().decode() if child.poll() is not None else "no stall"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        proxy.faults = []
        if child.poll() is None:
            child.kill()
        assert child.stderr is not None
        child.stderr.close()
    fs.invalidate_cache()
    assert not fs.exists(f"{out}/rank_1/checkpoint_1.ckpt")
    assert _uploads(fs, out) == [f"{out}/notes/other.bin", f"{out}/rank_1/checkpoint_1.ckpt"]
    proxy.reset_counts()
    again = zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]),
                         options=zckpt.ExportOptions(storage_options=proxy.options()))
    assert [r.rank for r in again.ranks] == [1]
    assert _puts(proxy, "/rank_0/") == 0
    assert _uploads(fs, out) == [f"{out}/notes/other.bin"], "only this job's upload is aborted"
    _abort_upload(fs, f"{out}/notes/other.bin", foreign)
    assert _remote_tree(fs, out) == _local_tree(job["root"] / "ckpt")


def test_failed_run_aborts_its_uploads(server: tuple[Any, Proxy]) -> None:
    """A run that fails (a task killed on a worker: no exception reached its upload) aborts
    the uploads of its planned files in progress when it gives up, not others'."""
    fs, proxy = server
    out = f"{BUCKET}/given-up"
    for name in ("rank_0/checkpoint_0.safetensors", "rank_1/checkpoint_1-00001-of-00002.safetensors"):
        _start_upload(fs, f"{out}/{name}")
    other = _start_upload(fs, f"{out}/rank_0/checkpoint_0.txt")
    dest = output_dir(f"s3://{out}", proxy.options())
    with pytest.raises(RuntimeError, match="worker lost"), dest.holding():
        dest.planned[:] = [Path(out, "rank_0", "checkpoint_0.safetensors"),
                           Path(out, "rank_1", "checkpoint_1.safetensors")]
        raise RuntimeError("worker lost")
    assert _uploads(fs, out) == [f"{out}/rank_0/checkpoint_0.txt"]
    _abort_upload(fs, f"{out}/rank_0/checkpoint_0.txt", other)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_successful_run_aborts_a_killed_attempts_upload(server: tuple[Any, Proxy], job: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """A task killed on a worker and run again elsewhere leaves its upload in progress while
    the run succeeds: the run aborts it as it finishes."""
    fs, proxy = server
    out = f"{BUCKET}/rerun-{fmt}"
    publish = streamed_files.StreamedFile.publish

    def killed_attempt_too(self: streamed_files.StreamedFile, fsync: bool, *, sync_dir: bool = True) -> None:
        _start_upload(fs, self.location.path)  # the same file's upload by an attempt since killed
        publish(self, fsync, sync_dir=sync_dir)

    monkeypatch.setattr(streamed_files.StreamedFile, "publish", killed_attempt_too)
    zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]),
                 options=zckpt.ExportOptions(format=fmt, storage_options=proxy.options()))
    assert _uploads(fs, out) == []
    assert _remote_tree(fs, out) == _local_tree(job["root"] / ("ckpt" if fmt == "ckpt" else "st"))


def test_complete_directory_is_kept_only_with_the_same_etags(server: tuple[Any, Proxy],
                                                             job: dict[str, Path]) -> None:
    """A finished export's rerun writes nothing; a file replaced since by one of the same size
    (another ETag) makes the directory someone else's: refused."""
    fs, proxy = server
    out = f"{BUCKET}/etags"
    opts = zckpt.ExportOptions(storage_options=proxy.options())
    zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]), options=opts)
    proxy.reset_counts()
    again = zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]), options=opts)
    assert again.ranks == () and _puts(proxy, f"/{out}/") == 0
    key = f"{out}/rank_0/checkpoint_0.ckpt"
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 1
    fs.pipe_file(key, bytes(data))
    with pytest.raises(OutputError, match="already holds"):
        zckpt.export(str(job["store"]), f"s3://{out}", str(job["dst"]), options=opts)


def test_memory_filesystem_streams_through_a_temporary_name(job: dict[str, Path]) -> None:
    """Filesystems whose files show before they are closed (``memory://``) are streamed under
    a temporary name and moved into place: the same files, nothing else left."""
    import fsspec

    out = "memory://zckpt-streams/out"
    zckpt.export(str(job["store"]), out, str(job["dst"]))
    fs = fsspec.filesystem("memory")
    got = {p.split("/out/", 1)[1]: fs.cat_file(p) for p in fs.find("/zckpt-streams/out")}
    assert got == _local_tree(job["root"] / "ckpt")
    fs.rm("/zckpt-streams", recursive=True)


def _stream(fs: Any, path: str, data: bytes, options: dict[str, Any]) -> streamed_files.StreamedFile:
    """``data`` written to ``s3://path`` in writes of 1 MiB as a writer writes, then published
    (discarded on failure, as the writers do)."""
    f = streamed_files.StreamedFile(Path(path), remote.locate(f"s3://{path}", options),
                                    lambda _: None)
    try:
        for i in range(0, len(data), 1 << 20):
            f.file.write(data[i : i + (1 << 20)])
        f.publish(False)
    except BaseException:
        f.discard()
        raise
    return f


def _etag(data: bytes, part: int) -> str:
    """The ETag S3 gives an object uploaded in parts of ``part`` bytes."""
    import hashlib

    parts = [data[i : i + part] for i in range(0, len(data), part)]
    return '"' + hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + f'-{len(parts)}"'


def test_parts_of_a_file_go_up_together(server: tuple[Any, Proxy]) -> None:
    """A file of six parts, each part held 0.3 s by the proxy: IN_FLIGHT parts of it are on the
    wire at once (s3fs's own file sends one at a time), no more; the object is the bytes
    written, in parts of exactly PART bytes (its ETag says so: a resume compares it)."""
    fs, proxy = server
    path = f"{BUCKET}/parts/file.bin"
    data = os.urandom(5 * PART + 12345)
    proxy.reset_counts()
    proxy.faults = [Fault("/parts/", "delay", method="PUT", stall_seconds=0.3)]
    try:
        _stream(fs, path, data, proxy.options())
    finally:
        proxy.faults = []
    fs.invalidate_cache()
    assert fs.cat_file(path) == data
    assert proxy.parts_at_once[f"/{path}"] == s3_parts.IN_FLIGHT > 1
    assert proxy.requests[f"PUT /{path}"] == 6 and proxy.uploaded[f"/{path}"] == len(data)
    assert fs.info(path)["ETag"] == _etag(data, PART)
    assert _uploads(fs, f"{BUCKET}/parts") == []


def test_a_transient_fault_on_a_part_is_retried(server: tuple[Any, Proxy], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 503 on one part (s3fs's own retries off): zckpt tries the part again, as a ranged read,
    and the upload completes."""
    fs, proxy = server
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    path = f"{BUCKET}/parts-retried/file.bin"
    data = os.urandom(3 * PART + 1)
    proxy.reset_counts()
    proxy.faults = [Fault("/parts-retried/", "503", method="PUT", query="partNumber=2", times=1)]
    try:
        _stream(fs, path, data, proxy.options())
    finally:
        proxy.faults = []
    fs.invalidate_cache()
    assert proxy.injected["503"] == 1 and proxy.requests[f"PUT /{path}"] == 5
    assert fs.cat_file(path) == data


def test_a_failed_part_among_parts_in_flight_leaves_nothing(server: tuple[Any, Proxy],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Part 3 of six fails (every try) while parts 1, 2 and 4 are on the wire (held 1.5 s): an
    OutputError naming the object; the parts in flight are cancelled and waited for, the upload
    is aborted: no object under the name, no upload on the server, even once the held parts
    have reached it."""
    fs, proxy = server
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(s3_parts.PartsInFlight, "policy", RangePolicy(attempts=2, backoff=0.05))
    path = f"{BUCKET}/parts-failed/file.bin"
    proxy.reset_counts()
    proxy.faults = [Fault("/parts-failed/", "500", method="PUT", query="partNumber=3"),
                    Fault("/parts-failed/", "delay", method="PUT", stall_seconds=1.5)]
    try:
        with pytest.raises(OutputError, match="cannot upload.*part 3 of the upload failed") as caught:
            _stream(fs, path, os.urandom(5 * PART + 1), proxy.options())
    finally:
        proxy.faults = []
    assert caught.value.path == f"s3://{path}"
    assert proxy.injected["500"] == 2 and proxy.parts_at_once[f"/{path}"] >= 3
    time.sleep(2)  # the held parts reach the server
    fs.invalidate_cache()
    assert not fs.exists(path)
    assert _uploads(fs, f"{BUCKET}/parts-failed") == []
