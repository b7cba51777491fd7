"""Where a strategy argument comes from: a strategy file, a directory of per-rank strategy
files, either of them at a URL, a :class:`StrategyMap` already read, or None (no strategy).

Every command that takes a strategy (ingest, export, transform, load, verify) reads it here,
so that a URL's strategy is named by its URL wherever it is recorded.
"""

from __future__ import annotations

from pathlib import Path

from zckpt.core.errors import StrategyError
from zckpt.formats.strategy import StrategyMap, combine_strategies, parse_strategy, read_strategies, read_strategy
from zckpt.io import remote

StrategyArg = str | Path | StrategyMap | None


def load_strategy(strategy: StrategyArg, storage_options: remote.StorageOptions = None) -> StrategyMap | None:
    """A strategy file, a directory of per-rank strategy files (local or URLs), a StrategyMap, or None."""
    if strategy is None or isinstance(strategy, StrategyMap):
        return strategy
    if isinstance(strategy, str) and remote.is_remote(strategy):
        return _load_remote_strategy(strategy, storage_options)
    p = remote.local_path(strategy)
    if p.is_dir():
        files = sorted(p.glob("*.ckpt")) or sorted(p.glob("*.json"))
        if not files:
            raise StrategyError("strategy directory holds no .ckpt or .json strategy files", path=p)
        return read_strategies(files)
    return read_strategy(p)


def _load_remote_strategy(url: str, storage_options: remote.StorageOptions) -> StrategyMap:
    """A strategy file or directory at a URL: each file read whole into memory (one ``GET``;
    strategy files are KiBs to MiBs) and parsed there, nothing on local disk; the map names
    the URLs (they enter the store's manifest and fingerprint)."""
    loc = remote.locate(url, storage_options, StrategyError)
    if remote.isdir(loc, StrategyError):
        names = [n for n, d in remote.listdir(loc, StrategyError) if not d]
        picked = sorted(n for n in names if n.endswith(".ckpt")) or sorted(n for n in names if n.endswith(".json"))
        if not picked:
            raise StrategyError("strategy directory holds no .ckpt or .json strategy files", path=url)
        return combine_strategies(_parse_remote(loc.child(n)) for n in picked)
    if not remote.isfile(loc, StrategyError):
        raise StrategyError("no such strategy file", path=url)
    return _parse_remote(loc)


def _parse_remote(loc: remote.Location) -> StrategyMap:
    return parse_strategy(remote.read_bytes(loc, StrategyError), loc.url)
