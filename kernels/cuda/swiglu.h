// CUDA SwiGLU and its backward on raw pointers; stream is a cudaStream_t.
#pragma once

#include <cstdint>

namespace tandem::ops::cuda {

// out (T, F) = silu(gate_up[:, :F]) * gate_up[:, F:], gate_up (T, 2F).
void swiglu(const float* gate_up, float* out, int64_t T, int64_t F, void* stream);
// dgate_up (T, 2F) from dout (T, F) and gate_up (T, 2F).
void swiglu_backward(const float* dout, const float* gate_up, float* dgate_up, int64_t T, int64_t F,
                     void* stream);

}  // namespace tandem::ops::cuda
