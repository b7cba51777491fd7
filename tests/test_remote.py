"""Object storage and remote paths: the store, sources, strategies and outputs as fsspec URLs.

A real S3-compatible server (moto's server mode) runs on a free loopback port for the
module; s3fs talks to it over HTTP like it would to AWS. The endpoint reaches s3fs through
``AWS_ENDPOINT_URL`` (botocore reads it; what a cluster would set on every worker), one
test passes it as a storage option instead. Every result is compared byte for byte with
the same job run on local paths.
"""

from __future__ import annotations

import json
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.cli.args import parse_storage_options
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import OutputError, SourceError, StoreError, UsageError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.rank_files import pick_rank_name
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.sources.replicas import SAMPLE_BYTES
from zckpt.store.store import Store

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import moto_server  # noqa: E402  (after the skips: it needs moto)

BUCKET = "zckpt-test"
SRC_N, DST_N = 4, 3
MARKER = ".zckpt-export.json"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """moto's S3 server on loopback, the credentials and endpoint in the environment, a bucket."""
    with moto_server(endpoint_in_env=True) as endpoint:
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        fs.endpoint = endpoint
        yield fs


def _prefix() -> str:
    return f"{BUCKET}/{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-rank job, a 3-rank destination strategy, and the all-local ingest + export."""
    root = tmp_path_factory.mktemp("job")
    rng = np.random.default_rng(6)
    types = ["Float32", "BFloat16", "Float16", "Int32", "Bool"]
    tensors = [TensorDef(f"net.p{i}.weight", tuple(int(rng.choice([12, 24])) for _ in range(1 + i % 3)),
                         types[i % len(types)]) for i in range(8)]
    tensors = [TensorDef(t.name, t.shape, t.ms_type, random_layout(rng, t.shape, SRC_N)) for t in tensors]
    write_model(root / "src", tensors, device_num=SRC_N, strings={"note": "remote"})
    layouts: dict[str, dict[int, ParamLayout]] = {}
    for t in tensors:
        lay = random_layout(rng, t.shape, DST_N, unlisted_prob=0.2)
        if lay is not None:
            layouts[t.name] = {0: lay}
    (root / "dst_strategy.ckpt").write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    zckpt.ingest(str(root / "src"), str(root / "store.zarr"), str(root / "src" / "strategy.ckpt"))
    zckpt.export(str(root / "store.zarr"), str(root / "out"), str(root / "dst_strategy.ckpt"))
    zckpt.export(str(root / "store.zarr"), str(root / "out_st"), str(root / "dst_strategy.ckpt"),
                 options=zckpt.ExportOptions(format="safetensors"))
    return {"root": root, "src": root / "src", "src_strategy": root / "src" / "strategy.ckpt",
            "dst_strategy": root / "dst_strategy.ckpt", "store": root / "store.zarr", "out": root / "out",
            "out_st": root / "out_st"}


def _local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MARKER}


def _remote_tree(fs: Any, root: str) -> dict[str, bytes]:
    return {p[len(root) + 1:]: fs.cat_file(p) for p in sorted(fs.find(root)) if not p.endswith(MARKER)}


def _arrays(store: str | Path, **opts: Any) -> dict[str, tuple[str, tuple[int, ...], bytes, Any]]:
    st = Store.open(str(store), storage_options=opts or None)
    out = {}
    for e in st.entries():
        if e.kind == "str":
            out[e.name] = ("str", (), (e.value or "").encode(), None)
            continue
        arr = st.array(e.name)
        out[e.name] = (str(arr.dtype), tuple(arr.shape), np.asarray(arr[...]).tobytes(), arr.attrs["zckpt"]["writers"])
    return out


def _upload(fs: Any, local: Path, remote_path: str) -> str:
    fs.put(str(local), remote_path, recursive=local.is_dir())
    return f"s3://{remote_path}"


# --- pure helpers -------------------------------------------------------------------------

