// CUDA AdamW: one thread per element, the CPU's arithmetic with every operation rounded as there.
#include "core/half.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/common.cuh"

namespace tandem::ops::cuda {
namespace {

constexpr int kThreads = 256;

// No FMA contraction (the _rn intrinsics): the result is bitwise the CPU's.
template <class Copy>
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n,
                             AdamWCoefficients c, Copy* copy) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float grad = __fmul_rn(g[i], c.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(c.beta1, m[i]), __fmul_rn(c.one_minus_beta1, grad));
    const float vi =
        __fadd_rn(__fmul_rn(c.beta2, v[i]), __fmul_rn(c.one_minus_beta2, __fmul_rn(grad, grad)));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bias2_sqrt), c.eps);
    const float pi =
        __fsub_rn(__fmul_rn(p[i], c.decay), __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if constexpr (!std::is_same_v<Copy, void>) copy[i] = from_f32<Copy>(pi);
  }
}

}  // namespace

void adamw(float* param, const float* grad, float* m, float* v, int64_t n,
           const AdamWCoefficients& c, void* copy, DType copy_type, void* stream) {
  if (n == 0) return;
  const unsigned blocks = blocks_for(n, kThreads);
  if (copy == nullptr) {
    adamw_kernel<void><<<blocks, kThreads, 0, native(stream)>>>(param, grad, m, v, n, c, nullptr);
  } else if (copy_type == DType::bf16) {
    adamw_kernel<<<blocks, kThreads, 0, native(stream)>>>(param, grad, m, v, n, c,
                                                          static_cast<bf16*>(copy));
  } else {
    adamw_kernel<<<blocks, kThreads, 0, native(stream)>>>(param, grad, m, v, n, c,
                                                          static_cast<float*>(copy));
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::ops::cuda
