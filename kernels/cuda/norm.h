// CUDA rmsnorm, add_rmsnorm and rmsnorm_backward on raw pointers; stream is a cudaStream_t.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::ops::cuda {

// x, out (T, C) f32; weight (C) f32 or bf16; rstd (T) f32.
void rmsnorm(const float* x, const void* weight, DType weight_type, float* out, float* rstd,
             int64_t T, int64_t C, float eps, void* stream);
// residual_out = residual + delta (residual_out may be residual), then rmsnorm of it.
void add_rmsnorm(const float* residual, const float* delta, const void* weight, DType weight_type,
                 float* residual_out, float* out, float* rstd, int64_t T, int64_t C, float eps,
                 void* stream);
// dx (T, C) [+]= d/dx; dweight (C) [+]= the sum over fixed chunks of 64 rows, in chunk order.
void rmsnorm_backward(const float* dout, const float* x, const void* weight, DType weight_type,
                      const float* rstd, float* dx, float* dweight, int64_t T, int64_t C,
                      bool accumulate_dx, bool accumulate_dweight, void* stream);

}  // namespace tandem::ops::cuda
