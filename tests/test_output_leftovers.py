"""Nothing of zckpt's in a user's output directory once an export or transform completes.

A MindSpore user's directory holds what MindSpore would write: ``rank_<r>/`` folders and
their rank files. zckpt's bookkeeping (the resume marker, the directory lock, temporary
files) is there only while a run is incomplete, or never (the lock is on the directory's
own descriptor; new files are unnamed while written where the system allows). A rerun on a
complete directory recognises it (a record outside it) and writes nothing; the summary
says how many files were kept and how many written; ``--quiet`` prints nothing.
The expected file names come from the bundled example's ``dst/expected`` (MindSpore's own
output), never from zckpt's planner.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import OutputError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.io import locks, new_files
from zckpt.write import out_records

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
EXPECTED = EXAMPLE / "dst" / "expected"
SRC, SRC_S = EXAMPLE / "src" / "checkpoints", EXAMPLE / "src" / "strategy.ckpt"
DST_S = EXAMPLE / "dst" / "strategy.ckpt"


def _tree(root: Path) -> set[str]:
    """Every entry below ``root`` (files and folders), as relative paths."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _expected(suffix: str) -> set[str]:
    """MindSpore's files for the example's destination, with their folders (``.ckpt`` names
    turned into ``.safetensors`` ones for that format)."""
    files = {p.relative_to(EXPECTED).as_posix() for p in EXPECTED.rglob("*.ckpt")}
    files = {f[: -len(".ckpt")] + suffix for f in files}
    assert len(files) == 4
    return files | {f.split("/")[0] for f in files}


def _stats(root: Path) -> dict[str, tuple[int, int]]:
    """``(mtime_ns, inode)`` of ``root`` and everything below it."""
    return {p.relative_to(root).as_posix(): (p.lstat().st_mtime_ns, p.lstat().st_ino)
            for p in [root, *root.rglob("*")]}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("leftovers") / "s.zarr"
    zckpt.ingest(str(SRC), path, str(SRC_S))
    return path


def _run(kind: str, out: Path, store: Path, *extra: str) -> list[str]:
    if kind == "export":
        return ["export", str(store), "--dst-strategy", str(DST_S), "--out", str(out), *extra]
    return ["transform", str(SRC), "--src-strategy", str(SRC_S), "--dst-strategy", str(DST_S), "--out", str(out),
            *extra]


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
@pytest.mark.parametrize("kind", ["export", "transform"])
def test_a_finished_run_leaves_only_the_rank_files(store: Path, tmp_path: Path, kind: str, fmt: str) -> None:
    out = tmp_path / "out"
    assert cli_main(_run(kind, out, store, "--format", fmt, "--quiet")) == 0
    assert _tree(out) == _expected("." + fmt)
    if fmt == "ckpt":
        assert all((out / f).read_bytes() == (EXPECTED / f).read_bytes() for f in _expected(".ckpt")
                   if f.endswith(".ckpt"))


