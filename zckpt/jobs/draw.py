"""Pictures of layouts as SVG text: the global tensor with the box each rank holds.

People reason about resharding in pictures (which rank holds which block, where a
destination rank's block comes from), so the CLI (``zckpt plan --svg``, ``zckpt info
--svg``) and the docs (``docs/make_pictures.py``) draw them from real layouts. SVG is
written by hand-built strings: no plotting library at run time, output diffable in git.

Every drawn box carries ``data-box`` (global ``[[start...], [stop...]]``) and
``data-ranks`` attributes, so a picture can be checked by a program as well as by eye. A
destination box is filled with the colours of the source boxes it reads, one part per
source box (``data-part``: the part, ``data-source``: the source box), and each panel's
axes are labelled with the dimensions they show (``class='axis'``).
"""

from __future__ import annotations

import colorsys
import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from zckpt.core.errors import LayoutError
from zckpt.core.layout import Box, all_boxes, normalized_shape, resolve
from zckpt.formats.strategy import ParamLayout, StrategyMap

WIDTH = 360
"""Drawing width of one tensor panel (pixels)."""
MIN_HEIGHT, MAX_HEIGHT = 48, 360
GAP = 64
LEFT = 16
"""Room left of the first panel for the label of its vertical axis."""
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"


@dataclass(frozen=True)
class Panel:
    """One tensor as drawn: its shape, the boxes ranks hold (with the ranks holding each),
    an optional chunk grid (drawn as thin lines) and boxes to emphasise."""

    title: str
    shape: tuple[int, ...]
    boxes: tuple[tuple[Box, tuple[int, ...]], ...]
    grid: tuple[int, ...] | None = None
    highlight: frozenset[Box] = field(default_factory=frozenset)
    sources: Panel | None = None
    """For a destination: the source panel whose boxes fill its boxes, each part in the
    colour of the source box it is read from."""


def held_boxes(boxes: Iterable[tuple[int, Box]]) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """Group ``(rank, box)`` pairs by box: replicas are drawn once, labelled with all holders."""
    groups: dict[Box, list[int]] = {}
    for rank, box in boxes:
        groups.setdefault(box, []).append(rank)
    return tuple((b, tuple(sorted(rs))) for b, rs in sorted(groups.items()))


def layout_panel(title: str, layout: ParamLayout | None, shape: Sequence[int], *, first_rank: int = 0,
                 param: str | None = None) -> Panel:
    """The boxes a layout gives every rank of one stage (``first_rank`` numbers them
    globally for a pipeline stage); no layout means every rank holds the whole tensor."""
    shape = tuple(int(s) for s in shape)
    if layout is None:
        return Panel(title, shape, ((Box.full(shape), (first_rank,)),))
    sharding = resolve(layout, shape, param=param)
    return Panel(title, shape, held_boxes((first_rank + r, b) for r, b in enumerate(all_boxes(sharding))))


def plane(shape: Sequence[int]) -> tuple[int, int]:
    """The tensor as a 2-D picture: dimension 0 down, the other dimensions flattened across."""
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, max(1, shape[0])
    return max(1, shape[0]), max(1, math.prod(shape[1:]))


def plane_box(box: Box, shape: Sequence[int]) -> tuple[int, int, int, int]:
    """``(row0, row1, col0, col1)`` of a box in :func:`plane` coordinates. Only boxes that
    are whole in dimensions 2 and up are rectangles there; others are refused."""
    if box.ndim == 0:
        return 0, 1, 0, 1
    if box.ndim == 1:
        return 0, 1, box.start[0], box.stop[0]
    for d in range(2, box.ndim):
        if box.start[d] != 0 or box.stop[d] != shape[d]:
            raise LayoutError(f"cannot draw a box split in dimension {d} of a {box.ndim}-D tensor "
                              f"({box.to_json()}): pictures split dimensions 0 and 1 only")
    inner = math.prod(shape[2:])
    return box.start[0], box.stop[0], box.start[1] * inner, box.stop[1] * inner


def colour(i: int, n: int, *, strong: bool = False) -> str:
    """Distinct light fills for ``n`` boxes (golden-angle hues keep neighbours apart)."""
    hue = (i * 0.381966) % 1.0
    r, g, b = colorsys.hls_to_rgb(hue, 0.55 if strong else 0.82, 0.65)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def rank_label(ranks: Sequence[int]) -> str:
    """``r3``, ``r0,r1,r4,r5``, or ``r0,r2,r4,... (8)`` for many replicas."""
    if len(ranks) <= 4:
        return ",".join(f"r{r}" for r in ranks)
    return ",".join(f"r{r}" for r in ranks[:3]) + f",... ({len(ranks)})"


