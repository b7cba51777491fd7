"""``--format mindformers``: the Checkpoint 2.0 iteration zckpt writes for a destination job
holds what MindFormers' own save of that job holds.

The scenarios are directories MindFormers 2.1 itself saved (``tests/fixtures/mindformers/<sid>``:
``src/`` the source job's save, ``dst/expected`` the destination job's). From ``src/``, zckpt
transform and ingest + export write ``--format mindformers``; the result is read back without
zckpt (json and the safetensors package): every piece ``dst/expected``'s ``metadata.json``
records (or, without one, every tensor of its files) is in zckpt's directory, bit for bit,
held by the same ranks; ``metadata.json``'s layouts, chunks and storage records are
MindFormers' own; ``common.json`` is the source's. zckpt reads its own output back as a source
(a second transform gives the same files). A run that fails while writing leaves no iteration
and no tracker.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zckpt.core.errors import OutputError
from zckpt.io.gathered_writes import GatheredWrites
from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.ingest import ingest
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.plan.mf_iteration import ms_layout_dict
from zckpt.write import group_writer, mindformers_dir
from zckpt.write.safetensors_file import SafetensorsFileWriter

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package reads the files back")

MF = Path(__file__).parent / "fixtures" / "mindformers"
SCENARIOS = ("s23", "s24", "s25", "s26")
TRACKER = "latest_checkpointed_iteration.txt"


def scenario(sid: str) -> tuple[Path, dict[str, Any]]:
    d = MF / sid
    if not (d / "meta.json").is_file():
        pytest.skip(f"fixture {d} is not there (MindFormers' own saves, copied from the generator's output)")
    return d, json.loads((d / "meta.json").read_text())


def settings(sid: str) -> tuple[Path, Path | None, str, bool]:
    """Source, destination strategy, prefix and redundancy removal of the destination job."""
    d, meta = scenario(sid)
    ck = meta["dst_spec"]["ckpt2"]
    dst = d / "dst" / "strategy.ckpt"
    return d / "src", dst if dst.is_file() else None, ck["prefix"], bool(ck["remove_redundancy"])


def iteration_of(root: Path) -> Path:
    return root / f"iteration_{int((root / TRACKER).read_text()):08d}"


def pieces(iteration: Path) -> dict[tuple[str, int], tuple[tuple[int, ...], np.ndarray]]:
    """``(name, slice) -> (ranks holding it, values)`` as ``metadata.json`` records them; without
    one (a single card's save) every tensor of the files, whole, held by rank 0."""
    files: dict[str, dict[str, np.ndarray]] = {}

    def tensors(fname: str) -> dict[str, np.ndarray]:
        if fname not in files:
            files[fname] = safetensors_numpy.load_file(str(iteration / fname))
        return files[fname]

    if not (iteration / "metadata.json").is_file():
        return {(n, 0): ((0,), v) for f in sorted(iteration.glob("*.safetensors")) for n, v in tensors(f.name).items()}
    meta = json.loads((iteration / "metadata.json").read_text())
    out = {}
    for key, places in meta["storage_data"].items():
        name, (k,) = ast.literal_eval(key)
        assert len(places) >= 1
        groups = {tuple(p["rank_group"]) for p in places}
        assert len(groups) == 1, f"{key}: records disagree on the ranks holding it"
        values = [tensors(p["file_name"])[name] for p in places]
        for v in values[1:]:
            assert v.tobytes() == values[0].tobytes()
        out[(name, k)] = (groups.pop(), values[0])
    return out


_OUT: dict[tuple[str, str], Path] = {}


def written(sid: str, how: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zckpt's ``--format mindformers`` output of scenario ``sid`` by ``how`` (transform or export)."""
    if (sid, how) not in _OUT:
        src, dst, prefix, rr = settings(sid)
        out = tmp_path_factory.mktemp(f"{sid}_{how}") / "ckpt"
        if how == "transform":
            transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix=prefix,
                                                                    remove_redundancy=rr))
        else:
            store = tmp_path_factory.mktemp(f"{sid}_store") / "store.zarr"
            ingest(src, store)
            export(store, out, dst, options=ExportOptions(format="mindformers", prefix=prefix, remove_redundancy=rr))
        _OUT[(sid, how)] = out
    return _OUT[(sid, how)]


