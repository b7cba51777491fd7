"""What zckpt remembers of the output directories it filled, kept outside them.

A finished ``export`` or ``transform`` leaves only the rank files in its output directory
(what MindSpore would write there). So that running the same job again recognises its own
complete directory (and writes nothing) instead of refusing it as someone else's, or
taking a directory of the same file names filled from another store for its own, the job
records here which directory it completed, with its fingerprint (what it was an export
of) and each file's size, modification time and inode: ``<state>/outputs/<sha256 of the
directory>.json``, where ``<state>`` is ``$ZCKPT_STATE_DIR``, else
``$XDG_STATE_HOME/zckpt``, else ``~/.local/state/zckpt``. A record whose files no longer
match is simply not used (the directory is then refused, as any other directory holding
files is: ``--overwrite`` replaces them). Records are best effort: where none can be
written, a rerun on a complete directory is refused instead of recognised.

While a job runs, the marker ``<out>/.zckpt-export.json`` (:data:`zckpt.write.out_dirs.MARKER`)
says which job the directory belongs to, so that a killed job resumes; it is removed as
the job's last step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

STATE_ENV = "ZCKPT_STATE_DIR"
KEEP = 4096
"""Records kept at most: the oldest beyond this are removed when a new one is written."""


def state_dir() -> Path:
    """Where zckpt keeps what it remembers between runs (outside every output directory)."""
    own = os.environ.get(STATE_ENV)
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "zckpt"


def _record_path(where: str) -> Path:
    return state_dir() / "outputs" / (hashlib.sha256(where.encode("utf-8")).hexdigest()[:40] + ".json")


def local_key(out: Path) -> str:
    """A local output directory's record key: its real path."""
    return str(out.resolve())


def local_files(out: Path, rels: Iterable[str]) -> dict[str, list[int]]:
    """``{relative path: [size, mtime_ns, inode]}`` of the files present among ``rels``."""
    found: dict[str, list[int]] = {}
    for rel in rels:
        try:
            st = os.lstat(out / rel)
        except OSError:
            continue
        found[rel] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return found


def remember(where: str, fingerprint: str, files: Mapping[str, list[int]] | Mapping[str, list[int | str]]) -> None:
    """Record that the job ``fingerprint`` completed the directory ``where`` with ``files``
    (best effort: a state directory that cannot be written is left alone)."""
    path = _record_path(where)
    doc = {"dir": where, "fingerprint": fingerprint, "files": dict(files)}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
        _trim(path.parent)


def recall(where: str, fingerprint: str) -> dict[str, Any] | None:
    """The files the job ``fingerprint`` left in ``where`` when it completed it (``None``
    when no such record exists: another job, or none, completed it last)."""
    try:
        doc = json.loads(_record_path(where).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("dir") != where or doc.get("fingerprint") != fingerprint:
        return None
    files = doc.get("files")
    return files if isinstance(files, dict) else None


def forget(where: str) -> None:
    """Drop the record of ``where`` (its files are about to change)."""
    with contextlib.suppress(OSError):
        _record_path(where).unlink()


def _trim(folder: Path) -> None:
    """Remove the oldest records beyond :data:`KEEP` (directories long gone, mostly)."""
    with os.scandir(folder) as it:
        names = [e.name for e in it if e.name.endswith(".json")]
    if len(names) <= KEEP:  # (no stat of every record on every run)
        return
    entries = sorted((folder / n for n in names), key=lambda p: p.stat().st_mtime_ns)
    for old in entries[: max(0, len(entries) - KEEP)]:
        with contextlib.suppress(OSError):
            old.unlink()


def finished_here(out: Path, planned: Iterable[str], fingerprint: str) -> bool:
    """Whether the local directory ``out`` is what the job ``fingerprint`` left when it
    completed it: its record exists, every file there is one of the job's ``planned`` files
    (relative paths; every folder one of theirs) unchanged since (size, modification time,
    inode). Files the job wrote that are gone since do not matter: they are written again."""
    record = recall(local_key(out), fingerprint)
    if record is None:
        return False
    files = set(planned)
    folders = {f.rsplit("/", 1)[0] for f in files if "/" in f}
    for root, dirs, names in os.walk(out):
        rel = os.path.relpath(root, out)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        if any(prefix + d not in folders for d in dirs):
            return False
        for name in names:
            key = prefix + name
            if name.endswith(".tmp-zckpt"):
                continue  # a temporary file of its own, removed when it resumes
            if key not in files or record.get(key) != local_files(out, [key]).get(key):
                return False
    return True


def finished_there(present: Mapping[str, tuple[int, str]], planned: Iterable[str], where: str,
                   fingerprint: str) -> bool:
    """:func:`finished_here` for a remote directory ``where``: ``present`` gives the size and
    ETag of each file there (relative paths; object stores keep no inode, and their times are
    not reliably those of the upload), compared with the record's (the ETag where both have one)."""
    record = recall(where, fingerprint)
    if record is None:
        return False
    files = set(planned)
    for key, (size, etag) in present.items():
        if key.endswith(".tmp-zckpt"):
            continue
        kept = record.get(key)
        if key not in files or not isinstance(kept, list) or not kept or kept[0] != size:
            return False
        if etag and len(kept) > 1 and kept[1] and kept[1] != etag:
            return False
    return True


def finished_as_recorded(out: Path, fingerprint: str) -> bool:
    """Whether the local directory ``out`` holds exactly the files the job ``fingerprint``
    recorded when it completed it, each unchanged (for outputs whose file names are known
    only once written: safetensors ranks split into parts)."""
    record = recall(local_key(out), fingerprint)
    if not record:
        return False
    found = {Path(root, n).relative_to(out).as_posix() for root, _, names in os.walk(out) for n in names}
    return found == set(record) and local_files(out, sorted(found)) == record


def remember_all(out: Path, fingerprint: str) -> None:
    """:func:`remember` every file below ``out`` (a job that has just filled it)."""
    found = sorted(Path(root, n).relative_to(out).as_posix() for root, _, names in os.walk(out) for n in names)
    remember(local_key(out), fingerprint, local_files(out, found))