def panel_height(shape: Sequence[int]) -> int:
    rows, cols = plane(shape)
    return int(min(MAX_HEIGHT, max(MIN_HEIGHT, WIDTH * rows / cols)))


def box_fill(p: Panel, i: int) -> str:
    """The fill of ``p``'s box ``i``: its own colour, strong when emphasised, grey when
    others are."""
    box = p.boxes[i][0]
    strong = box in p.highlight
    return "#eeeeee" if p.highlight and not strong else colour(i, len(p.boxes), strong=strong)


def _parts_svg(p: Panel, box: Box, x0: float, y0: float, sx: float, sy: float) -> list[str]:
    """The parts of destination ``box`` that each source box of ``p.sources`` holds, in
    that source box's colour (its strong colour when the box is emphasised)."""
    assert p.sources is not None
    src = p.sources
    strong = box in p.highlight
    out = []
    for j, (sbox, ranks) in enumerate(src.boxes):
        part = sbox.intersect(box)
        if part is None:
            continue
        r0, r1, c0, c1 = plane_box(part, p.shape)
        fill = colour(j, len(src.boxes), strong=True) if strong else (
            "#eeeeee" if p.highlight else colour(j, len(src.boxes)))
        out.append(f"<rect x='{x0 + c0 * sx:.2f}' y='{y0 + r0 * sy:.2f}' width='{(c1 - c0) * sx:.2f}' "
                   f"height='{(r1 - r0) * sy:.2f}' fill='{fill}' stroke='none' data-part='{part.to_json()}' "
                   f"data-source='{sbox.to_json()}' data-source-ranks='{','.join(map(str, ranks))}'/>")
    return out


def axis_labels(shape: Sequence[int]) -> tuple[str, str | None]:
    """What the picture's horizontal and vertical axes show (:func:`plane`)."""
    if not shape:
        return "a scalar (0-d)", None
    if len(shape) == 1:
        return f"dim 0: {shape[0]}", None
    across = f"dim 1: {shape[1]} columns" if len(shape) == 2 else \
        f"dims 1-{len(shape) - 1} flattened: {math.prod(shape[1:])} columns"
    return across, f"dim 0: {shape[0]} rows"


def _axes_svg(shape: Sequence[int], x0: float, y0: float, h: int) -> list[str]:
    across, down = axis_labels(shape)
    out = [f"<text x='{x0}' y='{y0 + h + 14}' {FONT} font-size='11' fill='#555' class='axis' data-dim='1'>"
           f"{html.escape(across)} \u2192</text>"]
    if down is not None:
        x, y = x0 - 6, y0 + h / 2
        out.append(f"<text x='{x}' y='{y:.2f}' {FONT} font-size='11' fill='#555' text-anchor='middle' "
                   f"transform='rotate(-90 {x} {y:.2f})' class='axis' data-dim='0'>"
                   f"\u2190 {html.escape(down)}</text>")
    return out


def _panel_svg(p: Panel, x0: float, y0: float) -> list[str]:
    rows, cols = plane(p.shape)
    h = panel_height(p.shape)
    sx, sy = WIDTH / cols, h / rows
    out = [f"<text x='{x0}' y='{y0 - 8}' {FONT} font-size='13' font-weight='bold'>{html.escape(p.title)}</text>",
           f"<text x='{x0 + WIDTH}' y='{y0 + h + 14}' {FONT} font-size='11' text-anchor='end' fill='#555'>"
           f"global shape {list(p.shape)}</text>", *_axes_svg(p.shape, x0, y0, h)]
    labels: list[str] = []
    for i, (box, ranks) in enumerate(p.boxes):
        r0, r1, c0, c1 = plane_box(box, p.shape)
        x, y, w, hh = x0 + c0 * sx, y0 + r0 * sy, (c1 - c0) * sx, (r1 - r0) * sy
        strong = box in p.highlight
        fill = box_fill(p, i)
        if p.sources is not None:
            out.extend(_parts_svg(p, box, x0, y0, sx, sy))
            fill = "none"
        out.append(
            f"<rect x='{x:.2f}' y='{y:.2f}' width='{w:.2f}' height='{hh:.2f}' fill='{fill}'"
            f" stroke='#222' stroke-width='{2.5 if strong else 0.8}' data-box='{box.to_json()}'"
            f" data-ranks='{','.join(map(str, ranks))}'/>"
        )
        label = rank_label(ranks)
        size = min(12.0, hh * 0.6, w / max(1, len(label)) * 1.7)
        if size >= 6:
            labels.append(f"<text x='{x + w / 2:.2f}' y='{y + hh / 2 + size / 3:.2f}' {FONT} font-size='{size:.1f}'"
                          f" text-anchor='middle' paint-order='stroke' stroke='white' stroke-width='3'>{label}</text>")
    if p.grid is not None:
        out.extend(_grid_lines(p, x0, y0, sx, sy, h))
    out.extend(labels)
    out.append(f"<rect x='{x0}' y='{y0}' width='{WIDTH}' height='{h}' fill='none' stroke='#000' stroke-width='1.2'/>")
    return out


