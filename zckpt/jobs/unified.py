"""``unified_safetensors``: a sharded job merged into MindSpore's unified safetensors directory.

The layout is MindSpore's (see :mod:`zckpt.formats.unified`): ``part<i>.safetensors`` holding
whole parameters, ``hyper_param.safetensors`` holding the entries the strategy does not
shard (``global_step``, ``learning_rate``, ``momentum``...), and ``param_name_map.json``.
As in MindSpore 2.10, parameters are spread over ``ceil(total / 3 GiB)`` parts (at most one
per parameter), each parameter going to the part with the fewest bytes so far, largest
first; ``split_dst_file=(k, n)`` writes only machine ``k``'s share of the parts (machine 1
also writes the map and the hyper-parameters).

The sources go through a temporary zckpt store beside ``dst_dir`` (read once, bounded
memory, any layout zckpt reads: ``.ckpt`` or ``.safetensors`` shards); each part is then
streamed from the store into its file, ``max_process_num`` parts at a time. The paths are
local: a URL is refused by name (that store would put the whole model on local disk).

``hyper_param.safetensors`` is MindSpore's (``_save_hyper_param``): every entry of rank 0's
file that no part holds, as rank 0 saved it, under its own name (``choice_func`` neither
renames nor drops it). That includes rank 0's *shard* of ``accu_grads.*`` (never merged into
a part) and of the parameters ``choice_func`` drops. From a store (:func:`unify_store`
without ``rank0_file``) there is no rank 0 file: the hyper-parameters are then the store's
whole entries that are not parameters, and ``accu_grads.*`` are left out.

Differences from MindSpore, deliberate: optimizer states the strategy omits are merged like
their parameter into the parts (MindSpore copies rank 0's shard of those into
``hyper_param.safetensors``); string entries go to ``hyper_param.safetensors``'s metadata
(zckpt's convention).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zckpt.core.errors import SourceError, UsageError
from zckpt.core.layout import Box
from zckpt.formats.opener import open_shard
from zckpt.formats.rank_files import choose_by_suffix, latest_by_numbers
from zckpt.formats.strategy import StrategyMap
from zckpt.formats.unified import HYPER_FILE, MAP_FILE, part_file
from zckpt.io import remote
from zckpt.io.fileio import write_atomic
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.plan.entry_layouts import state_owner
from zckpt.plan.values import RankExport, Slice, TensorSpec
from zckpt.sources.strategies import load_strategy
from zckpt.store.reader import StoreReader, reading
from zckpt.store.store import Store
from zckpt.write.box_adapters import Renamed, ShardBoxes
from zckpt.write.boxes import WriterSettings
from zckpt.write.safetensors_file import no_safetensors_form
from zckpt.write.writers import file_writer

PART_BYTES = 3 * 1024**3
"""MindSpore's target size of one part."""

ChoiceFunc = Callable[[str], "bool | str"]


def split_weights(sizes: Sequence[tuple[str, int]], groups: int) -> list[list[str]]:
    """MindSpore's ``_split_weight_dict``: largest first, each to the lightest group so far."""
    out: list[list[str]] = [[] for _ in range(groups)]
    total = [0] * groups
    for name, size in sorted(sizes, key=lambda t: -t[1]):
        i = total.index(min(total))
        out[i].append(name)
        total[i] += size
    return out


def machine_share(count: int, split_dst_file: tuple[int, int]) -> range:
    """The part indices machine ``k`` of ``n`` writes (MindSpore's split of ``count`` parts)."""
    k, n = split_dst_file
    avg, rem = divmod(count, n)
    start = avg * (k - 1) + min(k - 1, rem)
    return range(start, start + avg + (1 if k <= rem else 0))


def collect_rank_files(src_dir: Path, file_suffix: str | None) -> dict[int, Path]:
    """MindSpore's ``_collect_safetensor_files``: ``rank_<r>/*<file_suffix>.safetensors``, several
    narrowed by :func:`~zckpt.formats.rank_files.choose_by_suffix` (its ``_find_most_matching_file``)."""
    out: dict[int, Path] = {}
    for d in sorted(src_dir.glob("rank_[0-9]*")):
        rank = d.name.split("rank_")[-1]
        if not d.is_dir() or not rank.isdigit():
            continue
        tail = f"{file_suffix}.safetensors" if file_suffix is not None else ".safetensors"
        files = sorted(f.name for f in d.iterdir() if f.name.endswith(tail) and f.is_file())
        if len(files) > 1 and file_suffix is not None:
            out[int(rank)] = d / choose_by_suffix(files, "safetensors", str(d), file_suffix).name
        elif len(files) > 1:  # a tie on the numbers goes to the last name (MindSpore: the listing's order)
            out[int(rank)] = d / max(latest_by_numbers(files)[0])
        elif files:
            out[int(rank)] = d / files[0]
        elif file_suffix is not None:
            raise SourceError(f"no safetensors file ending with {file_suffix!r}", path=d)
    return out


