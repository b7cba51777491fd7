"""``--dry-run`` of ingest, export and transform checked against what the real run then does:
the files it announces are the files written (names and sizes), the bytes it says are read
are what the run's counters count, a dry run writes nothing, and a refusal is the real run's."""

from __future__ import annotations

import importlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.strategy import encode_strategy
from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, strategy_of, with_optimizer_states
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.write import group_writer

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = EXAMPLE / "src" / "checkpoints"
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")
BOOKKEEPING = (".zckpt-export.json", ".zckpt-out.lock")


def _listing(root: Path) -> dict[str, int]:
    """Every file and folder below ``root`` with its size (folders: -1)."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size if p.is_file() else -1) for p in sorted(root.rglob("*"))}


def _outputs(out: Path) -> dict[str, int]:
    """The files a run wrote into ``out`` (its bookkeeping aside)."""
    return {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in BOOKKEEPING}


def _dry(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    """Run ``zckpt ... --dry-run --json``: (exit code, the JSON document, stderr)."""
    code = cli_main([*args, "--dry-run", "--json", "--quiet"])
    got = capsys.readouterr()
    return code, json.loads(got.out) if got.out.strip() else None, got.err


def _announced(doc: dict[str, Any], out: Path) -> dict[str, int]:
    return {Path(f["path"]).relative_to(out).as_posix(): f["bytes"] for f in doc["files"] if not f["kept"]}


def test_transform_dry_run_is_what_the_run_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    before = _listing(tmp_path)
    code, doc, _ = _dry(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(out)],
                        capsys)
    assert code == 0 and doc["dry_run"] and doc["fits"]
    assert _listing(tmp_path) == before  # nothing written: no output folder, no lock
    r = transform(SRC, out, SRC_S, DST_S, options=TransformOptions())
    assert _announced(doc, out) == _outputs(out) and len(_outputs(out)) == 4
    assert doc["bytes_to_write"] == r.bytes_written == sum(_outputs(out).values())
    assert doc["bytes_to_read"] == sum(x.read_bytes for x in r.ranks)
    assert doc["bytes_read"] == r.bytes_read
    assert doc["bytes_compared"] == r.bytes_compared > 0
    # the files read no more than they hold (small files: read as one group, its reads listed
    # with the first file, replicated scalars once)
    assert 0 < sum(s["bytes"] for f in doc["files"] for s in f["sources"]) <= sum(f["data_bytes"] for f in doc["files"])
    for f in doc["files"]:
        assert {Path(s["path"]).name for s in f["sources"]} <= {p.name for p in SRC.rglob("*.ckpt")}
    code, again, _ = _dry(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(out)],
                          capsys)
    assert code == 0 and again["bytes_to_write"] == 0 and all(f["kept"] for f in again["files"])


@pytest.mark.parametrize("source_major", [False, True])
def test_transform_reading_part_of_the_source_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, source_major: bool) -> None:
    """4 -> 8 (the example the other way): destination slices take part of the source rows,
    so written one by one more is read than held, and source-major each byte once; either
    way the dry run counts the bytes the run reads."""
    monkeypatch.setattr(group_writer, "GAIN", 0.0 if source_major else math.inf)
    monkeypatch.setattr(group_writer, "SMALL_PIECE", group_writer.SMALL_PIECE if source_major else 0)
    src = EXAMPLE / "dst" / "expected"
    out = tmp_path / "out"
    code, doc, _ = _dry(["transform", str(src), "--src-strategy", DST_S, "--dst-strategy", SRC_S, "--out", str(out)],
                        capsys)
    assert code == 0
    r = transform(src, out, DST_S, SRC_S)
    assert _announced(doc, out) == _outputs(out) and len(_outputs(out)) == 8
    assert doc["bytes_to_read"] == sum(x.read_bytes for x in r.ranks)
    if source_major:
        assert doc["bytes_read"] == r.bytes_read == doc["bytes_to_read"]
    else:
        assert doc["bytes_read"] == r.bytes_read > doc["bytes_to_read"]


def test_safetensors_files_announced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, doc, _ = _dry(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(out),
                         "--format", "safetensors", "--crc"], capsys)
    assert code == 0 and not out.exists()
    transform(SRC, out, SRC_S, DST_S, options=TransformOptions(format="safetensors", crc=True))
    assert _announced(doc, out) == _outputs(out) and len(_outputs(out)) == 4


def test_split_safetensors_parts_and_index(tmp_path: Path) -> None:
    from zckpt.jobs.dryrun import dry_run_transform

    out = tmp_path / "out"
    opts = TransformOptions(format="safetensors", max_file_bytes=3000)
    doc = dry_run_transform(SRC, out, SRC_S, DST_S, options=opts).to_json()
    assert not out.exists()
    transform(SRC, out, SRC_S, DST_S, options=opts)
    written = _outputs(out)
    assert any(n.endswith(".index.json") for n in written) and len(written) > 8
    assert _announced(doc, out) == written


def test_ingest_and_export_dry_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, out = tmp_path / "store.zarr", tmp_path / "out"
    before = _listing(tmp_path)
    code, doc, _ = _dry(["ingest", str(SRC), "--strategy", SRC_S, "--store", str(store)], capsys)
    assert code == 0 and doc["state"] == "new"
    assert _listing(tmp_path) == before  # no store, no lock file beside it
    r = ingest(SRC, store, SRC_S, IngestOptions())
    assert doc["bytes_to_write"] == r.bytes_written
    assert doc["bytes_to_read"] == r.bytes_written  # ingest reads what it writes, then compares replicas
    assert doc["bytes_compared"] == r.bytes_compared > 0
    assert {int(s["rank"]) for s in doc["files"][0]["sources"]} == set(r.ranks_read)
    chunk_files = sum(p.stat().st_size for p in store.rglob("*") if p.is_file() and p.name != "zarr.json"
                      and "progress" not in p.relative_to(store).parts)
    assert doc["space_needed"] == chunk_files
    code, again, _ = _dry(["ingest", str(SRC), "--strategy", SRC_S, "--store", str(store)], capsys)
    assert code == 0 and again["state"] == "complete" and again["bytes_to_write"] == 0

    before = _listing(tmp_path)
    code, doc, _ = _dry(["export", str(store), "--strategy", DST_S, "--out", str(out)], capsys)
    assert code == 0 and _listing(tmp_path) == before
    e = export(store, out, DST_S, options=ExportOptions())
    assert _announced(doc, out) == _outputs(out) and len(_outputs(out)) == 4
    assert doc["bytes_to_read"] == sum(x.read_bytes for x in e.ranks) <= e.bytes_read


def _many_rank_job(root: Path) -> tuple[Path, Path, Path]:
    """A generated 32-rank source and a 5-rank destination of other splits."""
    rng = np.random.default_rng(25)
    shapes = [(60, 48), (120, 24), (48,), (24, 36, 12), (360, 8)]
    src = [TensorDef(f"net.p{i}.weight", s, ["Float32", "Float16", "BFloat16"][i % 3], random_layout(rng, s, 32))
           for i, s in enumerate(shapes)]
    model = write_model(root / "src", with_optimizer_states(src), device_num=32, strings={"note": "32->5"})
    dst = with_optimizer_states([TensorDef(t.name, t.shape, t.ms_type, random_layout(rng, t.shape, 5)) for t in src])
    path = root / "dst.ckpt"
    path.write_bytes(encode_strategy(strategy_of(dst)))
    assert model.strategy_path is not None
    return root / "src", model.strategy_path, path


def test_many_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, src_s, dst_s = _many_rank_job(tmp_path / "job")
    out, store, out2 = tmp_path / "out", tmp_path / "store.zarr", tmp_path / "out2"
    before = _listing(tmp_path)
    code, tdoc, _ = _dry(["transform", str(src), "--src-strategy", str(src_s), "--dst-strategy", str(dst_s),
                          "--out", str(out), "--crc"], capsys)
    code2, idoc, _ = _dry(["ingest", str(src), "--strategy", str(src_s), "--store", str(store)], capsys)
    assert code == code2 == 0 and _listing(tmp_path) == before
    r = transform(src, out, src_s, dst_s, options=TransformOptions(crc=True))
    assert _announced(tdoc, out) == _outputs(out) and len(_outputs(out)) == 5
    code, again, _ = _dry(["transform", str(src), "--src-strategy", str(src_s), "--dst-strategy", str(dst_s),
                           "--out", str(out), "--crc"], capsys)
    assert code == 0 and all(f["kept"] for f in again["files"])  # a rerun keeps them: they are complete
    assert {Path(f["path"]).relative_to(out).as_posix(): f["bytes"] for f in again["files"]} == _outputs(out)
    assert (tdoc["bytes_to_read"], tdoc["bytes_read"], tdoc["bytes_compared"]) == (
        sum(x.read_bytes for x in r.ranks), r.bytes_read, r.bytes_compared)
    i = ingest(src, store, src_s, IngestOptions())
    assert (idoc["bytes_to_write"], idoc["bytes_compared"]) == (i.bytes_written, i.bytes_compared)
    code, edoc, _ = _dry(["export", str(store), "--strategy", str(dst_s), "--out", str(out2)], capsys)
    assert code == 0 and not out2.exists()
    e = export(store, out2, dst_s)
    assert _announced(edoc, out2) == _outputs(out2)
    assert {k: v + len(b"crc_num") + 10 for k, v in _outputs(out2).items()} == _outputs(out)  # the same files
    assert edoc["bytes_to_read"] == sum(x.read_bytes for x in e.ranks)


def _both(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, int, str]:
    """The dry run's and then the real run's exit code and error line."""
    code = cli_main([*args, "--dry-run", "--quiet"])
    dry = capsys.readouterr().err
    real = cli_main([*args, "--quiet"])
    return code, dry, real, capsys.readouterr().err


def test_refusals_are_the_real_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    shutil.rmtree(src / "rank_5")
    watched = tmp_path / "w"
    watched.mkdir()
    before = _listing(watched)
    cases = [
        ["transform", str(src), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(watched / "o")],
        ["ingest", str(src), "--strategy", SRC_S, "--store", str(watched / "s.zarr")],
    ]
    for args in cases:
        code, dry, real, err = _both(args, capsys)
        assert code == real == 1 and dry == err and "rank(s) [5]" in dry, args
    assert _listing(watched) == before
    busy = watched / "busy"
    (busy / "rank_0").mkdir(parents=True)
    (busy / "notes.txt").write_text("mine")
    before = _listing(watched)
    code, dry, _, _ = _both(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                             str(busy)], capsys)
    after = _listing(watched)
    real = cli_main(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(busy),
                     "--quiet"])
    assert code == real == 1 and dry == capsys.readouterr().err and "not written by this same export" in dry
    assert after == before


def test_not_enough_space(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from zckpt.write import destinations

    monkeypatch.setattr(destinations, "free_space", lambda path: 1000)
    code, doc, err = _dry(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                           str(tmp_path / "o")], capsys)
    assert code == 1 and doc["error"]["type"] == "DiskFullError" and "not enough free space" in err
    assert "1000 free" in doc["error"]["message"] and not (tmp_path / "o").exists()
    assert cli_main(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                     str(tmp_path / "o"), "--dry-run"]) == 1
    assert "NOT ENOUGH" in capsys.readouterr().out


def test_plain_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                     str(tmp_path / "o"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "nothing written" in text and "rank_3/checkpoint_3.ckpt" in text and "free:" in text
    assert zckpt.__name__ == "zckpt"


def test_locks_held_are_the_real_runs_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A store an ingest writes, an output directory another run writes into: refused by the
    dry run as by the run, and the dry run leaves no lock file of its own."""
    from zckpt.io import locks

    store, out = tmp_path / "store.zarr", tmp_path / "out"
    ingest(SRC, store, SRC_S, IngestOptions())
    exp = ["export", str(store), "--strategy", DST_S, "--out", str(out)]
    ing = ["ingest", str(SRC), "--strategy", SRC_S, "--store", str(store)]
    with locks.store_writing(store):
        for args in (exp, ing):
            code, dry, real, err = _both(args, capsys)
            assert code == real == 1 and dry == err and "lock held" in dry, args
    out.mkdir()
    tr = ["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(out)]
    with locks.output_writing(out):
        for args in (exp, tr):
            code, dry, real, err = _both(args, capsys)
            assert code == real == 1 and dry == err and "lock held" in dry, args
    before = _listing(tmp_path)
    assert cli_main([*exp, "--dry-run", "--quiet"]) == 0 and cli_main([*ing, "--dry-run", "--quiet"]) == 0
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("command", ["transform", "export"])
def test_rerun_after_a_lost_file(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A destination file removed after a run: the dry run of the rerun announces what the
    rerun then does (the files it writes, or its refusal)."""
    out, store = tmp_path / "out", tmp_path / "store.zarr"
    if command == "export":
        ingest(SRC, store, SRC_S, IngestOptions())
        args = ["export", str(store), "--strategy", DST_S, "--out", str(out)]
    else:
        args = ["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out", str(out)]
    assert cli_main([*args, "--quiet"]) == 0
    capsys.readouterr()
    (out / "rank_2" / "checkpoint_2.ckpt").unlink()
    code, doc, dry_err = _dry(args, capsys)
    real = cli_main([*args, "--quiet", "--json"])
    got = capsys.readouterr()
    assert code == real
    if real:
        assert dry_err.splitlines()[-1] == got.err.splitlines()[-1]
        return
    written = {Path(r["path"]).relative_to(out).as_posix() for r in json.loads(got.out)["ranks"]}
    assert set(_announced(doc, out)) == written
    assert {k: v for k, v in _outputs(out).items() if k in written} == _announced(doc, out)


def test_store_of_another_ingest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store.zarr"
    ingest(SRC, store, SRC_S, IngestOptions())
    other = tmp_path / "other"
    shutil.copytree(SRC, other)
    args = ["ingest", str(other), "--strategy", SRC_S, "--store", str(store), "--chunk-size", "1KiB"]
    before = _listing(tmp_path)
    code, dry, real, err = _both(args, capsys)
    assert code == real == 1 and dry == err and "holds a different ingest" in dry
    assert _listing(tmp_path) == before
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x").write_text("x")
    code, dry, real, err = _both(["ingest", str(SRC), "--strategy", SRC_S, "--store", str(tmp_path / "plain")], capsys)
    assert code == real == 1 and dry == err and "not a zckpt store" in dry


def test_resumed_ingest(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An ingest interrupted after 3 source ranks: the dry run of the rerun says it resumes
    and announces the bytes the rerun then writes."""
    ingest_module = importlib.import_module("zckpt.jobs.ingest")  # the module (zckpt.ingest names the function)
    real_rank = ingest_module.ingest_rank
    done: list[int] = []

    def interrupted(job: Any, *args: Any, **kwargs: Any) -> int:
        if len(done) == 3:
            raise KeyboardInterrupt
        done.append(job.rank)
        return real_rank(job, *args, **kwargs)

    store = tmp_path / "store.zarr"
    monkeypatch.setattr(ingest_module, "ingest_rank", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ingest(SRC, store, SRC_S, IngestOptions(helper=False))
    monkeypatch.setattr(ingest_module, "ingest_rank", real_rank)
    before = _listing(tmp_path)
    code, doc, _ = _dry(["ingest", str(SRC), "--strategy", SRC_S, "--store", str(store)], capsys)
    assert code == 0 and doc["state"] == "resume" and _listing(tmp_path) == before
    r = ingest(SRC, store, SRC_S, IngestOptions())
    assert r.resumed and doc["bytes_to_write"] == r.bytes_written > 0
    assert {s["rank"] for s in doc["files"][0]["sources"]} == set(range(8)) - set(done)
    assert doc["bytes_compared"] == r.bytes_compared


def test_urls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """memory:// (an fsspec filesystem like s3://): sources and store at URLs, the store
    exported to a URL; the dry runs write no object and announce what the runs write."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"memory://zckpt-dry-{uuid.uuid4().hex[:8]}"
    fs.put(str(SRC), f"{base}/src", recursive=True)
    store, out = f"{base}/store.zarr", f"{base}/out"
    before = sorted(fs.find(base))
    code, idoc, _ = _dry(["ingest", f"{base}/src", "--strategy", SRC_S, "--store", store], capsys)
    assert code == 0 and idoc["free_bytes"] is None and sorted(fs.find(base)) == before
    i = ingest(f"{base}/src", store, SRC_S)
    assert idoc["bytes_to_write"] == i.bytes_written
    before = sorted(fs.find(base))
    code, edoc, _ = _dry(["export", store, "--strategy", DST_S, "--out", out], capsys)
    assert code == 0 and sorted(fs.find(base)) == before
    e = export(store, out, DST_S)
    written = {p.split("/out/", 1)[1]: fs.size(p) for p in fs.find(out) if not p.endswith(BOOKKEEPING)}
    assert {f["path"].split("/out/", 1)[1]: f["bytes"] for f in edoc["files"]} == written
    assert {f["path"] for f in edoc["files"]} == {x.path for x in e.ranks}  # the URLs the run reports
    assert edoc["bytes_to_read"] == sum(x.read_bytes for x in e.ranks)
    code, again, _ = _dry(["export", store, "--strategy", DST_S, "--out", out], capsys)
    assert code == 0 and again["bytes_to_write"] == 0
    fs.rm(base, recursive=True)


def test_replicas_that_differ(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unlisted scalar whose copies differ: the replica comparison the runs make before
    writing (transform) or after (ingest) refuses it, and so does the dry run of each."""
    from zckpt.formats.ckpt import CkptReader

    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    victim = src / "rank_3" / "checkpoint_3.ckpt"
    with CkptReader(victim) as r:
        offset = r.entries["momentum"].segments[0].offset
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x40
    victim.write_bytes(bytes(data))
    watched = tmp_path / "w"
    watched.mkdir()
    for args in (["transform", str(src), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                  str(watched / "o"), "--no-verify-crc"],
                 ["ingest", str(src), "--strategy", SRC_S, "--store", str(watched / "s.zarr")]):
        code = cli_main([*args, "--dry-run", "--quiet"])
        dry = capsys.readouterr().err
        assert _listing(watched) == {}, args  # nothing written by the dry run
        real = cli_main([*args, "--quiet"])
        assert code == real == 1 and dry == capsys.readouterr().err and "hold different values" in dry, args
        shutil.rmtree(watched)
        watched.mkdir()


@pytest.mark.parametrize("command", ["export", "transform"])
def test_finished_safetensors_directory_is_kept_as_the_rerun_keeps_it(command: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A rerun of a finished safetensors export or transform keeps its files; the dry run of
    that rerun says so (with the files' sizes), rather than refusing them."""
    out = tmp_path / "out"
    if command == "export":
        ingest(SRC, tmp_path / "s.zarr", SRC_S)
        args = ["export", str(tmp_path / "s.zarr"), "--strategy", DST_S]
    else:
        args = ["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S]
    args += ["--out", str(out), "--format", "safetensors"]
    assert cli_main([*args, "--quiet"]) == 0
    code, doc, _ = _dry(args, capsys)
    assert code == 0 and doc["files"] and all(f["kept"] for f in doc["files"])
    assert {Path(f["path"]).relative_to(out).as_posix(): f["bytes"] for f in doc["files"]} == _outputs(out)
    assert cli_main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kept"] == len(doc["files"])


def _groups(doc: dict[str, Any]) -> list[list[int]]:
    """The ranks of each source-major group the dry run announces, in order."""
    groups: dict[int, list[int]] = {}
    for f in doc["files"]:
        if f["group"] is not None:
            groups.setdefault(f["group"], []).append(f["rank"])
    return [groups[g] for g in sorted(groups)]


def test_groups_on_a_scheduler_are_cut_for_its_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--scheduler`` the run cuts source-major groups for the cluster's worker threads
    (``Client.nthreads``); the dry run asks the scheduler and announces the same groups (it
    cut them for ``--workers``, 1 with a scheduler: one group), in a transform and an export."""
    distributed = pytest.importorskip("distributed")
    from zckpt.formats.strategy import StrategyMap, make_layout
    from zckpt.jobs.transform import plan_transform, source_major_groups
    from zckpt.store.reader import StoreReader
    from zckpt.store.store import Store
    from zckpt.write.writers import source_major

    model = write_model(tmp_path / "src", [TensorDef(f"w{i}", (64, 8), "Float32", make_layout([2], [0, -1]))
                                           for i in range(4)], device_num=2)
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={t.name: {0: make_layout([32], [0, -1])}
                                                         for t in model.tensors if t.name.startswith("w")})))
    ingest(model.root, tmp_path / "s.zarr", model.strategy_path)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as c:
        at = ["--scheduler", c.scheduler_address]
        _, transformed, err = _dry(["transform", str(model.root), "--src-strategy", str(model.strategy_path),
                                    "--dst-strategy", str(dst), "--out", str(tmp_path / "direct"), *at], capsys)
        _, exported, err2 = _dry(["export", str(tmp_path / "s.zarr"), "--strategy", str(dst), "--out",
                                  str(tmp_path / "o"), *at], capsys)
    assert transformed is not None and exported is not None, err + err2
    plan = plan_transform(model.root, model.strategy_path, dst)
    by_rank = {r.rank: r for r in plan.export.ranks}
    ranks = [f["rank"] for f in transformed["files"]]
    want = source_major_groups(plan, [by_rank[r] for r in ranks], TransformOptions(), 2)
    assert want is not None and len(want) == 2, want
    assert _groups(transformed) == [[ranks[i] for i in g] for g in want] == [list(range(16)), list(range(16, 32))]
    store = Store.open(tmp_path / "s.zarr")
    ranks = [f["rank"] for f in exported["files"]]
    cut = source_major(StoreReader(store, ExportOptions()), [by_rank[r] for r in ranks], ExportOptions(), 2)
    assert cut is not None and _groups(exported) == [[ranks[i] for i in g] for g in cut] == _groups(transformed)
    assert not (tmp_path / "direct").exists() and not (tmp_path / "o").exists()


def test_unreachable_scheduler_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dry run that cannot reach its scheduler says so (it asks it how many threads it has)."""
    dask = pytest.importorskip("dask")
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        code, doc, err = _dry(["transform", str(SRC), "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                               str(tmp_path / "o"), "--scheduler", "tcp://127.0.0.1:1"], capsys)
    assert code == 1 and doc is not None and doc["error"]["type"] == "UsageError", (doc, err)
    assert doc["error"]["message"].startswith("cannot reach the Dask scheduler tcp://127.0.0.1:1: "), doc
    assert doc["error"]["param"] == "--scheduler", doc
    assert not (tmp_path / "o").exists()
