"""A store chunked for the destinations it serves (``ingest --serve DST``): one destination
rank's slice is read as whole chunks, not as every row of a row-chunked store; the store's
values, and what export writes from it, are those of a store ingested without ``--serve``.
Values are checked against the generator's, sliced here with numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from zckpt.cli.main import main as cli_main
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.segmented import read_slice

RANKS, COLUMNS = 8, 4
SHAPE = (512, 192)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[GeneratedModel, Path]:
    """Sources split by rows over 8 ranks; a destination split by columns over 4."""
    tmp = tmp_path_factory.mktemp("serve")
    rows = make_layout([RANKS], [0, -1])
    tensors = [TensorDef(f"w{i}", SHAPE, "Float32" if i % 2 else "BFloat16", rows) for i in range(3)]
    model = write_model(tmp / "src", tensors, device_num=RANKS, scalars=False)
    dst = StrategyMap(layouts={t.name: {0: make_layout([COLUMNS], [-1, 0])} for t in tensors})
    (tmp / "dst.ckpt").write_bytes(encode_strategy(dst))
    return model, tmp / "dst.ckpt"


def _ingest(model: GeneratedModel, store: Path, *serve: str) -> None:
    """Checksum blocks of 1 KiB (a store's are 256 KiB): checking a chunk of this small test
    model then reads that chunk alone."""
    ingest(model.root, store, model.strategy_path,
           IngestOptions(serve=tuple(serve), checksum_block_bytes=1024, pack_bytes=0))


def test_a_served_rank_reads_only_its_chunks(job: tuple[GeneratedModel, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model, dst = job
    _ingest(model, tmp_path / "plain.zarr")
    _ingest(model, tmp_path / "served.zarr", str(dst))
    width = SHAPE[1] // COLUMNS
    for rank in range(COLUMNS):
        for t in model.tensors:
            want = model.global_value(t.name)[:, rank * width:(rank + 1) * width]
            plain = read_slice(tmp_path / "plain.zarr", rank, str(dst), t.name)
            served = read_slice(tmp_path / "served.zarr", rank, str(dst), t.name)
            assert plain.array.tobytes() == served.array.tobytes() == np.ascontiguousarray(want).tobytes()
            assert plain.read_bytes == COLUMNS * want.nbytes  # every row, whole
            assert served.read_bytes == want.nbytes  # its own bytes, no more
    assert cli_main(["load", str(tmp_path / "plain.zarr"), "--strategy", str(dst), "--param", "w1",
                     "--rank", "1"]) == 0
    assert f"({COLUMNS:.2f}x)" in capsys.readouterr().out


def test_export_from_a_served_store_writes_the_same_files(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, dst = job
    outs = {}
    for name, serve in (("plain", ()), ("served", (str(dst),))):
        _ingest(model, tmp_path / f"{name}.zarr", *serve)
        outs[name] = tmp_path / f"out-{name}"
        assert cli_main(["export", str(tmp_path / f"{name}.zarr"), "--strategy", str(dst), "--out",
                         str(outs[name]), "--quiet"]) == 0
    files = sorted(p.relative_to(outs["plain"]) for p in outs["plain"].rglob("*.ckpt"))
    assert len(files) == COLUMNS
    for f in files:
        assert (outs["plain"] / f).read_bytes() == (outs["served"] / f).read_bytes(), f
