"""Read a zckpt store with zarr-python alone (zckpt cannot even be imported here) and print,
as JSON, every entry: Zarr data type, attributes, shape and a SHA-256 of the raw bytes.

usage: python zarr_read_store.py STORE.zarr [--consolidated] [--register FILE]

zarr-python has no ``bfloat16`` data type of its own. ``--register FILE`` runs FILE (zckpt's
standalone ``zarr_bfloat16.py``, which imports only numpy, ml_dtypes and zarr, as a user who
copied it would) and calls its ``register()``. Without it, an array zarr-python cannot open is
reported with zarr's error and read the documented fallback way: its ``zarr.json`` and raw
chunk files (bytes codec, little-endian) decoded with numpy as ``uint16`` bit patterns.
"""

import hashlib
import itertools
import json
import math
import runpy
import sys
from pathlib import Path

sys.modules["zckpt"] = None  # any "import zckpt" now fails

import numpy as np  # noqa: E402
import zarr  # noqa: E402


def _place(out: np.ndarray, coords: tuple[int, ...], chunks: tuple[int, ...], data: bytes, dtype: str) -> None:
    """Put one chunk's raw bytes (full chunk shape, edge chunks padded) at its place."""
    block = np.frombuffer(data, dtype=dtype).reshape(chunks)
    region = tuple(slice(i * c, min(s, (i + 1) * c)) for i, c, s in zip(coords, chunks, out.shape, strict=True))
    if all(r.start < r.stop for r in region):
        out[region] = block[tuple(slice(0, r.stop - r.start) for r in region)]


def read_raw_bits(array_dir: Path) -> tuple[str, np.ndarray]:
    """A 2-byte array of an uncompressed store from its files alone: ``zarr.json`` says the
    shape, chunk shape and chunk key separator; each chunk file holds its values' bytes. In a
    sharded array (``sharding_indexed``, index at the end) each shard file ends with its index:
    per inner chunk in C order, its byte offset and size (uint64 little-endian, all ones when
    absent), then the index's CRC-32C (4 bytes)."""
    doc = json.loads((array_dir / "zarr.json").read_text(encoding="utf-8"))
    codec = doc["codecs"][0]
    sharded = codec["name"] == "sharding_indexed"
    inner_codecs = codec["configuration"]["codecs"] if sharded else doc["codecs"]
    assert [c["name"] for c in inner_codecs] == ["bytes"], "the fallback reads uncompressed chunks only"
    assert not sharded or codec["configuration"].get("index_location", "end") == "end"
    assert doc["fill_value"] in (0, 0.0, "0x0000"), "the fallback fills missing chunks with zero bits"
    dtype = ("<" if inner_codecs[0]["configuration"]["endian"] == "little" else ">") + "u2"
    shape = tuple(doc["shape"])
    grid = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
    inner = tuple(codec["configuration"]["chunk_shape"]) if sharded else grid
    per = tuple(g // c for g, c in zip(grid, inner, strict=True))
    sep = doc["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    out = np.zeros(shape, dtype="<u2")  # fill value 0.0 is all-zero bits
    counts = [math.ceil(s / c) for s, c in zip(shape, grid, strict=True)]
    for coords in itertools.product(*(range(n) for n in counts)):
        path = array_dir / ("c" + "".join(f"{sep}{i}" for i in coords))
        if not path.is_file():
            continue
        data = path.read_bytes()
        if not sharded:
            _place(out, coords, inner, data, dtype)
            continue
        n = math.prod(per)
        index = np.frombuffer(data[len(data) - 4 - 16 * n : len(data) - 4], dtype="<u8").reshape(n, 2)
        for (offset, size), local in zip(index, itertools.product(*(range(k) for k in per)), strict=True):
            if offset != 2**64 - 1:
                at = tuple(c * k + i for c, k, i in zip(coords, per, local, strict=True))
                _place(out, at, inner, data[int(offset) : int(offset) + int(size)], dtype)
    return str(doc["data_type"]), out


def main(path: str, consolidated: bool, register: str | None) -> None:
    if register:
        runpy.run_path(register)["register"]()
    root = zarr.open_consolidated(path, mode="r") if consolidated else zarr.open_group(path, mode="r")
    manifest = root.attrs["zckpt"]
    out = {}
    for e in manifest["entries"]:
        if e["kind"] == "str":
            out[e["name"]] = {"kind": "str", "value": e["value"]}
            continue
        try:
            arr = root[e["key"]]
        except ValueError as err:
            data_type, data = read_raw_bits(Path(path) / e["key"])
            attrs = json.loads((Path(path) / e["key"] / "zarr.json").read_text(encoding="utf-8"))["attributes"]
            info = {"open_error": str(err), "data_type": data_type, "ms_dtype": attrs["zckpt"]["ms_dtype"]}
        else:
            data = np.asarray(arr[...])
            info = {"data_type": str(arr.metadata.data_type.to_json(zarr_format=3)),
                    "ms_dtype": arr.attrs["zckpt"]["ms_dtype"]}
        out[e["name"]] = {
            "kind": e["kind"],
            **info,
            "numpy": data.dtype.name if data.dtype.kind == "V" else data.dtype.str,
            "shape": list(data.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(data).view(np.uint8).tobytes()).hexdigest(),
        }
    try:
        arrays = sorted(name for name, _ in root["tensors"].arrays())
    except ValueError as err:  # listing opens every array
        arrays = [f"error: {err}"]
    json.dump({"entries": out, "tensor_arrays": arrays, "zckpt_blocked": sys.modules.get("zckpt", "") is None},
              sys.stdout)


if __name__ == "__main__":
    args = sys.argv[2:]
    main(sys.argv[1], "--consolidated" in args, args[args.index("--register") + 1] if "--register" in args else None)
