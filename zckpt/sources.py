"""Locate the source shards of a MindSpore job on disk.

MindSpore's layout is ``SRC_DIR/rank_<r>/<anything>.ckpt``; when a rank directory holds
several ``.ckpt`` files the last one in lexicographic order is the checkpoint, as in
``mindspore.transform_checkpoints``. Sharded safetensors jobs (``rank_<r>/*.safetensors``)
are found the same way (see :func:`zckpt.formats.shards.pick_rank_file`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from zckpt import remote
from zckpt.errors import SourceError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.shards import INDEX_SUFFIX, check_single_format, open_shard, pick_rank_file, pick_rank_name
from zckpt.source_layouts import discover_other_layout

_RANK_DIR = re.compile(r"^rank_(\d+)$")

SourceFile = Path | str
"""A local shard path, or the URL of a remote one (``s3://...``)."""


def discover_rank_files(src_dir: str | Path, storage_options: remote.StorageOptions = None) -> dict[int, SourceFile]:
    """Map rank id to its checkpoint file; refuses a directory with no rank files."""
    if isinstance(src_dir, str) and remote.is_remote(src_dir):
        return discover_remote(src_dir, storage_options)
    root = remote.local_path(src_dir)
    if not root.is_dir():
        raise SourceError("source checkpoint directory does not exist or is not a directory", path=root)
    other = discover_other_layout(root)  # MindSpore's unified directory, MindFormers' iterations
    if other is not None:
        return other
    out: dict[int, SourceFile] = {}
    for child in root.iterdir():
        m = _RANK_DIR.match(child.name)
        if not m or not child.is_dir():
            continue
        found = pick_rank_file(child)  # .ckpt or .safetensors, chosen as MindSpore does
        if found is not None:
            out[int(m.group(1))] = found
    if not out:
        raise SourceError("no rank_<r>/*.ckpt or rank_<r>/*.safetensors files found", path=root)
    check_single_format(out, root)
    return dict(sorted(out.items()))


def discover_remote(url: str, storage_options: remote.StorageOptions) -> dict[int, SourceFile]:
    """:func:`discover_rank_files` on an fsspec directory: same naming rules, URLs as results."""
    root = remote.locate(url, storage_options, SourceError)
    if not remote.isdir(root, SourceError):
        raise SourceError("source checkpoint directory does not exist or is not a directory", path=url)
    out: dict[int, SourceFile] = {}
    for name, is_dir in remote.listdir(root, SourceError):
        m = _RANK_DIR.match(name)
        if not m or not is_dir:
            continue
        sub = root.child(name)
        files = [n for n, d in remote.listdir(sub, SourceError) if not d]
        found = pick_rank_name(files, name, sub.url)
        if found is not None:
            out[int(m.group(1))] = sub.child(found).url
    if not out:
        raise SourceError("no rank_<r>/*.ckpt or rank_<r>/*.safetensors files found", path=url)
    check_single_format(out, url)
    return dict(sorted(out.items()))


def check_rank_map(
    files: Mapping[int, str | Path], storage_options: remote.StorageOptions = None
) -> dict[int, SourceFile]:
    """Validate an explicit ``{rank: file}`` map (MindSpore's checkpoint_files_map)."""
    out: dict[int, SourceFile] = {}
    for rank, path in files.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise SourceError(f"rank key {rank!r} must be a non-negative int")
        if isinstance(path, str) and remote.is_remote(path):
            if not remote.isfile(remote.locate(path, storage_options, SourceError), SourceError):
                raise SourceError(f"checkpoint file of rank {rank} does not exist", path=path)
            out[rank] = path
            continue
        p = remote.local_path(path)
        if not p.is_file():
            raise SourceError(f"checkpoint file of rank {rank} does not exist", path=p)
        out[rank] = p
    return dict(sorted(out.items()))


@contextlib.contextmanager
def open_source(
    path: SourceFile, storage_options: remote.StorageOptions = None, *, verify_crc: bool = True
) -> Iterator[CkptReader]:
    """Open a source shard, local or remote (a reader context).

    A remote shard is first copied to a local temporary file (readers map their file; the
    copy is streamed in blocks and deleted when the reader closes); a split safetensors
    rank brings its parts along. Errors name the URL, not the temporary copy.
    """
    if not (isinstance(path, str) and remote.is_remote(path)):
        with open_shard(path, verify_crc=verify_crc) as reader:
            yield reader
        return
    with (spool(path, storage_options) as local, remote.named_by_url(local.parent, path),
          open_shard(local, verify_crc=verify_crc) as reader):
        yield reader


@contextlib.contextmanager
def spool(url: str, storage_options: remote.StorageOptions) -> Iterator[Path]:
    """A remote shard (with the parts its index lists, for a split safetensors checkpoint) as a
    temporary local file, for readers that map files."""
    with remote.local_copy(url, storage_options, SourceError) as local:
        if local.name.endswith(INDEX_SUFFIX):
            for part in _index_parts(local, url):
                remote.download(remote.locate(url, storage_options, SourceError).sibling(part),
                                local.parent / part, SourceError)
        yield local


def _index_parts(index: Path, url: str) -> list[str]:
    """File names an HF-style index lists (only plain names beside the index are fetched;
    the reader refuses anything else with its own message)."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        return []
    return sorted({v for v in wm.values() if isinstance(v, str) and Path(v).name == v and v.endswith(".safetensors")})
