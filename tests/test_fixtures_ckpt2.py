"""MindFormers Checkpoint 2.0 directories that MindFormers itself saved (``tests/fixtures/mindformers``,
kept in the repository so that these tests always run; its README says how they were made): zckpt
transform, and ingest + export, from the source job's own save give every piece the destination job saved, bit for bit.

The expected side is read without zckpt: ``dst/expected``'s ``metadata.json`` (json) says which
file and which rank saved each piece of each parameter (``storage_data``: the file, the saving
rank and the ranks holding that same piece, ``rank_group``), and the ``safetensors`` package reads
the piece. Each rank of the group must hold it in zckpt's file. This holds for redundancy-free
saves too, where the file a piece is in need not be its rank's. Entries zckpt writes beyond
the saved pieces may only be ``common.json``'s numbers (:mod:`zckpt.formats.mindformers`).
Scenarios are found by their layout (an iteration directory with ``common.json`` on both sides),
not by name.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import MINDFORMERS_FIXTURES as FIXTURES
from safetensors import numpy as safetensors_numpy

from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.export import export
from zckpt.jobs.ingest import ingest
from zckpt.jobs.transform import transform


def _iteration(side: Path) -> Path | None:
    found = sorted(p for p in side.glob("iter*") if (p / "common.json").is_file()) if side.is_dir() else []
    return found[-1] if found else None


def ckpt2_scenarios() -> list[str]:
    """Scenarios whose source and expected destination are Checkpoint 2.0 saves."""
    return sorted(p.name for p in FIXTURES.iterdir()
                  if _iteration(p / "src") is not None and _iteration(p / "dst" / "expected") is not None)


CKPT2 = ckpt2_scenarios()


def test_the_fixtures_are_there_as_their_regenerator_describes_them() -> None:
    """The four scenarios of the README (a missing one fails, never skips), made from the job
    specs and descriptions ``make_ckpt2.py`` holds (it imports without MindFormers' machinery)."""
    assert CKPT2 == ["s23", "s24", "s25", "s26"]
    spec = importlib.util.spec_from_file_location("make_ckpt2", FIXTURES / "make_ckpt2.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    assert sorted(make.SCENARIOS) == CKPT2
    for sid, (description, src, dst) in make.SCENARIOS.items():
        meta = json.loads((FIXTURES / sid / "meta.json").read_text())
        assert (meta["description"], meta["src_spec"], meta["dst_spec"]) == (description, src, dst), sid


def expected_pieces(iteration: Path) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
    """Every saved piece as (name, ranks holding it, values), from metadata.json and the files;
    a save without metadata.json (a single card's) holds its rank's tensors whole, in the
    files numbered by that rank."""
    files: dict[str, dict[str, np.ndarray]] = {}
    out = []
    if not (iteration / "metadata.json").is_file():
        for f in sorted(iteration.glob("*.safetensors")):
            rank = int(f.stem.split("-")[-2])
            out += [(name, (rank,), value) for name, value in safetensors_numpy.load_file(str(f)).items()]
        return out
    meta = json.loads((iteration / "metadata.json").read_text())
    for key, places in meta["storage_data"].items():
        name, _ = ast.literal_eval(key)
        for place in places:
            if place["file_name"] not in files:
                files[place["file_name"]] = safetensors_numpy.load_file(str(iteration / place["file_name"]))
            out.append((name, tuple(place["rank_group"]), files[place["file_name"]][name]))
    return out


def _check(expected: Path, out: Path) -> None:
    """Every piece the save ``expected`` holds is in zckpt's rank files under ``out``, bit for bit."""
    iteration = _iteration(expected)
    assert iteration is not None
    pieces = expected_pieces(iteration)
    assert pieces
    common = set(json.loads((iteration / "common.json").read_text()))
    held: dict[int, set[str]] = {}
    problems = []
    for name, ranks, want in pieces:
        for r in ranks:
            with CkptReader(out / f"rank_{r}" / f"checkpoint_{r}.ckpt") as got:
                if name not in got.entries:
                    problems.append(f"rank {r}: {name} missing")
                    continue
                a = got.array(name)
                if a.shape != want.shape or a.tobytes() != np.ascontiguousarray(want).tobytes():
                    problems.append(f"rank {r}: {name} differs ({a.shape} vs saved {want.shape})")
            held.setdefault(r, set()).add(name)
    for r, names in held.items():
        with CkptReader(out / f"rank_{r}" / f"checkpoint_{r}.ckpt") as got:
            extra = set(got.entries) - names - common
        if extra:
            problems.append(f"rank {r}: entries no piece and no common.json number accounts for: {sorted(extra)}")
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("path", ["transform", "ingest+export"])
@pytest.mark.parametrize("sid", CKPT2)
def test_mindformers_own_saves_are_resharded_exactly(sid: str, path: str, tmp_path: Path) -> None:
    d = FIXTURES / sid
    dst = str(d / "dst" / "strategy.ckpt") if (d / "dst" / "strategy.ckpt").is_file() else None  # None: one rank
    if path == "transform":
        transform(d / "src", tmp_path / "out", None, dst)
    else:
        ingest(d / "src", tmp_path / "s.zarr", None)
        export(tmp_path / "s.zarr", tmp_path / "out", dst)
    _check(d / "dst" / "expected", tmp_path / "out")


@pytest.mark.parametrize("path", ["transform", "ingest+export"])
def test_a_single_card_save_is_a_source(path: str, tmp_path: Path) -> None:
    """s26's destination (MindFormers' one-card save: no metadata.json, whole tensors) resharded
    to s25's destination job gives what that job saved: both jobs come from one source job."""
    src, dst = FIXTURES / "s26" / "dst" / "expected", str(FIXTURES / "s25" / "dst" / "strategy.ckpt")
    assert not list(src.glob("*/metadata.json"))
    if path == "transform":
        transform(src, tmp_path / "out", None, dst)
    else:
        ingest(src, tmp_path / "s.zarr", None)
        export(tmp_path / "s.zarr", tmp_path / "out", dst)
    _check(FIXTURES / "s25" / "dst" / "expected", tmp_path / "out")
