#!/usr/bin/env python3
"""Writes a GGUF holding the same weights as SRC at another precision (F32 or BF16): every
quantised tensor dequantised with gguf-py's reference decoder (exactly the values tandem loads),
all metadata copied. `tandem bench generate` runs llama.cpp on these so that it computes at the
precision tandem computes in, beside the original file.

Usage: requant_gguf.py SRC DST {f32|bf16}
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants

FILE_TYPE = {"f32": 0, "bf16": 32}  # llama_ftype: ALL_F32, MOSTLY_BF16


def main() -> int:
    src, dst, precision = sys.argv[1], sys.argv[2], sys.argv[3]
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        if name == "general.file_type":
            w.add_uint32(name, FILE_TYPE[precision])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        values = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]
        values = values.reshape(shape)
        if precision == "bf16" and len(shape) > 1:
            data = quants.quantize(values, GGMLQuantizationType.BF16)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.BF16)
        else:
            w.add_tensor(t.name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