def _renamed(name: str, choice_func: ChoiceFunc | None) -> str | None:
    """The name ``choice_func`` gives an entry: ``None`` to leave it out."""
    if choice_func is None:
        return name
    out = choice_func(name)
    if isinstance(out, bool):
        return name if out else None
    if isinstance(out, str):
        return out
    raise UsageError(f"For 'unified_safetensors', the return value type of the function 'choice_func' must be bool "
                     f"or str, but got {type(out)}.", param=name)


def write_part(store_path: str, names: Sequence[tuple[str, str]], target: Path, options: ExportOptions,
               strings: Sequence[tuple[str, str]] = ()) -> Path:
    """One file holding the whole entries ``(store name, file name)``, streamed from the store."""
    store = Store.open(store_path)
    shapes = {e.name: e.shape for e in store.entries()}
    slices = [Slice(out, Box.full(shapes[src])) for src, out in [*names, *strings]]
    reader = Renamed(StoreReader(store, options), {out: src for src, out in [*names, *strings]})
    file_writer("safetensors", WriterSettings.of(options)).write(reader, RankExport(0, tuple(slices)), target)
    return target


def copy_hyper(rank0_file: str | os.PathLike[str], in_parts: set[str], target: Path,
               options: ExportOptions) -> Path | None:
    """MindSpore's ``_save_hyper_param``: the entries of rank 0's file no part holds, streamed
    as saved into ``target``; ``None`` when there are none."""
    with open_shard(rank0_file, verify_crc=False) as r:
        rest = {n: e for n, e in r.entries.items() if n not in in_parts}
        if not rest:
            return None
        for n, e in rest.items():
            if e.kind == "map":
                raise no_safetensors_form(n, error=UsageError, path=rank0_file)
        slices = tuple(Slice(n, Box.full(e.shape)) for n, e in rest.items())
        file_writer("safetensors", WriterSettings.of(options)).write(ShardBoxes(r, options.block_bytes),
                                                              RankExport(0, slices), target)
    return target


def _write_json(path: Path, doc: object) -> None:
    write_atomic(path, json.dumps(doc, indent=4).encode("utf-8"))


