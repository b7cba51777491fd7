"""Draw zckpt's layers from the package itself (``python docs/make_architecture.py``).

The layers are the ``layers`` contract in ``pyproject.toml`` (``lint-imports`` enforces it in
``.ci/run``); the modules, their sizes and the imports between them are read from the source
files under ``zckpt/`` with :mod:`ast`, imports inside functions and ``TYPE_CHECKING`` blocks
included, so the picture shows every import that can run. Each band is a layer (a package,
or two independent ones), top to bottom; each box a module of it (its width grows with its
lines); each arrow on the right counts the modules of one layer that import a lower one.
An import from a layer into a higher one would be drawn in red: ``tests/test_architecture.py``
checks there is none, and that ``docs/img/architecture.svg`` is what this script draws now.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zckpt"
PICTURE = ROOT / "docs" / "img" / "architecture.svg"

TITLES = {
    0: "face: command line, MindSpore-named API",
    1: "jobs: ingest, export, transform, load, verify, info: a plan, a reader, a writer, an engine",
    2: "store | sources (independent of each other): the Zarr store and its reader; the shards and theirs",
    3: "write: rank-file writers fed by any box reader, output directories",
    4: "run: engines (in-process, helper process, Dask), progress",
    5: "plan: frozen plan values from pure layout maths",
    6: "formats: .ckpt, safetensors, strategy files, MindFormers, unified",
    7: "io: files local and remote, checksums, locks, safe paths",
    8: "core: errors, dtypes, strategy values, sharding maths; protoc's output",
}


@dataclass(frozen=True)
class Module:
    name: str
    """Dotted below ``zckpt``: ``store.records``, ``api``; a package's ``__init__`` is the
    package's name, the root's is ``__init__``."""
    lines: int
    imports: frozenset[str]
    """The modules of ``zckpt`` it imports (dotted as :attr:`name`; its own name left out)."""
    package: bool = False
    """An ``__init__.py``: drawn as its layer's band, not as a box."""

    @property
    def layer(self) -> str:
        """The top-level package or module it belongs to: ``store`` for ``store.records``."""
        return self.name.split(".")[0]