def test_pick_rank_name_follows_mindspores_rules() -> None:
    assert pick_rank_name(["a_1.ckpt", "b_2.ckpt", "x.txt"], "rank_0", "d") == "b_2.ckpt"
    assert pick_rank_name(["m-1_9.safetensors", "m-2_1.safetensors"], "rank_0", "d") == "m-2_1.safetensors"
    assert pick_rank_name(["x.txt"], "rank_0", "d") is None
    with pytest.raises(SourceError, match="both"):
        pick_rank_name(["a.ckpt", "a.safetensors"], "rank_0", "d")


def test_parse_storage_options() -> None:
    got = parse_storage_options(["endpoint_url=http://h:9000", "anon=true", "config_kwargs={\"a\": 1}"])
    assert got == {"endpoint_url": "http://h:9000", "anon": True, "config_kwargs": {"a": 1}}
    with pytest.raises(UsageError):
        parse_storage_options(["novalue"])


# --- S3 through the command line ----------------------------------------------------------

def test_cli_local_sources_to_s3_store_and_back(s3: Any, job: dict[str, Path], tmp_path: Path) -> None:
    """ingest local -> s3:// store; export s3:// store -> local files: identical to the local run."""
    store = f"s3://{_prefix()}/store.zarr"
    assert cli_main(["ingest", str(job["src"]), "--strategy", str(job["src_strategy"]), "--store", store,
                     "--quiet"]) == 0
    assert _arrays(store) == _arrays(job["store"])
    assert not s3.exists(store[5:] + ".lock"), "the lock object is removed after the ingest"
    assert cli_main(["export", store, "--strategy", str(job["dst_strategy"]), "--out", str(tmp_path / "out"),
                     "--quiet"]) == 0
    assert _local_tree(tmp_path / "out") == _local_tree(job["out"])
    # the chunk checksums were recorded for the remote store too
    st = Store.open(store)
    assert sum(len(v) for v in st.checksums().values()) == sum(
        len(v) for v in Store.open(str(job["store"])).checksums().values()) > 0


