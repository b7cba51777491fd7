"""Bit-for-bit comparison of checkpoint files/directories (used by end-to-end tests)."""

from __future__ import annotations

from pathlib import Path

from zckpt.formats.ckpt import CkptReader


def entry_digest(reader: CkptReader, name: str) -> tuple[str, str, tuple[int, ...], bytes]:
    e = reader.entries[name]
    if e.kind == "str":
        return (e.kind, e.ms_type, (), reader.string(name).encode())
    if e.kind == "map":
        return (e.kind, e.ms_type, (), reader.map_bytes(name))
    return (e.kind, e.ms_type, e.shape, reader.array(name).tobytes())


def diff_files(expected: Path, got: Path) -> list[str]:
    """Every difference (entry names and order, dtype, shape, bytes); empty when identical."""
    problems: list[str] = []
    with CkptReader(expected) as e, CkptReader(got) as g:
        if list(e.entries) != list(g.entries):
            problems.append(f"{got}: entries {list(g.entries)} != expected {list(e.entries)}")
        for name in e.entries:
            if name not in g.entries:
                continue
            a, b = entry_digest(e, name), entry_digest(g, name)
            if a[:3] != b[:3]:
                problems.append(f"{got}: {name}: {b[:3]} != expected {a[:3]}")
            elif a[3] != b[3]:
                problems.append(f"{got}: {name}: bytes differ")
    return problems


def diff_dirs(expected_dir: Path, got_dir: Path, prefix: str = "checkpoint_") -> list[str]:
    problems: list[str] = []
    exp_ranks = sorted(p for p in expected_dir.iterdir() if p.name.startswith("rank_"))
    got_ranks = sorted(p.name for p in got_dir.iterdir() if p.name.startswith("rank_"))
    if [p.name for p in exp_ranks] != got_ranks:
        problems.append(f"rank directories {got_ranks} != expected {[p.name for p in exp_ranks]}")
    for rd in exp_ranks:
        rank = int(rd.name.split("_")[1])
        exp_file = sorted(rd.glob("*.ckpt"))[-1]
        got_file = got_dir / rd.name / f"{prefix}{rank}.ckpt"
        if not got_file.is_file():
            problems.append(f"missing {got_file}")
            continue
        problems.extend(diff_files(exp_file, got_file))
    return problems
