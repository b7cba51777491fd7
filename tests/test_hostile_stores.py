"""Hostile stores and output directories: zckpt never reads or writes outside them.

A store is data that people copy, share and download, and an output directory may hold
anything. Each case plants something in one of them (a symbolic link to a file or folder
outside, a key or a chunk-key separator that climbs out, a link where a temporary file,
the export marker, a ``rank_<r>`` folder or the ingest lock will be created) and checks
that the command refuses with a zckpt error naming the planted path, exits non-zero, and
leaves the outside untouched. Links point at exact copies of the store's own files, so a
zckpt that followed them would read the right bytes, pass every checksum and exit 0: only
the refusal tells the cases apart.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import ZckptError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import make_layout
from zckpt.io import locks
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.store.locking import store_lock

TENSORS = [
    TensorDef("w", (64, 8), "Float32", make_layout((4,), [[0], []])),  # sharded: one shard file c.0.0
    TensorDef("b", (8,), "Float32", None),  # unsharded: one chunk file c.0
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    write_model(root / "src", TENSORS, device_num=4, scalars=False)
    assert cli_main(["ingest", str(root / "src"), "--strategy", str(root / "src" / "strategy.ckpt"),
                     "--store", str(root / "s.zarr")]) == 0
    assert (root / "s.zarr" / "tensors" / "w" / "c.0.0").is_file(), "the model no longer gives a shard file"
    assert (root / "s.zarr" / "tensors" / "b" / "c.0").is_file()
    return root


@pytest.fixture
def work(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "w", symlinks=True)
    (tmp_path / "w" / "outside").mkdir()
    return tmp_path / "w"


def _tree(root: Path) -> dict[str, str]:
    """Every path below ``root`` with a digest of its content (what "untouched" means)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _plant(store: Path, rel: str, outside: Path) -> Path:
    """Move ``store/rel`` to ``outside`` and leave a symbolic link to it in its place."""
    src = store / rel
    dst = outside / rel.replace("/", "_")
    shutil.move(src, dst)
    os.symlink(dst, src)
    return src


def _drop_checksums(store: Path) -> None:
    """Remove the checksum records (record files, and the attributes of format-4 groups)."""
    records = sorted((store / "progress").glob("rank_*.json"))
    for record in records:
        doc = json.loads(record.read_text())
        doc.pop("crc32c_blocks", None)
        record.write_text(json.dumps(doc))
    for meta in (store / "progress").glob("rank_*/zarr.json"):
        doc = json.loads(meta.read_text())
        doc["attributes"].pop("crc32c_blocks", None)
        meta.write_text(json.dumps(doc))
        records.append(meta)
    assert records, "the store holds no progress record"


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = cli_main(args)
    got = capsys.readouterr()
    return code, got.err + got.out  # verify reports on stdout


READERS: dict[str, Callable[[Path, Path], list[str]]] = {
    "export": lambda s, w: ["export", str(s), "--out", str(w / "out")],
    "verify": lambda s, w: ["verify", str(s)],
    "info": lambda s, w: ["info", str(s)],
    "load-w": lambda s, w: ["load", str(s), "--param", "w"],
    "load-b": lambda s, w: ["load", str(s), "--param", "b"],
}
PLANTED = ["tensors/w/c.0.0", "tensors/b/c.0", "tensors/b", "tensors/w", "tensors/w/zarr.json"]


@pytest.mark.parametrize("checksums", [True, False], ids=["with-checksums", "checksums-removed"])
@pytest.mark.parametrize("planted", PLANTED)
@pytest.mark.parametrize("command", list(READERS))
def test_link_in_store_is_refused_by_name(work: Path, capsys: pytest.CaptureFixture[str], command: str,
                                          planted: str, checksums: bool) -> None:
    store = work / "s.zarr"
    if not checksums:
        _drop_checksums(store)
    link = _plant(store, planted, work / "outside")
    reads_it = command not in ("load-w", "load-b") or planted.startswith(f"tensors/{command[-1]}")
    code, err = _run(READERS[command](store, work), capsys)
    if not reads_it:  # loading the other parameter never touches this one
        assert code == 0 or (not checksums and "checksum records of source rank" in err), err
        return
    assert code != 0, f"{command} followed the link {planted}"
    # without checksum records the store's own integrity check may refuse it first
    refused_as_damaged = not checksums and "checksum records of source rank" in err
    assert refused_as_damaged or (str(link) in err and "symbolic link" in err), err
    assert not list((work / "out").rglob("*.ckpt")) if (work / "out").exists() else True
    assert not list((work / "out").rglob("*.tmp-zckpt")) if (work / "out").exists() else True


