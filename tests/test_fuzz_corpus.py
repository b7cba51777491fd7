"""Replay tests/fuzz_corpus: inputs the format fuzzers found or target, each with the
outcome it must have (see tests/tools/make_fuzz_corpus.py, which writes them, and
MANIFEST.json, which says why each one is there); then fuzz conversions judged by their
data.

A refused input must be refused with a ZckptError whose message names the file and
contains the manifest's fragment; an accepted one must pass every accessor's
self-consistency check. ``data/`` cases and the mutation tests at the end are judged by
what zckpt writes (tests/data_judge.py): a zckpt error, or tensors equal to what an
independent reader (protobuf decoding, the re-slicer in tests/oracle.py) says.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import data_judge as dj
import fuzz_support as fs
import numpy as np
import pytest

from zckpt.core.errors import ZckptError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import read_strategy
from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.ingest import IngestOptions, ingest

CORPUS = Path(__file__).parent / "fuzz_corpus"
MANIFEST: dict[str, dict[str, str]] = json.loads((CORPUS / "MANIFEST.json").read_text(encoding="utf-8"))


def test_manifest_lists_every_corpus_file() -> None:
    files = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.is_file() and p.name != "MANIFEST.json"}
    assert files == set(MANIFEST)
    assert sum((CORPUS / f).stat().st_size for f in files) < 1024 * 1024


@pytest.mark.parametrize("rel", sorted(r for r in MANIFEST if not r.startswith("data/")))
def test_corpus_case(rel: str, tmp_path: Path) -> None:
    case = MANIFEST[rel]
    path = tmp_path / Path(rel).name  # a private copy: the reader must not depend on the repository's copy
    shutil.copyfile(CORPUS / rel, path)
    data = path.read_bytes()
    if rel.startswith("ckpt/"):
        outcome = fs.exercise_ckpt(path, data)
        if case["expect"] == "refused":
            with pytest.raises(ZckptError) as info:
                CkptReader(path).close()
    else:
        outcome = fs.exercise_strategy([path])
        if case["expect"] == "refused":
            with pytest.raises(ZckptError) as info:
                read_strategy(path)
    assert outcome == case["expect"], case["why"]
    if case["expect"] == "refused":
        message = str(info.value)
        assert path.name in message, message
        assert case["match"] in message, (case["match"], message)


# --------------------------------------------------------------------------- judged by the data

SEED0 = int(os.environ.get("ZCKPT_FUZZ_SEED0", "0"))
"""First seed of the mutation tests (set it to explore further; the corpus keeps what was found)."""


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dj.write_job(tmp_path_factory.mktemp("judge") / "job")


def test_judge_accepts_the_intact_job_and_sees_a_wrong_file(job: Path, tmp_path: Path) -> None:
    """The judge can fail: the job converts to "same", and an output with one tensor's
    halves swapped is "WRONG"."""
    assert dj.judge_source(job, job / "strategy.ckpt", tmp_path / "o").outcome == "same"
    assert dj.judge_destination(job, job / "strategy.ckpt", tmp_path / "d").outcome == "same"
    whole = dj.read_ckpt(tmp_path / "o" / "rank_0" / "checkpoint_0.ckpt")
    w = whole["w"]
    swapped = {n: (np.concatenate([w[4:], w[:4]]) if n == "w" else a) for n, a in whole.items()}
    shards = {r: dj.read_ckpt(job / f"rank_{r}" / f"checkpoint_{r}.ckpt")["w"] for r in range(dj.DEVICES)}
    assert dj._held_as(swapped["w"], shards, dj.candidates("w", dj.oracle_layouts(job / "strategy.ckpt") or {}))


def _case(rel: str, tmp_path: Path, job: Path) -> tuple[dict[str, object], Path, Path]:
    """The manifest entry, the job to convert and the source strategy to read it with."""
    case = MANIFEST[rel]
    if case["kind"] == "shard":
        rank = int(case["rank"])  # type: ignore[call-overload]
        src = tmp_path / "job"
        shutil.copytree(job, src)
        shutil.copyfile(CORPUS / rel, src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        return case, src, src / "strategy.ckpt"
    strategy = tmp_path / Path(rel).name
    shutil.copyfile(CORPUS / rel, strategy)
    return case, job, strategy


@pytest.mark.parametrize("rel", sorted(r for r in MANIFEST if r.startswith("data/")))
def test_corpus_data_case(rel: str, tmp_path: Path, job: Path) -> None:
    """Through the direct path and through a store: refused as the manifest says, or the
    same data as the independent reader."""
    case, src, strategy = _case(rel, tmp_path, job)
    verdict = dj.judge_source(src, strategy, tmp_path / "direct")
    assert verdict.outcome == case["expect"], (case["why"], verdict)
    if case["expect"] == "refused":
        assert str(case["match"]) in verdict.detail, verdict.detail
        with pytest.raises(ZckptError) as info:
            ingest(src, tmp_path / "s.zarr", strategy)
        assert str(case["match"]) in str(info.value)
        assert not (tmp_path / "s.zarr").exists()


def _judged(verdicts: collections.Counter[str], name: str) -> None:
    print(f"{name}: {dict(verdicts)}")
    assert verdicts["WRONG"] == 0
    assert verdicts["same"] > 0  # some mutations are accepted, so the data was judged
    assert verdicts["unjudged"] <= verdicts["same"] + verdicts["refused"] // 20


def _judge_all(what: str, seeds: range, trial: Callable[[int], tuple[dj.Verdict, object]]) -> None:
    """Run ``trial`` per seed (a verdict and the mutations made); no verdict may be WRONG,
    and enough must be judged (:func:`_judged`)."""
    verdicts: collections.Counter[str] = collections.Counter()
    wrong = []
    for seed in seeds:
        v, ops = trial(seed)
        verdicts[v.outcome] += 1
        if v.outcome == "WRONG":
            wrong.append((seed, ops, v.detail))
    assert not wrong, wrong
    _judged(verdicts, what)


def test_mutated_source_strategies_judged_by_data(job: Path, tmp_path: Path) -> None:
    """Mutated copies of the job's strategy: each conversion is refused, or gives data the
    oracle reads the same from the shards; accepted ones also go through a store (ingest,
    export) and must give the same file as the direct path."""

    def trial(seed: int) -> tuple[dj.Verdict, object]:
        data, ops = fs.mutate_strategy_pb(fs.RandomChooser(seed), {"job": dj.strategy_bytes()})
        path = tmp_path / "mutated.ckpt"
        path.write_bytes(data)
        v = dj.judge_source(job, path, tmp_path / "direct")
        if v.outcome == "same":
            ingest(job, tmp_path / "s.zarr", path, options=_overwrite())
            export(tmp_path / "s.zarr", tmp_path / "stored", None, options=_export_overwrite())
            direct = dj.read_ckpt(tmp_path / "direct" / "rank_0" / "checkpoint_0.ckpt")
            stored = dj.read_ckpt(tmp_path / "stored" / "rank_0" / "checkpoint_0.ckpt")
            assert direct.keys() == stored.keys() and all(dj.same_bytes(direct[n], stored[n]) for n in direct), seed
        return v, ops

    _judge_all("source strategies", range(SEED0, SEED0 + 600), trial)


def test_mutated_destination_strategies_judged_by_data(job: Path, tmp_path: Path) -> None:
    def trial(seed: int) -> tuple[dj.Verdict, object]:
        data, ops = fs.mutate_strategy_pb(fs.RandomChooser(seed), {"job": dj.strategy_bytes()})
        path = tmp_path / "mutated.ckpt"
        path.write_bytes(data)
        return dj.judge_destination(job, path, tmp_path / "out"), ops

    _judge_all("destination strategies", range(SEED0, SEED0 + 400), trial)


def test_mutated_shards_judged_by_data(job: Path, tmp_path: Path) -> None:
    def trial(seed: int) -> tuple[dj.Verdict, object]:
        c = fs.RandomChooser(seed)
        rank = c.integer(0, dj.DEVICES - 1)
        data, ops = fs.mutate_ckpt(c, {"shard": (job / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").read_bytes()})
        return dj.judge_shard(job, rank, data, tmp_path / "scratch"), ops

    _judge_all("shards", range(SEED0, SEED0 + 400), trial)


def _overwrite() -> IngestOptions:
    return IngestOptions(overwrite=True)


def _export_overwrite() -> ExportOptions:
    return ExportOptions(overwrite=True, fsync=False)
