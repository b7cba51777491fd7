"""Run under MindSpore's own Python: ask ``mindspore.parallel.rank_list_for_transform`` for rank lists.

usage:
  python ms_rank_lists.py fixtures FIXTURES_DIR [--out FILE]
      every fixture scenario that has a destination side, every destination rank; paths in the
      output are relative to FIXTURES_DIR. Regenerates ``tests/data/ms_rank_lists.json``:
      python tests/tools/ms_rank_lists.py fixtures ../shared/fixtures --out tests/data/ms_rank_lists.json
  python ms_rank_lists.py batch MANIFEST.json
      MANIFEST is ``{"cases": [{"src": FILE|null, "dst": FILE|null, "rank": INT}, ...]}``; prints
      ``{"results": [{"ranks": [...]} | {"error": "Type: message"}, ...]}`` in the same order.

Output is JSON on stdout (or FILE). MindSpore's own log lines go to stderr.
"""

import json
import sys
from pathlib import Path
from typing import Any


def _ask(rank: int, src: str | None, dst: str | None) -> dict[str, Any]:
    from mindspore.parallel import rank_list_for_transform

    try:
        return {"ranks": [int(r) for r in rank_list_for_transform(rank, src, dst)]}
    except Exception as err:  # MindSpore raises ValueError, TypeError, IndexError, RuntimeError
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"error": f"{type(err).__name__}: {first}"}


def _src_strategy(side: Path) -> Path | None:
    for name in ("strategy_merged.ckpt", "strategy.ckpt"):
        if (side / name).is_file():
            return side / name
    return None


def fixtures(root: Path) -> dict[str, Any]:
    import mindspore

    scenarios: dict[str, Any] = {}
    out = {"mindspore_version": mindspore.__version__, "scenarios": scenarios}
    for sdir in sorted(p for p in root.iterdir() if p.is_dir() and (p / "meta.json").is_file()):
        if not (sdir / "dst").is_dir():
            continue  # no destination side (s03: MindSpore cannot compile it)
        meta = json.loads((sdir / "meta.json").read_text(encoding="utf-8"))
        src = _src_strategy(sdir / "src")
        dst_file = sdir / "dst" / "strategy.ckpt"
        dst = dst_file if dst_file.is_file() else None
        entry: dict[str, Any] = {
            "src": None if src is None else src.relative_to(root).as_posix(),
            "dst": None if dst is None else dst.relative_to(root).as_posix(),
            "dst_ranks": int(meta["dst_ranks"]),
            "ranks": {},
        }
        for rank in range(int(meta["dst_ranks"])):
            got = _ask(rank, None if src is None else str(src), None if dst is None else str(dst))
            if "error" in got:
                entry.setdefault("errors", {})[str(rank)] = got["error"]
            else:
                entry["ranks"][str(rank)] = got["ranks"]
        scenarios[sdir.name] = entry
    return out


def batch(manifest: Path) -> dict[str, Any]:
    doc = json.loads(manifest.read_text(encoding="utf-8"))
    return {"results": [_ask(int(c["rank"]), c.get("src"), c.get("dst")) for c in doc["cases"]]}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "fixtures":
        doc = fixtures(Path(argv[1]))
    elif len(argv) == 2 and argv[0] == "batch":
        doc = batch(Path(argv[1]))
    else:
        sys.stderr.write(__doc__)
        return 2
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if "--out" in argv:
        Path(argv[argv.index("--out") + 1]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
