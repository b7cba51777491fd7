"""Segmented checkpoints (several part files per rank) and single-slice reads from a store.

The partial-read tests make the bytes that must not be read *unreadable*: a subprocess
maps the part files with every other tensor's payload pages protected (``mprotect``,
``PROT_NONE``), so touching them kills it with SIGSEGV; a control run touches one on
purpose to prove the guard works. Store reads are counted at Zarr's ``LocalStore``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from mindspore_env import require_ms_python, run_ms_tool
from zarr.storage import LocalStore

import zckpt
from zckpt.cli.main import main
from zckpt.core.errors import LayoutError, SourceError, StoreError, UsageError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import value_header
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.ingest import IngestOptions
from zckpt.jobs.segmented import (
    LoadedCheckpoint,
    SegmentedCheckpoint,
    list_part_files,
    load_segmented_checkpoints,
    load_slice,
    open_segmented,
    part_order_key,
    read_slice,
)

Entry = tuple[str, str, Any]  # (name, ms_type or "str", value)


def bf16(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_part(path: Path, entries: Sequence[Entry]) -> Path:
    with CkptWriter(path, fsync=False) as w:
        for name, ms_type, value in entries:
            if ms_type == "str":
                w.write_string(name, value)
            else:
                w.write_array(name, ms_type, np.asarray(value))
    return path


RNG = np.random.default_rng(11)
LAYER1 = RNG.standard_normal((8, 6)).astype(np.float32)
MOM1 = RNG.standard_normal((8, 6)).astype(np.float32)
EMB = bf16(RNG.standard_normal((5, 4)))
LAYER2 = RNG.standard_normal((6, 6)).astype(np.float16)
BIAS2 = RNG.standard_normal(6).astype(np.float32)
TABLE = np.arange(12, dtype=np.int32).reshape(3, 4)
MASK = np.array([[True, False], [False, True]])
LR = np.array(0.01, dtype=np.float32)
STEP = np.array([42], dtype=np.int32)

SHARED: list[Entry] = [("learning_rate", "Float32", LR), ("global_step", "Int32", STEP), ("epoch_num", "str", "3")]
PART0: list[Entry] = [("layer1.weight", "Float32", LAYER1), ("moments.layer1.weight", "Float32", MOM1),
                      ("embedding.table", "BFloat16", EMB), *SHARED]
PART1: list[Entry] = [("layer2.weight", "Float16", LAYER2), ("layer2.bias", "Float32", BIAS2),
                      ("step_table", "Int32", TABLE), ("mask", "Bool", MASK), *SHARED]


def two_parts(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    write_part(d / "checkpoint_0_part0.ckpt", PART0)
    write_part(d / "checkpoint_0_part1.ckpt", PART1)
    return d


def expected_values() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, _, value in PART0 + PART1:
        out.setdefault(name, value)
    return out


# --------------------------------------------------------------------------- eager load


def test_load_merges_every_part(tmp_path: Path) -> None:
    d = two_parts(tmp_path / "rank_0")
    got = zckpt.load_segmented_checkpoints(str(d))
    assert isinstance(got, LoadedCheckpoint) and isinstance(got, dict)
    want = expected_values()
    assert list(got) == list(want)  # first appearance, walking the parts in order
    for name, value in want.items():
        if isinstance(value, str):
            assert got[name] == value
        else:
            arr = got[name]
            assert isinstance(arr, np.ndarray)
            bits = arr.view(np.uint16) if got.ms_types[name] == "BFloat16" else arr  # expected: bf16 bits
            assert bits.dtype == np.asarray(value).dtype and arr.shape == np.asarray(value).shape, name
            assert np.array_equal(bits, value), name
    # bf16 is handed out as ml_dtypes.bfloat16, never as its uint16 bits
    assert got.ms_types["embedding.table"] == "BFloat16" and got["embedding.table"].dtype == ml_dtypes.bfloat16
    assert got.ms_types["epoch_num"] == "str" and got.ms_types["mask"] == "Bool"


def test_loaded_values_own_their_memory(tmp_path: Path) -> None:
    """Like MindSpore's Parameters, the eager values survive the files being rewritten."""
    d = two_parts(tmp_path / "rank_0")
    got = load_segmented_checkpoints(d)
    arr = got["layer1.weight"]
    assert isinstance(arr, np.ndarray) and arr.flags.writeable and arr.flags.owndata
    write_part(d / "checkpoint_0_part0.ckpt", [(n, t, np.zeros_like(v) if t != "str" else v) for n, t, v in PART0])
    assert np.array_equal(arr, LAYER1)


