"""What ``zckpt verify`` found: every mismatch, named by file, parameter and region, and the
counts of what was read.

The report is shared by the three checks (the store's own chunks and metadata,
:mod:`zckpt.jobs.verify_store`; the sources and the exports against the store,
:mod:`zckpt.jobs.verify_files`), each adding to it instead of stopping at the first
problem; it sits below them so that none of them imports another. Nothing here reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt.core.errors import ZckptError

MiB = 1024 * 1024


@dataclass(frozen=True)
class Mismatch:
    """One problem found: where (file, parameter, region) and what."""

    check: str
    """``"store"``, ``"source"`` or ``"export"``."""
    message: str
    file: str | None = None
    param: str | None = None
    region: str | None = None

    def render(self) -> str:
        where = [f"file {self.file}"] if self.file else []
        if self.param is not None:
            where.append(f"parameter {self.param!r}")
        if self.region:
            where.append(self.region)
        return f"[{self.check}] " + (", ".join(where) + ": " if where else "") + self.message

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "message": self.message, "file": self.file, "param": self.param,
                "region": self.region}


@dataclass
class VerifyReport:
    """Counts of what was checked, and every mismatch."""

    store: str
    arrays: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    checksummed_chunks: int = 0
    source_files: int = 0
    source_bytes: int = 0
    export_files: int = 0
    export_bytes: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    source_choices: dict[int, tuple[str, tuple[str, ...], str]] = field(default_factory=dict)
    """Source rank directories that held several checkpoint files: (file read, candidates, rule)."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def add(self, check: str, message: str, *, file: str | Path | None = None, param: str | None = None,
            region: str | None = None) -> None:
        self.mismatches.append(Mismatch(check, message, None if file is None else str(file), param, region))

    def add_error(self, check: str, err: ZckptError) -> None:
        self.add(check, err.message, file=err.path, param=err.param)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store, "ok": self.ok, "arrays": self.arrays, "chunks": self.chunks,
            "chunk_bytes": self.chunk_bytes, "checksummed_chunks": self.checksummed_chunks,
            "source_files": self.source_files, "source_bytes": self.source_bytes,
            "export_files": self.export_files, "export_bytes": self.export_bytes,
            "mismatches": [m.to_json() for m in self.mismatches],
            "source_file_choices": {str(r): {"file": f, "candidates": list(c), "rule": why}
                                    for r, (f, c, why) in self.source_choices.items()},
        }


def summary_lines(report: VerifyReport) -> list[str]:
    """Human-readable report: what was checked, then one line per mismatch."""
    lines = [
        f"store {report.store}: {report.arrays} arrays, {report.chunks} chunks ({report.chunk_bytes} bytes, "
        f"{report.checksummed_chunks} against recorded checksums)",
    ]
    if report.source_files:
        lines.append(f"sources: {report.source_files} files, {report.source_bytes} bytes compared")
    lines += [f"source rank {r}: chose {f} among {len(c)} files ({why})"
              for r, (f, c, why) in report.source_choices.items()]
    if report.export_files:
        lines.append(f"exports: {report.export_files} files, {report.export_bytes} bytes compared")
    lines += [m.render() for m in report.mismatches]
    lines.append("OK: no mismatch" if report.ok else f"FAILED: {len(report.mismatches)} mismatch(es)")
    return lines
