"""Every entry point works on bf16 data in a fresh interpreter (issue 25).

zarr-python has no ``bfloat16`` of its own: zckpt registers it (:mod:`zckpt.zarr_bfloat16`) when
:mod:`zckpt.io.zarr_local` is imported. A module that imported zarr directly worked in the test
process, where some earlier import had registered the type, and failed in a user's fresh process
(``zckpt consolidate`` on any store holding bf16). So here each CLI command and each public
function runs in a new interpreter on a job whose tensors are bf16, and its output is compared
with values cut by :mod:`oracle` from the global tensors. The source files and strategies are
written with protobuf messages directly and the outputs decoded the same way (safetensors by its
header), so no zckpt encoder or reader decides what is right.

The cases are keyed by the CLI's subcommands (taken from its parser) and by the public names of
``zckpt`` and ``zckpt.parallel``: a new command or function without a case fails
:func:`test_every_subcommand_has_a_case` or :func:`test_every_public_function_has_a_case`.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import oracle
import pytest

import zckpt
import zckpt.parallel
from zckpt.cli.parser import build_parser
from zckpt.formats.strategy import ParamLayout
from zckpt.jobs.generate import write_pipeline_strategies
from zckpt.jobs.generate_model import TensorDef
from zckpt.third_party.mindspore_proto import ms_checkpoint_pb2 as ckpt_pb
from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
TENSORS: dict[str, tuple[tuple[int, ...], list[int] | None, list[int] | None]] = {
    # name: (global shape, source tensor_map, destination tensor_map) on dev_matrix [2]; None: unlisted
    "net.w": ((8, 6), [0, -1], [-1, 0]),
    "net.c": ((4, 6), [-1, 0], [0, -1]),
    "net.b": ((6,), None, None),  # whole on every rank (a packed array in the store)
}
LR = np.array(0.25, dtype=np.float32)


def global_bits(name: str) -> np.ndarray:
    """A tensor's bf16 bit patterns: every element distinct and finite."""
    shape = TENSORS[name][0]
    start = 0x3C00 + sum(name.encode()) % 256
    return (np.arange(int(np.prod(shape)), dtype=np.uint16) * 3 + start).astype(np.uint16).reshape(shape)


def _layout(tmap: list[int]) -> oracle.Layout:
    return {"dev": [RANKS], "map": [[a] if a >= 0 else [] for a in tmap], "tshape": None, "opt": 0,
            "split": [], "offset": []}


def expected(name: str, side: int | None, rank: int) -> np.ndarray:
    """What rank ``rank`` holds of ``name`` on the source (``side`` 1) or destination (2) side,
    or the whole tensor (``side`` None)."""
    tmap = TENSORS[name][side] if side is not None else None
    whole = global_bits(name)
    return whole if tmap is None else oracle.expected_shard(whole, _layout(tmap), rank)


def _ckpt_bytes(values: dict[str, np.ndarray]) -> bytes:
    msg = ckpt_pb.Checkpoint()
    for name, arr in values.items():
        v = msg.value.add()
        v.tag = name
        v.tensor.dims.extend(arr.shape)
        v.tensor.tensor_type = "Float32" if arr.dtype == np.float32 else "BFloat16"
        v.tensor.tensor_content = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
    return msg.SerializeToString()


def _strategy_bytes(side: int) -> bytes:
    msg = pb.ParallelStrategyMap()
    msg.current_stage = 0
    for name, spec in TENSORS.items():
        tmap = spec[side]
        if tmap is None:
            continue
        item = msg.parallel_layout_item.add()
        item.param_name = name
        lay = item.parallel_layouts
        lay.dev_matrix.add().dim.extend([RANKS])
        lay.tensor_map.add().dim.extend(tmap)
        lay.field = 0
        lay.opt_weight_shard_step = 0
        lay.opt_weight_shard_size = 0
    return msg.SerializeToString()


def read_ckpt(path: Path) -> dict[str, np.ndarray]:
    """A ``.ckpt`` decoded by protobuf alone; bf16 as its uint16 bits."""
    data = path.read_bytes()
    if len(data) >= 17 and data[-17:-10] == b"crc_num":
        data = data[:-17]
    parts: dict[str, list[bytes]] = {}
    meta: dict[str, tuple[list[int], str]] = {}
    for v in ckpt_pb.Checkpoint.FromString(data).value:
        parts.setdefault(v.tag, []).append(v.tensor.tensor_content)
        meta.setdefault(v.tag, (list(v.tensor.dims), v.tensor.tensor_type))
    out = {}
    for tag, chunks in parts.items():
        dims, ms_type = meta[tag]
        if ms_type in ("BFloat16", "Float32"):
            dtype = "<u2" if ms_type == "BFloat16" else "<f4"
            out[tag] = np.frombuffer(b"".join(chunks), dtype=dtype).reshape(dims)
    return out


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A ``.safetensors`` file decoded from its header; bf16 as its uint16 bits."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] not in ("BF16", "F32"):
            continue
        a, b = t["data_offsets"]
        dtype = "<u2" if t["dtype"] == "BF16" else "<f4"
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=dtype).reshape(t["shape"])
    return out


