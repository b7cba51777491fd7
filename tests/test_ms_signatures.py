"""Every checkpoint-resharding function MindSpore 2.10 exports exists in zckpt at the same
path (``mindspore.X`` -> ``zckpt.X``, ``mindspore.parallel.X`` -> ``zckpt.parallel.X``) with
the same parameters, kinds and defaults (zckpt may add keyword-only parameters after them,
e.g. ``storage_options``). The names and signatures come from MindSpore itself, run in its
own virtualenv (skipped when absent)."""

from __future__ import annotations

import importlib
import inspect

import pytest
from mindspore_env import run_ms_tool

pytestmark = pytest.mark.mindspore

NOT_RESHARDING = {
    "sync_pipeline_shared_parameters": "broadcasts shared parameters of a live pipeline network over communication",
    "merge_sliced_parameter": "takes MindSpore Parameter objects, not files",
    "build_searched_strategy": "returns MindSpore's layout objects (zckpt reads strategies with formats.strategy)",
    "restore_group_info_list": "reads a communication group file, not a checkpoint",
}
"""Names of those modules that are not about checkpoint files, and why zckpt has none."""


def zckpt_signature(path: str) -> list[list[object]]:
    mod_name, _, name = path.replace("mindspore", "zckpt", 1).rpartition(".")
    fn = getattr(importlib.import_module(mod_name), name)
    return [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values()]


def test_every_mindspore_resharding_name_has_mindspores_signature() -> None:
    doc = run_ms_tool("ms_signatures.py")
    assert doc["version"].startswith("2.10")
    wanted = {p: sig for p, sig in doc["functions"].items() if p.rpartition(".")[2] not in NOT_RESHARDING}
    assert "mindspore.parallel.convert_checkpoints" in wanted and "mindspore.ckpt_to_safetensors" in wanted
    problems = []
    for path, ms_sig in sorted(wanted.items()):
        try:
            ours = zckpt_signature(path)
        except (ImportError, AttributeError) as err:
            problems.append(f"{path}: missing in zckpt ({err})")
            continue
        head, extra = ours[: len(ms_sig)], ours[len(ms_sig):]
        if head != ms_sig:
            problems.append(f"{path}: MindSpore {ms_sig} but zckpt {head}")
        if any(kind != "KEYWORD_ONLY" or default is None for _, kind, default in extra):
            problems.append(f"{path}: zckpt's extra parameters {extra} must be keyword-only with defaults")
    assert not problems, "\n".join(problems)
