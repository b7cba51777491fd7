"""``load_distributed_checkpoint``: one rank's slices read where they are, loaded into a network.

MindSpore's function loads every source file whole (``format="ckpt"``) or every unified
tensor whole (``format="safetensors"``), merges and re-splits in memory. Here the calling
rank reads only its slice of each parameter (a load-time reshard, as Orbax and PyTorch DCP
do), from one of three places:

* source shards (``checkpoint_filenames`` with ``train_strategy_filename``): the mapped
  files, only the regions of the shards that overlap the slice (:class:`ShardSlicer`);
* MindSpore's unified safetensors directory (``format="safetensors"``,
  ``unified_safetensors_dir``): the same, over the one full source it is;
* a zckpt store (keyword-only ``store=``): the chunks that overlap the slice.

The destination layout is ``predict_strategy``: ``None`` (whole tensors), MindSpore's layout
dict (``model.infer_predict_layout``: ``{name: [dev_matrix, tensor_map, param_split_shape,
field_size, opt_shard_step, opt_shard_size]}``) or a strategy file. The rank is
``rank_id`` when given, else ``mindspore.communication.get_rank()`` (0 when communication
is not initialised, as MindSpore does for ``format="safetensors"``).

MindSpore is imported only to build Parameters for the network (``network`` a ``Cell``);
without a network (``format="safetensors"``, ``dst_safetensors_dir``) each rank's slices
are written as ``dst_safetensors_dir/rank_<r>/net.<output_format>``, streamed from the
slicer, without MindSpore.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from zckpt.core.dtypes import ms_dtype, public_array
from zckpt.core.errors import LayoutError, OutputError, SourceError, StrategyError, UsageError
from zckpt.core.layout import Box
from zckpt.formats.opener import open_remote, open_shard
from zckpt.formats.remote_shard import RemoteShard
from zckpt.formats.shard_reader import ShardReader
from zckpt.formats.strategy import ParamLayout, StrategyMap, make_layout
from zckpt.formats.unified import find_unified
from zckpt.io import remote, safe_paths
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.msnet import load_into_network
from zckpt.plan.export_plan import build_export_plan
from zckpt.plan.values import ExportPlan, IngestPlan, RankExport, Slice, TensorSpec
from zckpt.run.collect import fewer_collections
from zckpt.sources.prepare import prepare_ingest
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.store.reader import StoreReader, check_coverage, reading
from zckpt.store.store import Store
from zckpt.write.box_adapters import RegionBoxes, Renamed
from zckpt.write.writers import file_writer

Value = np.ndarray | str


class ShardSlicer:
    """Regions of entries read straight from source shards (headers indexed once; payload
    bytes read only where a requested region overlaps a shard). Threads may share one: each
    opens (maps) the shards it reads itself."""

    def __init__(self, files: Mapping[int, str | Path] | str | Path, strategy: StrategyArg,
                 storage_options: remote.StorageOptions = None) -> None:
        prepared = prepare_ingest(files, strategy, storage_options=storage_options)
        plan = prepared.plan
        self.storage_options = storage_options
        self._indexes = prepared.indexes
        self.plan: IngestPlan = plan
        self._writes: dict[str, list[tuple[int, Box]]] = {}
        for w in plan.writes:
            self._writes.setdefault(w.name, []).append((w.rank, w.box))
        self._local = threading.local()
        self._opened: list[ShardReader] = []
        self._lock = threading.Lock()

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.plan.tensors

    def _reader(self, rank: int) -> ShardReader:
        readers: dict[int, ShardReader] = self._local.__dict__.setdefault("readers", {})
        if rank not in readers:
            path = self.plan.rank_files[rank]
            readers[rank] = open_remote(str(path), self.storage_options, index=(self._indexes or {}).get(rank)) \
                if remote.is_remote(str(path)) else open_shard(path, verify_crc=False)
            with self._lock:
                self._opened.append(readers[rank])
        return readers[rank]

    def read(self, name: str, box: Box) -> Value:
        """The region ``box`` (global coordinates) of entry ``name``."""
        if self.plan.kind_of(name) == "str":
            rank = self._writes[name][0][0] if name in self._writes else min(self.plan.rank_files)
            return self._reader(rank).string(name)
        spec = next(t for t in self.plan.tensors if t.name == name)
        out = np.empty(box.shape, dtype=ms_dtype(spec.ms_type).storage)
        covered = 0
        for rank, shard_box in self._writes.get(name, ()):
            inter = shard_box.intersect(box) if box.ndim else shard_box
            if inter is None:
                continue
            reader = self._reader(rank)
            if isinstance(reader, RemoteShard) and box.ndim:  # the region's runs only
                part = inter.relative_to(shard_box)
                out[inter.relative_to(box).slices()] = reader.read_region(name, part.start, part.stop)
                covered += inter.size
                continue
            shard = reader.array(name).reshape(shard_box.shape)
            if box.ndim:
                out[inter.relative_to(box).slices()] = shard[inter.relative_to(shard_box).slices()]
            else:
                out[...] = shard
            del shard
            reader.release_pages()  # the mapped pages just read would count in RSS until released
            covered += inter.size
        if covered != box.size:
            raise SourceError(f"the source shards hold {covered} of the {box.size} elements of region "
                              f"{box.to_json()}", param=name)
        return public_array(out, spec.ms_type)

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for r in opened:
            r.close()
        self._local = threading.local()

    def __enter__(self) -> ShardSlicer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def predict_layout_map(predict: Mapping[str, Sequence[Any]]) -> StrategyMap:
    """MindSpore's predict layout dict as a strategy (``[dev_matrix, tensor_map,
    param_split_shape, field_size, opt_shard_step, opt_shard_size]`` per parameter; an
    optimizer-shard *group name* in place of the size cannot be resolved without
    communication and is refused)."""
    layouts: dict[str, dict[int, ParamLayout]] = {}
    for name, value in predict.items():
        if not isinstance(name, str) or not isinstance(value, (list, tuple)) or len(value) < 4:
            raise UsageError("For 'load_distributed_checkpoint', the argument 'predict_strategy' is dict, the key of "
                             "it must be string, and the value of it must be list or tuple that the first four "
                             "elements must be dev_matrix (list[int]), tensor_map (list[int]), param_split_shape "
                             "(list[int]) and field_size (int, which value is 0).", param=str(name))
        step = value[4] if len(value) > 4 and isinstance(value[4], int) else 0
        size = value[5] if len(value) > 5 else 0
        if isinstance(size, str):
            if size:
                raise StrategyError(f"optimizer-shard group {size!r} cannot be resolved to a size; give the "
                                    "predict strategy as a strategy file", param=name)
            size = 0
        layouts[name] = {0: make_layout(value[0], value[1], field_size=int(value[3]), opt_shard_step=int(step),
                                        opt_shard_size=int(size), param_split_shape=value[2] or (), param=name)}
    return StrategyMap(layouts, ("predict_strategy",))


def _dst_strategy(predict_strategy: object) -> StrategyMap | None:
    if predict_strategy is None:
        return None
    if isinstance(predict_strategy, Mapping):
        return predict_layout_map(predict_strategy)
    if isinstance(predict_strategy, (str, os.PathLike)):
        return load_strategy(os.fspath(predict_strategy))
    raise TypeError(f"For 'load_distributed_checkpoint', predict_strategy should be a dict, a str or None, but got "
                    f"{type(predict_strategy).__name__}.")


def rank_slices(tensors: Sequence[TensorSpec], strategy: StrategyMap | None, rank: int) -> tuple[Slice, ...]:
    """The box of every entry destination ``rank`` holds under ``strategy``."""
    return build_export_plan(tensors, strategy, ranks=[rank]).ranks[0].slices


def read_entry(source: ShardSlicer | Store, name: str, box: Box, checked: StoreReader | None = None) -> Value:
    """Region ``box`` of entry ``name`` from shards or a store (bf16 as ``ml_dtypes.bfloat16``);
    from a store through ``checked`` (one per rank and thread), which checks every chunk block
    it reads against its recorded CRC-32C, as export does."""
    if isinstance(source, ShardSlicer):
        return source.read(name, box)
    entry = source.entry(name)
    if entry.kind == "str":
        return entry.value or ""
    reader = checked if checked is not None else StoreReader(source, ExportOptions())
    return public_array(reader.materialise([(name, box)])[0], entry.ms_type)


def _checked_reader(source: ShardSlicer | Store) -> StoreReader | None:
    return StoreReader(source, ExportOptions()) if isinstance(source, Store) else None


def plan_rank(
    source: ShardSlicer | Store, strategy: StrategyMap | None, rank: int, wanted: Callable[[str], bool]
) -> list[tuple[str, str, str, Box]]:
    """``(name, kind, ms_type, box)`` of every wanted tensor or string destination ``rank``
    holds (MapParameter entries have no place in a network or a safetensors file); for a
    store, checked to be covered by its chunks first."""
    specs = {t.name: t for t in (source.specs() if isinstance(source, Store) else source.tensors)}
    slices = tuple(s for s in rank_slices(list(specs.values()), strategy, rank)
                   if wanted(s.name) and specs[s.name].kind in ("tensor", "str"))
    if isinstance(source, Store):
        check_coverage(source, ExportPlan((RankExport(rank, slices),), strategy.device_num() if strategy else 1))
    return [(s.name, specs[s.name].kind, specs[s.name].ms_type, s.box) for s in slices]


def read_rank(
    source: ShardSlicer | Store,
    strategy: StrategyMap | None,
    rank: int,
    wanted: Callable[[str], bool] = lambda _: True,
) -> dict[str, Value]:
    """Destination ``rank``'s slice of every wanted entry, read from shards or a store."""
    with reading(source) if isinstance(source, Store) else contextlib.nullcontext():
        plan = plan_rank(source, strategy, rank, wanted)
        if isinstance(source, Store):  # a remote store's arrays opened together, not a round trip each
            source.prefetch(name for name, kind, _, _ in plan if kind == "tensor")
        checked = _checked_reader(source)
        return {name: read_entry(source, name, box, checked) for name, _, _, box in plan}