def read_any(path: Path) -> dict[str, np.ndarray]:
    return read_safetensors(path) if path.suffix == ".safetensors" else read_ckpt(path)


def check_values(got: dict[str, np.ndarray], side: int | None, rank: int, where: object) -> None:
    """``got`` holds every tensor of the job as ``rank`` of ``side`` holds it, bit for bit."""
    for name in TENSORS:
        want = expected(name, side, rank)
        assert name in got, f"{where}: {name} missing (holds {sorted(got)})"
        assert got[name].shape == want.shape, f"{where}: {name} shape {got[name].shape} != {want.shape}"
        assert got[name].view("<u2").tobytes() == want.astype("<u2").tobytes(), f"{where}: {name} differs"
    if "learning_rate" in got:
        assert got["learning_rate"].tobytes() == LR.tobytes()


def check_job(out: Path, side: int | None, suffix: str = ".ckpt") -> None:
    """``out/rank_<r>/`` holds one file per rank with that rank's values (one rank for ``side`` None)."""
    ranks = RANKS if side is not None else 1
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"rank_{r}" for r in range(ranks)]
    for r in range(ranks):
        files = sorted((out / f"rank_{r}").glob(f"*{suffix}"))
        assert len(files) == 1, files
        check_values(read_any(files[0]), side, r, files[0])


@dataclass(frozen=True)
class Job:
    root: Path
    src: Path
    src_strategy: Path
    dst_strategy: Path
    pipeline_strategies: Path
    merged_strategy: Path
    """What MindSpore's ``merge_pipeline_strategys`` makes of ``pipeline_strategies`` (zckpt.jobs.generate
    writes it)."""
    store: Path

    def rank_file(self, r: int) -> Path:
        return self.src / f"rank_{r}" / f"checkpoint_{r}.ckpt"

    def store_copy(self, tmp: Path) -> Path:
        """A store of its own for a case that changes it."""
        return Path(shutil.copytree(self.store, tmp / "copy.zarr", symlinks=True))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    root = tmp_path_factory.mktemp("bf16job")
    src = root / "src"
    for r in range(RANKS):
        values = {n: expected(n, 1, r).view(np.uint16) for n in TENSORS}
        values["learning_rate"] = LR
        path = src / f"rank_{r}" / f"checkpoint_{r}.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(_ckpt_bytes(values))
    (root / "src_strategy.ckpt").write_bytes(_strategy_bytes(1))
    (root / "dst_strategy.ckpt").write_bytes(_strategy_bytes(2))
    stages = [[TensorDef(f"s{s}.{n}", spec[0], "BFloat16", ParamLayout((RANKS,), tuple((a,) if a >= 0 else ()
                                                                                    for a in spec[1])))
               for n, spec in TENSORS.items() if spec[1] is not None] for s in range(2)]
    pipe, merged = write_pipeline_strategies(root / "pipeline", stages, stage_device_num=RANKS)
    store = root / "store.zarr"
    zckpt.ingest(str(src), store, str(root / "src_strategy.ckpt"))
    return Job(root, src, root / "src_strategy.ckpt", root / "dst_strategy.ckpt", pipe, merged, store)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_cli(*args: object) -> str:
    """``zckpt ARGS`` in a fresh interpreter; it must exit 0. Its standard output."""
    proc = subprocess.run([sys.executable, "-m", "zckpt.cli", *map(str, args)], capture_output=True, text=True,
                          env=_env(), check=False)
    assert proc.returncode == 0, f"zckpt {' '.join(map(str, args))}: exit {proc.returncode}\n{proc.stderr}"
    return proc.stdout


def run_py(code: str, **paths: object) -> str:
    """``code`` in a fresh interpreter, with ``A`` the dict of ``paths`` (as strings); it must succeed."""
    prelude = f"import json, sys\nA = json.loads({json.dumps(json.dumps({k: str(v) for k, v in paths.items()}))})\n"
    proc = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=_env(),
                          check=False)
    assert proc.returncode == 0, f"{code}\n{proc.stderr}"
    return proc.stdout


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the CLI has no subcommands")


