// CUDA cast, scale, add, random_uniform and sum_squares on raw pointers; stream is a cudaStream_t.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::ops::cuda {

void cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n, void* stream);
void scale(float* x, float s, int64_t n, void* stream);
void add(const float* x, float* out, int64_t n, void* stream);
void random_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream_id, void* stream);
void sum_squares(const float* x, int64_t n, float* out, bool accumulate, void* stream);

}  // namespace tandem::ops::cuda
