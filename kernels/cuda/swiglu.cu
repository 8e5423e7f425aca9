// CUDA SwiGLU: one thread per output element, silu(g) = g / (1 + exp(-g)) with exp(-g) =
// silu_exp_neg (kernels/exp.h) as on the CPU.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/swiglu.h"
#include "kernels/exp.h"

namespace tandem::ops::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void swiglu_kernel(const float* gate_up, float* out, int64_t T, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < T * F;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / F, f = i % F;
    const float g = gate_up[t * 2 * F + f];
    out[i] = g / (1.0f + silu_exp_neg(g)) * gate_up[t * 2 * F + F + f];
  }
}

__global__ void swiglu_backward_kernel(const float* dout, const float* gate_up, float* dgate_up,
                                       int64_t T, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < T * F;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / F, f = i % F;
    const float g = gate_up[t * 2 * F + f];
    const float up = gate_up[t * 2 * F + F + f];
    const float denom = 1.0f + silu_exp_neg(g);
    const float sig = 1.0f / denom;
    dgate_up[t * 2 * F + f] = dout[i] * up * (sig * (1.0f + g * (1.0f - sig)));
    dgate_up[t * 2 * F + F + f] = dout[i] * (g / denom);
  }
}

}  // namespace

void swiglu(const float* gate_up, float* out, int64_t T, int64_t F, void* stream) {
  if (T * F == 0) return;
  swiglu_kernel<<<blocks_for(T * F, kThreads), kThreads, 0, native(stream)>>>(gate_up, out, T, F);
  CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const float* dout, const float* gate_up, float* dgate_up, int64_t T, int64_t F,
                     void* stream) {
  if (T * F == 0) return;
  swiglu_backward_kernel<<<blocks_for(T * F, kThreads), kThreads, 0, native(stream)>>>(
      dout, gate_up, dgate_up, T, F);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::ops::cuda
