"""The direct path (``transform``) with URLs for its sources, strategies and outputs.

moto's S3 server runs on loopback behind the counting, fault-injecting proxy
(``tests/s3_proxy.py``). Every output written to S3 is compared byte for byte with the same
transform written locally. Nothing may touch local disk on the way (zckpt has no local copy
of a remote file any more): the upload of a local file (``remote.upload``) and any temporary
file or directory zckpt makes fail the test, and the temporary directory must stay empty.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import UsageError
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout
from zckpt.io import remote, streamed_files
from zckpt.jobs.generate import write_model
from zckpt.jobs.transform import TransformOptions, transform

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import Fault, Proxy, proxied_bucket  # noqa: E402  (after the skips: it needs moto)
from test_streaming_writes import SRC_N, _cli_options, _puts, _remote_tree, _tensors  # noqa: E402  (the same job)

BUCKET = "zckpt-transform-urls"
DST_N = 4
PART = 5 * 1024 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Proxy]]:
    """The S3 server (``fs`` talks to it directly) and the proxy zckpt talks to."""
    with proxied_bucket(BUCKET) as served:
        yield served


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"local disk used for a remote file: {args}")


def _not_from_zckpt(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make`` (a :mod:`tempfile` function), refused when zckpt calls it (moto's server, in
    this process, keeps its objects in temporary files)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == "tempfile":
            frame = frame.f_back  # type: ignore[assignment]
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
        assert not caller.startswith("zckpt"), f"{caller} made a temporary file"
        return make(*args, **kwargs)

    return guarded


@pytest.fixture(autouse=True)
def no_local_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Parts of :data:`PART`; no local copy, no upload of a local file, no temporary file or
    directory (and the temporary directory left empty)."""
    monkeypatch.setattr(streamed_files, "PART", PART)
    monkeypatch.setattr(remote, "upload", _refuse)
    spool = tmp_path / "tmpdir"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    for name in ("mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile"):
        monkeypatch.setattr(tempfile, name, _not_from_zckpt(getattr(tempfile, name)))
    yield spool
    assert not [p for p in spool.rglob("*") if "moto" not in p.name], "something was written to the temporary directory"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, server: tuple[Any, Proxy]) -> dict[str, Any]:
    """The sources (local, and copied to S3 with the strategies), and the local transforms."""
    fs, _ = server
    root = tmp_path_factory.mktemp("transform-urls")
    write_model(root / "src", _tensors(), device_num=SRC_N, strings={"note": "urls"})
    layouts: dict[str, dict[int, ParamLayout]] = {
        t.name: {0: make_layout([DST_N, 1], [1, -1]) if len(t.shape) == 2 else make_layout([DST_N], [0])}
        for t in _tensors()}
    (root / "dst.ckpt").write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    src, src_strategy, dst = root / "src", root / "src" / "strategy.ckpt", root / "dst.ckpt"
    for fmt in ("ckpt", "safetensors"):
        transform(str(src), str(root / f"local-{fmt}"), str(src_strategy), str(dst),
                        options=TransformOptions(format=fmt))
    for p in sorted(src.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{BUCKET}/src/{p.relative_to(src).as_posix()}", p.read_bytes())
    fs.pipe_file(f"{BUCKET}/dst.ckpt", dst.read_bytes())
    return {"root": root, "src": src, "src_strategy": src_strategy, "dst": dst,
            "s3_src": f"s3://{BUCKET}/src", "s3_src_strategy": f"s3://{BUCKET}/src/strategy.ckpt",
            "s3_dst": f"s3://{BUCKET}/dst.ckpt"}


def _local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.name.startswith(".zckpt")}


def _uploads(fs: Any, prefix: str) -> list[str]:
    page = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix.split("/", 1)[1])
    return sorted(u["Key"] for u in page.get("Uploads") or [])


@pytest.mark.parametrize(("name", "fmt", "remote_src"), [("s3-s3", "ckpt", True), ("local-s3", "ckpt", False),
                                                         ("s3-s3-st", "safetensors", True)])
