// CUDA matmul and its backward products through cuBLASLt, on raw pointers; stream is a
// cudaStream_t. Shapes and semantics as in kernels/ops.h.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::ops::cuda {

// y (M, N) [+]= x (M, K) · w (N, K)^T; x, w f32 or bf16.
void matmul(const void* x, DType x_type, const void* w, DType w_type, float* y, int64_t M,
            int64_t N, int64_t K, bool accumulate, void* stream);
// dx (M, K) [+]= dy (M, N) · w (N, K); w f32 or bf16.
void matmul_backward_input(const float* dy, const void* w, DType w_type, float* dx, int64_t M,
                           int64_t N, int64_t K, bool accumulate, void* stream);
// dw (N, K) [+]= dy (M, N)^T · x (M, K); x f32 or bf16.
void matmul_backward_weight(const float* dy, const void* x, DType x_type, float* dw, int64_t M,
                            int64_t N, int64_t K, bool accumulate, void* stream);

}  // namespace tandem::ops::cuda
