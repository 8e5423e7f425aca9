#!/usr/bin/env python3
"""Writes tests/golden/quants.gguf: one small tensor per supported ggml type plus, for each, the
values gguf-py's reference decoder (gguf.quants.dequantize) gives, as an F32 tensor named
"<name>.expected". The [interop] test in tests/model/test_gguf.cpp decodes each tensor with
model/quants.cpp and requires exact equality.

Run with a venv that has the gguf and numpy packages:
  python3 -m venv /tmp/venv-gguf && /tmp/venv-gguf/bin/pip install gguf numpy
  /tmp/venv-gguf/bin/python tests/golden/make_gguf_golden.py
"""
import os

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

T = gguf.GGMLQuantizationType
ROWS, COLS = 3, 512
rng = np.random.default_rng(20261201)


def random_f16(n, lo, hi):
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def q4_k_blocks(n):
    # gguf-py cannot quantise K-quants: random blocks with sane super-block scales.
    d = random_f16(n, 1e-3, 2e-2)
    dmin = random_f16(n, 1e-3, 2e-2)
    scales = rng.integers(0, 256, (n, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def q6_k_blocks(n):
    ql = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    scales = rng.integers(-64, 64, (n, 16), dtype=np.int8).view(np.uint8)
    d = random_f16(n, 1e-3, 2e-2)
    return np.concatenate([ql, qh, scales, d], axis=1)


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quants.gguf")
    w = gguf.GGUFWriter(out, arch="golden")
    w.add_string("golden.generator", "tests/golden/make_gguf_golden.py, gguf " +
                 getattr(gguf, "__version__", "0.19.0"))
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    for qtype in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K):
        name = qtype.name.lower()
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        if qtype == T.Q4_K:
            raw = q4_k_blocks(ROWS * COLS // block).reshape(ROWS, -1)
        elif qtype == T.Q6_K:
            raw = q6_k_blocks(ROWS * COLS // block).reshape(ROWS, -1)
        elif qtype == T.F32:
            raw = x.view(np.uint8)
        elif qtype == T.F16:
            raw = x.astype(np.float16).view(np.uint8)
        else:
            raw = quantize(x, qtype)
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(ROWS, COLS // block * nbytes)
        expected = dequantize(raw, qtype).astype(np.float32).reshape(ROWS, COLS)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        w.add_tensor(name + ".expected", expected)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(out, os.path.getsize(out), "bytes")


if __name__ == "__main__":
    main()
