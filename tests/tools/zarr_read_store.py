"""Read a zckpt store with zarr-python alone (zckpt cannot even be imported here) and print,
as JSON, every entry: Zarr data type, attributes, shape and a SHA-256 of the raw bytes.

usage: python zarr_read_store.py STORE.zarr [--consolidated]
"""

import hashlib
import json
import sys

sys.modules["zckpt"] = None  # any "import zckpt" now fails

import numpy as np  # noqa: E402
import zarr  # noqa: E402


def main(path: str, consolidated: bool) -> None:
    root = zarr.open_consolidated(path, mode="r") if consolidated else zarr.open_group(path, mode="r")
    manifest = root.attrs["zckpt"]
    out = {}
    for e in manifest["entries"]:
        if e["kind"] == "str":
            out[e["name"]] = {"kind": "str", "value": e["value"]}
            continue
        arr = root[e["key"]]
        data = np.asarray(arr[...])
        out[e["name"]] = {
            "kind": e["kind"],
            "data_type": str(arr.metadata.data_type.to_json(zarr_format=3)),
            "numpy": data.dtype.str,
            "ms_dtype": arr.attrs["zckpt"]["ms_dtype"],
            "shape": list(data.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(data).view(np.uint8).tobytes()).hexdigest(),
        }
    arrays = sorted(name for name, _ in root["tensors"].arrays())
    json.dump({"entries": out, "tensor_arrays": arrays, "zckpt_blocked": sys.modules.get("zckpt", "") is None},
              sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], "--consolidated" in sys.argv[2:])
