"""Random layouts of the kinds MindSpore's parallel compiler produces, for generated models.

:func:`random_layout` draws factorised device matrices, left-most replication axes,
unsplit dimensions, several axes on one dimension, optimizer sharding over one or more
repeated axes (including an axis larger than the shard size still needs), ``manual_split``
uneven row splits and a ``field`` value; :func:`valid_opt_sizes` is derived independently
of :mod:`zckpt.core.layout`, so that tests of it are not circular. What a model holds is
:mod:`zckpt.jobs.generate_model`; nothing here writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zckpt.core.errors import UsageError
from zckpt.formats.strategy import ParamLayout, make_layout


def _prime_factors(n: int) -> list[int]:
    out = []
    p = 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def _random_factorization(rng: np.random.Generator, n: int) -> list[int]:
    """A random ordered factorisation of ``n`` into factors > 1 (empty for 1)."""
    primes = _prime_factors(n)
    rng.shuffle(primes)
    factors: list[int] = []
    for p in primes:
        if factors and rng.random() < 0.4:
            factors[-1] *= p
        else:
            factors.append(p)
    return factors


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_opt_sizes(dev_matrix: Sequence[int], used_dev_indices: set[int]) -> list[int]:
    """Optimizer shard sizes MindSpore can lay out on the repeated axes of a device matrix.

    The shard consumes the repeated axes (not used by the tensor map, size > 1) from the
    innermost outwards, whole axes first, and the last one only in part; so the valid
    sizes are ``(product of the k innermost repeated axes) * d`` with ``d`` dividing the
    next axis. Derived here independently of :mod:`zckpt.core.layout` so that tests of it are
    not circular.
    """
    repeated = [n for i, n in enumerate(dev_matrix) if i not in used_dev_indices and n > 1]
    sizes: set[int] = set()
    whole = 1
    for n in reversed(repeated):
        sizes.update(whole * d for d in _divisors(n) if d > 1)
        whole *= n
    return sorted(sizes)


def random_layout(
    rng: np.random.Generator,
    shape: Sequence[int],
    device_num: int,
    *,
    allow_opt: bool = True,
    allow_multi_axis: bool = True,
    unlisted_prob: float = 0.0,
    uneven_prob: float = 0.0,
    field_prob: float = 0.0,
) -> ParamLayout | None:
    """A random layout of ``shape`` on ``device_num`` devices that fits the shape.

    Draws a device matrix (a random factorisation of ``device_num``, sometimes with a
    left-most axis reserved for replication and sometimes with a size-1 axis), maps device
    axes onto dimensions they divide (possibly several onto one dimension when
    ``allow_multi_axis``; some axes stay unmapped, i.e. replicate), and with
    ``allow_opt`` picks an optimizer shard size: ``0``, ``-1`` (all repeated axes) or any
    valid size, including one that takes only part of an axis. Returns ``None`` (an
    unlisted tensor) with probability ``unlisted_prob``. With probability ``uneven_prob`` a
    dimension 0 split by one axis gets uneven pieces (``param_split_shape`` /
    ``indices_offset``, ``Gather`` ``manual_split``; MindSpore then shards no optimizer state
    of it), with ``field_prob`` a ``field`` value (``MatMul`` ``field_size``). Both draw from
    ``rng`` only when their probability is positive, so older seeds give the same layouts.
    """
    shp = tuple(int(s) for s in shape)
    if device_num < 1:
        raise UsageError(f"device_num must be positive, got {device_num}")
    if unlisted_prob > 0 and rng.random() < unlisted_prob:
        return None
    factors = _random_factorization(rng, device_num)
    if rng.random() < 0.15:
        factors.insert(int(rng.integers(0, len(factors) + 1)), 1)
    dev = tuple(factors) if factors else (1,)
    reserve_left = len(dev) >= 2 and rng.random() < 0.3
    ndim_dev = len(dev)
    axes = [a for a in range(ndim_dev) if not (reserve_left and a == ndim_dev - 1)]
    rng.shuffle(axes)
    tmap: list[list[int]] = [[] for _ in shp]
    remaining = list(shp)
    for a in axes:
        size = dev[ndim_dev - 1 - a]
        if not shp or rng.random() < 0.25:
            continue
        cands = [i for i in range(len(shp)) if remaining[i] % size == 0 and (allow_multi_axis or not tmap[i])]
        if not cands:
            continue
        i = cands[int(rng.integers(0, len(cands)))]
        tmap[i].append(a)
        remaining[i] //= size
    opt_size = 0
    opt_step = 0
    if allow_opt and shp and rng.random() < 0.6:
        used = {ndim_dev - 1 - a for axes_ in tmap for a in axes_}
        split0 = math.prod(dev[ndim_dev - 1 - a] for a in tmap[0])
        rows = shp[0] // split0
        sizes = [s for s in valid_opt_sizes(dev, used) if rows % s == 0]
        repeated_total = math.prod(n for i, n in enumerate(dev) if i not in used)
        choices: list[int] = list(sizes)
        if repeated_total > 1 and rows % repeated_total == 0:
            choices.append(-1)
        if choices:
            opt_size = choices[int(rng.integers(0, len(choices)))]
            inner = max(i for i, n in enumerate(dev) if i not in used and n > 1)
            opt_step = math.prod(dev[inner + 1 :])
    split: list[int] = []
    offsets: list[int] = []
    if uneven_prob > 0 and rng.random() < uneven_prob and shp and len(tmap[0]) == 1:
        pieces = dev[ndim_dev - 1 - tmap[0][0]]
        if shp[0] >= pieces > 1:
            # one count and offset per row piece, as MindSpore's compiler writes manual_split
            split = _uneven_parts(rng, shp[0], pieces)
            offsets = [sum(split[:k]) for k in range(pieces)]
            opt_size = opt_step = 0
    field_size = int(rng.choice([2, 6, 39])) if field_prob > 0 and rng.random() < field_prob else 0
    return make_layout(dev, [list(t) for t in tmap], opt_shard_step=opt_step, opt_shard_size=opt_size,
                       field_size=field_size, param_split_shape=split, indices_offset=offsets)


def _uneven_parts(rng: np.random.Generator, total: int, count: int) -> list[int]:
    """``count`` positive row counts adding up to ``total``, not all equal when that is possible."""
    for _ in range(8):
        cuts = sorted(int(c) for c in rng.choice(np.arange(1, total), size=count - 1, replace=False))
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        if len(set(parts)) > 1:
            return parts
    return parts
