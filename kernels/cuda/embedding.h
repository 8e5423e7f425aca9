// CUDA embedding gather and its deterministic backward on raw pointers; stream is a cudaStream_t.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::ops::cuda {

// out (T, C) f32 = table (V, C) f32/bf16 [ids (T)]. A row whose id is outside [0, V) is written
// as zeros and flagged on the device. Returns the first flagged position, or -1. To return it,
// this copies the flag to the host and waits for the stream: every call synchronises the host
// with the stream (so it cannot be captured in a CUDA graph).
int64_t embedding(const int32_t* ids, const void* table, DType table_type, float* out, int64_t T,
                  int64_t V, int64_t C, void* stream);
// dtable (V, C) [+]= dout (T, C) added at the rows ids (T) name, each element in token order,
// no atomics. Ids outside [0, V) are skipped and the first one's position returned (else -1),
// with the same host synchronisation as embedding.
int64_t embedding_backward(const int32_t* ids, const float* dout, float* dtable, int64_t T,
                           int64_t V, int64_t C, bool accumulate, void* stream);

}  // namespace tandem::ops::cuda