def test_cli_everything_on_s3(s3: Any, job: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Sources, both strategies, store and output all on S3."""
    base = _prefix()
    src = _upload(s3, job["src"], f"{base}/ckpts")
    src_strategy = f"{src}/strategy.ckpt"
    dst_strategy = _upload(s3, job["dst_strategy"], f"{base}/dst.ckpt")
    store, out = f"s3://{base}/store.zarr", f"s3://{base}/out"
    assert cli_main(["ingest", src, "--strategy", src_strategy, "--store", store, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["store"] == store and report["complete"]
    assert _arrays(store) == _arrays(job["store"])
    manifest = Store.open(store).manifest["source"]
    assert manifest["strategy_files"] == [src_strategy]
    assert manifest["rank_files"]["0"]["path"] == f"{src}/rank_0/checkpoint_0.ckpt"
    assert cli_main(["export", store, "--strategy", dst_strategy, "--out", out, "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["path"] for r in ranks] == [f"{out}/rank_{r}/checkpoint_{r}.ckpt" for r in range(DST_N)]
    assert _remote_tree(s3, out[5:]) == _local_tree(job["out"])
    assert not [p for p in s3.find(out[5:]) if p.endswith(".tmp-zckpt")]
    # rerunning the same ingest finds the store complete; the same export has nothing left to do
    assert cli_main(["ingest", src, "--strategy", src_strategy, "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks_read"] == []
    assert cli_main(["export", store, "--strategy", dst_strategy, "--out", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == []


def test_cli_storage_option_gives_the_endpoint(s3: Any, job: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AWS_ENDPOINT_URL, --storage-option endpoint_url=... reaches the server."""
    endpoint = s3.endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    store = f"s3://{_prefix()}/store.zarr"
    opts = ["--storage-option", f"endpoint_url={endpoint}"]
    assert cli_main(["ingest", str(job["src"]), "--strategy", str(job["src_strategy"]), "--store", store,
                     "--quiet", *opts]) == 0
    assert cli_main(["export", store, "--strategy", str(job["dst_strategy"]), "--out", str(tmp_path / "o"),
                     "--quiet", *opts]) == 0
    assert _local_tree(tmp_path / "o") == _local_tree(job["out"])


# --- S3 through the API -------------------------------------------------------------------

def test_api_s3_sources_store_and_safetensors_output(s3: Any, job: dict[str, Path]) -> None:
    base = _prefix()
    src = _upload(s3, job["src"], f"{base}/ckpts")
    opts = {"endpoint_url": s3.endpoint}
    report = zckpt.ingest(src, f"s3://{base}/store.zarr", f"{src}/strategy.ckpt",
                          zckpt.IngestOptions(storage_options=opts))
    assert report.complete and report.store == f"s3://{base}/store.zarr"
    assert _arrays(report.store, **opts) == _arrays(job["store"])
    zckpt.export(report.store, f"s3://{base}/out", str(job["dst_strategy"]),
                 options=zckpt.ExportOptions(storage_options=opts))
    assert _remote_tree(s3, f"{base}/out") == _local_tree(job["out"])
    zckpt.export(report.store, f"s3://{base}/out_st", str(job["dst_strategy"]),
                 options=zckpt.ExportOptions(format="safetensors", storage_options=opts))
    assert _remote_tree(s3, f"{base}/out_st") == _local_tree(job["out_st"])
    with pytest.raises(OutputError, match="already exist"):
        zckpt.export(report.store, f"s3://{base}/out_st", str(job["dst_strategy"]),
                     options=zckpt.ExportOptions(format="safetensors"))


def test_split_safetensors_sources_on_s3(s3: Any, job: dict[str, Path], tmp_path: Path) -> None:
    """A rank saved as parts + index: the parts are fetched with the index."""
    local = tmp_path / "st_src"
    zckpt.export(str(job["store"]), str(local), str(job["src_strategy"]),
                 options=zckpt.ExportOptions(format="safetensors", max_file_bytes=600))
    assert list(local.glob("rank_0/*.index.json"))
    zckpt.ingest(str(local), str(tmp_path / "st_store.zarr"), str(job["src_strategy"]))
    src = _upload(s3, local, f"{_prefix()}/st_src")
    store = src.rsplit("/", 1)[0] + "/store.zarr"
    zckpt.ingest(src, store, str(job["src_strategy"]))
    assert _arrays(store) == _arrays(tmp_path / "st_store.zarr")


def test_export_to_s3_on_dask_workers(s3: Any, job: dict[str, Path]) -> None:
    """Workers inherit the endpoint from the environment and reopen the store by URL."""
    pytest.importorskip("distributed")
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    zckpt.export(store, f"s3://{base}/out", str(job["dst_strategy"]), options=zckpt.ExportOptions(workers=2))
    assert _remote_tree(s3, f"{base}/out") == _local_tree(job["out"])


# --- resume, refusal, lock, checksums -----------------------------------------------------

def test_remote_export_resumes_and_refuses_foreign_directories(s3: Any, job: dict[str, Path]) -> None:
    base = _prefix()
    store, out = f"s3://{base}/store.zarr", f"s3://{base}/out"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    zckpt.export(store, out, str(job["dst_strategy"]))
    s3.rm(f"{base}/out/rank_1/checkpoint_1.ckpt")
    s3.pipe(f"{base}/out/rank_2/checkpoint_2.ckpt.tmp-zckpt", b"partial")
    again = zckpt.export(store, out, str(job["dst_strategy"]))
    assert [r.rank for r in again.ranks] == [1], "only the missing file is written"
    assert _remote_tree(s3, f"{base}/out") == _local_tree(job["out"]), "the stray temporary is removed"
    s3.pipe(f"{base}/foreign/notes.txt", b"x")
    with pytest.raises(OutputError, match="already holds"):
        zckpt.export(store, f"s3://{base}/foreign", str(job["dst_strategy"]))
    assert cli_main(["export", store, "--strategy", str(job["dst_strategy"]), "--out", f"s3://{base}/foreign",
                     "--quiet"]) == 1
    zckpt.export(store, f"s3://{base}/foreign", str(job["dst_strategy"]),
                 options=zckpt.ExportOptions(overwrite=True))
    assert s3.exists(f"{base}/foreign/rank_0/checkpoint_0.ckpt")


def test_remote_store_refusals_and_overwrite(s3: Any, job: dict[str, Path], tmp_path: Path) -> None:
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    write_model(tmp_path / "other", [TensorDef("x", (4,), "Float32")], device_num=1, strategy_format=None)
    with pytest.raises(StoreError, match="different ingest"):
        zckpt.ingest(str(tmp_path / "other"), store)
    zckpt.ingest(str(tmp_path / "other"), store, options=zckpt.IngestOptions(overwrite=True))
    assert "x" in _arrays(store)
    assert "net.p0.weight" not in _arrays(store), "overwrite removed the old store first"
    s3.pipe(f"{base}/notastore/a.txt", b"x")
    with pytest.raises(StoreError, match="not a zckpt store"):
        zckpt.ingest(str(job["src"]), f"s3://{base}/notastore", str(job["src_strategy"]))
    with pytest.raises(StoreError, match="not a zarr store"):
        zckpt.ingest(str(job["src"]), f"s3://{base}/notastore", str(job["src_strategy"]),
                     zckpt.IngestOptions(overwrite=True))


def test_remote_ingest_resumes_after_an_interruption(s3: Any, job: dict[str, Path]) -> None:
    """A store whose rank 2 never finished (its progress node removed, its chunks kept or
    not) is completed by rerunning the same ingest, to the same arrays."""
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    s3.rm(f"{base}/store.zarr/progress/rank_2.json")
    meta = json.loads(s3.cat_file(f"{base}/store.zarr/zarr.json"))
    meta["attributes"]["zckpt"]["complete"] = False
    s3.pipe(f"{base}/store.zarr/zarr.json", json.dumps(meta).encode())
    report = zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    assert report.resumed and report.complete
    assert _arrays(store) == _arrays(job["store"])


def test_remote_lock_object(s3: Any, job: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The lock is an object created only if absent (S3 conditional put): while it exists,
    ingest is refused and told which object to delete; once deleted, ingest runs."""
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    s3.pipe(f"{base}/store.zarr.lock", b'{"host": "elsewhere", "pid": 1}')
    with pytest.raises(StoreError, match="another zckpt ingest") as err:
        zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    assert f"s3://{base}/store.zarr.lock" in str(err.value) and "elsewhere" in str(err.value)
    assert not s3.exists(f"{base}/store.zarr/zarr.json")
    assert cli_main(["ingest", str(job["src"]), "--store", store, "--strategy", str(job["src_strategy"])]) == 1
    assert "lock" in capsys.readouterr().err
    s3.rm(f"{base}/store.zarr.lock")
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    assert not s3.exists(f"{base}/store.zarr.lock")


def test_remote_chunks_are_verified_at_export(s3: Any, job: dict[str, Path], tmp_path: Path) -> None:
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    st = Store.open(store)
    name = next(n for n, per in st.checksums().items() if per)
    key = sorted(st.checksums()[name])[0]
    obj = f"{base}/store.zarr/{st.entry(name).key}/{key}"
    data = bytearray(s3.cat_file(obj))
    data[0] ^= 0xFF
    s3.pipe(obj, bytes(data))
    with pytest.raises(StoreError, match="fails its checksum") as err:
        zckpt.export(store, str(tmp_path / "bad"), str(job["dst_strategy"]))
    assert err.value.param == name and store in str(err.value)
    zckpt.export(store, str(tmp_path / "unchecked"), str(job["dst_strategy"]),
                 options=zckpt.ExportOptions(verify_checksums=False))


# --- replicas that differ, on object storage ----------------------------------------------

REPLICATED = "net.v"
REPLICA_BYTES = 64 * 512 * 4


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four ranks that each hold all of ``net.v`` (``dev_matrix [4]``, ``tensor_map [-1, -1]``,
    128 KiB a copy): rank 0's copy is written, rank 1 is the replica one step from it along
    the only device axis, the one the default spot check reads (its first and last
    ``SAMPLE_BYTES``); ranks 2 and 3 are compared only with ``--verify-replicas``."""
    root = tmp_path_factory.mktemp("replicated")
    write_model(root, [TensorDef(REPLICATED, (64, 512), "Float32", make_layout([4], [-1, -1])),
                       TensorDef("net.w", (8, 16), "Float32", make_layout([4], [0, -1]))], device_num=4)
    return root


def _flip(src: Path, rank: int, name: str, at: int) -> str:
    """Flip one bit pattern of byte ``at`` of ``name``'s value in ``rank``'s shard; its file name."""
    f = src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
    with CkptReader(f) as r:
        segments = r.entries[name].segments
    pos = at
    for seg in segments:
        if pos < seg.length:
            break
        pos -= seg.length
    data = bytearray(f.read_bytes())
    data[seg.offset + pos] ^= 0x5A
    f.write_bytes(bytes(data))
    return f"rank_{rank}/checkpoint_{rank}.ckpt"


@pytest.mark.parametrize(("rank", "at", "spotted"), [
    (1, 0, True),  # the spot-checked replica, inside its first SAMPLE_BYTES
    (1, REPLICA_BYTES - 1, True),  # ... inside its last SAMPLE_BYTES
    (1, REPLICA_BYTES // 2, False),  # the spot-checked replica, between the two ends it samples
    (3, 0, False),  # a replica three steps from the writer: never spot-checked
])
def test_s3_sources_whose_replicas_differ(s3: Any, replicated: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], rank: int, at: int,
                                          spotted: bool) -> None:
    """Sources on S3 get the replica checks local sources get: a byte the spot check reads
    is refused by default (ingest and ``transform_checkpoints``), any other one with
    ``--verify-replicas``; the error names the parameter, the file and the rank compared with."""
    src = tmp_path / "src"
    shutil.copytree(replicated, src)
    bad = _flip(src, rank, REPLICATED, at)
    assert SAMPLE_BYTES < REPLICA_BYTES // 2 - SAMPLE_BYTES, "the middle byte lies outside both sampled ends"
    url = _upload(s3, src, f"{_prefix()}/ckpts")
    args = ["ingest", url, "--strategy", f"{url}/strategy.ckpt", "--quiet"]
    for verify in (False, True):
        store = tmp_path / f"store-{verify}.zarr"
        code = cli_main([*args, "--store", str(store), *(["--verify-replicas"] if verify else [])])
        err = capsys.readouterr().err
        if spotted or verify:
            assert code == 1, f"verify_replicas={verify}: a replica that differs was not refused"
            assert f"'{REPLICATED}'" in err and f"{url}/{bad}" in err and "rank 0 (" in err and "replica" in err, err
            assert not store.exists(), "nothing that looks like a store is left"
        else:
            assert code == 0, err  # the documented default: replicas are spot-checked, not compared in full
            assert Store.open(str(store)).complete
    out = tmp_path / "out"
    if spotted:
        with pytest.raises(SourceError, match="replica") as raised:
            zckpt.transform_checkpoints(url, str(out), "checkpoint_", f"{url}/strategy.ckpt")
        assert raised.value.param == REPLICATED and f"{url}/{bad}" in str(raised.value)
        assert not list(out.rglob("*.ckpt")) if out.exists() else True
    else:
        zckpt.transform_checkpoints(url, str(out), "checkpoint_", f"{url}/strategy.ckpt")
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.ckpt")) == ["rank_0/checkpoint_0.ckpt"]


# --- info, verify, consolidate and plan on S3 --------------------------------------------

def _cli_json(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 0) -> dict[str, Any]:
    assert cli_main([*args, "--json"]) == code, capsys.readouterr().err
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_info_on_s3_store_checkpoint_and_strategy(s3: Any, job: dict[str, Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The same description as for the local copies, with the URL as the path."""
    base = _prefix()
    store = _upload(s3, job["store"], f"{base}/store.zarr")
    ckpt = _upload(s3, job["src"] / "rank_1" / "checkpoint_1.ckpt", f"{base}/c.ckpt")
    strategy = _upload(s3, job["dst_strategy"], f"{base}/dst.ckpt")
    st_file = _upload(s3, job["out_st"] / "rank_0" / "checkpoint_0.safetensors", f"{base}/r0.safetensors")
    for url, local, kind in ((store, job["store"], "store"),
                             (ckpt, job["src"] / "rank_1" / "checkpoint_1.ckpt", "ckpt"),
                             (strategy, job["dst_strategy"], "strategy"),
                             (st_file, job["out_st"] / "rank_0" / "checkpoint_0.safetensors", "safetensors")):
        got, want = _cli_json(["info", url], capsys), _cli_json(["info", str(local)], capsys)
        assert got["type"] == want["type"] == kind and got["path"] == url and want["path"] == str(local)
        assert {**got, "path": None} == {**want, "path": None}
    assert cli_main(["info", f"s3://{base}/nothing.ckpt"]) == 1
    assert f"s3://{base}/nothing.ckpt" in capsys.readouterr().err
    s3.pipe(f"{base}/junk.ckpt", b"\x00not a checkpoint")
    assert cli_main(["info", f"s3://{base}/junk.ckpt"]) == 1
    err = capsys.readouterr().err
    assert f"s3://{base}/junk.ckpt" in err and "zckpt-spool" not in err, "errors name the URL, not the copy"


def test_verify_s3_store_and_a_damaged_chunk(s3: Any, job: dict[str, Path],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    local = _cli_json(["verify", str(job["store"])], capsys)
    good = _cli_json(["verify", store], capsys)
    assert good["ok"] and good["store"] == store and good["checksummed_chunks"] > 0
    for k in ("arrays", "chunks", "chunk_bytes", "checksummed_chunks"):
        assert good[k] == local[k], k
    st = Store.open(store)
    name = next(n for n, per in st.checksums().items() if per)
    key = sorted(st.checksums()[name])[-1]
    obj = f"{base}/store.zarr/{st.entry(name).key}/{key}"
    data = bytearray(s3.cat_file(obj))
    data[-1] ^= 0x01
    s3.pipe(obj, bytes(data))
    s3.rm(f"{base}/store.zarr/{st.entry('net.p1.weight').key}/" + sorted(st.checksums()["net.p1.weight"])[0])
    bad = _cli_json(["verify", store], capsys, code=1)
    found = {(m["param"], m["file"]): m["message"] for m in bad["mismatches"]}
    assert "fails its checksum" in found[(name, f"s3://{obj}")]
    missing = [f for p, f in found if p == "net.p1.weight"]
    assert len(missing) == 1 and missing[0].startswith(f"{store}/tensors/")
    assert "missing from a complete store" in found[("net.p1.weight", missing[0])]
    assert len(bad["mismatches"]) == 2


def test_verify_consolidate_and_plan_take_storage_options(s3: Any, job: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AWS_ENDPOINT_URL, --storage-option endpoint_url=... reaches the server."""
    base = _prefix()
    store = f"s3://{base}/store.zarr"
    zckpt.ingest(str(job["src"]), store, str(job["src_strategy"]))
    src_strategy = _upload(s3, job["src_strategy"], f"{base}/src.ckpt")
    dst_strategy = _upload(s3, job["dst_strategy"], f"{base}/dst.ckpt")
    endpoint = s3.endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    opts = ["--storage-option", f"endpoint_url={endpoint}"]
    assert _cli_json(["verify", store, *opts], capsys)["ok"]
    plan = _cli_json(["plan", "--src-strategy", src_strategy, "--dst-strategy", dst_strategy, *opts], capsys)
    want = _cli_json(["plan", "--src-strategy", str(job["src_strategy"]), "--dst-strategy",
                      str(job["dst_strategy"])], capsys)
    assert plan == want and len(plan["ranks"]) == DST_N
    assert _cli_json(["info", store, *opts], capsys)["complete"]
    report = _cli_json(["consolidate", store, *opts], capsys)
    root = json.loads(s3.cat_file(f"{base}/store.zarr/zarr.json"))
    assert report["nodes"] == len(root["consolidated_metadata"]["metadata"]) >= 8, "8 tensor arrays at least"
    assert report["store"] == store
    assert report["root_bytes"] == s3.size(f"{base}/store.zarr/zarr.json")
    zckpt.export(store, str(tmp_path / "out"), str(job["dst_strategy"]),
                 options=zckpt.ExportOptions(storage_options={"endpoint_url": endpoint}))
    assert _local_tree(tmp_path / "out") == _local_tree(job["out"])
    assert cli_main(["plan", "--src-strategy", f"s3://{base}/none.ckpt"]) == 1
    assert f"s3://{base}/none.ckpt" in capsys.readouterr().err


def test_info_and_verify_on_memory_store(job: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    fsspec = pytest.importorskip("fsspec")
    base = f"memory://zckpt-{uuid.uuid4().hex[:8]}"
    zckpt.ingest(str(job["src"]), f"{base}/store.zarr", str(job["src_strategy"]))
    try:
        assert _cli_json(["verify", f"{base}/store.zarr"], capsys)["ok"]
        info = _cli_json(["info", f"{base}/store.zarr"], capsys)
        assert info["path"] == f"{base}/store.zarr" and len(info["entries"]) == len(Store.open(job["store"]).entries())
    finally:
        fs, path = fsspec.core.url_to_fs(base)
        fs.rm(path, recursive=True)


# --- the MindSpore-compatible API with URLs -----------------------------------------------

def test_transform_checkpoints_with_urls(s3: Any, job: dict[str, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Sources, strategies and destination on S3 (endpoint given only as a storage option),
    then S3 sources to a local destination: MindSpore's file layout, the local export's bytes."""
    base = _prefix()
    src = _upload(s3, job["src"], f"{base}/ckpts")
    dst_strategy = _upload(s3, job["dst_strategy"], f"{base}/dst.ckpt")
    opts = {"endpoint_url": s3.endpoint}
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    zckpt.transform_checkpoints(src, f"s3://{base}/out", "checkpoint_", f"{src}/strategy.ckpt", dst_strategy,
                                storage_options=opts)
    assert _remote_tree(s3, f"{base}/out") == _local_tree(job["out"])
    assert {p[len(base) + 1:].split("/")[0] for p in s3.find(base)} == {"ckpts", "dst.ckpt", "out"}, \
        "no temporary store left beside the destination"
    zckpt.transform_checkpoints(src, str(tmp_path / "out"), "checkpoint_", f"{src}/strategy.ckpt", dst_strategy,
                                storage_options=opts)
    assert _local_tree(tmp_path / "out") == _local_tree(job["out"])
    with pytest.raises(NotADirectoryError):
        zckpt.transform_checkpoints(f"s3://{base}/nowhere", str(tmp_path / "x"), "checkpoint_",
                                    storage_options=opts)
    with pytest.raises(UsageError, match="dst_strategy_file does not exist") as err:
        zckpt.transform_checkpoints(src, str(tmp_path / "x"), "checkpoint_", f"{src}/strategy.ckpt",
                                    f"s3://{base}/none.ckpt", storage_options=opts)
    assert f"s3://{base}/none.ckpt" in str(err.value)


def test_transform_checkpoint_by_rank_with_urls(s3: Any, job: dict[str, Path], tmp_path: Path) -> None:
    """Only the source ranks rank_list_for_transform names, as URLs; the file saved to S3."""
    base = _prefix()
    src = _upload(s3, job["src"], f"{base}/ckpts")
    src_strategy, dst_strategy = f"{src}/strategy.ckpt", _upload(s3, job["dst_strategy"], f"{base}/dst.ckpt")
    needed = zckpt.rank_list_for_transform(1, src_strategy, dst_strategy)
    assert needed == zckpt.rank_list_for_transform(1, str(job["src_strategy"]), str(job["dst_strategy"]))
    files = {r: f"{src}/rank_{r}/checkpoint_{r}.ckpt" for r in needed}
    target = f"s3://{base}/one/checkpoint_1.ckpt"
    zckpt.transform_checkpoint_by_rank(1, files, target, src_strategy, dst_strategy)
    assert s3.cat_file(target[5:]) == (job["out"] / "rank_1" / "checkpoint_1.ckpt").read_bytes()
    assert s3.ls(f"{base}/one") == [target[5:]], "only the file, no temporary store"
    local = tmp_path / "r1.ckpt"
    zckpt.transform_checkpoint_by_rank(1, files, str(local), src_strategy, dst_strategy)
    assert local.read_bytes() == s3.cat_file(target[5:])
    with pytest.raises(UsageError, match="does not exist") as err:
        zckpt.transform_checkpoint_by_rank(1, {**files, 9: f"{src}/rank_9/nothing.ckpt"}, target, src_strategy,
                                           dst_strategy)
    assert f"{src}/rank_9/nothing.ckpt" in str(err.value)
    s3.pipe(f"{base}/dir.ckpt/inside", b"x")
    with pytest.raises(OutputError, match="is a directory") as err:
        zckpt.transform_checkpoint_by_rank(1, files, f"s3://{base}/dir.ckpt", src_strategy, dst_strategy)
    assert f"s3://{base}/dir.ckpt" in str(err.value)


# --- failures become zckpt errors naming the URL ------------------------------------------

def test_missing_bucket_and_store(s3: Any, job: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(StoreError) as err:
        zckpt.ingest(str(job["src"]), "s3://no-such-bucket-zckpt/store.zarr", str(job["src_strategy"]))
    assert "s3://no-such-bucket-zckpt/store.zarr" in str(err.value)
    with pytest.raises(StoreError, match="no zarr.json"):
        zckpt.export(f"s3://{BUCKET}/nothing-here.zarr", "unused-out")
    with pytest.raises(SourceError, match="does not exist"):
        zckpt.ingest(f"s3://{BUCKET}/no-sources", f"s3://{BUCKET}/x.zarr")
    assert cli_main(["export", "s3://no-such-bucket-zckpt/store.zarr", "--out", "o"]) == 1
    assert "s3://no-such-bucket-zckpt/store.zarr" in capsys.readouterr().err


def test_unreachable_endpoint(s3: Any, job: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    code = cli_main(["export", f"s3://{BUCKET}/store.zarr", "--out", "o", "--storage-option",
                     f"endpoint_url=http://127.0.0.1:{closed}",
                     "--storage-option", 'config_kwargs={"retries": {"max_attempts": 1}}',
                     "--storage-option", "retries=1"])
    err = capsys.readouterr().err
    assert code == 1 and f"s3://{BUCKET}/store.zarr" in err and "zckpt export: error" in err


# --- memory:// ----------------------------------------------------------------------------

def test_memory_store_round_trip(job: dict[str, Path], tmp_path: Path) -> None:
    """memory:// is an fsspec filesystem like any other (in this process only)."""
    fsspec = pytest.importorskip("fsspec")
    base = f"memory://zckpt-{uuid.uuid4().hex[:8]}"
    zckpt.ingest(str(job["src"]), f"{base}/store.zarr", str(job["src_strategy"]))
    assert _arrays(f"{base}/store.zarr") == _arrays(job["store"])
    zckpt.export(f"{base}/store.zarr", str(tmp_path / "out"), str(job["dst_strategy"]))
    assert _local_tree(tmp_path / "out") == _local_tree(job["out"])
    zckpt.export(f"{base}/store.zarr", f"{base}/out", str(job["dst_strategy"]))
    fs, path = fsspec.core.url_to_fs(f"{base}/out")
    assert _remote_tree(fs, path) == _local_tree(job["out"])
    fs.rm(path.split("/out")[0], recursive=True)