def current_rank() -> int:
    """MindSpore's rank of this process; 0 when communication is not initialised."""
    try:
        from mindspore.communication import get_rank

        return int(get_rank())
    except (ImportError, RuntimeError):
        return 0


def write_rank_file(
    entries: Sequence[tuple[str, str, str, Box]],
    read: Callable[[str, Box], Value],
    target: Path,
    output_format: str,
    rename: Mapping[str, str] | None = None,
) -> Path:
    """One rank's ``(name, kind, ms_type, box)`` entries as a ``.ckpt`` or MindSpore-style
    ``.safetensors`` file, one tensor read (``read(name, box)``) and written at a time;
    ``rename`` gives an entry another name in the file."""
    out = {n: (rename or {}).get(n, n) for n, _, _, _ in entries}
    reader = Renamed(RegionBoxes(entries, read), {new: n for n, new in out.items()})
    slices = tuple(Slice(out[n], box) for n, _, _, box in entries)
    file_writer(output_format).write(reader, RankExport(0, slices), target)
    return target


def _check_args(format: str, output_format: str, name_map: object, max_process_num: object,
                return_param_dict: object) -> None:
    if format not in ("safetensors", "ckpt") or output_format not in ("safetensors", "ckpt"):
        raise UsageError("For 'load_distributed_checkpoint', 'format' and 'output_format' must be 'ckpt' or "
                         f"'safetensors', but got {format}.")
    if name_map is not None and not isinstance(name_map, dict):
        raise TypeError(f"name_map should be a dict, but got {type(name_map).__name__}.")
    if not isinstance(max_process_num, int) or isinstance(max_process_num, bool) or max_process_num < 1:
        raise UsageError(f"max_process_num must be a positive int, got {max_process_num!r}")
    if not isinstance(return_param_dict, bool):
        raise TypeError(f"return_param_dict should be a bool, but got {type(return_param_dict).__name__}.")


