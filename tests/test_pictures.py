"""Pictures: docs/img is what docs/make_pictures.py draws, and what a picture shows is true.

A drawn box is checked against MindSpore's own files, not against zckpt's layout maths:
its shape against the shard each named rank holds (docs/example is fixture s01), and its
position against the unsharded reference (fixture s01's ``reference/global.ckpt``, when
present): the shard's values are the reference's values inside the drawn box.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import scenario
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import LayoutError
from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.draw import Panel, plane_box

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLE = DOCS / "example"
RECT = re.compile(r"<rect [^>]*data-box='(\[\[[^']*\]\])' data-ranks='([0-9,]+)'")


def _make_pictures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_pictures", DOCS / "make_pictures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_pictures"] = module
    spec.loader.exec_module(module)
    return module


def boxes_of(svg_text: str) -> list[list[tuple[Box, tuple[int, ...]]]]:
    """The drawn boxes of every panel (panels are separated by their outline rect)."""
    panels: list[list[tuple[Box, tuple[int, ...]]]] = [[]]
    for line in svg_text.splitlines():
        m = RECT.search(line)
        if m:
            doc = eval(m.group(1))  # noqa: S307 - two lists of ints written by draw.py
            panels[-1].append((Box.from_json(doc), tuple(int(r) for r in m.group(2).split(","))))
        elif "fill='none' stroke='#000'" in line:
            panels.append([])
    return [p for p in panels if p]


def shard(side: str, rank: int, name: str) -> np.ndarray:
    folder = EXAMPLE / ("src/checkpoints" if side == "src" else "dst/expected") / f"rank_{rank}"
    with CkptReader(next(folder.glob("*.ckpt"))) as r:
        return np.array(r.array(name))


def test_docs_pictures_are_current(tmp_path: Path) -> None:
    mod = _make_pictures()
    drawn = mod.pictures(tmp_path)
    assert set(drawn) == {p.name for p in (DOCS / "img").glob("*.svg")}
    for name, text in drawn.items():
        assert (DOCS / "img" / name).read_text(encoding="utf-8") == text, f"docs/img/{name} is stale: " \
            "run python docs/make_pictures.py"


@pytest.mark.parametrize("picture, name", [("example-layer1-weight.svg", "layer1.weight"),
                                           ("example-layer3-weight.svg", "layer3.weight")])
def test_drawn_boxes_are_the_real_shards(picture: str, name: str) -> None:
    src, dst = boxes_of((DOCS / "img" / picture).read_text(encoding="utf-8"))
    for side, panel, n in (("src", src, 8), ("dst", dst, 4)):
        seen = sorted(r for _, ranks in panel for r in ranks)
        assert seen == list(range(n))
        for box, ranks in panel:
            for r in ranks:
                assert box.shape == shard(side, r, name).shape, (side, r, box)
        boxes = [b for b, _ in panel]
        assert all(a.intersect(b) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])
        extent = (max(b.stop[0] for b in boxes), max(b.stop[1] for b in boxes))
        assert sum(b.size for b in boxes) == math.prod(extent)  # disjoint boxes that fill the tensor


def test_drawn_boxes_sit_where_the_reference_says() -> None:
    ref_file = scenario("s01") / "reference" / "global.ckpt"
    with CkptReader(ref_file) as r:
        whole = np.array(r.array("layer1.weight"))
    src, dst = boxes_of((DOCS / "img" / "example-layer1-weight.svg").read_text(encoding="utf-8"))
    for side, panel in (("src", src), ("dst", dst)):
        for box, ranks in panel:
            for rank in ranks:
                assert np.array_equal(shard(side, rank, "layer1.weight"), whole[box.slices()]), (side, rank)


def test_plan_svg_emphasises_the_rank_and_what_it_reads(tmp_path: Path) -> None:
    out = tmp_path / "p.svg"
    src_s, dst_s = str(EXAMPLE / "src/strategy.ckpt"), str(EXAMPLE / "dst/strategy.ckpt")
    assert cli_main(["plan", "--src-strategy", src_s, "--dst-strategy", dst_s, "--param", "layer1.weight",
                     "--shape", "32,48", "--rank", "1", "--svg", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    src, dst = boxes_of(text)
    strong = [b for b, _ in dst if f"data-box='{b.to_json()}'" in text and _is_strong(text, b)]
    assert [r for b, rs in dst for r in rs if b in strong] == [1]
    mine = strong[0]
    read = {b for b, _ in src if _is_strong(text, b)}
    assert read == {b for b, _ in src if b.intersect(mine) is not None}
    assert list(tmp_path.iterdir()) == [out]


def _is_strong(text: str, box: Box) -> bool:
    line = next(x for x in text.splitlines() if f"data-box='{box.to_json()}'" in x)
    return "stroke-width='2.5'" in line


def test_info_svg_draws_store_writers_and_chunks(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(["ingest", str(EXAMPLE / "src/checkpoints"), "--strategy", str(EXAMPLE / "src/strategy.ckpt"),
                     "--store", str(store), "--quiet"]) == 0
    out = tmp_path / "i.svg"
    assert cli_main(["info", str(store), "--svg", str(out), "--param", "layer2.weight",
                     "--dst-strategy", str(EXAMPLE / "dst/strategy.ckpt"), "--rank", "3"]) == 0
    src, dst = boxes_of(out.read_text(encoding="utf-8"))
    assert sorted(r for _, rs in dst for r in rs) == [0, 1, 2, 3]
    for box, ranks in src:  # one writer per box, the shard it wrote
        assert len(ranks) == 1 and box.shape == shard("src", ranks[0], "layer2.weight").shape


@pytest.mark.parametrize("args, message, code", [
    (["--svg", "x.svg"], "--svg needs --param", 2),
    (["--svg", "x.png", "--param", "layer1.weight"], "must end with .svg", 2),
    (["--svg", "x.svg", "--param", "nothing"], "neither strategy lists", 1),
    (["--svg", "x.svg", "--param", "layer1.weight", "--shape", "32,x"], "comma-separated", 2),
])
def test_plan_svg_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str,
                           code: int) -> None:
    argv = ["plan", "--src-strategy", str(EXAMPLE / "src/strategy.ckpt"), "--dst-strategy",
            str(EXAMPLE / "dst/strategy.ckpt")] + [str(tmp_path / a) if a.startswith("x.") else a for a in args]
    assert cli_main(argv) == code
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_boxes_split_beyond_dimension_one_are_refused() -> None:
    with pytest.raises(LayoutError, match="dimension 2"):
        plane_box(Box((0, 0, 0), (2, 2, 1)), (2, 2, 2))
    assert plane_box(Box((0, 1, 0), (2, 2, 3)), (2, 2, 3)) == (0, 2, 3, 6)
    assert Panel("t", (4,), ()).shape == (4,)


FILL = re.compile(r"fill='(#[0-9a-f]{6}|none)'")
PART = re.compile(r"data-part='(\[\[[^']*\]\])' data-source='(\[\[[^']*\]\])'")


def _fills(svg_text: str) -> dict[str, str]:
    """Fill of every drawn box (by its data-box) and of every part (by 'part:' + data-part)."""
    out = {}
    for line in svg_text.splitlines():
        fill = FILL.search(line)
        box, part = RECT.search(line), PART.search(line)
        if fill and part:
            out["part:" + part.group(1)] = fill.group(1)
        elif fill and box:
            out[box.group(1)] = fill.group(1)
    return out


def _parts(svg_text: str) -> list[tuple[Box, Box]]:
    return [(Box.from_json(eval(m.group(1))), Box.from_json(eval(m.group(2))))  # noqa: S307 - ints from draw.py
            for m in PART.finditer(svg_text)]


def _check_parts(text: str, emphasised: int | None) -> int:
    """Every destination box is filled by one part per source box it overlaps, in that
    source box's colour, the parts together being the box; returns how many boxes read
    several sources."""
    src, dst = boxes_of(text)
    fills, parts = _fills(text), _parts(text)
    several = 0
    for box, ranks in dst:
        mine = [(p, s) for p, s in parts if p.intersect(box) == p]
        overlapping = [s for s, _ in src if s.intersect(box) is not None]  # worked out from the source panel
        assert sorted(s for _, s in mine) == sorted(overlapping), (box, ranks)
        assert sum(p.size for p, _ in mine) == box.size  # disjoint parts inside the box: they cover it
        assert all(a.intersect(b) is None for i, (a, _) in enumerate(mine) for b, _ in mine[i + 1:])
        for p, s in mine:
            want = fills[str(s.to_json())] if emphasised is None or emphasised in ranks else "#eeeeee"
            assert fills["part:" + str(p.to_json())] == want, (box, p)
        assert fills[str(box.to_json())] == "none"  # the box itself is only an outline over its parts
        several += len(mine) > 1
    return several


@pytest.mark.parametrize("picture", ["example-layer1-weight.svg", "example-layer3-weight.svg", "multi-axis.svg"])
def test_destination_boxes_show_each_source_colour(picture: str) -> None:
    text = (DOCS / "img" / picture).read_text(encoding="utf-8")
    assert _check_parts(text, emphasised=0) >= 1
    src, dst = boxes_of(text)
    (mine,) = [b for b, rs in dst if 0 in rs]
    colours = {_fills(text)["part:" + str(p.to_json())] for p, _ in _parts(text) if p.intersect(mine) == p}
    assert len(colours) == len([s for s, _ in src if s.intersect(mine) is not None]) == 2


def test_plan_svg_fills_every_destination_box_by_source(tmp_path: Path) -> None:
    out = tmp_path / "p.svg"
    assert cli_main(["plan", "--src-strategy", str(EXAMPLE / "src/strategy.ckpt"), "--dst-strategy",
                     str(EXAMPLE / "dst/strategy.ckpt"), "--param", "layer3.weight", "--shape", "48,24",
                     "--svg", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert _check_parts(text, emphasised=None) == 4  # each destination row block reads two source columns
    assert len({f for k, f in _fills(text).items() if k.startswith("part:")}) == 4  # the 4 source boxes' colours


AXIS = re.compile(r"class='axis' data-dim='(\d)'>([^<]*)<")


@pytest.mark.parametrize("picture, labels", [
    ("example-layer1-weight.svg", {"0": "dim 0: 32 rows", "1": "dim 1: 48 columns"}),
    ("example-layer3-weight.svg", {"0": "dim 0: 48 rows", "1": "dim 1: 24 columns"}),
    ("store-chunks.svg", {"0": "dim 0: 32 rows", "1": "dim 1: 48 columns"}),
])
def test_axes_are_labelled(picture: str, labels: dict[str, str]) -> None:
    text = (DOCS / "img" / picture).read_text(encoding="utf-8")
    found = AXIS.findall(text)
    panels = len(boxes_of(text))
    assert len(found) == 2 * panels
    for dim, label in found:
        assert labels[dim] in label


def test_axis_labels_of_other_ranks() -> None:
    from zckpt.jobs.draw import axis_labels

    assert axis_labels(()) == ("a scalar (0-d)", None)
    assert axis_labels((48,)) == ("dim 0: 48", None)
    assert axis_labels((4, 3, 2)) == ("dims 1-2 flattened: 6 columns", "dim 0: 4 rows")