@pytest.mark.parametrize("how", ["transform", "export"])
@pytest.mark.parametrize("sid", SCENARIOS)
def test_every_piece_as_mindformers_saved_it(sid: str, how: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    d, _ = scenario(sid)
    out = written(sid, how, tmp_path_factory)
    want = pieces(iteration_of(d / "dst" / "expected"))
    got = pieces(iteration_of(out))
    assert want
    assert sorted(got) == sorted(want)
    for key, (group, value) in want.items():
        g_group, g_value = got[key]
        assert g_group == group, key
        assert (g_value.dtype, g_value.shape) == (value.dtype, value.shape), key
        assert g_value.tobytes() == value.tobytes(), key


@pytest.mark.parametrize("sid", SCENARIOS)
def test_metadata_common_and_tracker(sid: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    d, _ = scenario(sid)
    out = written(sid, "transform", tmp_path_factory)
    assert sorted(os.listdir(out)) == ["iteration_00000001", TRACKER]  # nothing else of ours
    assert (out / TRACKER).read_text() == "1"
    mine, theirs = iteration_of(out), iteration_of(d / "dst" / "expected")
    assert json.loads((mine / "common.json").read_text()) == \
        json.loads((iteration_of(d / "src") / "common.json").read_text())
    names = sorted(p.name for p in mine.iterdir())
    assert names == sorted({p.name for p in theirs.iterdir()} | {"metadata.json"})
    if not (theirs / "metadata.json").is_file():  # one card: MindFormers writes none, zckpt records tensors whole
        meta = json.loads((mine / "metadata.json").read_text())
        assert all(m["layout"] is None and m["axis_fragmentations"] == [1] * len(m["global_shape"])
                   for m in meta["state_dict_metadata"].values())
        return
    assert json.loads((mine / "metadata.json").read_text()) == json.loads((theirs / "metadata.json").read_text())
    assert (mine / "metadata.json").read_bytes() == (theirs / "metadata.json").read_bytes()


@pytest.mark.parametrize("sid", SCENARIOS)
def test_zckpt_reads_its_output_back(sid: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    _, dst, prefix, rr = settings(sid)
    first = written(sid, "transform", tmp_path_factory)
    again = tmp_path / "again"
    transform(first, again, None, dst, options=TransformOptions(format="mindformers", prefix=prefix,
                                                                 remove_redundancy=rr))
    a, b = iteration_of(first), iteration_of(again)
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name


# (dev_matrix, tensor_map, opt_shard_size) -> what MindSpore 2.10.0's StrategyLayout._layout_process
# reports (Layout.to_dict(): device_matrix, tensor_map), asked of MindSpore itself
MS_LAYOUTS = [
    ((4, 2), ((0,), ()), 2, [2, 2, 2], [[0, 1], -1]),
    ((2, 2), ((0,), ()), -1, [2, 2], [[0, 1], -1]),
    ((1, 1, 4), ((),), -1, [1, 1, 4], [[2, 1, 0]]),
    ((2, 4), ((1,), ()), 2, [2, 2, 2], [[2, 0], -1]),
    ((8,), ((), ()), 4, [2, 4], [0, -1]),
    ((2, 2, 2), ((), (0,)), 2, [2, 2, 2], [1, 0]),
    ((2, 1, 2), ((0,), ()), 0, [2, 1, 2], [0, -1]),
]


@pytest.mark.parametrize(("dev", "tmap", "opt", "want_dev", "want_map"), MS_LAYOUTS)
def test_layouts_as_mindspore_reports_them(dev: tuple[int, ...], tmap: tuple[tuple[int, ...], ...], opt: int,
                                          want_dev: list[int], want_map: list[Any]) -> None:
    """``get_strategy_metadata``'s folding of the optimizer shard into dimension 0, a partial
    shard cutting a device axis in two (``_split_dev_dim``)."""
    from zckpt.formats.strategy import ParamLayout

    got = ms_layout_dict(ParamLayout(dev, tmap, opt_shard_step=1, opt_shard_size=opt), [0, 1])
    assert (got["device_matrix"], got["tensor_map"]) == (want_dev, want_map)
    assert got["alias_name"] == [chr(ord("a") + i) for i in range(len(want_dev))]


def test_file_names() -> None:
    """MindFormers' ``get_checkpoint_name`` (no prefix: ``model-...``)."""
    from zckpt.plan.mf_iteration import file_name

    assert file_name("", "opt", 3, 8) == "opt-0000003-0000008.safetensors"
    assert file_name("q", "model", 0, 1) == "q-model-0000000-0000001.safetensors"


@pytest.mark.parametrize("order", ["one_by_one", "source_major"])
def test_failed_write_leaves_no_iteration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """The third file fails (one by one), or the group's third write (these files' parts are
    small: by default a group)."""
    src, dst, prefix, _ = settings("s23")
    calls = []
    cls: Any = SafetensorsFileWriter if order == "one_by_one" else GatheredWrites
    method = "write_file" if order == "one_by_one" else "_write"
    real = getattr(cls, method)

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise OSError("injected: disk gone")
        return real(self, *args, **kwargs)

    if order == "one_by_one":
        monkeypatch.setattr(group_writer, "GAIN", float("inf"))
        monkeypatch.setattr(group_writer, "SMALL_PIECE", 0)
    monkeypatch.setattr(cls, method, failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="injected"):
        transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix=prefix,
                                                                workers=1, helper=False))
    assert len(calls) == 3
    assert not out.exists() or os.listdir(out) == []
    monkeypatch.undo()

    def no_metadata(doc: Any) -> bytes:
        raise OSError("injected: metadata.json")

    monkeypatch.setattr(mindformers_dir, "metadata_text", no_metadata)
    with pytest.raises(OSError, match="injected"):
        transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix=prefix))
    assert not out.exists() or os.listdir(out) == []