def _nonempty(path: str, storage_options: remote.StorageOptions) -> bool:
    """Whether a local file or an object at a URL exists and holds bytes."""
    if remote.is_remote(path):
        loc = remote.locate(path, storage_options, SourceError)
        return remote.isfile(loc, SourceError) and remote.size(loc, SourceError) > 0
    return os.path.exists(path) and os.path.getsize(path) > 0


def _check_ckpt_files(files: object, storage_options: remote.StorageOptions = None) -> list[str]:
    if not isinstance(files, (list, tuple)):
        raise TypeError(f"For 'load_distributed_checkpoint', checkpoint_filenames should be a list of str, but got "
                        f"{type(files).__name__}.")
    for i, f in enumerate(files):
        if not isinstance(f, str) or f[-5:] != ".ckpt" or not _nonempty(f, storage_options):
            raise UsageError(f"For 'load_distributed_checkpoint', please check 'checkpoint_filenames', and make sure "
                             f"the {f} at index {i} is a valid checkpoint file, it must be a string ending with "
                             "'.ckpt', and the checkpoint file it represents must be exist and not empty.")
    return list(files)


def _train_strategy(train_strategy_filename: str | None) -> str:
    if train_strategy_filename is not None:
        return train_strategy_filename
    try:
        import mindspore as ms

        found = ms.get_auto_parallel_context("strategy_ckpt_load_file")
    except ImportError:
        found = ""
    if not found:
        raise UsageError("For 'load_distributed_checkpoint', train_strategy_filename is None and MindSpore's context "
                         "names no strategy_ckpt_load_file: give the training strategy file")
    return str(found)