@pytest.mark.parametrize("planted", ["tensors/w/c.0.0", "tensors/b"])
def test_load_api_refuses_a_link(work: Path, planted: str) -> None:
    link = _plant(work / "s.zarr", planted, work / "outside")
    with pytest.raises(ZckptError, match="symbolic link") as info:
        zckpt.load_slice(work / "s.zarr", 0, None, planted.split("/")[1])
    assert str(link) in str(info.value)


def test_linked_progress_folder_is_refused(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The records of which ranks are done (and their checksums) come from inside the store only."""
    link = _plant(work / "s.zarr", "progress", work / "outside")
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(work / "out")], capsys)
    assert code != 0 and str(link) in err, err


def _edit_manifest(store: Path, edit: Callable[[dict[str, object]], None]) -> None:
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    edit(doc["attributes"]["zckpt"])
    meta.write_text(json.dumps(doc))


HOSTILE_KEYS = ["../../outside/tensors_w", "/etc", "tensors/../../outside/tensors_w", "tensors\\w", "tensors/w\x00",
                "tensors//w", "."]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
@pytest.mark.parametrize("command", ["export", "verify", "info", "load-w"])
def test_manifest_key_that_escapes_is_refused(work: Path, capsys: pytest.CaptureFixture[str], key: str,
                                              command: str) -> None:
    store = work / "s.zarr"
    shutil.copytree(store / "tensors" / "w", work / "outside" / "tensors_w")  # what an escape would read

    def edit(m: dict[str, object]) -> None:
        entries = m["entries"]
        assert isinstance(entries, list)
        for e in entries:
            if e["name"] == "w":
                e["key"] = key

    _edit_manifest(store, edit)
    code, err = _run(READERS[command](store, work), capsys)
    assert code != 0, f"{command} accepted the key {key!r}"
    assert "manifest key" in err and "'w'" in err and str(store / "zarr.json") in err, err


@pytest.mark.parametrize("separator", ["/../../../outside/", "..", "\\", "_"])
@pytest.mark.parametrize("command", ["export", "verify", "load-w"])
def test_chunk_key_separator_that_escapes_is_refused(work: Path, capsys: pytest.CaptureFixture[str],
                                                     separator: str, command: str) -> None:
    store = work / "s.zarr"
    meta = store / "tensors" / "w" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["chunk_key_encoding"]["configuration"]["separator"] = separator
    meta.write_text(json.dumps(doc))
    code, err = _run(READERS[command](store, work), capsys)
    assert code != 0, f"{command} accepted the separator {separator!r}"
    assert "separator" in err, err


def _ingest_args(pristine: Path, store: Path) -> list[str]:
    """Ingest from the sources the stores were made from (the ingest's identity names them)."""
    src = pristine / "src"
    return ["ingest", str(src), "--strategy", str(src / "strategy.ckpt"), "--store", str(store)]


def _interrupt(store: Path, rank: int) -> None:
    """The store as an ingest killed before ``rank`` finished leaves it."""
    record = store / "progress" / f"rank_{rank}.json"
    if record.exists():
        record.unlink()
    else:
        shutil.rmtree(store / "progress" / f"rank_{rank}")
    _edit_manifest(store, lambda m: m.update(complete=False))


@pytest.mark.parametrize("planted", ["tensors/w/c.0.0", "tensors/b/c.0", "tensors/w", "tensors"])
def test_resumed_ingest_never_writes_through_a_link(pristine: Path, work: Path, capsys: pytest.CaptureFixture[str],
                                                    planted: str) -> None:
    store = work / "s.zarr"
    _interrupt(store, 0)  # rank 0 holds part of w and all of b: resuming rewrites both
    link = _plant(store, planted, work / "outside")
    target = work / "outside" / planted.replace("/", "_")
    if target.is_file():  # a zckpt writing through would change these bytes
        target.write_bytes(b"\xee" * target.stat().st_size)
    before = _tree(work / "outside")
    code, err = _run(_ingest_args(pristine, store), capsys)
    assert _tree(work / "outside") == before, "ingest wrote outside the store"
    assert code != 0 and str(link) in err and "symbolic link" in err, err


@pytest.mark.parametrize("separator", ["/../../../outside/", "/../../"])
def test_resumed_ingest_never_writes_through_a_hostile_separator(pristine: Path, work: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 separator: str) -> None:
    """Resuming writes where the layout says, never where a store's ``zarr.json`` points."""
    store = work / "s.zarr"
    _interrupt(store, 0)
    for name in ("w", "b"):
        meta = store / "tensors" / name / "zarr.json"
        doc = json.loads(meta.read_text())
        doc["chunk_key_encoding"]["configuration"]["separator"] = separator
        meta.write_text(json.dumps(doc))
    outside = {k: v for k, v in _tree(work).items() if not k.startswith("s.zarr")}
    code, err = _run(_ingest_args(pristine, store), capsys)
    assert {k: v for k, v in _tree(work).items() if not k.startswith("s.zarr")} == outside, err
    assert code != 0 and "separator" in err, err


def test_resumed_ingest_still_works_without_links(pristine: Path, work: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The control for the case above: the same interrupted store resumes and exports right."""
    store = work / "s.zarr"
    _interrupt(store, 0)
    code, err = _run(_ingest_args(pristine, store), capsys)
    assert code == 0, err
    assert cli_main(["export", str(store), "--out", str(work / "out")]) == 0
    with CkptReader(work / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        for t in TENSORS:
            assert r.array(t.name).tobytes() == global_value(t.name, t.shape, t.ms_type).tobytes()


def test_dangling_lock_link_is_refused_and_creates_nothing(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = work / "outside" / "created-by-lock"
    lock = work / "new.zarr.lock"
    os.symlink(victim, lock)
    code, err = _run(["ingest", str(work / "src"), "--strategy", str(work / "src" / "strategy.ckpt"),
                      "--store", str(work / "new.zarr")], capsys)
    assert code != 0 and str(lock) in err and "symbolic link" in err, err
    assert not victim.exists() and not os.path.lexists(victim)


def test_lock_on_a_file_its_holder_removed_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ingest that opened the lock file just before its holder finished (the holder
    unlinks it, then unlocks) would lock a file that no longer has the name, while a third
    ingest locks a new one: both would write. It must see that and take the name again."""
    store, lock = tmp_path / "s.zarr", tmp_path / "s.zarr.lock"
    lock.write_bytes(b"")
    stale = os.open(lock, os.O_RDWR)
    lock.unlink()
    opened: list[object] = []
    real = locks._open

    def first_stale(path: Path, create: bool) -> int | None:
        opened.append(path)
        return stale if len(opened) == 1 else real(path, create)

    monkeypatch.setattr(locks, "_open", first_stale)
    with store_lock(store):
        assert len(opened) == 2 and lock.is_file()
        other = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # the file under the name is the one held
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    assert not lock.exists()


def test_export_refuses_a_linked_rank_folder(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = work / "out"
    out.mkdir()
    (work / "outside" / "rank_0").mkdir()
    os.symlink(work / "outside" / "rank_0", out / "rank_0")
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(out), "--overwrite"], capsys)
    assert code != 0 and str(out / "rank_0") in err and "symbolic link" in err, err
    assert list((work / "outside" / "rank_0").iterdir()) == []


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_transform_refuses_a_linked_rank_folder(work: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    out = work / "out"
    out.mkdir()
    (work / "outside" / "rank_0").mkdir()
    os.symlink(work / "outside" / "rank_0", out / "rank_0")
    code, err = _run(["transform", str(work / "src"), "--src-strategy", str(work / "src" / "strategy.ckpt"),
                      "--out", str(out), "--format", fmt, "--overwrite"], capsys)
    assert code != 0 and str(out / "rank_0") in err and "symbolic link" in err, err
    assert list((work / "outside" / "rank_0").iterdir()) == []


def test_export_safetensors_refuses_a_linked_rank_folder(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = work / "out"
    out.mkdir()
    (work / "outside" / "rank_0").mkdir()
    os.symlink(work / "outside" / "rank_0", out / "rank_0")
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(out), "--format", "safetensors"], capsys)
    assert code != 0 and str(out / "rank_0") in err and "symbolic link" in err, err
    assert list((work / "outside" / "rank_0").iterdir()) == []


def _victim(work: Path) -> Path:
    victim = work / "outside" / "victim"
    victim.write_bytes(b"not zckpt's to write")
    return victim


@pytest.mark.parametrize("overwrite", [False, True])
def test_export_never_writes_through_a_planted_temporary_name(work: Path, capsys: pytest.CaptureFixture[str],
                                                             overwrite: bool) -> None:
    """``<file>.tmp-zckpt`` (the name zckpt used to write to) planted as a link: the writer
    creates its temporary file anew under a name nobody can guess."""
    out = work / "out"
    (out / "rank_0").mkdir(parents=True)
    victim = _victim(work)
    os.symlink(victim, out / "rank_0" / "checkpoint_0.ckpt.tmp-zckpt")
    os.symlink(victim, out / "rank_0" / ".checkpoint_0.ckpt.tmp-zckpt")
    args = ["export", str(work / "s.zarr"), "--out", str(out)] + (["--overwrite"] if overwrite else [])
    code, err = _run(args, capsys)
    assert victim.read_bytes() == b"not zckpt's to write"
    if overwrite:
        assert code == 0, err
        with CkptReader(out / "rank_0" / "checkpoint_0.ckpt") as r:
            assert np.array_equal(r.array("w"), global_value("w", (64, 8), "Float32"))
    else:  # a directory holding foreign entries is refused, as before
        assert code != 0 and "already holds" in err, err


def test_export_replaces_a_planted_final_file_link(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = work / "out"
    (out / "rank_0").mkdir(parents=True)
    victim = _victim(work)
    os.symlink(victim, out / "rank_0" / "checkpoint_0.ckpt")
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert victim.read_bytes() == b"not zckpt's to write"
    assert not (out / "rank_0" / "checkpoint_0.ckpt").is_symlink()


def test_export_refuses_a_linked_marker(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A resumable export reads its marker: a link there is refused by name, not read."""
    out = work / "out"
    assert cli_main(["export", str(work / "s.zarr"), "--out", str(out)]) == 0
    marker = out / ".zckpt-export.json"
    victim = work / "outside" / "marker"
    victim.write_text('{"fingerprint": "a marker outside the directory"}')
    os.symlink(victim, marker)
    before = victim.read_bytes()
    (out / "rank_0" / "checkpoint_0.ckpt").unlink()  # something left to do
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(out)], capsys)
    assert code != 0 and str(marker) in err and "symbolic link" in err, err
    assert victim.read_bytes() == before


@pytest.mark.parametrize("prefix", ["../../x_", "/x_", "a/b", "..\\x_"])
def test_prefix_that_escapes_is_refused(work: Path, capsys: pytest.CaptureFixture[str], prefix: str) -> None:
    before = _tree(work)
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(work / "out"), "--prefix", prefix], capsys)
    assert code != 0 and "prefix" in err, err
    assert {k for k in _tree(work) if k not in before and not k.startswith("out")} == set()


def test_load_distributed_checkpoint_refuses_a_linked_rank_folder(work: Path) -> None:
    out = work / "out"
    out.mkdir()
    (work / "outside" / "rank_0").mkdir()
    os.symlink(work / "outside" / "rank_0", out / "rank_0")
    with pytest.raises(ZckptError, match="symbolic link") as info:
        zckpt.load_distributed_checkpoint(None, format="safetensors", store=str(work / "s.zarr"),
                                          dst_safetensors_dir=str(out))
    assert str(out / "rank_0") in str(info.value)
    assert list((work / "outside" / "rank_0").iterdir()) == []


def test_export_replaces_a_linked_marker_it_does_not_need(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An output directory holding only a marker link: nothing to resume, so the marker is
    not read, and writing it replaces the link instead of writing through it."""
    out = work / "out"
    out.mkdir()
    victim = _victim(work)
    os.symlink(victim, out / ".zckpt-export.json")
    code, err = _run(["export", str(work / "s.zarr"), "--out", str(out)], capsys)
    assert code == 0, err
    assert victim.read_bytes() == b"not zckpt's to write"
    assert not (out / ".zckpt-export.json").is_symlink()


@pytest.mark.parametrize("command", ["export", "verify", "load-b"])
def test_fifo_in_store_is_refused_without_waiting(work: Path, command: str) -> None:
    """A FIFO planted as a chunk file would block a reader until some writer appears."""
    import subprocess
    import sys

    chunk = work / "s.zarr" / "tensors" / "b" / "c.0"
    chunk.unlink()
    os.mkfifo(chunk)
    proc = subprocess.run([sys.executable, "-m", "zckpt.cli", *READERS[command](work / "s.zarr", work)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(zckpt.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode != 0 and str(chunk) in proc.stderr + proc.stdout, proc.stderr + proc.stdout
