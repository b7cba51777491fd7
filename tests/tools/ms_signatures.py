"""Print, as JSON, the checkpoint functions MindSpore exports and their signatures.

usage: python ms_signatures.py   (under MindSpore's Python)

Names: every public name of ``mindspore.parallel.checkpoint_transform``,
``checkpoint_convert`` and ``transform_safetensors`` that ``mindspore.parallel`` or
``mindspore`` exports, plus ``mindspore.ckpt_to_safetensors`` / ``safetensors_to_ckpt``.
Printed: ``{"version": str, "functions": {"<module>.<name>": [[param, kind, default repr | null], ...]}}``.
"""

from __future__ import annotations

import inspect
import json
import sys

import mindspore
import mindspore.parallel
import mindspore.parallel.checkpoint_convert as convert
import mindspore.parallel.checkpoint_transform as transform
import mindspore.parallel.transform_safetensors as safetensors


def describe(fn: object) -> list[list[object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
            for p in sig.parameters.values()]


def main() -> int:
    names = [n for mod in (transform, convert, safetensors) for n in mod.__all__ if not n.startswith("_")]
    names += ["ckpt_to_safetensors", "safetensors_to_ckpt"]
    out: dict[str, list[list[object]]] = {}
    for mod in (mindspore, mindspore.parallel):
        for n in names:
            fn = getattr(mod, n, None)
            if callable(fn):
                out[f"{mod.__name__}.{n}"] = describe(fn)
    json.dump({"version": mindspore.__version__, "functions": out}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
