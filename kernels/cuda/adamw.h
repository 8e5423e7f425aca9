// CUDA AdamW on raw pointers, and the per-step coefficients the CPU and CUDA updates share.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::ops {

// The scalars of one AdamW step, computed once on the host (in double, then rounded to f32) so
// that the CPU and CUDA element updates use the same numbers.
struct AdamWCoefficients {
  float decay;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;   // lr / (1 - beta1^step)
  float bias2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float grad_scale;
};

}  // namespace tandem::ops

namespace tandem::ops::cuda {

// param, grad, m, v (n) f32; copy: nullptr or (n) of copy_type (bf16 or f32).
void adamw(float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWCoefficients& c, void* copy, DType copy_type, void* stream);

}  // namespace tandem::ops::cuda