@fewer_collections()
def load_distributed_checkpoint(
    network: Any,
    checkpoint_filenames: list[str] | None = None,
    predict_strategy: dict[str, Any] | str | None = None,
    train_strategy_filename: str | None = None,
    strict_load: bool = False,
    dec_key: bytes | None = None,
    dec_mode: str = "AES-GCM",
    format: str = "ckpt",
    unified_safetensors_dir: str | None = None,
    dst_safetensors_dir: str | None = None,
    rank_id: int | None = None,
    output_format: str = "safetensors",
    name_map: dict[str, str] | None = None,
    max_process_num: int = 64,
    return_param_dict: bool = False,
    *,
    store: str | os.PathLike[str] | None = None,
    storage_options: remote.StorageOptions = None,
) -> Any:
    """Load this rank's slices into ``network`` (see the module); MindSpore's signature, plus
    ``store`` to read from a zckpt store instead of ``checkpoint_filenames``. The store and
    the checkpoint files may be URLs (``storage_options``: the filesystem's options): the rank
    reads only the byte ranges of its slices.

    With a network: ``format="ckpt"`` returns True; ``format="safetensors"`` returns
    ``load_param_into_net``'s ``(param_not_load, ckpt_not_load)``, or the values
    (``{name: ndarray}``) with ``return_param_dict``. Without one (``format="safetensors"``)
    writes the files and returns True.
    """
    _check_args(format, output_format, name_map, max_process_num, return_param_dict)
    if dec_key is not None:
        raise UsageError("encrypted checkpoints (dec_key) are not supported by zckpt")
    if rank_id is not None and (not isinstance(rank_id, int) or isinstance(rank_id, bool) or rank_id < 0):
        raise TypeError(f"rank_id should be a non-negative int, but got {rank_id!r}.")
    dst = _dst_strategy(predict_strategy)
    if format == "safetensors":
        if unified_safetensors_dir is None and store is None:
            raise UsageError("For 'load_distributed_checkpoint', 'unified_safetensors_dir' can not be None when "
                             "format is 'safetensors'.")
        for what, value in (("checkpoint_filenames", checkpoint_filenames),
                            ("train_strategy_filename", train_strategy_filename)):
            if value is not None:
                raise UsageError(f"For 'load_distributed_checkpoint', {what} must be None when format is "
                                 "'safetensors'.")
        if strict_load or dec_mode != "AES-GCM":
            raise UsageError("For 'load_distributed_checkpoint', strict_load and dec_mode must be default when "
                             "format is 'safetensors'.")
        source: ShardSlicer | Store = (Store.open(store, storage_options=storage_options) if store is not None
                                       else ShardSlicer(_unified_index(unified_safetensors_dir), None))
        try:
            if network is None:
                if dst_safetensors_dir is None:
                    raise UsageError("For 'load_distributed_checkpoint', 'dst_safetensors_dir' can not be None when "
                                     "network is None.")
                ranks = [rank_id] if rank_id is not None else list(range(dst.device_num() if dst else 1))
                with reading(source) if isinstance(source, Store) else contextlib.nullcontext():
                    _save_ranks(source, dst, ranks, Path(dst_safetensors_dir), output_format, name_map,
                                max_process_num)
                return True
            values = _renamed(read_rank(source, dst, rank_id if rank_id is not None else current_rank()), name_map)
            if return_param_dict:
                return values
            return load_into_network(network, values, strict_load=False)
        finally:
            if isinstance(source, ShardSlicer):
                source.close()
    if network is None:
        raise TypeError("For 'load_distributed_checkpoint', the network should be a Cell, but got None.")
    names = {p.name for _, p in network.parameters_and_names()}
    rank = rank_id if rank_id is not None else (current_rank() if dst is not None else 0)
    if store is not None:
        values = read_rank(Store.open(store, storage_options=storage_options), dst, rank, names.__contains__)
    else:
        files = _check_ckpt_files(checkpoint_filenames, storage_options)
        smap = load_strategy(_train_strategy(train_strategy_filename), storage_options)
        if smap is not None and smap.device_num() != len(files):
            raise UsageError("For 'Load_distributed_checkpoint', the length of 'checkpoint_filenames' should be equal "
                             "to the device count of training process. But got the length of 'checkpoint_filenames' "
                             f"is {len(files)} and the device count is {smap.device_num()}.")
        refuse_field_reorder(smap, names)
        with ShardSlicer(dict(enumerate(files)), smap, storage_options) as slicer:
            values = read_rank(slicer, dst, rank, names.__contains__)
    load_into_network(network, values, strict_load=strict_load)
    return True


