"""Loading values into a MindSpore network: the one place zckpt imports MindSpore.

Values are numpy arrays (bf16 as ``ml_dtypes.bfloat16``, which ``mindspore.Tensor``
accepts) and strings (``append_dict`` entries, which have no Parameter form and are left
out, as ``mindspore.load_param_into_net`` ignores them too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zckpt.core.errors import UsageError


def require_mindspore(what: str) -> Any:
    """The ``mindspore`` module, or a clear refusal naming the argument that needs it."""
    try:
        import mindspore
    except ImportError:
        raise UsageError(f"{what} is a MindSpore network: loading into it needs MindSpore installed in this "
                         "environment (without it, call with no network to get the arrays)") from None
    return mindspore


def load_into_network(network: Any, values: Mapping[str, np.ndarray | str], strict_load: bool = False) -> Any:
    """``mindspore.load_param_into_net(network, {name: Parameter}, strict_load)``; its result."""
    ms = require_mindspore("network")
    if not isinstance(network, ms.nn.Cell):
        raise TypeError(f"The network should be a mindspore.nn.Cell, but got {type(network).__name__}.")
    params = {n: ms.Parameter(ms.Tensor(np.ascontiguousarray(v)), name=n)
              for n, v in values.items() if isinstance(v, np.ndarray)}
    return ms.load_param_into_net(network, params, strict_load=strict_load)
