"""Merge the per-rank strategy files of a pipeline job into one file MindSpore reads.

A pipeline-parallel job saves one strategy file per rank, each holding only the layouts of
its own stage. Resharding needs them all, in the single file that MindSpore's
``merge_pipeline_strategys`` writes: every layout name prefixed with ``"<stage>-"``,
``current_stage = 1``, operator strategies of every stage concatenated. This module writes
exactly that file (byte for byte what MindSpore writes when it meets the stages in
ascending order), from protobuf (``*.ckpt``) or JSON (``*.json``) inputs, JSON out for JSON
in.

Where MindSpore silently writes a file that cannot be right, zckpt stops and says why:

* a missing stage (the stages found must be exactly ``0 .. S-1``): MindSpore would write a
  strategy that lacks a stage's parameters and the transform fails later, far from the
  cause;
* two files claiming the same stage with different layouts: MindSpore keeps whichever file
  ``glob`` lists first, so the result depends on directory order;
* empty files, files without layouts or operator strategies, already-merged files (their
  names carry stage prefixes), an empty directory, an output name whose extension
  makes MindSpore's reader pick the wrong format (it decides by ``.json``).

Inputs are read in natural name order (``strategy_2`` before ``strategy_10``) and the
output is ordered by stage, so the result does not depend on how the filesystem lists the
directory. Byte-identical files are read once, as MindSpore does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from google.protobuf.message import DecodeError

from zckpt.core.errors import OutputError, StrategyError, UsageError
from zckpt.formats.strategy import ParamLayout, read_strategy
from zckpt.io.fileio import write_atomic
from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

StrategyFormat = Literal["protobuf", "json"]


class NotAStrategyDirError(UsageError, NotADirectoryError):
    """``src_strategy_dirs`` is not a directory.

    A zckpt :class:`~zckpt.core.errors.UsageError` that is also the ``NotADirectoryError``
    MindSpore raises, so code written against ``mindspore`` keeps catching it.
    """


@dataclass(frozen=True)
class MergeReport:
    """What a merge read and wrote.

    ``stage_files`` names, per stage, the file whose content went into the output (the
    first in natural order); ``duplicates`` maps every other file to the one it repeats
    (byte-identical, or the same layouts for the same stage).
    """

    out_file: str
    format: StrategyFormat
    files: tuple[str, ...]
    stage_files: Mapping[int, str]
    duplicates: Mapping[str, str]
    layouts: int

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted(self.stage_files))


@dataclass(frozen=True)
class _StageFile:
    """One distinct input file: its stage, its layouts (for comparison) and its raw content."""

    path: Path
    stage: int
    layouts: Mapping[str, ParamLayout]
    content: pb.ParallelStrategyMap | dict[str, Any]


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key where digit runs compare as numbers: ``strategy_2`` before ``strategy_10``."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def _check_path_arg(value: object, what: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"The {what} should be a str, but got {type(value).__name__}.")
    return Path(os.fspath(value))


def list_strategy_files(src_dir: str | os.PathLike[str], *, exclude: Path | None = None) -> list[Path]:
    """The strategy files of a directory, as ``merge_pipeline_strategys`` sees them.

    ``*.ckpt`` or ``*.json`` (never both), hidden names skipped as ``glob`` skips them,
    natural name order. ``exclude`` (the output file, when it lies in the same directory)
    is left out so that merging twice does not read the previous result.
    """
    d = Path(src_dir)
    if not d.is_dir():
        raise NotAStrategyDirError(
            "src_strategy_dirs is not a directory (give the directory holding every rank's strategy file)",
            path=d,
        )
    protobuf: list[Path] = []
    js: list[Path] = []
    skip = exclude.resolve() if exclude is not None else None
    with os.scandir(d) as it:
        for entry in it:
            if entry.name.startswith(".") or not entry.is_file():
                continue
            p = Path(entry.path)
            if skip is not None and p.resolve() == skip:
                continue
            if entry.name.endswith(".ckpt"):
                protobuf.append(p)
            elif entry.name.endswith(".json"):
                js.append(p)
    if protobuf and js:
        raise StrategyError(
            f"holds both protobuf (*.ckpt: {protobuf[0].name}, ...) and JSON (*.json: {js[0].name}, ...) "
            "strategy files; the strategies of one job must all be '.ckpt' or all '.json'",
            path=d,
        )
    files = protobuf or js
    if not files:
        raise StrategyError("no strategy files (*.ckpt or *.json) in the directory", path=d)
    return sorted(files, key=lambda p: _natural_key(p.name))


_PREFIXED = re.compile(r"^\d+-")


def _flat_layouts(p: Path, raw_names: Sequence[str]) -> dict[str, ParamLayout]:
    """The file's layouts by name, checked by zckpt's reader (so bad layouts fail here, named).

    A name that already carries a ``"<stage>-"`` prefix means a merged file was put among
    the per-rank files; merging it again would write ``"0-0-name"``.
    """
    for raw in raw_names:
        if _PREFIXED.match(raw):
            raise StrategyError(
                "layout name already carries a '<stage>-' prefix: this looks like an already merged strategy "
                "file; merge the per-rank files instead",
                path=p,
                param=raw,
            )
    smap = read_strategy(p)
    return {name: next(iter(per.values())) for name, per in smap.layouts.items()}


def _read_protobuf(p: Path, raw: bytes) -> _StageFile:
    msg = pb.ParallelStrategyMap()
    try:
        msg.ParseFromString(raw)
    except DecodeError as err:
        raise StrategyError(f"not a protobuf strategy file ({err})", path=p) from None
    if not msg.parallel_layout_item:
        raise StrategyError("strategy file has no parameter layouts (parallel_layout_item is empty)", path=p)
    if not msg.parallel_strategy_item:
        raise StrategyError(
            "strategy file has no operator strategies (parallel_strategy_item is empty), so its pipeline stage "
            "is unknown",
            path=p,
        )
    stage = int(msg.parallel_strategy_item[0].parallel_strategys.stage)  # MindSpore: the first operator's
    return _StageFile(p, stage, _flat_layouts(p, [it.param_name for it in msg.parallel_layout_item]), msg)


def _read_json(p: Path, raw: bytes) -> _StageFile:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StrategyError(f"not a JSON strategy file ({err})", path=p) from None
    if not isinstance(doc, dict):
        raise StrategyError("JSON strategy must be an object", path=p)
    layouts = doc.get("parallel_layout_item")
    ops = doc.get("parallel_strategy_item")
    if not isinstance(layouts, dict) or not layouts:
        raise StrategyError("strategy file has no parameter layouts (parallel_layout_item is empty)", path=p)
    if not isinstance(ops, dict) or not ops:
        raise StrategyError(
            "strategy file has no operator strategies (parallel_strategy_item is empty), so its pipeline stage "
            "is unknown",
            path=p,
        )
    node, item = next(iter(ops.items()))  # MindSpore: the first operator's stage is the file's
    stage = item.get("stage") if isinstance(item, dict) else None
    if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise StrategyError(f"operator {node!r} has no valid 'stage' (got {stage!r})", path=p)
    return _StageFile(p, stage, _flat_layouts(p, list(layouts)), doc)


def _first_difference(a: Mapping[str, ParamLayout], b: Mapping[str, ParamLayout]) -> str:
    for name in list(a) + [n for n in b if n not in a]:
        if name not in b:
            return f"parameter {name!r} is listed only in the first"
        if name not in a:
            return f"parameter {name!r} is listed only in the second"
        if a[name] != b[name]:
            return f"parameter {name!r}: {a[name]} vs {b[name]}"
    return "no difference"


def _encode(fmt: StrategyFormat, chosen: Sequence[_StageFile]) -> bytes:
    """The merged file, built exactly as MindSpore's ``_merge_*_strategy`` builds it."""
    if fmt == "protobuf":
        out = pb.ParallelStrategyMap()
        for sf in chosen:
            assert isinstance(sf.content, pb.ParallelStrategyMap)
            msg = pb.ParallelStrategyMap()
            msg.CopyFrom(sf.content)
            for item in msg.parallel_layout_item:
                item.param_name = f"{sf.stage}-{item.param_name}"
            out.parallel_strategy_item.extend(msg.parallel_strategy_item)
            out.parallel_layout_item.extend(msg.parallel_layout_item)
        out.current_stage = 1
        return out.SerializeToString()
    doc: dict[str, Any] = {"current_stage": 1, "parallel_strategy_item": {}, "parallel_layout_item": {}}
    for sf in chosen:
        assert isinstance(sf.content, dict)
        for name, item in sf.content["parallel_layout_item"].items():
            doc["parallel_layout_item"][f"{sf.stage}-{name}"] = item
        doc["parallel_strategy_item"].update(sf.content["parallel_strategy_item"])
    return json.dumps(doc).encode("utf-8")  # json.dump's defaults, as MindSpore writes it