def _grid_lines(p: Panel, x0: float, y0: float, sx: float, sy: float, h: int) -> list[str]:
    """Chunk borders as dashed lines (at most one line every 3 pixels, else none: too dense to read)."""
    assert p.grid is not None
    rows, cols = plane(p.shape)
    grid_rows = p.grid[0] if len(p.shape) >= 2 else rows
    grid_cols = (p.grid[-1] if len(p.shape) == 1 else math.prod(p.grid[1:])) if p.shape else cols
    out = []
    if grid_rows * sy >= 3:
        out += [f"<line x1='{x0}' y1='{y0 + r * sy:.2f}' x2='{x0 + WIDTH}' y2='{y0 + r * sy:.2f}' "
                "stroke='#000' stroke-width='0.5' stroke-dasharray='3,2' class='chunk'/>"
                for r in range(grid_rows, rows, grid_rows)]
    if grid_cols * sx >= 3:
        out += [f"<line x1='{x0 + c * sx:.2f}' y1='{y0}' x2='{x0 + c * sx:.2f}' y2='{y0 + h}' "
                "stroke='#000' stroke-width='0.5' stroke-dasharray='3,2' class='chunk'/>"
                for c in range(grid_cols, cols, grid_cols)]
    return out


def svg(panels: Sequence[Panel], *, caption: str = "", arrows: bool = True) -> str:
    """Panels side by side (with ``arrows``: an arrow from each to the next), a caption underneath."""
    if not panels:
        raise LayoutError("nothing to draw")
    heights = [panel_height(p.shape) for p in panels]
    top = 32
    width = max(len(panels) * WIDTH + (len(panels) - 1) * GAP + 24 + LEFT, 24 + 6.6 * len(caption))
    height = top + max(heights) + (48 if caption else 24)
    body: list[str] = []
    for i, p in enumerate(panels):
        x0 = 12 + LEFT + i * (WIDTH + GAP)
        body += _panel_svg(p, x0, top)
        if i and arrows:
            ax, ay = x0 - GAP + 8, top + min(heights[i - 1], heights[i]) / 2
            body.append(f"<path d='M{ax},{ay} h{GAP - 36}' stroke='#444' stroke-width='2' marker-end='url(#arrow)'/>")
    if caption:
        body.append(f"<text x='12' y='{height - 14}' {FONT} font-size='12' fill='#333'>{html.escape(caption)}</text>")
    return _document(width, height, body)


def _document(width: float, height: float, body: list[str]) -> str:
    head = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}'>\n"
            "<defs><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
            "orient='auto'><path d='M0,0 L10,5 L0,10 z' fill='#444'/></marker></defs>\n"
            f"<rect width='100%' height='100%' fill='white'/>\n")
    return head + "\n".join(body) + "\n</svg>\n"


def reads_of(dst_box: Box, src: Panel) -> frozenset[Box]:
    """The source boxes a destination box overlaps: what that destination rank reads."""
    return frozenset(b for b, _ in src.boxes if b.intersect(dst_box) is not None)


def transfer_svg(name: str, src: Panel, dst: Panel, rank: int | None = None, note: str = "") -> str:
    """Source and destination layouts of one parameter; with ``rank``, that destination
    rank's box and the source boxes it is read from are emphasised."""
    caption = f"{name}: boxes held by each rank (rN), filled with the colours of the source boxes they read"
    if rank is not None:
        mine = [b for b, rs in dst.boxes if rank in rs]
        if not mine:
            raise LayoutError(f"destination rank {rank} holds no part of {name}", param=name)
        reads = frozenset().union(*(reads_of(b, src) for b in mine))
        src = Panel(src.title, src.shape, src.boxes, src.grid, reads)
        dst = Panel(dst.title, dst.shape, dst.boxes, dst.grid, frozenset(mine))
        caption = f"{name}: destination rank {rank} reads the {len(reads)} coloured source box(es), each part in " \
                  "its source's colour"
    return svg([src, replace(dst, sources=src)], caption=caption + note)


