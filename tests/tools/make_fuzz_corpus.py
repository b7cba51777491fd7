"""(Re)write tests/fuzz_corpus: the interesting inputs the format fuzzers found or target.

usage: python tests/tools/make_fuzz_corpus.py

Each file is small and named after what it exercises; ``MANIFEST.json`` records, per
file, whether the reader must accept or refuse it, a fragment the refusal message must
contain, and why the case is there (``found``: it broke the reader before the fix named
there). tests/test_fuzz_corpus.py replays them. Rerunning this script rewrites the same
bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data_judge as dj  # noqa: E402
import fuzz_support as fs  # noqa: E402
import numpy as np  # noqa: E402

from zckpt.formats import wire  # noqa: E402
from zckpt.formats.ckpt_encoding import CRC_MAGIC, value_header  # noqa: E402
from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "fuzz_corpus"


def _value_raw(tag: bytes, tensor: bytes) -> bytes:
    v = wire.encode_len_field(1, len(tag)) + tag + wire.encode_len_field(2, len(tensor)) + tensor
    return wire.encode_len_field(1, len(v)) + v


def _tensor_raw(dims: list[int], ms_type: bytes, content: bytes, *, packed: bool = False) -> bytes:
    if packed:
        body = b"".join(wire.encode_varint(d) for d in dims)
        out = wire.encode_len_field(1, len(body)) + body
    else:
        out = b"".join(wire.encode_key(1, wire.WIRE_VARINT) + wire.encode_varint(d) for d in dims)
    return out + wire.encode_len_field(2, len(ms_type)) + ms_type + wire.encode_len_field(3, len(content)) + content


def ckpt_cases() -> dict[str, tuple[bytes, str, str, str]]:
    """name -> (bytes, "accepted"/"refused", message fragment, why)."""
    ok = value_header("w", "Float32", [2], 8) + b"\0\0\x80?\0\0\0@"
    one = value_header("a", "Bool", [2000], 1) + b"\1"
    cut = np.arange(9, dtype=np.float64).tobytes()
    found = "found by the fuzzer: escaped as {} before the fix in zckpt/formats/ckpt.py ({})"
    return {
        "dims_overflow_with_zero.ckpt": (
            value_header("w", "Float32", [2**30, 2**31, 0], 0), "refused", "overflow int64",
            found.format("numpy ValueError 'array is too big' from array()/rows()", "_check_size, MAX_NBYTES")),
        "dims_overflow_zero_first.ckpt": (
            value_header("w", "Int64", [0, 2**62], 0), "refused", "overflow int64",
            found.format("numpy ValueError from array()", "_check_size, MAX_NBYTES")),
        "dims_huge_but_fits.ckpt": (
            value_header("w", "Float32", [2**30, 2**31 - 1, 0], 0), "accepted", "",
            "the largest empty shape numpy can represent: accepted, every accessor works"),
        "dims_65.ckpt": (
            value_header("w", "Float32", [1] * 65, 4) + b"\0" * 4, "refused", "more than 32 dims",
            found.format("numpy ValueError 'maximum supported dimension' from array()", "_parse_tensor, MAX_NDIM")),
        "dims_33_packed_zeros.ckpt": (
            _value_raw(b"w", _tensor_raw([0] * 33, b"Float32", b"", packed=True)), "refused", "more than 32 dims",
            "a packed dims field is parsed only up to the limit (a million zeros would be a million ints)"),
        "dims_product_overflows_int64.ckpt": (
            value_header("w", "Float64", [2**62, 2**62], 16) + b"\0" * 16, "refused", "overflow int64",
            "dims whose product overflows int64 while the payload is tiny"),
        "dims_disagree_with_payload.ckpt": (
            value_header("w", "Float32", [3], 8) + b"\0" * 8, "refused", "need 12",
            "payload shorter than dims say"),
        "dims_negative.ckpt": (
            value_header("w", "Float32", [-1], 0), "refused", "negative dimension", "two's complement varint"),
        "dtype_unknown.ckpt": (
            value_header("w", "Float8", [1], 1) + b"\0", "refused", "unknown tensor_type 'Float8'", "unknown dtype"),
        "dtype_not_ascii.ckpt": (
            _value_raw(b"w", _tensor_raw([1], "Fl\u00f6at".encode(), b"\0")), "refused", "not ASCII",
            "non-ASCII tensor_type"),
        "tag_not_utf8.ckpt": (
            _value_raw(b"\xff\xfe", _tensor_raw([1], b"Bool", b"\1")), "refused", "not UTF-8", "non-UTF-8 tag"),
        "tag_twice_apart.ckpt": (ok + value_header("b", "Bool", [1], 1) + b"\1" + ok, "refused",
                                 "not consecutively", "a tag repeated after another entry"),
        "continuation_disagrees.ckpt": (
            ok + value_header("w", "Float32", [4], 8) + b"\0" * 8, "refused", "disagrees",
            "continuation Value with other dims"),
        "segment_splits_element.ckpt": (
            value_header("w", "Float32", [2], 3) + b"\0" * 3 + value_header("w", "Float32", [2], 5) + b"\0" * 5,
            "refused", "splits an element", "a Value boundary inside an element"),
        "length_runs_past_end.ckpt": (
            wire.encode_len_field(1, 2**63) + b"\0" * 8, "refused", "runs past the end", "huge length prefix"),
        "length_negative.ckpt": (
            wire.encode_key(1, wire.WIRE_LEN) + wire.encode_varint(-5) + b"\0" * 8, "refused", "runs past the end",
            "a length of -5 as a 10-byte varint"),
        "varint_overlong.ckpt": (
            wire.encode_key(1, wire.WIRE_LEN) + b"\x80" * 10 + b"\x00", "refused", "longer than 10 bytes",
            "11-byte varint"),
        "wire_type_group.ckpt": (b"\x0b" + ok, "refused", "unsupported wire type", "deprecated group wire type"),
        "field_number_zero.ckpt": (b"\x02\x00" + ok, "refused", "field number 0", "field number 0"),
        "top_level_unknown_field.ckpt": (ok + b"\x10\x01", "refused", "unexpected top-level field 2",
                                         "a varint field where only Values belong"),
        "truncated_mid_tensor.ckpt": (ok[:-3], "refused", "truncated", "cut inside the payload"),
        "crc_mismatch.ckpt": (fs.with_crc(ok, 12345), "refused", "crc_num trailer mismatch", "wrong CRC"),
        "crc_trailer_cut.ckpt": (fs.with_crc(ok)[:-4], "refused", "corrupt or truncated", "trailer cut short"),
        "crc_value_over_32_bits.ckpt": (ok + CRC_MAGIC + b"\xff" * 10, "refused", "crc_num trailer mismatch",
                                        "a 10-byte CRC no CRC32 can equal"),
        "crc_good.ckpt": (fs.with_crc(ok), "accepted", "", "valid trailer"),
        "empty.ckpt": (b"", "accepted", "", "zero-length file: no entries"),
        "random_bytes.ckpt": (bytes(range(256))[::7] * 3, "refused", "", "random bytes"),
        "continuation_2000_values.ckpt": (one * 2000, "accepted", "",
                                          "found by the fuzzer: quadratic indexing and row lookup (fixed in _index "
                                          "and _SegmentMap); now linear"),
        "split_by_bytes_cuts_rows.ckpt": (
            value_header("c", "Float64", [3, 3], 32) + cut[:32] + value_header("c", "Float64", [3, 3], 40) + cut[32:],
            "accepted", "", "MindSpore's get_bytes split: rows straddle Values; rows() and row_blocks() gather"),
        "zero_d_as_dims_0.ckpt": (value_header("z", "Float32", [0], 4) + b"\0\0\x80?", "accepted", "",
                                  "MindSpore's 0-d tensor stored with dims [0]"),
        "string_not_utf32.ckpt": (value_header("s", "str", [0], 4) + b"\xff\xff\xff\xff", "accepted", "",
                                  "indexed fine; string() refuses with a format error"),
        "map_entry.ckpt": (fs.seed_files()["full"], "accepted", "", "every kind of entry, map and string included"),
    }


def _pb_strategy(name: bytes = b"w", node: bytes = b"MatMul-op0", dev: list[int] | None = None,
                 tmap: list[int] | None = None, opt_size: int = 0) -> bytes:
    """A one-layout protobuf strategy; names are set on the wire (so they may be invalid
    UTF-8, which the protobuf API refuses to write) with enclosing lengths re-encoded."""
    msg = pb.ParallelStrategyMap()
    msg.current_stage = 0
    op = msg.parallel_strategy_item.add()
    op.node_name = "n"
    op.parallel_strategys.stage = 0
    item = msg.parallel_layout_item.add()
    item.param_name = "p"
    lay = item.parallel_layouts
    lay.dev_matrix.add().dim.extend(dev or [2])
    lay.tensor_map.add().dim.extend(tmap if tmap is not None else [0])
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 0, opt_size
    tree = fs.parse(msg.SerializeToString(), fs.STRATEGY_SCHEMA, "ParallelStrategyMap")
    for top, value in ((2, node), (3, name)):
        for n in tree:
            if n.number == top and isinstance(n.value, list):
                fs.set_leaf(n.value, 1, value)
    return fs.encode(tree)


def strategy_cases() -> dict[str, tuple[bytes, str, str, str]]:
    found = "found by the fuzzer: escaped as {} before the fix in zckpt/formats/strategy.py ({})"
    layout = '"w": {"dev_matrix": [2], "tensor_map": [0]}'
    return {
        "json_parallel_strategy_item_list.json": (
            b'{"parallel_strategy_item": [1, 2]}', "refused", "must be an object",
            found.format("AttributeError", "_read_json type checks")),
        "json_layout_entry_list.json": (
            b'{"parallel_layout_item": {"w": [1]}}', "refused", "not an object",
            "a layout that is not an object"),
        "json_infinity.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [Infinity], "tensor_map": [0]}}}', "refused",
            "not an integer", found.format("OverflowError from int(inf)", "_json_int")),
        "json_nan_field.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0], "field": NaN}}}', "refused",
            "not an integer", found.format("ValueError from int(nan)", "_json_int")),
        "json_5000_digits.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [' + b"9" * 5000 + b'], "tensor_map": [0]}}}',
            "refused", "not a JSON strategy file",
            found.format("ValueError 'Exceeds the limit (4300 digits)'", "_read_json catches ValueError")),
        "json_deep_nesting.json": (
            b"[" * 20000 + b"]" * 20000, "refused", "not a JSON strategy file",
            found.format("RecursionError", "_read_json catches RecursionError")),
        "json_bool_dev_matrix.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [true], "tensor_map": [0]}}}', "refused",
            "not an integer", "int(True) would silently be 1"),
        "json_fractional_dim.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [2.5], "tensor_map": [0]}}}', "refused",
            "not an integer", "int(2.5) would silently be 2"),
        "json_integral_float.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [2.0], "tensor_map": [0.0]}}}', "accepted", "",
            "2.0 is an integer"),
        "json_dev_matrix_too_many_devices.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [4294967295, 4294967295], "tensor_map": [0, 1]}}}',
            "refused", "more than zckpt's limit",
            "a device count no plan can enumerate (range(device_num) would never end)"),
        "json_dev_matrix_over_uint32.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [4294967296], "tensor_map": [0]}}}', "refused",
            "must hold positive sizes", found.format("ValueError 'Value out of range' from encode_strategy",
                                                     "make_layout range checks")),
        "json_opt_size_over_int32.json": (
            b'{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0], '
            b'"opt_weight_shard_size": 2147483648}}}', "refused", "does not fit its field",
            found.format("ValueError 'Value out of range' from encode_strategy", "make_layout range checks")),
        "json_negative_stage.json": (
            b'{"parallel_strategy_item": {"op": {"stage": -1, "parallel_strategy": []}}, '
            b'"parallel_layout_item": {' + layout.encode() + b"}}", "refused", "does not fit its field",
            found.format("a layout at pipeline stage -1", "stage range check")),
        "json_parallel_strategy_negative.json": (
            b'{"parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": [[2, -1]]}}}', "refused",
            "does not fit its field", found.format("ValueError 'Value out of range' from encode_strategy",
                                                   "parallel_strategy range check")),
        "json_empty_param_name.json": (
            b'{"parallel_layout_item": {"": {"dev_matrix": [2], "tensor_map": [0]}}}', "refused",
            "empty parameter name", "an empty name cannot round-trip through a stage prefix"),
        "json_huge_stage_prefix.json": (
            b'{"parallel_layout_item": {"99999999999999999999-w": {"dev_matrix": [2], "tensor_map": [0]}}}',
            "accepted", "", "more than 10 digits is not a stage prefix (int() of 5000 digits would raise)"),
        "json_not_utf8.json": (b'{"parallel_layout_item": {"\xff": {}}}', "refused", "not a JSON strategy file",
                               "invalid UTF-8"),
        "json_bom.json": (b'\xef\xbb\xbf{"parallel_layout_item": {}}', "refused", "not a JSON strategy file",
                          "UTF-8 byte order mark"),
        "pb_param_name_not_utf8.ckpt": (
            _pb_strategy(name=b"\xff\xfe"), "refused", "param_name",
            found.format("TypeError (upb returns bytes for a proto2 string that is not UTF-8)", "_pb_text")),
        "pb_node_name_not_utf8.ckpt": (
            _pb_strategy(node=b"\xc3"), "refused", "node_name",
            found.format("bytes used as an operator name", "_pb_text")),
        "pb_tensor_map_out_of_range.ckpt": (
            _pb_strategy(dev=[2, 2], tmap=[3, -1]), "refused", "axis 3", "tensor_map names a missing axis"),
        "pb_opt_shard_size_negative.ckpt": (
            _pb_strategy(opt_size=-5), "refused", "negative", "opt_weight_shard_size below -1"),
        "pb_too_many_devices.ckpt": (
            _pb_strategy(dev=[65536, 65536], tmap=[0, 1]), "refused", "more than zckpt's limit",
            "2**32 devices"),
        "pb_truncated.ckpt": (_pb_strategy()[:-3], "refused", "protobuf", "cut short"),
        "pb_random.ckpt": (b"\xff\xff\xff\xff garbage", "refused", "protobuf", "random bytes"),
        "pb_valid.ckpt": (_pb_strategy(), "accepted", "", "control: the unmodified file"),
    }


def found_cases() -> dict[str, tuple[bytes, str, str, str]]:
    """Raw inputs of the fuzzers (``fuzz_support`` mutators driven by ``RandomChooser(seed)``)
    that made the pre-fix readers raise something other than a ZckptError. Written only
    when absent: if the mutators change, the seed no longer gives these bytes, the file does."""
    why = "fuzzer seed {}: the pre-fix reader raised {}"
    ckpt_seeds = fs.seed_files()
    pb_seeds = fs.seed_strategy_bytes()
    doc = json.loads(fs.encode_strategy_json(fs.seed_strategy()))
    out: dict[str, tuple[bytes, str, str, str]] = {}
    for seed, err in ((666, "numpy ValueError 'array is too big'"), (7664, "numpy ValueError 'cannot reshape'")):
        out[f"ckpt/found_seed_{seed}.ckpt"] = (
            fs.mutate_ckpt(fs.RandomChooser(seed), ckpt_seeds)[0], "refused", "overflow int64", why.format(seed, err))
    for seed, err, match in (
        (71, "AttributeError", "must be an object"),
        (111, "nothing, then protobuf ValueError 'Value out of range' when re-encoded", "does not fit"),
        (135, "OverflowError", "not an integer"),
        (155, "nothing: a layout at stage -2**64", "does not fit"),
        (1813, "nothing, then protobuf ValueError when re-encoded", "does not fit"),
    ):
        c = fs.RandomChooser(seed)
        out[f"strategy/found_seed_{seed}.json"] = (
            fs.json_text(fs.mutate_json_doc(c, doc)).encode(), "refused", match, why.format(seed, err))
    for seed, err, match in ((656, "TypeError", "param_name"), (2006, "UnicodeDecodeError", "node_name")):
        out[f"strategy/found_seed_{seed}.ckpt"] = (
            fs.mutate_strategy_pb(fs.RandomChooser(seed), pb_seeds)[0], "refused", match, why.format(seed, err))
    return out


def data_cases() -> dict[str, tuple[bytes, dict[str, object]]]:
    """Inputs judged by their data (tests/data_judge.py): mutated strategies of the judge's
    job that zckpt converted with wrong data, and a mutated shard it read otherwise than
    protobuf does, before the fixes named. name -> (bytes, manifest entry)."""
    seeds = {"job": dj.strategy_bytes()}
    why = ("found by the data-judging fuzzer (seed {}): {}; converted to wrong data before the fix in "
           "zckpt/sources/replicas.py (replicas spot-checked along every replicated axis)")
    replica = "differs from the one held by"
    out: dict[str, tuple[bytes, dict[str, object]]] = {}
    for seed, what in (
        (2403, "w's tensor_map [1, 0] became [-1, -1]: its four different shards called replicas"),
        (2582, "b's tensor_map [1] became [-1]: two of its replicas are real, the third is the other half"),
        (1874, "o's opt_weight_shard_size 2 became 0: its optimizer shards called replicas"),
        (1543, "moments.w's tensor_map [1, 0] became [-1, 0]: its row halves called replicas"),
        (4166, "w's tensor_map became [-1, 0] and o's dev_matrix was given twice"),
    ):
        data = fs.mutate_strategy_pb(fs.RandomChooser(seed), seeds)[0]
        out[f"source_strategy_seed_{seed}.ckpt"] = (data, {
            "kind": "source-strategy", "expect": "refused", "match": replica, "why": why.format(seed, what)})
    c = fs.RandomChooser(2752)
    rank = c.integer(0, dj.DEVICES - 1)
    data = fs.mutate_ckpt(c, {"shard": _job_shard(rank)})[0]
    out["shard_seed_2752.ckpt"] = (data, {
        "kind": "shard", "rank": rank, "expect": "refused", "match": "holds its tensor twice",
        "why": ("found by the data-judging fuzzer (seed 2752): a Value holding its TensorProto twice; protobuf (and "
                "so MindSpore) merges them, joining their dims; zckpt read the last one, before the fix in "
                "zckpt/formats/ckpt.py (_parse_value)")})
    return out


def _job_shard(rank: int) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        job = dj.write_job(Path(tmp))
        return (job / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").read_bytes()


def main() -> None:
    manifest: dict[str, dict[str, object]] = {}
    for sub, cases in (("ckpt", ckpt_cases()), ("strategy", strategy_cases())):
        folder = ROOT / sub
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            if not old.name.startswith("found_"):
                old.unlink()
        for name, (data, expect, match, why) in sorted(cases.items()):
            (folder / name).write_bytes(data)
            manifest[f"{sub}/{name}"] = {"expect": expect, "match": match, "why": why}
    for rel, (data, expect, match, why) in sorted(found_cases().items()):
        if not (ROOT / rel).exists():
            (ROOT / rel).write_bytes(data)
        manifest[rel] = {"expect": expect, "match": match, "why": why}
    (ROOT / "data").mkdir(exist_ok=True)
    for name, (data, entry) in sorted(data_cases().items()):
        (ROOT / "data" / name).write_bytes(data)
        manifest[f"data/{name}"] = {k: v for k, v in entry.items()}  # type: ignore[misc]
    (ROOT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    print(f"{len(manifest)} corpus files, {total} bytes in {ROOT}")


if __name__ == "__main__":
    main()
