"""Durability: every finished output is synced before it gets its name, and its directory after.

A file gets its final name atomically, by a rename (or, written unnamed, by a link straight
to that name: :meth:`zckpt.io.new_files.NewFile.publish`), but that is not durable: after a
power cut the new name may be gone (its directory was never synced), or present with a file
whose bytes never reached the disk (the file was never synced). This test records the real
``fsync`` and ``rename`` system calls and the final links (paths read back from
``/proc/self/fd``) while zckpt writes each kind of output, and fails when any of those syncs
is removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zckpt.cli.main import main as cli_main
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.io import fileio, new_files
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"

Event = tuple[str, str, str]


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Event]]:
    """``("fsync", path, inode)``, ``("rename", inode, dst)`` (a rename, or an unnamed file
    linked to its final name) and ``("unlink", path, "")`` in the order they happen (files are
    told by inode: a new file may have no name when synced)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name synced descriptors")
    events: list[Event] = []
    real_fsync, real_replace, real_rename, real_unlink = os.fsync, os.replace, os.rename, os.unlink

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), str(os.fstat(fd).st_ino)))
        real_fsync(fd)

    def wrap(real: Callable[..., None]) -> Callable[..., None]:
        def move(src: str | os.PathLike[str], dst: str | os.PathLike[str], *a: object, **k: object) -> None:
            real(src, dst, *a, **k)
            events.append(("rename", str(os.stat(dst).st_ino), os.path.realpath(dst)))
        return move

    def unlink(path: str | os.PathLike[str], *a: object, **k: object) -> None:
        where = os.path.realpath(path)
        real_unlink(path, *a, **k)  # type: ignore[arg-type]
        events.append(("unlink", where, ""))

    real_link_final = new_files.NewFile._link_final

    def link_final(self: new_files.NewFile) -> bool:
        linked = real_link_final(self)
        if linked:
            events.append(("rename", str(os.stat(self.path).st_ino), os.path.realpath(self.path)))
        return linked

    monkeypatch.setattr(new_files.NewFile, "_link_final", link_final)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", wrap(real_replace))
    monkeypatch.setattr(os, "rename", wrap(real_rename))
    monkeypatch.setattr(os, "unlink", unlink)
    yield events


def assert_durable(events: list[Event], final: Path) -> None:
    """``final`` was synced before it got its name (renamed, or linked), then its directory synced."""
    final = Path(os.path.realpath(final))
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final)]
    assert renames, f"{final} was not published by a rename or a link to its final name"
    at = renames[-1]
    inode = events[at][1]
    assert any(e[0] == "fsync" and e[2] == inode for e in events[:at]), \
        f"{final}: its bytes were not synced before the rename"
    assert _dir_synced(events[at + 1:], final.parent), f"{final}: its directory was not synced after the rename"


def _dir_synced(events: list[Event], folder: Path) -> bool:
    return any(e[:2] == ("fsync", str(folder)) or e[0] == "syncfs" for e in events)


@pytest.fixture
def syncfs(syscalls: list[Event], monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """:func:`syscalls`, with each sync of a whole filesystem (``syncfs``, which covers every
    file and folder on it) recorded as ``("syncfs", "", "")``."""
    real = fileio.sync_filesystem

    def sync_filesystem(fd: int, *, close: bool = False) -> bool:
        synced = real(fd, close=close)
        if synced:
            syscalls.append(("syncfs", "", ""))
        return synced

    monkeypatch.setattr(fileio, "sync_filesystem", sync_filesystem)
    return syscalls


def assert_durable_together(events: list[Event], final: Path) -> None:
    """As :func:`assert_durable`, a sync of the whole filesystem standing for the file's and
    the directory's."""
    final = Path(os.path.realpath(final))
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final)]
    assert renames, f"{final} was not published by a rename or a link to its final name"
    at = renames[-1]
    assert any(e[0] == "syncfs" or (e[0] == "fsync" and e[2] == events[at][1]) for e in events[:at]), \
        f"{final}: its bytes were not synced before the rename"
    assert _dir_synced(events[at + 1:], final.parent), f"{final}: its directory was not synced after the rename"