def test_existing_iteration_kept_unless_overwrite(tmp_path: Path) -> None:
    src, dst, prefix, _ = settings("s23")
    out = tmp_path / "out"
    options = TransformOptions(format="mindformers", prefix=prefix)
    transform(src, out, None, dst, options=options)
    before = {p.name: p.read_bytes() for p in iteration_of(out).iterdir()}
    with pytest.raises(OutputError, match="exists already"):
        transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix="other"))
    assert {p.name: p.read_bytes() for p in iteration_of(out).iterdir()} == before
    transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix="other", overwrite=True,
                                                            iteration=1))
    assert sorted(os.listdir(out)) == ["iteration_00000001", TRACKER]
    assert all(p.name.startswith("other-") for p in iteration_of(out).glob("*.safetensors"))
    transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix=prefix, iteration=7))
    assert (out / TRACKER).read_text() == "7"
    assert sorted(os.listdir(out)) == ["iteration_00000001", "iteration_00000007", TRACKER]


def test_from_a_legacy_checkpoint(tmp_path: Path) -> None:
    """A legacy ``.ckpt`` source (s23's stand-alone reference job, values set by name as in
    every job of the scenario): the same pieces and ``metadata.json`` as MindFormers' save;
    model and optimizer entries split by name, ``scale_sense`` only in a model file (no
    metadata records it); ``common.json`` from the entries there are (``global_step``), the
    iteration from ``global_step`` (0)."""
    d, _ = scenario("s23")
    src = tmp_path / "legacy" / "rank_0"
    src.mkdir(parents=True)
    (src / "checkpoint_0.ckpt").symlink_to(d / "reference" / "global.ckpt")
    out = tmp_path / "out"
    transform(src.parent, out, None, d / "dst" / "strategy.ckpt",
              options=TransformOptions(format="mindformers", prefix="qwen3"))
    assert (out / TRACKER).read_text() == "0"
    mine, theirs = iteration_of(out), iteration_of(d / "dst" / "expected")
    assert mine.name == "iteration_00000000"
    want, got = pieces(theirs), pieces(mine)
    assert sorted(got) == sorted(want)
    assert all(got[k][0] == g and got[k][1].tobytes() == v.tobytes() for k, (g, v) in want.items())
    assert (mine / "metadata.json").read_bytes() == (theirs / "metadata.json").read_bytes()
    common = json.loads((mine / "common.json").read_text())
    assert common == {"epoch_num": None, "step_num": None, "global_step": 0, "loss_scale": None,
                      "global_batch_size": None, "consumed_samples": None, "ckpt_status": None}
    model = safetensors_numpy.load_file(str(mine / "qwen3-model-0000000-0000004.safetensors"))
    opt = safetensors_numpy.load_file(str(mine / "qwen3-opt-0000000-0000004.safetensors"))
    assert "scale_sense" in model and "global_step" in opt
    assert not any(n.startswith("adam_") for n in model) and all(n.startswith("adam_") or n == "global_step"
                                                                 for n in opt)