def flow_svg(src_files: int, store_arrays: int, dst_files: int) -> str:
    """ingest -> store -> export (and the direct transform path), with real counts."""
    body: list[str] = []

    def files(x: float, n: int, title: str) -> None:
        shown = min(n, 6)
        for i in range(shown):
            y = 60 + i * 30
            text = f"rank_{i}" if i < shown - 1 or n <= shown else f"... rank_{n - 1}"
            body.append(f"<rect x='{x}' y='{y}' width='110' height='24' rx='3' fill='#e8eef8' stroke='#345'/>")
            body.append(f"<text x='{x + 55}' y='{y + 16}' {FONT} font-size='11' text-anchor='middle'>{text}</text>")
        body.append(f"<text x='{x + 55}' y='44' {FONT} font-size='13' font-weight='bold' "
                    f"text-anchor='middle'>{html.escape(title)}</text>")

    files(20, src_files, f"{src_files} source shards")
    files(470, dst_files, f"{dst_files} destination files")
    body.append("<rect x='250' y='70' width='120' height='120' rx='10' fill='#f3ecd9' stroke='#753'/>")
    body.append(f"<text x='310' y='44' {FONT} font-size='13' font-weight='bold' text-anchor='middle'>"
                "Zarr v3 store</text>")
    body.append(f"<text x='310' y='125' {FONT} font-size='11' text-anchor='middle'>{store_arrays} arrays,</text>")
    body.append(f"<text x='310' y='140' {FONT} font-size='11' text-anchor='middle'>global shapes</text>")
    body.append("<path d='M135,130 H245' stroke='#444' stroke-width='2' marker-end='url(#arrow)'/>")
    body.append(f"<text x='190' y='122' {FONT} font-size='12' text-anchor='middle'>ingest</text>")
    body.append("<path d='M375,130 H465' stroke='#444' stroke-width='2' marker-end='url(#arrow)'/>")
    body.append(f"<text x='420' y='122' {FONT} font-size='12' text-anchor='middle'>export</text>")
    body.append("<path d='M135,250 C250,300 370,300 465,250' fill='none' stroke='#888' stroke-width='2' "
                "stroke-dasharray='6,4' marker-end='url(#arrow)'/>")
    body.append(f"<text x='300' y='312' {FONT} font-size='12' text-anchor='middle' fill='#555'>"
                "transform (straight from the shards, no store)</text>")
    return _document(600, 330, body)


def panels_by_stage(title: str, layouts: Mapping[int, ParamLayout], shape: Sequence[int], stage_device_num: int,
                    *, param: str | None = None) -> list[Panel]:
    """One panel per pipeline stage holding the parameter (ranks numbered globally)."""
    return [layout_panel(f"{title} (stage {s}: ranks {s * stage_device_num}..{(s + 1) * stage_device_num - 1})",
                         lay, shape, first_rank=s * stage_device_num, param=param)
            for s, lay in sorted(layouts.items())]


def _first_stage(smap: StrategyMap | None, name: str) -> tuple[ParamLayout | None, int, int]:
    """(layout, first global rank, stage) of the first stage holding ``name``; unlisted or
    no strategy: the whole tensor on rank 0 of its stage."""
    if smap is None:
        return None, 0, 0
    per = smap.layouts.get(name, {})
    if not per:
        return None, 0, 0
    stage = min(per)
    return per[stage], stage * smap.stage_device_num(), stage


def plan_picture(src: StrategyMap | None, dst: StrategyMap | None, name: str,
                 shape: Sequence[int] | None = None, rank: int | None = None) -> str:
    """``zckpt plan --svg``: one parameter under both strategies. Strategy files hold no
    shapes, so without ``shape`` the tensor is drawn on the smallest shape both layouts
    divide evenly (the boxes' proportions are right, the aspect ratio is not)."""
    if (src is None or name not in src.layouts) and (dst is None or name not in dst.layouts):
        raise LayoutError("neither strategy lists this parameter", param=name)
    src_lay, src_first, src_stage = _first_stage(src, name)
    dst_lay, dst_first, dst_stage = _first_stage(dst, name)
    note = ""
    if shape is None:
        ndim = len((src_lay or dst_lay).tensor_map)  # type: ignore[union-attr]
        shape = normalized_shape(src_lay, dst_lay, ndim=ndim)
        note = "; shape unknown, drawn on one both layouts divide (give the real one with the shape option)"
    s_panel = layout_panel(f"source, stage {src_stage}", src_lay, shape, first_rank=src_first, param=name)
    d_panel = layout_panel(f"destination, stage {dst_stage}", dst_lay, shape, first_rank=dst_first, param=name)
    return transfer_svg(name, s_panel, d_panel, rank, note)


def store_picture(store_panel: Panel, dst_boxes: Iterable[tuple[int, Box]], name: str, rank: int | None = None) -> str:
    """``zckpt info STORE --svg``: the store's writers and chunk grid beside a destination."""
    dst = Panel("destination", store_panel.shape, held_boxes(dst_boxes))
    return transfer_svg(name, store_panel, dst, rank)
