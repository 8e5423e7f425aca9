// CPU rotary position embedding, and the inverse frequencies every backend uses.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::ops::cpu {

// The largest head size rope accepts (the CUDA kernel takes the frequencies by value).
inline constexpr int64_t kRopeMaxHeadDim = 512;

// inv_freq[i] for i < D/2: theta^(-2i/D), with Llama-3 scaling when p.factor != 0 (Hugging
// Face's _compute_llama3_parameters), computed in double and rounded to float once.
void rope_inv_freq(int64_t D, const RopeParams& p, float* inv_freq);

// out (T, N, D) = x rotated pairwise by the angles float(positions[t]) * inv_freq[i] (by their
// negatives when inverse); out may be x.
void rope(const Tensor& x, const Tensor& positions, const Tensor& out, const float* inv_freq,
          bool inverse);

}  // namespace tandem::ops::cpu
