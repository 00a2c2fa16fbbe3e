#!/usr/bin/env python3
"""Regenerates the GGUF reader fixtures in crates/cmf-convert/tests/fixtures/gguf/.

Needs the `gguf` Python package (0.19 was used) and numpy. The Rust tests read the committed
files and need no Python.

dequant.gguf  one tensor `<TYPE>.q` per ggml type plus `<TYPE>.expected` (F32) holding what
              `gguf.quants.dequantize` returns for it. Types `gguf.quants.quantize` supports are
              quantized from random normals (with a zero block and a constant block mixed in);
              the K-quants, which it cannot quantize, are random bytes whose f16 scales are
              overwritten with sane values. Q8_K, which the package cannot dequantize either, gets
              its expected values from the one-line formula d * q (ggml-quants.c,
              dequantize_row_q8_K).
metadata.gguf every metadata value type (scalars, arrays, a nested array), alignment 64, two
              tensors; the expected values are written out again in the Rust test.
"""
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T, GGUFValueType as V
from gguf.quants import quantize, dequantize

OUT = Path(__file__).resolve().parent.parent / "crates/cmf-convert/tests/fixtures/gguf"
rng = np.random.default_rng(20240601)

QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
RANDOM_BLOCKS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_kquant_blocks(qtype, n_blocks):
    """Random bytes with every f16 (or f32) scale field replaced by a sane random value."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    scale = lambda: rng.uniform(1e-3, 5e-2, size=n_blocks) * rng.choice([-1, 1], size=n_blocks)
    # byte offsets of the f16 super-block scales, from the layouts in gguf/quants.py
    fields = {T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
    if qtype == T.Q8_K:
        b[:, 0:4] = np.abs(scale()).astype(np.float32).view(np.uint8).reshape(-1, 4)
    else:
        for off in fields[qtype]:
            b[:, off:off + 2] = f16_bytes(np.abs(scale()))
    return b


def expected_q8_k(blocks):
    d = blocks[:, 0:4].copy().view(np.float32)  # (n, 1)
    q = blocks[:, 4:260].view(np.int8).astype(np.float32)
    return (d * q).astype(np.float32)


def make_dequant():
    w = gguf.GGUFWriter(OUT / "dequant.gguf", "fixture")
    for qtype in QUANTIZABLE:
        bs = gguf.GGML_QUANT_SIZES[qtype][0]
        rows, cols = 3, 128
        x = rng.normal(0, 1, size=(rows, cols)).astype(np.float32)
        if bs > 1:
            x[1, :bs] = 0.0  # an all-zero block
            x[1, bs:2 * bs] = 0.75  # a constant block
        x[2] *= 1e-3  # small magnitudes
        q = quantize(x, qtype)
        expected = dequantize(q, qtype).astype(np.float32)
        # uint8 data: the writer derives the element shape from the byte shape
        w.add_tensor(f"{qtype.name}.q", np.ascontiguousarray(q), raw_dtype=qtype)
        w.add_tensor(f"{qtype.name}.expected", expected.reshape(x.shape))
    for qtype in RANDOM_BLOCKS:
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        rows, n_blocks = 2, 1
        blocks = random_kquant_blocks(qtype, rows * n_blocks)
        if qtype == T.Q8_K:
            expected = expected_q8_k(blocks)
        else:
            expected = dequantize(blocks.reshape(rows, n_blocks * ts), qtype)
        expected = np.asarray(expected, dtype=np.float32).reshape(rows, n_blocks * bs)
        w.add_tensor(f"{qtype.name}.q", blocks.reshape(rows, n_blocks * ts), raw_dtype=qtype)
        w.add_tensor(f"{qtype.name}.expected", expected)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_metadata():
    w = gguf.GGUFWriter(OUT / "metadata.gguf", "fixture")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.15625)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.5e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.arr_str", ["a", "", "Ġb"])
    w.add_key_value("t.arr_u16", [1, 2, 65535], V.ARRAY, sub_type=V.UINT16)
    w.add_key_value("t.arr_f32", [0.5, -1.0], V.ARRAY, sub_type=V.FLOAT32)
    w.add_array("t.arr_nested", [[1, 2], [3]])
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.array([1.5, -2.0], dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    make_dequant()
    make_metadata()
    for p in sorted(OUT.glob("*.gguf")):
        print(p.name, p.stat().st_size, "bytes", file=sys.stderr)