@pytest.mark.parametrize("command", ["transform", "export"])
def test_a_group_of_files_published_together_is_durable(tmp_path: Path, syncfs: list[Event], command: str) -> None:
    """2 ranks -> 40 ranks of 2-row slabs: written source-major as one group and published
    together (one filesystem sync before the names, one after), still each file synced before
    its name and its directory after."""
    model = write_model(tmp_path / "src", [TensorDef(f"w{i}", (80, 16), "Float32", make_layout([2], [0, -1]))
                                           for i in range(3)], device_num=2, scalars=False)
    dst = StrategyMap(layouts={t.name: {0: make_layout([40], [0, -1])} for t in model.tensors})
    (tmp_path / "dst.ckpt").write_bytes(encode_strategy(dst))
    out = tmp_path / "out"
    if command == "transform":
        args = ["transform", str(model.root), "--src-strategy", str(model.strategy_path)]
    else:
        assert cli_main(["ingest", str(model.root), "--strategy", str(model.strategy_path), "--store",
                         str(tmp_path / "s.zarr"), "--quiet"]) == 0
        args = ["export", str(tmp_path / "s.zarr")]
    syncfs.clear()
    assert cli_main([*args, "--dst-strategy" if command == "transform" else "--strategy", str(tmp_path / "dst.ckpt"),
                     "--out", str(out), "--quiet"]) == 0
    files = sorted(out.glob("rank_*/*.ckpt"))
    assert len(files) == 40 >= fileio.BATCH
    assert ("syncfs", "", "") in syncfs, "the group was not published together"
    for f in files:
        assert_durable_together(syncfs, f)


def test_ckpt_export_files_are_durable(tmp_path: Path, syscalls: list[Event]) -> None:
    store, out = tmp_path / "s.zarr", tmp_path / "out"
    assert cli_main(["ingest", str(EXAMPLE / "src/checkpoints"), "--strategy", str(EXAMPLE / "src/strategy.ckpt"),
                     "--store", str(store), "--quiet"]) == 0
    syscalls.clear()
    assert cli_main(["export", str(store), "--strategy", str(EXAMPLE / "dst/strategy.ckpt"), "--out", str(out),
                     "--quiet"]) == 0
    files = sorted(out.glob("rank_*/*.ckpt"))
    assert len(files) == 4
    for f in files:
        assert_durable(syscalls, f)
    marker = str((out / ".zckpt-export.json").resolve())
    assert any(e == ("rename", e[1], marker) for e in syscalls), "the export never wrote its marker"
    removed = [i for i, e in enumerate(syscalls) if e == ("unlink", marker, "")]
    assert removed and not (out / ".zckpt-export.json").exists(), "the marker was left in the output directory"
    assert _dir_synced(syscalls[removed[-1] + 1:], out.resolve()), "the marker's removal was not synced"


def test_transform_files_are_durable(tmp_path: Path, syscalls: list[Event]) -> None:
    """The direct path syncs its files on a publishing thread while it writes the next one,
    and the directories once at the end: still each file before its rename, each directory
    after, and the output directory that received the new rank directories."""
    out = tmp_path / "out"
    assert cli_main(["transform", str(EXAMPLE / "src/checkpoints"), "--src-strategy",
                     str(EXAMPLE / "src/strategy.ckpt"), "--dst-strategy", str(EXAMPLE / "dst/strategy.ckpt"),
                     "--out", str(out), "--quiet"]) == 0
    files = sorted(out.glob("rank_*/*.ckpt"))
    assert len(files) == 4
    for f in files:
        assert_durable(syscalls, f)
    assert _dir_synced(syscalls, out.resolve()), "the new rank directories' entries were not synced"


def test_safetensors_export_files_are_durable(tmp_path: Path, syscalls: list[Event]) -> None:
    store, out = tmp_path / "s.zarr", tmp_path / "out"
    assert cli_main(["ingest", str(EXAMPLE / "src/checkpoints"), "--strategy", str(EXAMPLE / "src/strategy.ckpt"),
                     "--store", str(store), "--quiet"]) == 0
    syscalls.clear()
    assert cli_main(["export", str(store), "--out", str(out), "--format", "safetensors", "--max-file-mb", "0",
                     "--quiet"]) == 0
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != ".zckpt-export.json")
    assert files
    for f in files:
        assert_durable(syscalls, f)


def test_merged_strategy_is_durable(tmp_path: Path, syscalls: list[Event]) -> None:
    src = tmp_path / "strategies"
    src.mkdir()
    (src / "strategy_0.ckpt").write_bytes((EXAMPLE / "src/strategy.ckpt").read_bytes())
    out = tmp_path / "merged.ckpt"
    assert cli_main(["merge-strategies", str(src), str(out)]) == 0
    assert_durable(syscalls, out)


def test_a_missing_directory_sync_is_caught(tmp_path: Path, syscalls: list[Event]) -> None:
    """The check itself can fail: a rename with a synced file but no directory sync."""
    tmp, final = tmp_path / "a.tmp", tmp_path / "a"
    with open(tmp, "wb") as f:
        f.write(b"x")
        os.fsync(f.fileno())
    os.replace(tmp, final)
    with pytest.raises(AssertionError, match="directory was not synced"):
        assert_durable(syscalls, final)
