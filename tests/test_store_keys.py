"""Properties of the store's naming and chunking rules (pure functions of store.manifest and store.geometry)."""

from __future__ import annotations

import math
import urllib.parse

from hypothesis import given, settings
from hypothesis import strategies as st

from zckpt.store.geometry import chunk_shape
from zckpt.store.manifest import encode_key

_names = st.text(st.characters(codec="utf-8"), min_size=0, max_size=60)


@settings(max_examples=500, deadline=None)
@given(st.lists(_names, min_size=2, max_size=6, unique=True))
def test_keys_stay_distinct_when_case_is_folded(names: list[str]) -> None:
    keys = [encode_key(n) for n in names]
    assert len({k.lower() for k in keys}) == len(names), (names, keys)


@settings(max_examples=500, deadline=None)
@given(_names)
def test_key_is_one_safe_component_that_decodes_back(name: str) -> None:
    key = encode_key(name)
    assert "/" not in key and "\\" not in key and "\x00" not in key
    assert not key.startswith((".", "_")) and key.lower() != "zarr.json" and key.isascii()
    if name and "~" not in key:  # shortened keys carry a digest instead
        assert urllib.parse.unquote(key, errors="strict") == name


@settings(max_examples=800, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=0, max_size=4),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 1 << 22),
)
def test_chunk_divides_the_shard_and_fits(shard: list[int], itemsize: int, target: int) -> None:
    c = chunk_shape(shard, itemsize, target)
    assert all(s % k == 0 for s, k in zip(shard, c, strict=True))
    assert math.prod(c) * itemsize <= max(target, itemsize)


def test_chunk_of_an_empty_shard_with_a_huge_dimension_is_its_shape() -> None:
    assert chunk_shape((0, 2**40), 4, 1 << 20) == (1, 2**40)