def test_parts_are_ordered_by_part_number(tmp_path: Path) -> None:
    d = tmp_path / "rank_0"
    d.mkdir()
    for name in ["ckpt_part10.ckpt", "ckpt_part2.ckpt", "ckpt_part0.ckpt", "ckpt.ckpt", "a_part1.ckpt"]:
        write_part(d / name, [(f"w.{name}", "Float32", np.zeros(2, np.float32)), ("tag", "str", name)])
    (d / ".hidden.ckpt").write_bytes(b"garbage")  # glob skips hidden names; so does zckpt
    (d / "notes.txt").write_text("not a checkpoint")
    order = [p.name for p in list_part_files(d)]
    assert order == ["ckpt.ckpt", "ckpt_part0.ckpt", "a_part1.ckpt", "ckpt_part2.ckpt", "ckpt_part10.ckpt"]
    got = load_segmented_checkpoints(d)
    assert [k for k in got if k.startswith("w.")] == [f"w.{n}" for n in order]
    assert got["tag"] == "ckpt.ckpt"  # strings: the lowest part wins
    assert part_order_key("x_part3_part12.ckpt") > part_order_key("x_part3_part4.ckpt")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"specify_prefix": "layer"}, ["layer1.weight", "layer2.weight", "layer2.bias"]),
        ({"specify_prefix": ["moments.", "mask"]}, ["moments.layer1.weight", "mask"]),
        ({"filter_prefix": ("layer", "moments", "step")},
         ["embedding.table", "learning_rate", "global_step", "epoch_num", "mask"]),
        ({"specify_prefix": "layer", "filter_prefix": "layer2.b"}, ["layer1.weight", "layer2.weight"]),
        ({"choice_func": lambda n: n.endswith("weight")}, ["layer1.weight", "moments.layer1.weight", "layer2.weight"]),
        # MindSpore: either prefix argument overrides choice_func
        ({"filter_prefix": "layer", "choice_func": lambda n: False},
         ["moments.layer1.weight", "embedding.table", "learning_rate", "global_step", "epoch_num", "step_table",
          "mask"]),
    ],
)
def test_prefix_filters_and_choice_func(tmp_path: Path, kwargs: dict[str, Any], expected: list[str]) -> None:
    got = load_segmented_checkpoints(two_parts(tmp_path / "r"), **kwargs)
    assert list(got) == expected


def test_argument_errors(tmp_path: Path) -> None:
    d = two_parts(tmp_path / "r")
    with pytest.raises(TypeError, match="specify_prefix"):
        load_segmented_checkpoints(d, specify_prefix=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index 1"):
        load_segmented_checkpoints(d, filter_prefix=["a", 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="can't be empty"):
        load_segmented_checkpoints(d, filter_prefix=[])
    with pytest.raises(ValueError, match="can't include ''"):
        load_segmented_checkpoints(d, specify_prefix=("a", ""))
    with pytest.raises(UsageError, match="empty after filter"):
        load_segmented_checkpoints(d, specify_prefix="nothing.")
    if importlib.util.find_spec("mindspore") is None:
        with pytest.raises(UsageError, match="needs MindSpore installed"):
            load_segmented_checkpoints(d, net=object())
    with pytest.raises(UsageError, match="dec_key"):
        load_segmented_checkpoints(d, dec_key=b"0123456789abcdef")
    with pytest.raises(TypeError, match="dec_key"):
        load_segmented_checkpoints(d, dec_key="key")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="choice_func"):
        load_segmented_checkpoints(d, choice_func="layer")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ckpt_file_dir"):
        load_segmented_checkpoints(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a directory"):
        load_segmented_checkpoints(d / "checkpoint_0_part0.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no .ckpt files"):
        load_segmented_checkpoints(tmp_path / "empty")


# --------------------------------------------------------------------------- duplicates


def test_identical_duplicates_are_fine_and_reported(tmp_path: Path) -> None:
    d = two_parts(tmp_path / "r")
    with open_segmented(d) as seg:
        dup = seg.duplicates
        assert set(dup) == {"learning_rate", "global_step", "epoch_num"}
        assert [p.name for p in dup["global_step"]] == ["checkpoint_0_part0.ckpt", "checkpoint_0_part1.ckpt"]
        assert seg.file_of("global_step").name == "checkpoint_0_part0.ckpt"
        assert seg.file_of("mask").name == "checkpoint_0_part1.ckpt"


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (("global_step", "Int32", np.array([43], np.int32)), "different values"),
        (("learning_rate", "Float64", np.array(0.01)), r"Float32\[\] but .* holds Float64\[\]"),
        (("global_step", "Int32", np.array([42, 42], np.int32)), r"Int32\[1\] but .* holds Int32\[2\]"),
        (("learning_rate", "str", "0.01"), "is a tensor in .* but a str in"),
    ],
)
def test_conflicting_duplicates_name_both_files(tmp_path: Path, other: Entry, match: str) -> None:
    d = tmp_path / "r"
    d.mkdir()
    a = write_part(d / "checkpoint_0_part0.ckpt", PART0)
    b = write_part(d / "checkpoint_0_part1.ckpt", [e for e in PART1 if e[0] != other[0]] + [other])
    with pytest.raises(SourceError, match=match) as err:
        load_segmented_checkpoints(d)
    assert str(a) in str(err.value) and str(b) in str(err.value)
    assert err.value.param == other[0]
    # the conflicting entry left out by the filter is never compared
    got = load_segmented_checkpoints(d, filter_prefix=other[0])
    assert other[0] not in got