def test_cli_transform_to_s3_equals_the_local_transform(server: tuple[Any, Proxy], job: dict[str, Any], name: str,
                                                        fmt: str, remote_src: bool,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``zckpt transform --out s3://...`` from S3 sources (strategies at URLs too) or local
    ones: the same bytes as the local transform, each file sent once, no upload left open."""
    fs, proxy = server
    proxy.reset_counts()
    out = f"{BUCKET}/out-{name}"
    src = [job["s3_src"], "--src-strategy", job["s3_src_strategy"], "--dst-strategy", job["s3_dst"]] if remote_src \
        else [str(job["src"]), "--src-strategy", str(job["src_strategy"]), "--dst-strategy", str(job["dst"])]
    code = cli_main(["transform", *src, "--out", f"s3://{out}", "--format", fmt, "--quiet", *_cli_options(proxy)])
    assert code == 0, capsys.readouterr().err
    want = _local_tree(job["root"] / f"local-{fmt}")
    assert len(want) == DST_N
    assert _remote_tree(fs, out) == want
    sent = sum(n for p, n in proxy.uploaded.items() if f"/{out}/rank_" in p)
    assert sent == sum(len(b) for b in want.values())
    assert _uploads(fs, out) == []


def test_a_remote_output_is_written_file_by_file_where_groups_would_pay(
        server: tuple[Any, Proxy], job: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Source-major groups write local files at offsets: where they would be chosen (made to
    pay here), a remote output is still written one file at a time, front to back, streamed."""
    from zckpt.write import group_writer

    monkeypatch.setattr(group_writer, "GAIN", 0.0)
    monkeypatch.setattr(group_writer, "SMALL_PIECE", 1 << 40)
    fs, proxy = server
    out = f"{BUCKET}/out-grouped"
    code = cli_main(["transform", str(job["src"]), "--src-strategy", str(job["src_strategy"]), "--dst-strategy",
                     str(job["dst"]), "--out", f"s3://{out}", "--quiet", *_cli_options(proxy)])
    assert code == 0, capsys.readouterr().err
    assert _remote_tree(fs, out) == _local_tree(job["root"] / "local-ckpt")


def test_transform_checkpoints_urls_touch_no_local_disk(server: tuple[Any, Proxy], job: dict[str, Any]) -> None:
    """``transform_checkpoints`` with every path a URL: the direct path (no temporary store, no
    local file: see :func:`no_local_disk`), the local transform's bytes, and source bytes
    fetched at most 1.1x what the destination files hold."""
    fs, proxy = server
    proxy.reset_counts()
    out = f"{BUCKET}/api"
    zckpt.transform_checkpoints(job["s3_src"], f"s3://{out}", "checkpoint_", job["s3_src_strategy"], job["s3_dst"],
                                storage_options=proxy.options())
    want = _local_tree(job["root"] / "local-ckpt")
    assert _remote_tree(fs, out) == want
    needed = sum(math.prod(t.shape) * ms_dtype(t.ms_type).storage.itemsize for t in _tensors())
    fetched = proxy.fetched(f"/{BUCKET}/src/rank_")
    assert needed <= fetched <= 1.1 * needed, (fetched, needed)
    assert _uploads(fs, out) == []


def test_transform_checkpoint_by_rank_from_and_to_s3(server: tuple[Any, Proxy], job: dict[str, Any]) -> None:
    """One destination rank from S3 source files to an S3 file: the local transform's file."""
    fs, proxy = server
    path = f"{BUCKET}/by-rank/rank_2.ckpt"
    files = {r: f"{job['s3_src']}/rank_{r}/checkpoint_{r}.ckpt" for r in range(SRC_N)}
    zckpt.transform_checkpoint_by_rank(2, files, f"s3://{path}", job["s3_src_strategy"], job["s3_dst"],
                                       storage_options=proxy.options())
    fs.invalidate_cache()
    assert fs.cat_file(path) == (job["root"] / "local-ckpt" / "rank_2" / "checkpoint_2.ckpt").read_bytes()
    assert fs.ls(f"{BUCKET}/by-rank") == [path]


def test_upload_fault_fails_by_name_and_the_rerun_resumes(server: tuple[Any, Proxy], job: dict[str, Any],
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 on every upload of rank 1's file: exit 1 naming the object, nothing under its
    name, no upload left open; the rerun writes rank 1 only (the complete files are not sent
    again) and ends byte-identical."""
    fs, proxy = server
    out = f"{BUCKET}/fault"
    bad = f"s3://{out}/rank_1/checkpoint_1.ckpt"
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    args = ["transform", job["s3_src"], "--src-strategy", job["s3_src_strategy"], "--dst-strategy", job["s3_dst"],
            "--out", f"s3://{out}", "--quiet", *_cli_options(proxy)]
    proxy.faults = [Fault(f"/{out}/rank_1/", "500", method="PUT")]
    try:
        code = cli_main(args)
    finally:
        proxy.faults = []
    err = capsys.readouterr().err
    assert code == 1, err
    assert bad in err and "cannot upload" in err, err
    fs.invalidate_cache()
    assert not fs.exists(bad[5:])
    assert _uploads(fs, out) == []
    done = [r for r in range(DST_N) if fs.exists(f"{out}/rank_{r}/checkpoint_{r}.ckpt")]
    assert done and 1 not in done
    proxy.reset_counts()
    assert cli_main(args) == 0, capsys.readouterr().err
    assert _puts(proxy, "/rank_1/") == 1  # (files below a part: one PUT each)
    assert all(_puts(proxy, f"/rank_{r}/") == 0 for r in done), proxy.requests
    assert _remote_tree(fs, out) == _local_tree(job["root"] / "local-ckpt")


def test_dry_run_plans_an_output_url(server: tuple[Any, Proxy], job: dict[str, Any],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--dry-run`` with an output URL: every destination file named by its URL, nothing sent."""
    fs, proxy = server
    proxy.reset_counts()
    out = f"s3://{BUCKET}/dry"
    code = cli_main(["transform", job["s3_src"], "--src-strategy", job["s3_src_strategy"], "--dst-strategy",
                     job["s3_dst"], "--out", out, "--dry-run", "--json", *_cli_options(proxy)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert sorted(f["path"] for f in doc["files"]) == [f"{out}/rank_{r}/checkpoint_{r}.ckpt" for r in range(DST_N)]
    assert proxy.writes() == []


def test_mindformers_iteration_to_a_url_is_refused(server: tuple[Any, Proxy], job: dict[str, Any]) -> None:
    _, proxy = server
    with pytest.raises(UsageError, match="MindFormers iteration is written to a local directory"):
        transform(str(job["src"]), f"s3://{BUCKET}/mf", str(job["src_strategy"]), str(job["dst"]),
                        options=TransformOptions(format="mindformers", storage_options=proxy.options()))
    assert proxy.writes("/mf") == []


@pytest.mark.parametrize("what", ["ckpt", "safetensors", "strategy"])
def test_info_reads_a_remote_file_by_range(server: tuple[Any, Proxy], job: dict[str, Any], what: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``zckpt info`` of a checkpoint at a URL: the local file's description (but its name),
    from its header and index (a small part of it fetched, nothing copied); a strategy file
    at a URL read into memory."""
    fs, proxy = server
    local = {"ckpt": job["src"] / "rank_1" / "checkpoint_1.ckpt", "strategy": job["src_strategy"],
             "safetensors": job["root"] / "local-safetensors" / "rank_1" / "checkpoint_1.safetensors"}[what]
    url = f"s3://{BUCKET}/info/{local.name}"
    fs.pipe_file(url[5:], local.read_bytes())
    assert cli_main(["info", str(local), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    proxy.reset_counts()
    assert cli_main(["info", url, "--json", *_cli_options(proxy)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {**want, "path": url}
    if what != "strategy":
        assert proxy.fetched("/info/") < local.stat().st_size / 10, proxy.fetched("/info/")
