// CUDA logprob_gather and its backward on raw pointers, and the row-softmax arithmetic that the
// CPU and CUDA log-softmax and sampling ops share (free of fmt, so .cu files can include it).
#pragma once

#include <cstdint>

#include "core/half.h"
#include "kernels/exp.h"

namespace tandem::ops {

// The temperature-scaled logit z = x / temperature, as every op of the family computes it.
TANDEM_HD float scaled_logit(float x, float temperature) { return div_rn(x, temperature); }

// Softmax statistics of one row of z = x / temperature.
struct RowSoftmax {
  float max = 0;      // max of z
  float sum = 0;      // sum of exp(z - max)
  float lse = 0;      // max + log(sum)
  float entropy = 0;  // -sum p log p (when asked for)
  float ey = 0;       // sum exp(z - max) (z - max) (when asked for; the CPU's only)
};

// The logprob of token value x under a row with log-sum-exp lse: sample and logprob_gather both
// call this, so the rollout's and the trainer's numbers agree bit for bit.
TANDEM_HD float token_logprob(float x, float temperature, float lse) {
  return sub_rn(scaled_logit(x, temperature), lse);
}

}  // namespace tandem::ops

namespace tandem::ops::cuda {

// Threads per row: one block per row in logprob_gather, its backward and sample, so that a row's
// reductions run in the same order in all three.
inline constexpr int kRowThreads = 256;

// logits (T, V), targets (T) -> logprob (T), lse (T), entropy (T) or nullptr. A target outside
// [0, V) gives a NaN logprob (the CPU op throws instead; the device is not synchronised).
void logprob_gather(const float* logits, const int32_t* targets, float* logprob, float* lse,
                    float* entropy, int64_t T, int64_t V, float temperature, void* stream);
// dlogits (T, V) [+]= the gradient; dentropy may be nullptr. A row with a target outside [0, V)
// gets NaN gradients.
void logprob_gather_backward(const float* dlogprob, const float* dentropy, const float* logits,
                             const int32_t* targets, const float* lse, float* dlogits, int64_t T,
                             int64_t V, float temperature, bool accumulate, void* stream);

#if defined(__CUDACC__)
struct SumOp {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};
// NaN wins, as on the CPU: a row holding NaN gets a NaN log-sum-exp.
struct MaxOp {
  __device__ float operator()(float a, float b) const { return (a > b || a != a) ? a : b; }
};
struct MinOp {
  __device__ float operator()(float a, float b) const { return a < b ? a : b; }
};

// Reduces one value per thread over the block in a fixed order (warp butterflies, then the warps
// in index order); every thread gets the result. blockDim.x is a multiple of 32, every thread
// calls it.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op) {
  __shared__ T warp_values[32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // the previous reduction's readers are done
  if (threadIdx.x % 32 == 0) warp_values[threadIdx.x / 32] = v;
  __syncthreads();
  T r = warp_values[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w) r = op(r, warp_values[w]);
  return r;
}

// The row softmax statistics of x (V) with one block: thread i visits i, i + blockDim.x, ...
template <bool kEntropy>
__device__ RowSoftmax block_row_softmax(const float* x, int64_t V, float temperature) {
  // max z = (max x) / temperature exactly: division by a positive number rounds monotonically.
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = MaxOp{}(x[v], m);
  m = scaled_logit(block_reduce(m, MaxOp{}), temperature);
  float s = 0.0f, ey = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float y = sub_rn(scaled_logit(x[v], temperature), m);
    const float e = softmax_exp(y);
    s = add_rn(s, e);
    if constexpr (kEntropy) ey = add_rn(ey, mul_rn(e, e > 0.0f ? y : 0.0f));
  }
  s = block_reduce(s, SumOp{});
  RowSoftmax r;
  r.max = m;
  r.sum = s;
  r.lse = add_rn(m, logf(s));
  if constexpr (kEntropy) r.entropy = sub_rn(logf(s), div_rn(block_reduce(ey, SumOp{}), s));
  return r;
}
#endif

}  // namespace tandem::ops::cuda