def test_conflicting_strings_keep_the_lowest_part(tmp_path: Path) -> None:
    d = tmp_path / "r"
    d.mkdir()
    write_part(d / "checkpoint_0_part1.ckpt", [("epoch_num", "str", "second")])
    write_part(d / "checkpoint_0_part0.ckpt", [("epoch_num", "str", "first")])
    assert load_segmented_checkpoints(d)["epoch_num"] == "first"


# --------------------------------------------------------------------------- lazy mapping


def test_open_segmented_is_a_lazy_mapping_of_views(tmp_path: Path) -> None:
    d = two_parts(tmp_path / "r")
    with zckpt.open_segmented(d) as seg:
        assert isinstance(seg, SegmentedCheckpoint)
        assert seg.names == tuple(expected_values()) and len(seg) == len(expected_values())
        assert seg.dtype("embedding.table") == "BFloat16" and seg.shape("embedding.table") == (5, 4)
        assert seg.dtype("epoch_num") == "str" and seg.kind("epoch_num") == "str" and seg.shape("epoch_num") == ()
        assert seg.shape("learning_rate") == () and seg.nbytes("layer1.weight") == LAYER1.nbytes
        assert "mask" in seg and "absent" not in seg
        with pytest.raises(KeyError):
            seg["absent"]
        view = seg["layer1.weight"]
        assert isinstance(view, np.ndarray) and not view.flags.writeable
        assert np.array_equal(view, LAYER1)
        # a view of the mapped file, not a copy: rewriting the bytes in place shows through
        with CkptReader(d / "checkpoint_0_part0.ckpt") as r:
            seg0 = r.entries["layer1.weight"].segments[0]
        with open(d / "checkpoint_0_part0.ckpt", "r+b") as f:
            f.seek(seg0.offset)
            f.write(np.full(LAYER1.shape, 7.0, np.float32).tobytes())
        assert np.all(view == 7.0)
        assert np.all(seg["layer1.weight"] == 7.0)
        assert "2 part file(s), 10 entries" in repr(seg)
    assert np.all(view == 7.0)  # views outlive close()
    with pytest.raises(UsageError, match="closed"):
        seg["layer1.weight"]
    assert "closed" in repr(seg)


def test_tensor_split_over_several_values(tmp_path: Path) -> None:
    data = np.arange(24, dtype=np.float32).reshape(6, 4)
    head, tail = data[:4].tobytes(), data[4:].tobytes()
    d = tmp_path / "r"
    d.mkdir()
    (d / "big_part0.ckpt").write_bytes(value_header("big", "Float32", [6, 4], len(head)) + head
                                       + value_header("big", "Float32", [6, 4], len(tail)) + tail)
    write_part(d / "big_part1.ckpt", [("big", "Float32", data)])  # same tensor, one Value: identical
    with open_segmented(d) as seg:
        assert np.array_equal(seg["big"], data)
    assert np.array_equal(load_segmented_checkpoints(d)["big"], data)


