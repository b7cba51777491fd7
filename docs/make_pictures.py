"""Draw the pictures of docs/ from real MindSpore layouts (``python docs/make_pictures.py``).

Every layout drawn here was written by MindSpore's parallel compiler: ``docs/example`` is
fixture s01 (8 -> 4 ranks, optimizer parallel on the destination), ``docs/layouts/`` holds
the strategy files of fixtures s06 (2 pipeline stages x 4 ranks) and s16 (multi-axis
tensor maps). Shapes come from the example's real shards (ingested into a temporary store);
s06 and s16 compile the same network. ``tests/test_pictures.py`` checks the files here are
what this script draws, and that the drawn boxes are the shards' real shapes. It also draws
the layers of docs/architecture.md (``make_architecture.py``, from zckpt's own code).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from zckpt.formats.strategy import read_strategy
from zckpt.jobs.draw import Panel, flow_svg, held_boxes, layout_panel, panels_by_stage, svg, transfer_svg
from zckpt.jobs.export_job import plan_export
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.plan.entry_layouts import without_opt_shard
from zckpt.store.store import Store

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))
import make_architecture  # noqa: E402  (beside this script)

EXAMPLE = DOCS / "example"
LAYOUTS = DOCS / "layouts"
SHAPES = {"layer1.weight": (32, 48), "layer2.weight": (48, 48), "layer2.bias": (48,), "layer3.weight": (48, 24)}
"""The network every fixture compiles (make/ms_worker.py in the fixtures' generators)."""
CHUNK_BYTES = 1024
"""Chunk cap of the pictures' store: small, so that the chunk grid shows inside the boxes."""


def store_panel(store: Store, name: str, title: str, *, grid: bool = False) -> Panel:
    """The boxes the store's writers hold (one source rank per box; replicas not drawn)."""
    spec = next(s for s in store.specs() if s.name == name)
    chunks = store.chunk_info(name).chunks if grid else None
    return Panel(title, spec.shape, held_boxes(store.writers(name)), chunks)


def export_panel(store: Store, strategy: Path, name: str, title: str) -> Panel:
    """The boxes each destination rank of ``strategy`` holds (replicas grouped)."""
    plan = plan_export(store, str(strategy))
    spec = next(s for s in store.specs() if s.name == name)
    held = [(r.rank, s.box) for r in plan.ranks for s in r.slices if s.name == name]
    return Panel(title, spec.shape, held_boxes(held))


def source_panel_all(store: Store, strategy: Path, name: str, title: str) -> Panel:
    """Every source rank's box (replicas grouped), from the source strategy and real shapes."""
    smap = read_strategy(strategy)
    spec = next(s for s in store.specs() if s.name == name)
    return layout_panel(title, smap.layout(name), spec.shape, param=name)


def pictures(work: Path) -> dict[str, str]:
    """File name -> SVG text of every picture in docs/img."""
    store_path = work / "store.zarr"
    ingest(EXAMPLE / "src" / "checkpoints", store_path, str(EXAMPLE / "src" / "strategy.ckpt"),
           IngestOptions(progress=False, chunk_bytes=CHUNK_BYTES))
    store = Store.open(store_path)
    src_s, dst_s = EXAMPLE / "src" / "strategy.ckpt", EXAMPLE / "dst" / "strategy.ckpt"
    out: dict[str, str] = {}
    n_src = len(list((EXAMPLE / "src" / "checkpoints").glob("rank_*")))
    out["flow.svg"] = flow_svg(n_src, len(store.specs()), plan_export(store, str(dst_s)).device_num)
    for name, file in (("layer1.weight", "example-layer1-weight.svg"), ("layer3.weight", "example-layer3-weight.svg")):
        src = source_panel_all(store, src_s, name, "source: 8 ranks")
        dst = export_panel(store, dst_s, name, "destination: 4 ranks")
        out[file] = transfer_svg(name, src, dst, rank=0)
    lay = read_strategy(dst_s).layout("layer1.weight")
    assert lay is not None
    shape = SHAPES["layer1.weight"]
    opt = [layout_panel("tensor parallel only (no optimizer split)", without_opt_shard(lay), shape),
           export_panel(store, dst_s, "layer1.weight", "as saved: optimizer shard over the copies")]
    out["optimizer-shard.svg"] = svg(opt, caption="layer1.weight on 4 ranks: the optimizer splits dimension 0 of "
                                                  "each slice again over the ranks that held copies of it")
    out["store-chunks.svg"] = svg([store_panel(store, "layer1.weight", "layer1.weight in the store", grid=True)],
                                  caption="Chunks (dashed; capped at 1 KiB here) divide the source boxes: "
                                          "each chunk has exactly one writer, the rank named")
    pipe = read_strategy(LAYOUTS / "s06_src_strategy_merged.ckpt")
    stage_dev = pipe.stage_device_num()
    panels = [p for name in ("layer1.weight", "layer3.weight")
              for p in panels_by_stage(name, pipe.layouts[name], SHAPES[name], stage_dev, param=name)]
    out["pipeline-stages.svg"] = svg(panels, arrows=False,
                                     caption=f"Pipeline, {stage_dev} ranks per stage: rank = stage * {stage_dev} + "
                                             "the rank inside the stage's device matrix")
    multi = read_strategy(LAYOUTS / "s16_src_strategy.ckpt")
    multi_dst = read_strategy(LAYOUTS / "s16_dst_strategy.ckpt")
    name = "layer1.weight"
    src = layout_panel("source: dev_matrix (2,4,2), map (None, (mp, sp))", multi.layout(name), SHAPES[name], param=name)
    dst = layout_panel("destination: dev_matrix (4,2), map (y, x)", multi_dst.layout(name), SHAPES[name], param=name)
    out["multi-axis.svg"] = transfer_svg(name, src, dst, rank=0)
    out[make_architecture.PICTURE.name] = make_architecture.picture()  # zckpt's layers, from its code
    return out


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else DOCS / "img"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zckpt-pictures-") as tmp:
        for name, text in pictures(Path(tmp)).items():
            (target / name).write_text(text, encoding="utf-8")
            print(target / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