def layers(pyproject: Path = ROOT / "pyproject.toml") -> list[list[str]]:
    """The layers of the ``layers`` contract, top first, each a list of top-level names."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            return [[m.strip() for m in layer.replace("|", ":").split(":")] for layer in contract["layers"]]
    raise SystemExit("pyproject.toml has no layers contract")


def _exists(package: Path, dotted: str) -> bool:
    path = package.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported(tree: ast.Module, package: Path = PACKAGE) -> set[str]:
    """What a module imports of ``zckpt``, as names below it: ``from zckpt.io import remote``
    gives ``io.remote``, ``from zckpt.store.store import Store`` gives ``store.store``."""
    out: set[str] = set()

    def add(dotted: str) -> None:
        if dotted == "zckpt" or dotted.startswith("zckpt."):
            out.add(dotted.removeprefix("zckpt").removeprefix(".") or "__init__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            inner = [a.name for a in node.names
                     if node.module.startswith("zckpt") and _exists(package, f"{node.module}.{a.name}"[6:])]
            for name in inner:
                add(f"{node.module}.{name}")
            if len(inner) < len(node.names):
                add(node.module)
    return out


def modules(package: Path = PACKAGE) -> dict[str, Module]:
    """Every module of the package, generated protobuf code left out of the line counts."""
    found: dict[str, Module] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        name = ".".join(parts) or "__init__"
        text = path.read_text(encoding="utf-8")
        lines = 0 if path.name.endswith("_pb2.py") else text.count("\n")
        found[name] = Module(name, lines, frozenset(imported(ast.parse(text), package) - {name}),
                             package=rel.name == "__init__")
    return found


def upward(mods: dict[str, Module], bands: list[list[str]]) -> list[tuple[str, str]]:
    """Imports from a module into a module of a higher layer (none may exist)."""
    level = {m: i for i, band in enumerate(bands) for m in band}
    return sorted((m.name, t) for m in mods.values() for t in m.imports
                  if m.layer in level and t.split(".")[0] in level and level[t.split(".")[0]] < level[m.layer])


def svg(mods: dict[str, Module], bands: list[list[str]]) -> str:
    level = {m: i for i, band in enumerate(bands) for m in band}
    band_h, gap, left, width = 112, 14, 16, 900
    arrows_x = left + width + 40
    total_w = arrows_x + 260
    out: list[str] = []
    y = 40
    tops: list[float] = []
    for i, band in enumerate(bands):
        tops.append(y)
        present = sorted((m for m in mods if mods[m].layer in band and not mods[m].package),
                         key=lambda k: (band.index(mods[k].layer), k))
        lines = sum(mods[m].lines for m in present) or 1
        out.append(f"<rect x='{left}' y='{y}' width='{width}' height='{band_h}' fill='#f4f6fa' stroke='#9aa5b8'/>")
        out.append(f"<text x='{left + 6}' y='{y + 14}' font-size='12' font-weight='bold'>{escape(TITLES.get(i, ''))}"
                   f" ({lines} lines)</text>")
        x = left + 6.0
        usable = width - 12 - 3 * (len(present) - 1)
        for m in present:
            w = max(usable * mods[m].lines / lines, 1.0)
            out.append(f"<rect x='{x:.1f}' y='{y + 22}' width='{w:.1f}' height='{band_h - 28}' fill='#dbe4f3' "
                       f"stroke='#4a5a78'><title>zckpt.{escape(m)}: {mods[m].lines} lines</title></rect>")
            label = m.split(".", 1)[-1] if "." in m else m
            if w > 7 * len(label) * 0.62:
                out.append(f"<text x='{x + w / 2:.1f}' y='{y + 22 + (band_h - 28) / 2 + 4:.1f}' font-size='10' "
                           f"text-anchor='middle'>{escape(label)}</text>")
            elif w > 9:
                out.append(f"<text x='{x + w / 2 + 3:.1f}' y='{y + 26:.1f}' font-size='9' "
                           f"transform='rotate(90 {x + w / 2 + 3:.1f} {y + 26:.1f})'>{escape(label)}</text>")
            x += w + 3
        y += band_h + gap
    flows: Counter[tuple[int, int]] = Counter()
    for m in mods.values():
        for t in {t.split(".")[0] for t in m.imports}:
            if m.layer in level and t in level and level[m.layer] != level[t]:
                flows[(level[m.layer], level[t])] += 1
    for lane, ((a, b), n) in enumerate(sorted(flows.items(), key=lambda kv: (kv[0][1] - kv[0][0], kv[0]))):
        up = b < a
        x = arrows_x + 11 * (lane % 20)
        y0 = tops[a] + band_h / 2
        y1 = tops[b] + (band_h / 2 + 8 if up else band_h / 2 - 8)
        colour = "#c0392b" if up else "#556"
        out.append(f"<text x='{x + 2}' y='{y0 - 2:.1f}' font-size='8' fill='{colour}'>{n}</text>")
        out.append(f"<line x1='{x}' y1='{y0:.1f}' x2='{x}' y2='{y1:.1f}' stroke='{colour}' stroke-width='1.2' "
                   f"marker-end='url(#head{'up' if up else ''})'><title>{n} import(s) from layer {a} into layer "
                   f"{b}</title></line>")
    out.append(f"<text x='{arrows_x}' y='30' font-size='11'>imports between layers (count at the importer)</text>")
    count = sum(1 for m in mods.values() if not m.package)
    legend = f"{count} modules, {sum(m.lines for m in mods.values())} lines; arrows point at the layer imported"
    out.append(f"<text x='{left}' y='26' font-size='13'>zckpt's layers, read from the code ({escape(legend)})</text>")
    head = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{total_w}' height='{y + 10}' "
            f"font-family='DejaVu Sans, Arial, sans-serif'>\n<defs>"
            "<marker id='head' markerWidth='8' markerHeight='8' refX='6' refY='3' orient='auto'>"
            "<path d='M0,0 L6,3 L0,6 z' fill='#556'/></marker>"
            "<marker id='headup' markerWidth='8' markerHeight='8' refX='6' refY='3' orient='auto'>"
            "<path d='M0,0 L6,3 L0,6 z' fill='#c0392b'/></marker></defs>\n")
    return head + "\n".join(out) + "\n</svg>\n"


def picture() -> str:
    return svg(modules(), layers())


def main() -> int:
    PICTURE.write_text(picture(), encoding="utf-8")
    print(PICTURE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