def test_crc_is_checked_only_on_request(tmp_path: Path) -> None:
    d = tmp_path / "r"
    d.mkdir()
    p = d / "c_part0.ckpt"
    with CkptWriter(p, crc=True, fsync=False) as w:
        w.write_array("w", "Float32", np.ones(4, np.float32))
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1  # damage the trailer: reading it needs the whole file, which lazy opening avoids
    p.write_bytes(bytes(raw))
    with open_segmented(d) as seg:
        assert np.array_equal(seg["w"], np.ones(4, np.float32))
    with pytest.raises(ValueError, match="crc_num"):
        open_segmented(d, verify_crc=True)


def test_select_leaves_entries_out(tmp_path: Path) -> None:
    d = two_parts(tmp_path / "r")
    with open_segmented(d, select=lambda n: n.startswith("layer2")) as seg:
        assert seg.names == ("layer2.weight", "layer2.bias")
    with pytest.raises(TypeError):
        open_segmented(1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- nothing else is read

_GUARD = r"""
import ctypes, hashlib, json, mmap, os, sys
import numpy as np
from zckpt.formats import ckpt_index as ckpt_module
from zckpt.jobs.segmented import load_segmented_checkpoints, open_segmented

mode, directory, target, guard_json = sys.argv[1:5]
guard = {os.path.realpath(k): v for k, v in json.loads(guard_json).items()}
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
real_mmap = mmap.mmap
protected = [0]

def guarded_mmap(fileno, length, *args, **kwargs):
    m = real_mmap(fileno, length, *args, **kwargs)
    path = os.path.realpath(os.readlink(f"/proc/self/fd/{fileno}"))
    view = np.frombuffer(m, np.uint8)
    base = view.ctypes.data
    del view
    for offset, size in guard.get(path, []):
        lo = -(-(base + offset) // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (base + offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            if libc.mprotect(ctypes.c_void_p(lo), hi - lo, 0) != 0:  # PROT_NONE
                raise OSError(ctypes.get_errno(), "mprotect failed")
            protected[0] += hi - lo
    return m

ckpt_module.mmap.mmap = guarded_mmap

def digest(value):
    return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()

if mode == "eager":
    got = load_segmented_checkpoints(directory, specify_prefix=target)
    out = {"names": list(got), "sha": digest(got[target])}
else:
    with open_segmented(directory) as seg:
        meta = {n: [seg.dtype(n), list(seg.shape(n))] for n in seg}
        out = {"names": list(meta), "meta": meta, "sha": digest(seg[target])}
out["protected"] = protected[0]
print(json.dumps(out))
"""

BIG = 64 * 1024  # elements: 256 KiB of float32, many pages whatever the page size


def _guarded_dir(d: Path) -> tuple[dict[str, list[list[int]]], np.ndarray]:
    """Two parts with big tensors; the guard protects every payload except ``wanted.weight``'s."""
    rng = np.random.default_rng(3)
    wanted = rng.standard_normal((16, 2048)).astype(np.float32)
    d.mkdir(parents=True)
    write_part(d / "ckpt_part0.ckpt", [("big.a", "Float32", rng.standard_normal(BIG).astype(np.float32)), *SHARED,
                                       ("big.b", "Int64", np.arange(BIG, dtype=np.int64))])
    write_part(d / "ckpt_part1.ckpt", [("big.c", "Float32", np.ones(BIG, np.float32)),
                                       ("wanted.weight", "Float32", wanted), *SHARED,
                                       ("big.d", "Float16", np.zeros((BIG,), np.float16))])
    guard: dict[str, list[list[int]]] = {}
    for p in sorted(d.glob("*.ckpt")):
        with CkptReader(p) as r:
            guard[str(p)] = [[s.offset, s.length] for e in r.entries.values() if e.name != "wanted.weight"
                             for s in e.segments if s.length >= 2 * mmap.PAGESIZE]
    assert sum(len(v) for v in guard.values()) == 4
    return guard, wanted


def _run_guarded(
    mode: str, d: Path, target: str, guard: dict[str, list[list[int]]]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _GUARD, mode, str(d), target, json.dumps(guard)],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses mprotect and /proc/self/fd")
def test_reading_one_parameter_touches_no_other_payload(tmp_path: Path) -> None:
    guard, wanted = _guarded_dir(tmp_path / "r")
    sha = hashlib.sha256(wanted.tobytes()).hexdigest()
    lazy = _run_guarded("lazy", tmp_path / "r", "wanted.weight", guard)
    assert lazy.returncode == 0, lazy.stderr
    doc = json.loads(lazy.stdout)
    assert doc["protected"] >= 4 * 200 * 1024  # the guard was in place
    assert doc["sha"] == sha
    assert doc["meta"]["big.b"] == ["Int64", [BIG]]  # metadata of guarded tensors needs no payload
    eager = _run_guarded("eager", tmp_path / "r", "wanted.weight", guard)
    assert eager.returncode == 0, eager.stderr
    assert json.loads(eager.stdout)["names"] == ["wanted.weight"]
    assert json.loads(eager.stdout)["sha"] == sha
    # control: reading a guarded tensor does kill the process, so the runs above prove something
    touch = _run_guarded("lazy", tmp_path / "r", "big.c", guard)
    assert touch.returncode == -signal.SIGSEGV, (touch.returncode, touch.stdout, touch.stderr[-500:])


# --------------------------------------------------------------------------- store slices


@pytest.fixture
def small_store(tmp_path: Path) -> tuple[Path, Path]:
    """A store of a 1-rank model with 1 KiB chunks (rows of 4) and a 4-rank destination strategy."""
    tensors = [TensorDef("w", (64, 64), "Float32"), TensorDef("emb", (16, 8), "BFloat16"),
               TensorDef("b", (64,), "Float16")]
    write_model(tmp_path / "src", tensors, device_num=1, strategy_format=None, strings={"epoch_num": "2"})
    store = tmp_path / "store.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, None, IngestOptions(chunk_bytes=1024, checksum_block_bytes=1024))
    dst = StrategyMap(layouts={"w": {0: make_layout((4,), [[0], []])}, "emb": {0: make_layout((2, 2), [[1], [0]])}})
    (tmp_path / "dst.ckpt").write_bytes(encode_strategy(dst))
    return store, tmp_path / "dst.ckpt"


def _count_store_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    reads: list[tuple[str, int]] = []
    get, partial = LocalStore.get, LocalStore.get_partial_values

    async def counting_get(self: LocalStore, key: str, *args: Any, **kwargs: Any) -> Any:
        buf = await get(self, key, *args, **kwargs)
        if buf is not None:
            reads.append((key, len(buf)))
        return buf

    async def counting_partial(self: LocalStore, prototype: Any, key_ranges: Any) -> Any:
        key_ranges = list(key_ranges)
        bufs = await partial(self, prototype, key_ranges)
        reads.extend((k, len(b)) for (k, _), b in zip(key_ranges, bufs, strict=True) if b is not None)
        return bufs

    monkeypatch.setattr(LocalStore, "get", counting_get)
    monkeypatch.setattr(LocalStore, "get_partial_values", counting_partial)
    return reads


def test_load_slice_values(small_store: tuple[Path, Path]) -> None:
    store, dst = small_store
    w = global_value("w", (64, 64), "Float32")
    emb = global_value("emb", (16, 8), "BFloat16")
    for r in range(4):
        assert np.array_equal(zckpt.load_slice(store, r, str(dst), "w"), w[16 * r : 16 * r + 16])
        got = load_slice(store, r, dst, "emb")
        assert got.dtype == ml_dtypes.bfloat16
        assert np.array_equal(got.view(np.uint16), emb[8 * (r // 2) : 8 * (r // 2) + 8, 4 * (r % 2) : 4 * (r % 2) + 4])
        assert np.array_equal(load_slice(store, r, dst, "b"), global_value("b", (64,), "Float16"))  # unlisted: whole
    assert np.array_equal(load_slice(store, 0, None, "w"), w)
    assert load_slice(store, 0, None, "learning_rate").shape == ()
    s = read_slice(store, 3, dst, "w")
    assert s.box.to_json() == [[48, 0], [64, 64]] and s.global_shape == (64, 64) and s.ms_type == "Float32"


def _count_file_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(fd, bytes)`` of every positioned read (how zckpt reads raw chunk files and checks them)."""
    reads: list[tuple[int, int]] = []
    preadv, pread = os.preadv, os.pread

    def counting_preadv(fd: int, buffers: Any, offset: int) -> int:
        n = preadv(fd, buffers, offset)
        reads.append((fd, n))
        return n

    def counting_pread(fd: int, length: int, offset: int) -> bytes:
        data = pread(fd, length, offset)
        reads.append((fd, len(data)))
        return data

    monkeypatch.setattr(os, "preadv", counting_preadv)
    monkeypatch.setattr(os, "pread", counting_pread)
    return reads


def test_load_slice_reads_only_the_slice_chunks(
    small_store: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """load reads the slice's bytes of the shard, and checks them as export does: the
    checksum blocks they touch (1 KiB here), at most one block beyond each end."""
    store, dst = small_store
    reads = _count_file_reads(monkeypatch)
    zarr_reads = _count_store_reads(monkeypatch)
    got = load_slice(store, 2, dst, "w")
    assert got.nbytes == 16 * 64 * 4
    assert not [k for k, _ in zarr_reads if "/c." in k]  # raw shard reads, not through zarr
    total = sum(n for _, n in reads)
    assert got.nbytes <= total <= got.nbytes + 2 * 1024, total
    reads.clear()
    load_slice(store, 0, None, "w")
    assert sum(n for _, n in reads) == 64 * 64 * 4


def test_load_slice_refusals(small_store: tuple[Path, Path], tmp_path: Path) -> None:
    store, dst = small_store
    with pytest.raises(StoreError, match="no such entry"):
        load_slice(store, 0, dst, "absent")
    with pytest.raises(UsageError, match="string entry"):
        load_slice(store, 0, dst, "epoch_num")
    with pytest.raises(LayoutError, match="outside"):
        load_slice(store, 4, dst, "w")
    with pytest.raises(TypeError, match="rank"):
        load_slice(store, "1", dst, "w")  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="not a zarr store"):
        load_slice(tmp_path, 0, dst, "w")
    two_stages = StrategyMap(layouts={"w": {1: make_layout((2,), [[0], []])}, "b": {0: make_layout((2,), [[0]])}})
    with pytest.raises(UsageError, match=r"rank 0 holds no slice .* stage\(s\) \[1\]"):
        load_slice(store, 0, two_stages, "w")


def test_cli_load(small_store: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, dst = small_store
    out = tmp_path / "out" / "emb.npy"
    assert main(["load", str(store), "--rank", "3", "--strategy", str(dst), "--param", "emb", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "emb: BFloat16 (stored as uint16), shape [8, 4] of global [16, 8], box [[8, 4], [16, 8]]" in text
    assert np.array_equal(np.load(out), load_slice(store, 3, dst, "emb").view(np.uint16))  # .npy: the bits
    assert main(["load", str(store), "--strategy", str(dst), "--param", "w", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    w0 = global_value("w", (64, 64), "Float32")[:16]
    assert doc["shape"] == [16, 64] and doc["rank"] == 0
    assert doc["min"] == pytest.approx(float(w0.min())) and doc["max"] == pytest.approx(float(w0.max()))
    assert main(["load", str(store), "--param", "absent"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'absent'" in err and "no such entry" in err


# --------------------------------------------------------------------------- MindSpore itself


def _describe(got: dict[str, Any], types: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in got.items():
        if isinstance(v, str):
            out[name] = {"kind": "str", "value": v}
        else:
            raw = np.ascontiguousarray(v).view(np.uint8).tobytes() if v.size else b""
            out[name] = {"kind": "tensor", "dtype": types[name], "shape": list(v.shape),
                         "sha256": hashlib.sha256(raw).hexdigest()}
    return out


@pytest.mark.mindspore
def test_mindspore_loads_the_same_segmented_checkpoint(tmp_path: Path) -> None:
    require_ms_python()
    d = two_parts(tmp_path / "rank_0")
    cases: list[dict[str, Any]] = [
        {"dir": str(d)},
        {"dir": str(d), "filter_prefix": ["moments.", "step"]},
        {"dir": str(d), "specify_prefix": "layer"},
        {"dir": str(d), "specify_prefix": "layer1"},  # only part0 has a match: MindSpore refuses, zckpt does not
    ]
    (tmp_path / "job.json").write_text(json.dumps(cases), encoding="utf-8")
    res = run_ms_tool("ms_segmented_load.py", str(tmp_path / "job.json"))
    filters: list[Callable[..., LoadedCheckpoint]] = [
        lambda: load_segmented_checkpoints(str(d)),
        lambda: load_segmented_checkpoints(str(d), filter_prefix=["moments.", "step"]),
        lambda: load_segmented_checkpoints(str(d), specify_prefix="layer"),
    ]
    for case, make, got in zip(cases, filters, res, strict=False):
        assert "error" not in got, (case, got)
        ours = make()
        assert _describe(ours, ours.ms_types) == got["entries"], case
        assert len(got["entries"]) >= 3
    assert "empty after filter" in res[3]["error"]
    assert list(load_segmented_checkpoints(str(d), specify_prefix="layer1")) == ["layer1.weight"]