def _options(command: str) -> set[str]:
    return {s for a in _subparsers()[command]._actions for s in a.option_strings}


# --------------------------------------------------------------------------- CLI


def _cli_ingest(job: Job, tmp: Path) -> None:
    store = tmp / "s.zarr"
    run_cli("ingest", job.src, "--src-strategy", job.src_strategy, "--store", store)
    run_cli("ingest", job.src, "--src-strategy", job.src_strategy, "--store", store)  # reopens the store
    zckpt.export(store, tmp / "out", str(job.dst_strategy))
    check_job(tmp / "out", 2)


def _cli_export(job: Job, tmp: Path) -> None:
    for reader in ("zarr", "dask"):
        run_cli("export", job.store, "--dst-strategy", job.dst_strategy, "--out", tmp / reader, "--reader", reader)
        check_job(tmp / reader, 2)
    run_cli("export", job.store, "--out", tmp / "st", "--format", "safetensors")
    check_job(tmp / "st", None, ".safetensors")


def _cli_transform(job: Job, tmp: Path) -> None:
    run_cli("transform", job.src, "--src-strategy", job.src_strategy, "--dst-strategy", job.dst_strategy,
            "--out", tmp / "out")
    check_job(tmp / "out", 2)


def _needed_sources(dst_rank: int) -> set[int]:
    """Source ranks holding some element of what ``dst_rank`` holds of a listed tensor (by the oracle)."""
    need = set()
    for shape, src_map, dst_map in TENSORS.values():
        if src_map is None or dst_map is None:
            continue
        ids = np.arange(int(np.prod(shape))).reshape(shape)
        want = oracle.expected_shard(ids, _layout(dst_map), dst_rank)
        need |= {r for r in range(RANKS) if np.intersect1d(want, oracle.expected_shard(ids, _layout(src_map), r)).size}
    return need


def _cli_plan(job: Job, tmp: Path) -> None:
    doc = json.loads(run_cli("plan", "--src-strategy", job.src_strategy, "--dst-strategy", job.dst_strategy,
                             "--json"))
    assert {int(r): set(s) for r, s in doc["ranks"].items()} == {r: _needed_sources(r) for r in range(RANKS)}


def _cli_info(job: Job, tmp: Path) -> None:
    doc = json.loads(run_cli("info", job.store, "--json"))
    held = {e["name"]: (e["ms_type"], tuple(e["shape"])) for e in doc["entries"]}
    assert {n: held[n] for n in TENSORS} == {n: ("BFloat16", spec[0]) for n, spec in TENSORS.items()}


def _merged_names(path: Path) -> set[str]:
    return {item.param_name for item in pb.ParallelStrategyMap.FromString(path.read_bytes()).parallel_layout_item}


def _cli_merge_strategies(job: Job, tmp: Path) -> None:
    out = tmp / "merged.ckpt"
    run_cli("merge-strategies", job.pipeline_strategies, *(["--out"] if "--out" in _options("merge-strategies")
                                                          else []), out)
    assert _merged_names(out) == _merged_names(job.merged_strategy)


def _cli_load(job: Job, tmp: Path) -> None:
    for r in range(RANKS):
        for name in TENSORS:
            npy = tmp / f"{name}.{r}.npy"
            run_cli("load", job.store, "--rank", r, "--dst-strategy", job.dst_strategy, "--param", name,
                    "--out", npy)
            check_one = {name: np.load(npy)}
            got = expected(name, 2, r)
            assert check_one[name].view("<u2").tobytes() == got.tobytes() and check_one[name].shape == got.shape