def merge_strategy_files(
    files: Sequence[str | os.PathLike[str]], dst_strategy_file: str | os.PathLike[str], *, where: str | None = None
) -> MergeReport:
    """Merge the given per-rank strategy files, in the given order, into ``dst_strategy_file``.

    The order only decides which file represents a stage when several are equivalent; the
    output lists stages in ascending order. ``where`` names the source in error messages.
    """
    dst = _check_path_arg(dst_strategy_file, "dst_strategy_file")
    paths = [_check_path_arg(f, "strategy file") for f in files]
    if not paths:
        raise StrategyError("no strategy files to merge", path=where)
    kinds = {"json" if p.name.endswith(".json") else "protobuf" for p in paths}
    if len(kinds) > 1:
        raise StrategyError("the strategy files mix '.json' and '.ckpt'; they must all be one format", path=where)
    fmt: StrategyFormat = "json" if kinds == {"json"} else "protobuf"
    if fmt == "json" and not dst.name.endswith(".json"):
        raise UsageError(
            "the inputs are JSON strategies, so the merged file is JSON: its name must end with '.json' "
            "(MindSpore reads any other name as protobuf)",
            path=dst,
        )
    if fmt == "protobuf" and dst.name.endswith(".json"):
        raise UsageError(
            "the inputs are protobuf strategies, so the merged file is protobuf: its name must not end with "
            "'.json' (MindSpore would read it as JSON)",
            path=dst,
        )
    if dst.is_dir():
        raise OutputError("dst_strategy_file is a directory", path=dst)
    by_stage: dict[int, _StageFile] = {}
    seen: dict[bytes, Path] = {}
    duplicates: dict[str, str] = {}
    for p in paths:
        try:
            raw = p.read_bytes()
        except OSError as err:
            raise StrategyError(f"cannot read strategy file: {err.strerror}", path=p) from None
        if not raw:
            raise StrategyError("strategy file is empty (0 bytes)", path=p)
        if raw in seen:
            duplicates[str(p)] = str(seen[raw])
            continue
        seen[raw] = p
        sf = _read_json(p, raw) if fmt == "json" else _read_protobuf(p, raw)
        first = by_stage.get(sf.stage)
        if first is None:
            by_stage[sf.stage] = sf
            continue
        if first.layouts != sf.layouts:
            raise StrategyError(
                f"claims pipeline stage {sf.stage} like {first.path}, but their layouts differ "
                f"({_first_difference(first.layouts, sf.layouts)}); the per-rank files of one stage must agree",
                path=p,
            )
        duplicates[str(p)] = str(first.path)
    stages = sorted(by_stage)
    missing = sorted(set(range(stages[-1] + 1)) - set(stages))
    if missing:
        raise StrategyError(
            f"pipeline stage(s) {missing} have no strategy file (found stage(s) {stages}); "
            "every stage's per-rank strategy file is needed",
            path=where,
        )
    chosen = [by_stage[s] for s in stages]
    data = _encode(fmt, chosen)
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(dst, data)
    return MergeReport(
        out_file=str(dst),
        format=fmt,
        files=tuple(str(p) for p in paths),
        stage_files={s: str(by_stage[s].path) for s in stages},
        duplicates=duplicates,
        layouts=sum(len(sf.layouts) for sf in chosen),
    )


def merge_strategies(
    src_strategy_dir: str | os.PathLike[str], dst_strategy_file: str | os.PathLike[str]
) -> MergeReport:
    """Merge every strategy file of a directory (see :func:`list_strategy_files`) and report."""
    src = _check_path_arg(src_strategy_dir, "src_strategy_dirs")
    dst = _check_path_arg(dst_strategy_file, "dst_strategy_file")
    files = list_strategy_files(src, exclude=dst)
    return merge_strategy_files(files, dst, where=str(src))


def merge_pipeline_strategys(
    src_strategy_dirs: str | os.PathLike[str], dst_strategy_file: str | os.PathLike[str]
) -> None:
    """MindSpore's ``merge_pipeline_strategys``: same name, arguments and output file.

    Raises :class:`NotAStrategyDirError` (a ``NotADirectoryError``) when
    ``src_strategy_dirs`` is not a directory, and :class:`~zckpt.core.errors.StrategyError`
    (a ``ValueError``) for the inconsistent inputs MindSpore would merge silently.
    """
    merge_strategies(src_strategy_dirs, dst_strategy_file)
