"""File-for-file format conversion: MindSpore's ``ckpt_to_safetensors`` and ``safetensors_to_ckpt``.

MindSpore loads each file whole into Parameters and saves it again. Here each file is
streamed from its mapped source into the other format's writer (row blocks of at most
``BLOCK_BYTES``; the safetensors header is known from the source's index before a byte of
data is copied), under a temporary name renamed when complete. The layout is kept: no
strategy is involved (to reshard while converting, see ``transform_checkpoints(...,
output_format=...)``).

Which files, where they go and what is refused follow MindSpore 2.10
(``mindspore/train/serialization.py``): a directory converts every ``.ckpt`` (or
``.safetensors``) file directly inside its ``rank*`` subdirectories whose name matches
``file_name_regex`` (``re.search``), into ``save_path/<rank dir>/`` or beside the source;
one file converts into ``save_path`` or beside it. ``name_map`` renames entries
(``{old: new}``). ``processes_num`` files are converted at once.

String entries become ``__metadata__`` keys in safetensors (zckpt's convention, read back
as strings); MapParameter entries have no safetensors form and are refused, naming them.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Concatenate, ParamSpec

from zckpt.core.errors import CheckpointFormatError, UsageError
from zckpt.core.layout import Box
from zckpt.formats.opener import open_shard
from zckpt.plan.values import RankExport, Slice
from zckpt.write.box_adapters import Renamed, ShardBoxes
from zckpt.write.safetensors_file import no_safetensors_form
from zckpt.write.writers import file_writer

_P = ParamSpec("_P")

BLOCK_BYTES = 64 * 1024 * 1024
"""Most bytes of one tensor in memory at a time while copying."""


def convert_file(src: Path, dst: Path, dst_format: str, name_map: Mapping[str, str] | None = None) -> Path:
    """Write ``src`` (any shard format) as ``dst`` in ``dst_format`` (``"ckpt"`` or ``"safetensors"``)."""
    rename = dict(name_map or {})
    with open_shard(src) as reader:
        entries = list(reader.entries.values())
        new_names = [rename.get(e.name, e.name) for e in entries]
        if len(set(new_names)) != len(new_names):
            dup = next(n for n in new_names if new_names.count(n) > 1)
            raise UsageError("name_map gives two entries the same name", path=src, param=dup)
        if dst_format == "safetensors":
            for e in entries:
                if e.kind == "map":
                    raise no_safetensors_form(e.name, error=CheckpointFormatError, path=src)
        pairs = list(zip(entries, new_names, strict=True))
        boxes = Renamed(ShardBoxes(reader, BLOCK_BYTES), {new: e.name for e, new in pairs})
        slices = tuple(Slice(new, Box.full(e.shape)) for e, new in pairs)
        file_writer(dst_format).write(boxes, RankExport(0, slices), dst)
        return dst


def _tasks(root: Path, save_path: str | None, regex: str | None, src_suffix: str, func: str) -> list[tuple[Path, Path]]:
    """MindSpore's ``_gather_all_tasks``: files directly in ``root/rank*/`` with the suffix."""
    rank_dirs = sorted(d for d in os.listdir(root) if d.startswith("rank") and (root / d).is_dir())
    if not rank_dirs:
        raise UsageError(f"For '{func}', no directories starting with 'rank' found in {root}.", path=root)
    out: list[tuple[Path, Path]] = []
    for d in rank_dirs:
        dst_root = Path(save_path) / d if save_path is not None else root / d
        dst_root.mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(root / d)):
            if name.endswith(src_suffix) and (regex is None or re.search(regex, name)):
                out.append((root / d / name, dst_root / name.replace(src_suffix, _other(src_suffix))))
    return out


def _other(suffix: str) -> str:
    return ".safetensors" if suffix == ".ckpt" else ".ckpt"


def convert_checkpoint_files(
    dst_format: str,
    file_path: str,
    save_path: str | None = None,
    name_map: dict[str, str] | None = None,
    file_name_regex: str | None = None,
    processes_num: int = 1,
) -> None:
    """MindSpore's ``_convert_checkpoint_file``: the checks, the file choice, the conversion.
    Its parameters after ``dst_format`` are MindSpore's, stated once for both public names."""
    src_suffix = ".ckpt" if dst_format == "safetensors" else ".safetensors"
    func = "ckpt_to_safetensors" if dst_format == "safetensors" else "safetensors_to_ckpt"
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"For {func}, file_path should be a str, but got {type(file_path).__name__}.")
    src = Path(file_path)
    if not src.is_dir() and not src.is_file():
        raise UsageError(f"For {func}, the input path must be a valid path or file, but got {file_path}", path=src)
    if save_path and os.path.splitext(save_path)[1]:
        raise UsageError(f"For {func}, the save_path must be a directory, but got '{save_path}'", path=save_path)
    if name_map is not None and not isinstance(name_map, dict):
        raise UsageError(f"For {func}, the type of 'name_map' must be a directory, but got '{type(name_map)}'")
    if not isinstance(processes_num, int) or isinstance(processes_num, bool) or processes_num < 1:
        raise UsageError(f"For {func}, processes_num must be a positive int, but got {processes_num!r}")
    if src.is_dir():
        tasks = _tasks(src, os.fspath(save_path) if save_path else None, file_name_regex, src_suffix, func)
    else:
        if not src.name.endswith(src_suffix):
            raise UsageError(f"For {func}, the input file must be a {src_suffix} file, but got {file_path}", path=src)
        if file_name_regex is not None and not re.findall(file_name_regex, os.fspath(file_path)):
            raise UsageError(f"For {func}, the input file does not match the regular expression.", path=src)
        folder = Path(save_path) if save_path else src.parent
        folder.mkdir(parents=True, exist_ok=True)
        tasks = [(src, folder / src.name.replace(src_suffix, _other(src_suffix)))]
    if processes_num == 1 or len(tasks) <= 1:
        for s, d in tasks:
            convert_file(s, d, dst_format, name_map)
        return
    with ThreadPoolExecutor(max_workers=processes_num, thread_name_prefix="zckpt-convert") as pool:
        list(pool.map(lambda t: convert_file(t[0], t[1], dst_format, name_map), tasks))


def _for_format(
    convert_files: Callable[Concatenate[str, _P], None], dst_format: str, name: str, doc: str
) -> Callable[_P, None]:
    """``convert_files`` with ``dst_format`` given: a public function whose signature (what
    ``inspect`` and type checkers see) is MindSpore's, stated once for both directions."""

    def convert(*args: _P.args, **kwargs: _P.kwargs) -> None:
        convert_files(dst_format, *args, **kwargs)

    whole = inspect.signature(convert_files)
    convert.__signature__ = whole.replace(parameters=list(whole.parameters.values())[1:])  # type: ignore[attr-defined]
    convert.__name__ = convert.__qualname__ = name
    convert.__doc__ = doc
    return convert


ckpt_to_safetensors = _for_format(
    convert_checkpoint_files, "safetensors", "ckpt_to_safetensors",
    "Convert ``.ckpt`` files to ``.safetensors`` (a file, or every rank of a job directory).")
safetensors_to_ckpt = _for_format(
    convert_checkpoint_files, "ckpt", "safetensors_to_ckpt",
    "Convert ``.safetensors`` files to ``.ckpt`` (a file, or every rank of a job directory).")