def test_a_killed_run_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    """What a run killed while writing leaves is a hidden directory: no reader takes it for an
    iteration, and the next run of that iteration removes it."""
    src, dst, prefix, _ = settings("s23")
    out = tmp_path / "out"
    left = out / ".iteration_00000001.zckpt-999999"
    left.mkdir(parents=True)
    (left / "qwen3-model-0000000-0000004.safetensors").write_bytes(b"half")
    from zckpt.formats.mindformers import find_iteration

    assert find_iteration(out) is None
    transform(src, out, None, dst, options=TransformOptions(format="mindformers", prefix=prefix))
    assert sorted(os.listdir(out)) == ["iteration_00000001", TRACKER]


def test_command_line_and_api(tmp_path: Path) -> None:
    """``zckpt transform/export --format mindformers`` (no prefix unless given, ``--iteration``,
    ``--remove-redundancy``) and ``transform_checkpoints(output_format="mindformers")``."""
    from zckpt.api import transform_checkpoints
    from zckpt.cli.main import main as cli_main

    src, dst, _, _ = settings("s24")
    out = tmp_path / "cli"
    assert cli_main(["transform", str(src), "--out", str(out), "--dst-strategy", str(dst), "--format", "mindformers",
                     "--iteration", "5", "--remove-redundancy", "--quiet"]) == 0
    assert (out / TRACKER).read_text() == "5"
    names = sorted(p.name for p in (out / "iteration_00000005").glob("*.safetensors"))
    assert names[0] == "model-0000000-0000004.safetensors" and len(names) == 8
    meta = json.loads((out / "iteration_00000005" / "metadata.json").read_text())
    assert all(len(places) == 1 for places in meta["storage_data"].values())  # each piece saved once
    store, exported = tmp_path / "store.zarr", tmp_path / "exported"
    assert cli_main(["ingest", str(src), "--store", str(store), "--quiet"]) == 0
    assert cli_main(["export", str(store), "--out", str(exported), "--dst-strategy", str(dst), "--format",
                     "mindformers", "--iteration", "5", "--remove-redundancy", "--quiet"]) == 0
    for p in (out / "iteration_00000005").iterdir():
        assert p.read_bytes() == (exported / "iteration_00000005" / p.name).read_bytes(), p.name
    assert cli_main(["transform", str(src), "--out", str(tmp_path / "r"), "--dst-strategy", str(dst), "--format",
                     "mindformers", "--rank", "1", "--quiet"]) != 0
    api_out = tmp_path / "api"
    transform_checkpoints(str(src), str(api_out), "qwen3", None, str(dst), output_format="mindformers",
                          remove_redundancy=True)
    want = pieces(iteration_of(scenario("s24")[0] / "dst" / "expected"))
    got = pieces(iteration_of(api_out))
    assert sorted(got) == sorted(want)
    assert all(got[k][1].tobytes() == v.tobytes() for k, (_, v) in want.items())
