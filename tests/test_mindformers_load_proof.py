"""MindFormers itself loads what ``--format mindformers`` writes, into the destination job,
with the values that job saved.

zckpt transforms each scenario's source (``tests/fixtures/mindformers/<sid>/src``, MindFormers'
own save) into a Checkpoint 2.0 iteration for the destination job; then
``tests/fixtures/mindformers/mf_load_check.py`` builds that job rank by rank in MindFormers'
environment under MindSpore's dryrun, lets MindFormers' resume branch compile it and run its
``load_checkpoint`` on zckpt's directory, and compares every parameter it loaded with the
destination job's own save (``dst/expected``). s23 (Qwen3 pipeline x tensor x data x optimizer
parallel 8 -> tensor parallel 4), s25 (Qwen3-MoE expert x tensor parallel 8 -> 4), s24 (written
redundancy-free) and s26 (one card) are checked.

It needs MindFormers' environment, not zckpt's: ``ZCKPT_MF_PYTHON`` (a python with mindformers
2.1.0 and mindspore 2.10.0) and ``ZCKPT_MF_ENV`` (the dryrun environment: stub CANN libraries and
Python shims), both built by ``tests/fixtures/mindformers/env/setup.sh VENV ENV``. Without them
the tests skip, saying which is missing; with ``ZCKPT_MF_REQUIRED`` set (``.ci/run`` sets it,
after running that script) they fail instead, so that CI cannot pass without the proof.
``ZCKPT_MF_JOBS`` ranks are loaded at once (default 2); a rank of a 4-rank job takes about 35 s of
compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

from zckpt.jobs.transform import TransformOptions, transform

pytestmark = pytest.mark.mindformers

MF = Path(__file__).parent / "fixtures" / "mindformers"
CHECKER = MF / "mf_load_check.py"


def unavailable(reason: str) -> NoReturn:
    """Skip, or fail where the proof is required (``ZCKPT_MF_REQUIRED``: ``.ci/run``)."""
    if os.environ.get("ZCKPT_MF_REQUIRED"):
        pytest.fail(f"ZCKPT_MF_REQUIRED is set but {reason}")
    pytest.skip(reason)


def mf_environment(scratch: Path) -> tuple[str, str]:
    """MindFormers' python and the dryrun environment, or a skip naming what is missing."""
    python, env = os.environ.get("ZCKPT_MF_PYTHON"), os.environ.get("ZCKPT_MF_ENV")
    if not python or not env:
        unavailable("MindFormers' own loader is run only with ZCKPT_MF_PYTHON (a python with mindformers 2.1.0 "
                    "and mindspore 2.10.0) and ZCKPT_MF_ENV (the dryrun environment) set, as "
                    "tests/fixtures/mindformers/env/setup.sh builds them")
    if not os.access(python, os.X_OK):
        unavailable(f"ZCKPT_MF_PYTHON {python} is not an executable")
    if not (Path(env) / "cann").is_dir() or not (Path(env) / "py").is_dir():
        unavailable(f"ZCKPT_MF_ENV {env} is not a dryrun environment (no cann/ and py/)")
    # (MindFormers makes output/log in the working directory on import)
    probe = subprocess.run([python, "-c", "import mindformers, mindspore"], capture_output=True, text=True,
                           cwd=scratch)
    if probe.returncode:
        unavailable(f"ZCKPT_MF_PYTHON {python} cannot import mindformers and mindspore")
    return python, env


@pytest.mark.parametrize("sid", ["s23", "s25", "s24", "s26"])
def test_mindformers_loads_zckpt_output(sid: str, tmp_path: Path) -> None:
    python, env = mf_environment(tmp_path)
    d = MF / sid
    if not (d / "meta.json").is_file():
        unavailable(f"fixture {d} is not there")
    ck = json.loads((d / "meta.json").read_text())["dst_spec"]["ckpt2"]
    dst = d / "dst" / "strategy.ckpt"
    out = tmp_path / "ckpt"
    transform(d / "src", out, None, dst if dst.is_file() else None,
              options=TransformOptions(format="mindformers", prefix=ck["prefix"],
                                       remove_redundancy=bool(ck["remove_redundancy"])))
    run = subprocess.run([python, str(CHECKER), str(out), str(d), "--env", env, "--work", str(tmp_path / "work"),
                          "-j", os.environ.get("ZCKPT_MF_JOBS", "2")], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    ranks = json.loads((d / "meta.json").read_text())["dst_ranks"]
    ok = [line for line in run.stdout.splitlines() if line.startswith("rank ") and ": ok, " in line]
    assert len(ok) == ranks, run.stdout