def unify_store(
    store_path: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    strategy: StrategyMap | None = None,
    *,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
    max_process_num: int = 64,
    part_bytes: int = PART_BYTES,
    rank0_file: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write a store's whole tensors as a unified directory; the files written, parts first.

    The parts hold the entries ``strategy`` (the source's) lists, with optimizer states of a
    listed parameter, except ``accu_grads.*``. ``hyper_param.safetensors`` holds, with
    ``rank0_file`` (the source's rank 0 file), every entry of that file no part holds, copied
    as saved (MindSpore's rule); without it, the store's other entries but ``accu_grads.*``.
    Without a strategy, the parameters are the entries of more than one element.
    """
    with reading(store_path):
        store = Store.open(store_path)
        store.check_integrity()
        return _unify(store, Path(dst_dir), strategy, choice_func, split_dst_file, max_process_num, part_bytes,
                      rank0_file)


def _unify(store: Store, dst: Path, strategy: StrategyMap | None, choice_func: ChoiceFunc | None,
           split_dst_file: tuple[int, int] | tuple[()], max_process_num: int, part_bytes: int,
           rank0_file: str | os.PathLike[str] | None) -> list[Path]:
    """:func:`unify_store` once the store is held and checked."""
    dst.mkdir(parents=True, exist_ok=True)
    specs: list[TensorSpec] = store.specs()
    params: list[tuple[str, str, int]] = []
    hyper: list[tuple[str, str]] = []
    strings: list[tuple[str, str]] = []
    for t in specs:
        if t.name.startswith("accu_grads"):
            continue
        out = _renamed(t.name, choice_func)
        if out is None:
            continue
        if t.kind == "str":
            strings.append((t.name, out))
        elif t.kind != "tensor":
            raise no_safetensors_form(t.name, error=UsageError)
        elif _is_parameter(t, strategy):
            params.append((t.name, out, t.nbytes))
        else:
            hyper.append((t.name, out))
    count = min(max(1, math.ceil(sum(p[2] for p in params) / part_bytes)), len(params)) if params else 0
    groups = split_weights([(p[0], p[2]) for p in params], count) if count else []
    rename = {p[0]: p[1] for p in params}
    share = machine_share(count, split_dst_file) if split_dst_file else range(count)
    first_machine = not split_dst_file or split_dst_file[0] == 1
    options = ExportOptions(format="safetensors", overlap=False)
    jobs = [([(n, rename[n]) for n in groups[i]], dst / part_file(i)) for i in share]
    workers = max(1, min(len(jobs), max_process_num))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zckpt-unified") as pool:
        written = list(pool.map(lambda j: write_part(store.url, j[0], j[1], options), jobs))
    if first_machine:
        if rank0_file is not None:
            copied = copy_hyper(rank0_file, set(rename), dst / HYPER_FILE, options)
            written += [copied] if copied is not None else []
        elif hyper or strings:
            written.append(write_part(store.url, hyper, dst / HYPER_FILE, options, strings))
        weight_map = {rename[n]: part_file(i) for i, g in enumerate(groups) for n in g}
        _write_json(dst / MAP_FILE, {"metadata": {"total_size": sum(p[2] for p in params)}, "weight_map": weight_map})
        written.append(dst / MAP_FILE)
    return written


def _is_parameter(t: TensorSpec, strategy: StrategyMap | None) -> bool:
    if strategy is None:
        return math.prod(t.shape) > 1
    return t.name in strategy.layouts or state_owner(t.name, strategy.layouts) is not None


def _check_split(split_dst_file: object) -> tuple[int, int] | tuple[()]:
    if split_dst_file == () or split_dst_file is None:
        return ()
    ok = (isinstance(split_dst_file, (tuple, list)) and len(split_dst_file) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in split_dst_file)
          and 1 <= split_dst_file[0] <= split_dst_file[1])
    if not ok:
        raise UsageError(f"split_dst_file must be () or (k, n) with 1 <= k <= n, got {split_dst_file!r}")
    return (int(split_dst_file[0]), int(split_dst_file[1]))  # type: ignore[index]


def refuse_urls(**paths: str | os.PathLike[str] | None) -> None:
    """The job goes through a temporary store beside ``dst_dir`` and writes local files: a URL
    is refused by name rather than spooled to local disk or read as a local path."""
    for what, p in paths.items():
        if p is not None and remote.is_remote(p):
            raise UsageError(f"For 'unified_safetensors', the '{what}' must be a local path (the job goes through "
                             "a temporary store on local disk); transform_checkpoints takes URLs", path=str(p))


def unified_safetensors(
    src_dir: str,
    src_strategy_file: str,
    dst_dir: str,
    merge_with_redundancy: bool = True,
    file_suffix: str | None = None,
    max_process_num: int = 64,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
) -> None:
    """Merge a sharded job (``src_dir/rank_<r>/*.safetensors`` or ``.ckpt``) into MindSpore's
    unified safetensors directory ``dst_dir`` (see the module).

    ``merge_with_redundancy`` is accepted for MindSpore's signature: zckpt takes each region
    from whichever rank holds it and refuses a job where no rank does, deduplicated or not.
    """
    if src_strategy_file is not None and not isinstance(src_strategy_file, (str, os.PathLike)):
        raise TypeError(f"The src_strategy_file should be a str, but got {type(src_strategy_file).__name__}.")
    if not isinstance(merge_with_redundancy, bool):
        raise TypeError(f"merge_with_redundancy should be a bool, but got {type(merge_with_redundancy).__name__}.")
    if not isinstance(max_process_num, int) or isinstance(max_process_num, bool) or max_process_num < 1:
        raise UsageError(f"max_process_num must be a positive int, got {max_process_num!r}")
    if choice_func is not None and not callable(choice_func):
        raise TypeError(f"The choice_func should be callable, but got {type(choice_func).__name__}.")
    split = _check_split(split_dst_file)
    refuse_urls(src_dir=src_dir, src_strategy_file=src_strategy_file, dst_dir=dst_dir)
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    src = Path(src_dir)
    if src.is_file():
        raise UsageError("For 'unified_safetensors', the 'src_dir' can not be a file.", path=src)
    st_files = collect_rank_files(src, file_suffix)
    ckpt_files = [d for d in src.glob("rank_[0-9]*") if d.name[5:].isdigit() and d.is_dir() and any(d.glob("*.ckpt"))]
    if st_files and ckpt_files:
        raise SourceError("For 'unified_safetensors', the 'src_dir' cannot contain both ckpt file and safetensors "
                          "file simultaneously", path=src)
    smap = load_strategy(src_strategy_file)
    sources: dict[int, Path] | str = st_files if st_files else str(src)
    with tempfile.TemporaryDirectory(prefix=".zckpt-", dir=dst) as tmp:
        store = Path(tmp) / "store.zarr"
        report = ingest(sources, store, smap, IngestOptions(workers=1))
        unify_store(store, dst, smap, choice_func=choice_func, split_dst_file=split, max_process_num=max_process_num,
                    rank0_file=report.rank_files.get(0))