def test_a_finished_export_to_object_storage_leaves_only_the_rank_files(store: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    base = f"memory://zckpt-{uuid.uuid4().hex[:8]}"
    zckpt.export(store, f"{base}/out", str(DST_S))
    fs, path = fsspec.core.url_to_fs(f"{base}/out")
    try:
        files = {p[len(path) + 1:] for p in fs.find(path)}
        assert files == {f for f in _expected(".ckpt") if "/" in f}
        again = zckpt.export(store, f"{base}/out", str(DST_S))  # complete: recognised, nothing written
        assert (again.kept, again.ranks) == (4, ())
        fs.rm(f"{path}/rank_2/checkpoint_2.ckpt")
        resumed = zckpt.export(store, f"{base}/out", str(DST_S))
        assert (resumed.kept, [r.rank for r in resumed.ranks]) == (3, [2])
        assert {p[len(path) + 1:] for p in fs.find(path)} == files
        assert fs.cat_file(f"{path}/rank_2/checkpoint_2.ckpt") == (EXPECTED / "rank_2/checkpoint_2.ckpt").read_bytes()
    finally:
        fs.rm(path, recursive=True)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
@pytest.mark.parametrize("kind", ["export", "transform"])
def test_a_killed_tasks_temporary_file_goes_when_the_run_completes(store: Path, tmp_path: Path, kind: str,
                                                                   fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Dask worker killed while writing rank 1 leaves its temporary file (named, on a file
    system without unnamed files); the task runs again elsewhere and the run completes: the
    directory then holds the rank files only."""
    from zckpt.io import safe_paths
    from zckpt.write import out_dirs

    real = out_dirs.output_folders

    def killed_worker_was_here(out: Path, paths: object) -> None:
        real(out, paths)  # type: ignore[arg-type]
        target = out / "rank_1" / f"checkpoint_1.{fmt}"
        safe_paths.temp_name(target).write_bytes(b"half a rank file")

    monkeypatch.setattr(out_dirs, "output_folders", killed_worker_was_here)
    out = tmp_path / "out"
    assert cli_main(_run(kind, out, store, "--format", fmt, "--quiet")) == 0
    assert _tree(out) == _expected("." + fmt)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
@pytest.mark.parametrize("kind", ["export", "transform"])
def test_a_rerun_on_a_complete_directory_writes_nothing(store: Path, tmp_path: Path, kind: str, fmt: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    run = _run(kind, out, store, "--format", fmt)
    assert cli_main([*run, "--quiet"]) == 0
    before = _stats(out)
    capsys.readouterr()
    assert cli_main(run) == 0
    assert "rank files: 4 kept, 0 written: already complete, nothing to do" in capsys.readouterr().out
    assert _stats(out) == before, "a rerun on a complete directory changed it"
    assert cli_main([*run, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["kept"], doc["written"], doc["ranks"]) == (4, 0, [])
    if fmt == "ckpt":  # (safetensors output refuses only files of the names it writes)
        assert cli_main(_run(kind, out, store, "--prefix", "net_", "--quiet")) != 0  # another job: refused
        assert _stats(out) == before


@pytest.mark.parametrize("kind", ["export", "transform"])
def test_a_resumed_run_says_what_it_kept_and_wrote(store: Path, tmp_path: Path, kind: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli_main(_run(kind, out, store, "--quiet")) == 0
    (out / "rank_1" / "checkpoint_1.ckpt").unlink()
    capsys.readouterr()
    assert cli_main(_run(kind, out, store)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("rank files: 3 kept, 1 written, "), lines
    assert [x.split(":")[0] for x in lines if x.startswith("  rank ")] == ["  rank 1"]
    assert _tree(out) == _expected(".ckpt")
    assert (out / "rank_1" / "checkpoint_1.ckpt").read_bytes() == (EXPECTED / "rank_1/checkpoint_1.ckpt").read_bytes()


def test_a_complete_directory_of_another_job_is_not_taken_for_this_one(store: Path, tmp_path: Path) -> None:
    """Same file names, other contents: another store's export is refused, not "complete"."""
    out = tmp_path / "out"
    assert cli_main(_run("export", out, store, "--quiet")) == 0
    src = tmp_path / "src"  # the same job one step later: every file name and shape the same
    for f in sorted(SRC.rglob("*.ckpt")):
        (src / f.parent.name).mkdir(parents=True)
        with CkptReader(f) as r, CkptWriter(src / f.parent.name / f.name) as w:
            for name, e in r.entries.items():
                value = np.asarray(r.array(name))
                w.write_array(name, e.ms_type, (value + 1).astype(value.dtype))  # numpy 1.26 widens scalars
    other = tmp_path / "other.zarr"
    zckpt.ingest(str(src), other, str(SRC_S))
    with pytest.raises(OutputError, match="not written by this same export"):
        zckpt.export(other, out, str(DST_S))
    (out / "rank_0" / "checkpoint_0.ckpt").touch()  # a file changed since: no longer what the record says
    with pytest.raises(OutputError, match="not written by this same export"):
        zckpt.export(store, out, str(DST_S))
    assert zckpt.export(store, out, str(DST_S), options=zckpt.ExportOptions(overwrite=True)).kept == 0
    assert zckpt.export(store, out, str(DST_S)).kept == 4
    out_records.forget(out_records.local_key(out))  # the files alone do not tell whose they are
    with pytest.raises(OutputError, match="not written by this same export"):
        zckpt.export(store, out, str(DST_S))


@pytest.mark.parametrize("kind", ["export", "transform", "ingest"])
def test_quiet_prints_nothing_on_success(store: Path, tmp_path: Path, kind: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    if kind == "ingest":
        args = ["ingest", str(SRC), "--src-strategy", str(SRC_S), "--store", str(tmp_path / "q.zarr")]
    else:
        args = _run(kind, tmp_path / "out", store)
    capsys.readouterr()
    assert cli_main([*args, "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert cli_main([*args, "--quiet", "--json"]) == 0  # a report asked for is printed
    got = capsys.readouterr()
    assert got.err == "" and isinstance(json.loads(got.out), dict)
    code = cli_main(["export", str(tmp_path / "nowhere.zarr"), "--out", str(tmp_path / "x"), "--quiet"])
    assert code != 0 and "error" in capsys.readouterr().err  # errors still print


def test_the_output_lock_leaves_nothing_and_keeps_writers_exclusive(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with locks.output_writing(out):
        assert _tree(out) == set(), "the lock put a file into the output directory"
        with pytest.raises(OutputError, match="another zckpt export or transform"), locks.output_writing(out):
            pass
        link = tmp_path / "link"
        link.symlink_to(out)  # the directory a link leads to is the one locked
        with pytest.raises(OutputError, match="another zckpt export or transform"), locks.output_writing(link):
            pass
    with locks.output_writing(out):
        pass
    assert _tree(out) == set()


def test_a_new_file_has_no_name_until_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a rank file is written, its folder holds nothing (where the system allows unnamed
    files, as on this machine's test directories); the named fallback leaves nothing either
    once it fails."""
    probe = new_files.NewFile(tmp_path / "probe")
    probe.discard()
    if not probe.unnamed:
        pytest.skip("this filesystem cannot write unnamed files (the named fallback is tested below)")
    with CkptWriter(tmp_path / "a.ckpt", fsync=False) as w:
        w.write_array("x", "Int8", np.arange(4, dtype=np.int8))
        assert _tree(tmp_path) == set()
    assert _tree(tmp_path) == {"a.ckpt"}
    monkeypatch.setattr(new_files, "UNNAMED", False)
    with pytest.raises(RuntimeError), CkptWriter(tmp_path / "b.ckpt", fsync=False) as w:
        w.write_array("x", "Int8", np.arange(4, dtype=np.int8))
        assert any(n.endswith(".tmp-zckpt") for n in _tree(tmp_path))
        raise RuntimeError("stop")
    assert _tree(tmp_path) == {"a.ckpt"}


def test_a_marker_left_by_a_killed_run_is_resumed_then_removed(store: Path, tmp_path: Path) -> None:
    """A run killed after writing some files leaves its marker (nothing else of zckpt's): the
    rerun keeps the complete files, writes the rest and removes the marker last."""
    out = tmp_path / "out"
    zckpt.export(store, out, str(DST_S))
    fingerprint_doc = {"fingerprint": _marker_of(store, out)}
    (out / ".zckpt-export.json").write_text(json.dumps(fingerprint_doc))
    (out / "rank_3" / "checkpoint_3.ckpt").unlink()
    again = zckpt.export(store, out, str(DST_S))
    assert (again.kept, [r.rank for r in again.ranks]) == (3, [3])
    assert _tree(out) == _expected(".ckpt")


def _marker_of(store: Path, out: Path) -> str:
    """The fingerprint a run of this export writes into its marker."""
    from zckpt.jobs.export_job import export_fingerprint, output_jobs, plan_export
    from zckpt.store.store import Store

    st = Store.open(store)
    plan = plan_export(st, str(DST_S))
    return export_fingerprint(st, output_jobs(st, plan, out, zckpt.ExportOptions()), zckpt.ExportOptions())


def _damaged_copy(store: Path, tmp_path: Path) -> Path:
    """A copy of the store with one byte of layer1.weight's chunk data flipped: an export
    plans and starts, then stops at the checksum of that chunk."""
    import shutil

    copy = tmp_path / "damaged.zarr"
    shutil.copytree(store, copy)
    chunk = max((p for p in (copy / "tensors" / "layer1.weight").rglob("*") if p.is_file() and p.name != "zarr.json"),
                key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("made", [False, True])
def test_a_run_that_fails_before_any_file_leaves_the_directory_as_found(store: Path, tmp_path: Path,
                                                                        made: bool) -> None:
    """An export stopped by a damaged chunk before it published a rank file leaves no marker,
    no empty rank folder, and no output directory it created itself."""
    out = tmp_path / "out"
    if made:
        out.mkdir()
    assert cli_main(_run("export", out, _damaged_copy(store, tmp_path), "--quiet")) == 1
    assert out.exists() == made
    if made:
        assert _tree(out) == set()


def test_a_failed_resume_keeps_the_marker_it_resumes_from(store: Path, tmp_path: Path) -> None:
    """A rerun of a killed export that fails again keeps the killed run's marker and files:
    the next rerun still resumes them."""
    out = tmp_path / "out"
    zckpt.export(store, out, str(DST_S))
    (out / ".zckpt-export.json").write_text(json.dumps({"fingerprint": _marker_of(store, out)}))
    (out / "rank_3" / "checkpoint_3.ckpt").unlink()
    kept = _tree(out)
    damaged = _damaged_copy(store, tmp_path)
    assert cli_main(_run("export", out, damaged, "--quiet")) == 1
    assert _tree(out) == kept


def test_records_beyond_the_limit_are_trimmed_oldest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The records of finished directories stay at most ``KEEP``: the oldest go first, and
    none goes while there are no more than that."""
    import os

    monkeypatch.setenv(out_records.STATE_ENV, str(tmp_path / "state"))
    monkeypatch.setattr(out_records, "KEEP", 3)
    for i in range(3):
        out_records.remember(f"dir{i}", "f", {})
        path = out_records._record_path(f"dir{i}")
        os.utime(path, ns=(i * 10**9, i * 10**9))
    assert all(out_records.recall(f"dir{i}", "f") == {} for i in range(3))
    out_records.remember("dir3", "f", {})
    assert [out_records.recall(f"dir{i}", "f") for i in range(4)] == [None, {}, {}, {}]


def test_a_killed_tasks_temporaries_go_from_every_folder_but_nothing_else(tmp_path: Path) -> None:
    """What a killed task left (``*.tmp-zckpt``, in any rank folder) goes at the end of the
    run; other files, and a link of that name, stay."""
    from zckpt.write.out_dirs import drop_temporaries

    for r in range(3):
        (tmp_path / f"rank_{r}").mkdir()
        (tmp_path / f"rank_{r}" / f"checkpoint_{r}.ckpt").write_bytes(b"x")
        (tmp_path / f"rank_{r}" / f".checkpoint_{r}.ckpt.1.2.tmp-zckpt").write_bytes(b"y")
    (tmp_path / "keep.tmp-zckpt.not").write_bytes(b"z")
    (tmp_path / "link.tmp-zckpt").symlink_to(tmp_path / "rank_0" / "checkpoint_0.ckpt")
    drop_temporaries(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if not p.is_dir()) == [
        "keep.tmp-zckpt.not", "link.tmp-zckpt", "rank_0/checkpoint_0.ckpt", "rank_1/checkpoint_1.ckpt",
        "rank_2/checkpoint_2.ckpt"]