def refuse_field_reorder(train: StrategyMap | None, names: Collection[str]) -> None:
    """Refuse training parameters whose merge MindSpore's function reorders.

    MindSpore's ``load_distributed_checkpoint`` merges the training slices with
    ``merge_sliced_parameter``, which reorders the rows of an evenly split parameter whose
    layout has ``field`` > 1 on several devices (``_reshape_param_data_with_weight``): not
    what the training job held, which zckpt reads (docs/layout-kinds.md). Loading either
    would differ from the other, so such a parameter is refused by name.
    """
    if train is None:
        return
    for name in sorted(set(names) & set(train.layouts)):
        for lay in train.layouts[name].values():
            if lay.field_size > 1 and lay.device_num > 1 and not lay.param_split_shape:
                raise LayoutError(
                    f"its training layout has field {lay.field_size}: MindSpore's load_distributed_checkpoint "
                    "reorders such a parameter's rows when it merges the slices (merge_sliced_parameter), which "
                    "zckpt does not reproduce; convert with transform_checkpoints instead",
                    param=name,
                )


def _unified_index(unified_dir: str | None) -> dict[int, Path]:
    root = Path(os.fspath(unified_dir or ""))
    index = find_unified(root)
    if index is None:
        if not root.is_dir():
            raise UsageError("unified_safetensors_dir is not a directory", path=root)
        files = sorted(root.glob("*.safetensors"))
        if len(files) != 1:
            raise UsageError("For 'load_parallel_checkpoint', there must be a JSON file named 'param_name_map.json' "
                             "in the 'total_safetensors_dir'.", path=root)
        return {0: files[0]}
    return {0: index}


def _renamed(values: dict[str, Value], name_map: Mapping[str, str] | None) -> dict[str, Value]:
    """``name_map`` is ``{network name: name in the checkpoint}`` (MindSpore's meaning)."""
    if not name_map:
        return values
    back = {v: k for k, v in name_map.items()}
    return {back.get(k, k): v for k, v in values.items()}


def _save_ranks(source: ShardSlicer | Store, dst: StrategyMap | None, ranks: list[int], out: Path,
                output_format: str, name_map: Mapping[str, str] | None, workers: int) -> None:
    """``out/rank_<r>/net.<output_format>`` for each rank, ``workers`` ranks at a time."""
    back = {v: k for k, v in (name_map or {}).items()}  # name_map: {network name: checkpoint name}
    out.mkdir(parents=True, exist_ok=True)  # the directory named; its rank folders are made without following links

    def one(rank: int) -> Path:
        folder = safe_paths.real_dirs(out, f"rank_{rank}", OutputError, create=True)  # never through a link
        entries = plan_rank(source, dst, rank, lambda _: True)
        checked = _checked_reader(source)
        return write_rank_file(entries, lambda n, b: read_entry(source, n, b, checked),
                               folder / f"net.{output_format}", output_format, back)

    if workers == 1 or len(ranks) == 1:
        for r in ranks:
            one(r)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(ranks))) as pool:
        list(pool.map(one, ranks))


__all__ = ["ShardSlicer", "load_distributed_checkpoint", "predict_layout_map", "read_rank"]
