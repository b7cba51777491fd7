"""Replay tests/fuzz_corpus: inputs the format fuzzers found or target, each with the
outcome it must have (see tests/tools/make_fuzz_corpus.py, which writes them, and
MANIFEST.json, which says why each one is there).

A refused input must be refused with a ZckptError whose message names the file and
contains the manifest's fragment; an accepted one must pass every accessor's
self-consistency check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fuzz_support as fs
import pytest

from zckpt.errors import ZckptError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import read_strategy

CORPUS = Path(__file__).parent / "fuzz_corpus"
MANIFEST: dict[str, dict[str, str]] = json.loads((CORPUS / "MANIFEST.json").read_text(encoding="utf-8"))


def test_manifest_lists_every_corpus_file() -> None:
    files = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.is_file() and p.name != "MANIFEST.json"}
    assert files == set(MANIFEST)
    assert sum((CORPUS / f).stat().st_size for f in files) < 1024 * 1024


@pytest.mark.parametrize("rel", sorted(MANIFEST))
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
