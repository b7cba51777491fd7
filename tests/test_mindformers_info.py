"""``zckpt info`` on MindFormers Checkpoint 2.0 directories MindFormers itself saved
(``tests/fixtures/mindformers``): the iteration, ``common.json``, the ranks and their files, every
parameter with its layout, and what reading would refuse.

What info reports is checked against ``metadata.json``, ``common.json``, the tracker and the
file names read here with ``json`` alone, and against each scenario's ``meta.json`` (the job's
rank count), never against zckpt's own reading.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import MINDFORMERS_FIXTURES as FIXTURES

from zckpt.cli.main import main as cli_main

SIDES = [(sid, side) for sid in ("s23", "s24", "s25", "s26") for side in ("src", "dst/expected")]


def _info(path: Path, capsys: pytest.CaptureFixture[str], *more: str) -> Any:
    capsys.readouterr()
    assert cli_main(["info", str(path), *more]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in more else out


def _kind(entry: dict[str, Any]) -> str:
    """What a layout is, from metadata.json alone: no cut, a cut, or a cut with several device
    axes on dimension 0 (MindSpore's fold of an optimizer shard)."""
    lay = entry["layout"]
    if lay is None or all(f == 1 for f in entry["axis_fragmentations"]):
        return "whole"
    return "split, dim 0 folded" if isinstance(lay["tensor_map"][0], list) and len(lay["tensor_map"][0]) > 1 \
        else "split"


@pytest.mark.parametrize("sid, side", SIDES)
def test_info_reports_what_the_save_holds(sid: str, side: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = FIXTURES / sid / side
    scenario = json.loads((FIXTURES / sid / "meta.json").read_text())
    (iteration,) = root.glob("iteration_*")
    doc = _info(root, capsys, "--json")
    assert doc["type"] == "mindformers" and doc["refused"] == []
    assert doc["iteration"] == int((root / "latest_checkpointed_iteration.txt").read_text()) == 1
    assert doc["tracker"]["iteration"] == 1 and doc["iteration_dir"] == str(iteration)
    assert doc["common"] == json.loads((iteration / "common.json").read_text())
    files = sorted(p.name for p in iteration.glob("*.safetensors"))
    assert sorted(f for r in doc["ranks"].values() for f in r["files"]) == files
    assert doc["job_ranks"] == scenario["src_ranks" if side == "src" else "dst_ranks"]
    assert doc["files"] == {kind: {"present": len(files) // 2, "named_total": len(files) // 2}
                            for kind in ("model", "opt")}
    if not (iteration / "metadata.json").is_file():  # s26's one card: whole tensors, from the files
        assert "single card" in doc["saving"] and len(doc["ranks"]) == 1
        assert {p["layout"]["kind"] for p in doc["parameters"]} == {"whole"}
        return
    meta = json.loads((iteration / "metadata.json").read_text())
    for key, places in meta["storage_data"].items():
        for place in places:
            assert place["file_name"] in doc["ranks"][str(place["storage_rank"])]["files"], key
    redundancy_free = any(len(places) < len(places[0]["rank_group"]) for places in meta["storage_data"].values())
    assert ("redundancy-free" in doc["saving"]) == redundancy_free == (sid == "s24" and side != "src")
    params = {p["name"]: p for p in doc["parameters"]}
    assert list(params) == list(meta["state_dict_metadata"])
    for name, entry in meta["state_dict_metadata"].items():
        got = params[name]
        kinds = {place["file_name"].split("-")[-3] for k, places in meta["storage_data"].items()
                 if k.startswith(f"('{name}',") for place in places}
        assert got["refused"] is None, name
        assert got["global_shape"] == entry["global_shape"] and got["dtype"] == entry["properties"]["dtype"]
        assert got["file"] == "+".join(sorted(kinds)) and got["chunks"] == len(entry["chunk"])
        lay = got["layout"]
        assert lay["kind"] == _kind(entry), name
        if entry["layout"] is not None:
            ranks = entry["layout"]["rank_list"]
            assert lay["device_matrix"] == entry["layout"]["device_matrix"]
            assert lay["tensor_map"] == entry["layout"]["tensor_map"]
            assert lay["pieces"] == entry["axis_fragmentations"]
            assert lay["stage"] == min(ranks) // len(ranks)


def test_the_text_and_an_iteration_given_directly(capsys: pytest.CaptureFixture[str]) -> None:
    root = FIXTURES / "s23" / "src"
    meta = json.loads((root / "iteration_00000001" / "metadata.json").read_text())["state_dict_metadata"]
    text = _info(root, capsys)
    head = text.splitlines()[0]
    assert "iteration 1 (iteration_00000001)" in head and "latest_checkpointed_iteration.txt says '1'" in head
    assert "global_batch_size 4" in text and "nothing refused" in text
    row = next(line for line in text.splitlines() if line.startswith("decoder.final_layernorm.weight "))
    lay = meta["decoder.final_layernorm.weight"]["layout"]
    assert row.split() == ["decoder.final_layernorm.weight", "model", "float32", "[64]", "split,", "dim", "0",
                           "folded", *json.dumps(lay["device_matrix"]).split(), "[[2,1,0]]", "[4]", "1", "4"]
    whole = _info(root, capsys, "--json")
    direct = _info(root / "iteration_00000001", capsys, "--json")
    assert direct["parameters"] == whole["parameters"] and direct["ranks"] == whole["ranks"]
    assert direct["tracker"] == whole["tracker"]


def _edit(it: Path, name: str, change: Any) -> None:
    doc = json.loads((it / "metadata.json").read_text())
    change(doc["state_dict_metadata"][name])
    (it / "metadata.json").write_text(json.dumps(doc))


def test_refusals_are_listed_beside_everything_else(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An interleaved layout, a chunk no layout produces and a tracker naming no iteration: each
    reported with its file and parameter, the other parameters still described; exit 0."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "s23" / "src", root)
    it = root / "iteration_00000001"
    _edit(it, "decoder.final_layernorm.weight", lambda e: e["layout"].update(interleaved_parallel=True))
    _edit(it, "output_layer.weight", lambda e: e["chunk"][0].update(global_offset=[99]))
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    doc = _info(root, capsys, "--json")
    refused = {(Path(f["file"]).name, f["param"]): f["reason"] for f in doc["refused"]}
    assert set(refused) == {("latest_checkpointed_iteration.txt", None),
                            ("metadata.json", "decoder.final_layernorm.weight"),
                            ("metadata.json", "output_layer.weight")}
    assert "interleaved" in refused[("metadata.json", "decoder.final_layernorm.weight")]
    assert "slice [99]" in refused[("metadata.json", "output_layer.weight")]
    assert doc["iteration"] == 1 and doc["tracker"]["iteration"] is None
    params = {p["name"]: p for p in doc["parameters"]}
    assert len(params) == 57 and sum(p["refused"] is not None for p in params.values()) == 2
    assert params["output_layer.weight"]["layout"]["kind"] == "refused"
    assert params["embedding.word_embeddings.weight"]["layout"]["kind"] == "split, dim 0 folded"
    text = _info(root, capsys)
    assert "refused (3)" in text and "(no such iteration; the highest is shown)" in text
    for line in ("parameter 'decoder.final_layernorm.weight': interleaved_parallel",
                 "latest_checkpointed_iteration.txt: names iteration '7'"):
        assert line in text
    direct = _info(it, capsys, "--json")  # reading the iteration itself does not consult the tracker
    assert len(direct["refused"]) == 2 and direct["tracker"]["iteration"] is None
    assert "says '7' (names no iteration here)" in _info(it, capsys)


def test_a_file_that_disagrees_with_metadata_is_refused_by_rank(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """metadata.json gives a parameter another dtype than its files hold: every rank's files
    are refused by name, and the listing goes on."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "s23" / "src", root)
    _edit(root / "iteration_00000001", "output_layer.weight", lambda e: e["properties"].update(dtype="bfloat16"))
    doc = _info(root, capsys, "--json")
    files = sorted(Path(f["file"]).name for f in doc["refused"] if f["param"] == "output_layer.weight")
    assert files == [f"qwen3-model-000000{r}-0000008.safetensors" for r in range(4, 8)]  # the last stage
    assert len(doc["ranks"]) == 8 and len(doc["parameters"]) == 57
