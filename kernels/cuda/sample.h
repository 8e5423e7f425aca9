// CUDA sampling on raw pointers: one block per row, thresholds by binary search, no sort.
#pragma once

#include <cstdint>

namespace tandem::ops::cuda {

// logits (B, V); settings (B) each; token (B) i32, logprob (B) f32. A row with bad settings gets
// token -1 and a NaN logprob (the CPU op throws instead; the device is not synchronised).
void sample(const float* logits, int64_t B, int64_t V, const float* temperature,
            const int32_t* top_k, const float* top_p, const float* min_p, const int64_t* seed,
            const int64_t* offset, int32_t* token, float* logprob, void* stream);

}  // namespace tandem::ops::cuda
