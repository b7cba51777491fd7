"""MindSpore's own ``get_strategy_metadata`` layout for strategy fields (the cross-check of
tests/mindformers_writer.py's port of ``_NetStrategyInfo._layout_process``).

usage (under MindSpore's Python; prints JSON): ms_layouts.py CASES_JSON
CASES_JSON: ``{case: {"dev_matrix", "tensor_map" (per dimension a list), "opt", "rank_list"}}``;
prints ``{case: Layout.to_dict()}`` of the layout MindSpore reports for them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from mindspore.parallel.strategy import _NetStrategyInfo


def main(path: str) -> int:
    info = object.__new__(_NetStrategyInfo)  # no network: only the layout arithmetic is used
    out = {}
    for case, c in json.loads(Path(path).read_text(encoding="utf-8")).items():
        raw = SimpleNamespace(opt_weight_shard_size=c["opt"], dev_matrix=list(c["dev_matrix"]),
                              tensor_map=[list(s) for s in c["tensor_map"]], rank_list=c["rank_list"],
                              tensor_type="Float32", tensor_shape=[1])
        layout = info._layout_process(raw)[0].to_dict()
        out[case] = {k: list(v) if isinstance(v, tuple) else v for k, v in layout.items()}
    json.dump(out, sys.stdout, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