def _cli_consolidate(job: Job, tmp: Path) -> None:
    store = job.store_copy(tmp)
    run_cli("consolidate", store)
    meta = json.loads((store / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    assert any(m.get("data_type") == "bfloat16" for m in meta.values())
    run_cli("export", store, "--dst-strategy", job.dst_strategy, "--out", tmp / "out", "--reader", "dask")
    check_job(tmp / "out", 2)


def _cli_verify(job: Job, tmp: Path) -> None:
    zckpt.export(job.store, tmp / "out", str(job.dst_strategy))
    run_cli("verify", job.store)
    run_cli("verify", job.store, job.src, "--src-strategy", job.src_strategy, "--against", tmp / "out",
            "--dst-strategy", job.dst_strategy)


CLI_CASES: dict[str, Callable[[Job, Path], None]] = {
    "ingest": _cli_ingest,
    "export": _cli_export,
    "transform": _cli_transform,
    "plan": _cli_plan,
    "info": _cli_info,
    "merge-strategies": _cli_merge_strategies,
    "load": _cli_load,
    "consolidate": _cli_consolidate,
    "verify": _cli_verify,
}


def test_every_subcommand_has_a_case() -> None:
    assert sorted(_subparsers()) == sorted(CLI_CASES), "a CLI subcommand has no fresh-interpreter case here"


@pytest.mark.parametrize("command", sorted(CLI_CASES))
def test_cli_in_a_fresh_interpreter(command: str, job: Job, tmp_path: Path) -> None:
    CLI_CASES[command](job, tmp_path)


# --------------------------------------------------------------------------- public functions

CALL = "import importlib\nfn = getattr(importlib.import_module(A['module']), A['name'])\n"
"""Each case's code starts here: ``fn`` is the function under test, imported by the fresh interpreter."""


def _api_ingest(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "fn(A['src'], A['store'], A['strategy'])", module=module, name=name, src=job.src,
           store=tmp / "s.zarr", strategy=job.src_strategy)
    zckpt.export(tmp / "s.zarr", tmp / "out", str(job.dst_strategy))
    check_job(tmp / "out", 2)


def _api_export(module: str, name: str, job: Job, tmp: Path) -> None:
    for reader in ("zarr", "dask"):
        run_py(CALL + "import zckpt\nfn(A['store'], A['out'], A['strategy'], "
               "options=zckpt.ExportOptions(reader=A['reader']))",
               module=module, name=name, store=job.store, out=tmp / reader, strategy=job.dst_strategy, reader=reader)
        check_job(tmp / reader, 2)


def _api_open_store(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "import numpy as np\nst = fn(A['store'])\n"
           "np.savez(A['out'], **{n: np.asarray(st.array(n)[...]) for n in A['names'].split(',')})",
           module=module, name=name, store=job.store, out=tmp / "v.npz", names=",".join(TENSORS))
    with np.load(tmp / "v.npz") as got:
        check_values({n: got[n] for n in TENSORS}, None, 0, "open_store")


def _api_load_slice(module: str, name: str, job: Job, tmp: Path) -> None:
    for r in range(RANKS):
        out = tmp / f"r{r}.npz"
        run_py(CALL + "import numpy as np\n"
               "np.savez(A['out'], **{n: fn(A['store'], int(A['rank']), A['strategy'], n).view(np.uint16) "
               "for n in A['names'].split(',')})",
               module=module, name=name, store=job.store, out=out, rank=r, strategy=job.dst_strategy,
               names=",".join(TENSORS))
        with np.load(out) as got:
            check_values({n: got[n] for n in TENSORS}, 2, r, f"load_slice rank {r}")


def _api_load_distributed_checkpoint(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "fn(None, predict_strategy=A['strategy'], format='safetensors', store=A['store'], "
           "dst_safetensors_dir=A['out'])",
           module=module, name=name, store=job.store, out=tmp / "out", strategy=job.dst_strategy)
    check_job(tmp / "out", 2, ".safetensors")


def _api_load_segmented_checkpoints(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "import numpy as np\nvalues = fn(A['dir'])\n"
           "np.savez(A['out'], **{n: np.asarray(v).view(np.uint16) for n, v in values.items() if n.startswith('net')})",
           module=module, name=name, dir=job.src / "rank_1", out=tmp / "v.npz")
    with np.load(tmp / "v.npz") as got:
        check_values({n: got[n] for n in TENSORS}, 1, 1, name)


def _api_open_segmented(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "import numpy as np\nwith fn(A['dir']) as seg:\n"
           "    np.savez(A['out'], **{n: np.asarray(seg[n]).view(np.uint16) for n in seg if n.startswith('net')})",
           module=module, name=name, dir=job.src / "rank_0", out=tmp / "v.npz")
    with np.load(tmp / "v.npz") as got:
        check_values({n: got[n] for n in TENSORS}, 1, 0, name)


def _api_transform_checkpoints(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "fn(A['src'], A['out'], 'checkpoint_', A['src_strategy'], A['dst_strategy'])",
           module=module, name=name, src=job.src, out=tmp / "out", src_strategy=job.src_strategy,
           dst_strategy=job.dst_strategy)
    check_job(tmp / "out", 2)


def _api_transform_checkpoint_by_rank(module: str, name: str, job: Job, tmp: Path) -> None:
    out = tmp / "rank_1" / "checkpoint_1.ckpt"
    run_py(CALL + "fn(1, {0: A['f0'], 1: A['f1']}, A['out'], A['src_strategy'], A['dst_strategy'])",
           module=module, name=name, f0=job.rank_file(0), f1=job.rank_file(1), out=out,
           src_strategy=job.src_strategy, dst_strategy=job.dst_strategy)
    check_values(read_ckpt(out), 2, 1, out)


def _api_rank_list(module: str, name: str, job: Job, tmp: Path) -> None:
    for r in range(RANKS):
        got = json.loads(run_py(CALL + "print(json.dumps(fn(int(A['rank']), A['src'], A['dst'])))",
                                module=module, name=name, rank=r, src=job.src_strategy, dst=job.dst_strategy))
        assert got == sorted(_needed_sources(r), reverse=True)


def _api_merge_pipeline_strategys(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "fn(A['dir'], A['out'])", module=module, name=name, dir=job.pipeline_strategies,
           out=tmp / "merged.ckpt")
    assert _merged_names(tmp / "merged.ckpt") == _merged_names(job.merged_strategy)


def _api_unified_safetensors(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "fn(A['src'], A['strategy'], A['out'])", module=module, name=name, src=job.src,
           strategy=job.src_strategy, out=tmp / "out")
    got: dict[str, np.ndarray] = {}
    for path in (tmp / "out").glob("*.safetensors"):
        got |= read_safetensors(path)
    check_values(got, None, 0, tmp / "out")


def _api_ckpt_to_safetensors(module: str, name: str, job: Job, tmp: Path) -> None:
    run_py(CALL + "fn(A['src'], A['out'])", module=module, name=name, src=job.src, out=tmp / "out")
    check_job(tmp / "out", 1, ".safetensors")


def _api_safetensors_to_ckpt(module: str, name: str, job: Job, tmp: Path) -> None:
    zckpt.ckpt_to_safetensors(str(job.src), str(tmp / "st"))
    check_job(tmp / "st", 1, ".safetensors")
    run_py(CALL + "fn(A['src'], A['out'])", module=module, name=name, src=tmp / "st", out=tmp / "out")
    check_job(tmp / "out", 1)


API_CASES: dict[str, Callable[[str, str, Job, Path], None]] = {
    "ingest": _api_ingest,
    "export": _api_export,
    "open_store": _api_open_store,
    "load_slice": _api_load_slice,
    "load_distributed_checkpoint": _api_load_distributed_checkpoint,
    "load_segmented_checkpoints": _api_load_segmented_checkpoints,
    "open_segmented": _api_open_segmented,
    "transform_checkpoints": _api_transform_checkpoints,
    "convert_checkpoints": _api_transform_checkpoints,
    "transform_checkpoint_by_rank": _api_transform_checkpoint_by_rank,
    "convert_checkpoint_by_rank": _api_transform_checkpoint_by_rank,
    "rank_list_for_transform": _api_rank_list,
    "rank_list_for_convert": _api_rank_list,
    "merge_pipeline_strategys": _api_merge_pipeline_strategys,
    "unified_safetensors": _api_unified_safetensors,
    "ckpt_to_safetensors": _api_ckpt_to_safetensors,
    "safetensors_to_ckpt": _api_safetensors_to_ckpt,
}


def _public_functions() -> list[tuple[str, str]]:
    """``(module, name)`` of every function ``zckpt`` and ``zckpt.parallel`` export."""
    out = []
    for module in (zckpt, zckpt.parallel):
        for name in module.__all__:
            if inspect.isfunction(getattr(module, name)):
                out.append((module.__name__, name))
    return out


def test_every_public_function_has_a_case() -> None:
    missing = sorted({name for _, name in _public_functions()} - set(API_CASES))
    assert not missing, f"public functions without a fresh-interpreter case here: {missing}"


@pytest.mark.parametrize("module,name", _public_functions())
def test_function_in_a_fresh_interpreter(module: str, name: str, job: Job, tmp_path: Path) -> None:
    API_CASES[name](module, name, job, tmp_path)


# --------------------------------------------------------------------------- the one door to zarr


def _runtime_zarr_imports(path: Path) -> list[int]:
    """Lines of ``path`` importing zarr-python outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    lines = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "zarr" for a in node.names):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "zarr":
            lines.append(node.lineno)
    return lines


def test_zarr_is_imported_only_through_zarr_local() -> None:
    """Any other module importing zarr could use it before ``bfloat16`` is registered."""
    door = {ROOT / "zckpt" / "io" / "zarr_local.py", ROOT / "zckpt" / "zarr_bfloat16.py"}
    stray = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "zckpt").rglob("*.py"))
             if p not in door and (lines := _runtime_zarr_imports(p))}
    assert not stray, f"import zarr from zckpt.io.zarr_local instead: {stray}"
    assert _runtime_zarr_imports(ROOT / "zckpt" / "io" / "zarr_local.py")  # the check sees imports where they are
