"""What each destination file reads from the source files on the direct path.

One computation serves ``zckpt plan --src`` (per destination rank: the source files, the
bytes taken from each, the bytes read for them, the read amplification) and the dry runs
of :mod:`zckpt.jobs.dryrun`. The bytes are those :class:`zckpt.sources.reader.SourceReader`
counts: ``read_bytes`` (data taken) and ``read_bytes + checked_bytes`` (read from the files:
whole source rows where a slice takes part of a row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zckpt.core.dtypes import ms_dtype
from zckpt.core.layout import c_order_pieces
from zckpt.formats.opener import shard_format
from zckpt.plan.values import RankExport
from zckpt.run.engines import Engine, wants_overlap
from zckpt.write.boxes import batch_bytes

if TYPE_CHECKING:
    from zckpt.jobs.transform import TransformPlan


@dataclass(frozen=True)
class SourceRead:
    """What one destination file (or the store) takes from one source file."""

    rank: int
    path: str
    bytes: int
    """Data bytes taken from the file."""
    read: int
    """Bytes read from the file for them: more than ``bytes`` where a slice takes part of
    the source's rows (whole rows are read and cut)."""


def source_reads(plan: TransformPlan, rank: RankExport, band_bytes: int) -> tuple[SourceRead, ...]:
    """The source files one destination file (its slices) reads on the direct path, with
    the bytes it takes from each and the bytes read for them: a slice made of whole rows of
    a source shard reads just those; any other is read band by band (``band_bytes``), each
    band reading the source rows it meets whole, as :class:`zckpt.sources.reader.SourceReader`
    does."""
    boxes = plan.boxes(rank)
    data: dict[int, int] = {}
    read: dict[int, int] = {}
    split: dict[int, bool] = {}

    def is_split(r: int) -> bool:
        if r not in split:
            split[r] = shard_format(boxes.files[r]) not in ("ckpt", "safetensors")
        return split[r]

    for s in rank.slices:
        spec = boxes.specs[s.name]
        writes = boxes.writes.get(s.name, ())
        if spec.kind != "tensor" or s.box.size == 0 or not writes:
            continue
        itemsize = ms_dtype(spec.ms_type).storage.itemsize
        if s.box.ndim == 0:
            w = writes[0]
            data[w.rank] = data.get(w.rank, 0) + itemsize
            read[w.rank] = read.get(w.rank, 0) + itemsize
            continue
        lo, hi = s.box.start[1:], s.box.stop[1:]
        if all(w.box.start[1:] == lo and w.box.stop[1:] == hi and not is_split(w.rank) for w in writes):
            bands = [s.box]  # whole rows of every source: copied as file ranges
        else:
            bands = c_order_pieces(s.box, max(1, band_bytes // itemsize))
        for band in bands:
            for w in writes:
                inter = w.box.intersect(band)
                if inter is None or inter.size == 0:
                    continue
                data[w.rank] = data.get(w.rank, 0) + inter.size * itemsize
                read[w.rank] = read.get(w.rank, 0) + inter.shape[0] * math.prod(w.box.shape[1:]) * itemsize
    files = plan.source.rank_files
    return tuple(SourceRead(r, str(files[r]), data[r], read[r]) for r in sorted(data))


@dataclass(frozen=True)
class PlanReads:
    """``zckpt plan --src``: per destination rank, the source files it reads and the bytes
    it holds."""

    ranks: Mapping[int, tuple[SourceRead, ...]]
    held: Mapping[int, int]

    @property
    def bytes_held(self) -> int:
        return sum(self.held.values())

    @property
    def bytes_read(self) -> int:
        return sum(s.read for reads in self.ranks.values() for s in reads)

    @property
    def amplification(self) -> float:
        """Bytes read from the source files per byte the destination ranks hold."""
        return self.bytes_read / self.bytes_held if self.bytes_held else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"reads": {str(r): {"held": self.held[r], "read": sum(s.read for s in reads),
                                   "sources": [{"rank": s.rank, "path": s.path, "bytes": s.bytes, "read": s.read}
                                               for s in reads]}
                          for r, reads in self.ranks.items()},
                "bytes_held": self.bytes_held, "bytes_read": self.bytes_read,
                "read_amplification": round(self.amplification, 6)}

    def lines(self, size: Callable[[float], str]) -> list[str]:
        out = []
        for r, reads in self.ranks.items():
            got = sum(s.read for s in reads)
            out.append(f"destination rank {r}: holds {size(self.held[r])}, reads {size(got)} from "
                       f"{len(reads)} source file(s)")
            for s in reads:
                more = f" ({size(s.read)} read: whole source rows)" if s.read != s.bytes else ""
                out.append(f"  source rank {s.rank}: {size(s.bytes)}{more} from {s.path}")
        out.append(f"total: {len(self.ranks)} destination rank(s) hold {size(self.bytes_held)}, read "
                   f"{size(self.bytes_read)} from the source files: read amplification {self.amplification:.2f}")
        return out


def plan_reads(plan: TransformPlan, block_bytes: int, overlap: bool | None = None) -> PlanReads:
    """What every destination rank of ``plan`` reads (:func:`source_reads`) and holds."""
    band = band_bytes_of(block_bytes, overlap)
    ranks = {r.rank: source_reads(plan, r, band) for r in plan.export.ranks}
    specs = {t.name: t for t in plan.source.tensors}
    held = {r.rank: sum(s.box.size * ms_dtype(specs[s.name].ms_type).storage.itemsize for s in r.slices
                        if specs[s.name].kind == "tensor") for r in plan.export.ranks}
    return PlanReads(ranks, held)


def band_bytes_of(block_bytes: int, overlap: bool | None, options: Any = None) -> int:
    """The band size the direct path's reader uses (its share of ``block_bytes``)."""
    share = Engine.of(options).share(block_bytes) if options is not None else block_bytes
    return batch_bytes(share, wants_overlap(overlap))
