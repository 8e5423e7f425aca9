// CUDA logprob_gather and its backward on raw pointers, and the row-softmax arithmetic that the
// CPU and CUDA log-softmax and sampling ops share (free of fmt, so .cu files can include it).
#pragma once

#include <cstdint>

#include "core/half.h"

namespace tandem::ops {

// IEEE single operations that nvcc must not fuse into FMAs: the shared arithmetic below gives
// bitwise the same result on the CPU (built without contraction) and on CUDA.
TANDEM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TANDEM_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TANDEM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TANDEM_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The temperature-scaled logit z = x / temperature, as every op of the family computes it.
TANDEM_HD float scaled_logit(float x, float temperature) { return div_rn(x, temperature); }

// exp(x) for x <= 88, within 2 ulp of the true value (Cody-Waite reduction and the Cephes expf
// polynomial); 0 below about -87.68 (= ln(2^-126.5), where the exponent field runs out) and for
// -inf. No float branch or select, so CPU loops over it vectorise (GCC will not speculate float
// arithmetic past a float select), and the same bits on CPU and CUDA. NaN in, NaN out is not
// promised: callers detect NaN rows themselves.
TANDEM_HD float softmax_exp(float x) {
  constexpr uint32_t kLowBits = 0xC2B00000u;  // -88.0f, which gives n = -127: a zero scale
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo; n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // Below -88 (as bit patterns: negative floats of larger magnitude have larger patterns), -88.
  const uint32_t bits = float_bits(x);
  const float xc = bits_float(bits < kLowBits ? bits : kLowBits);
  const float n = sub_rn(add_rn(mul_rn(xc, kLog2e), kRound), kRound);
  const float r = sub_rn(sub_rn(xc, mul_rn(n, kLn2Hi)), mul_rn(n, kLn2Lo));
  float p = 1.9875691500e-4f;
  p = add_rn(mul_rn(p, r), 1.3981999507e-3f);
  p = add_rn(mul_rn(p, r), 8.3334519073e-3f);
  p = add_rn(mul_rn(p, r), 4.1665795894e-2f);
  p = add_rn(mul_rn(p, r), 1.6666665459e-1f);
  p = add_rn(mul_rn(p, r), 5.0000001201e-1f);
  const float y = add_rn(add_rn(mul_rn(p, mul_rn(r, r)), r), 1.0f);
  // 2^n from its exponent field; n = -127 gives the field 0, the float 0.
  const uint32_t field = static_cast<uint32_t>(static_cast<int32_t>(n) + 127);
  return mul_rn(y, bits_float(field << 23));
}

// Softmax statistics of one row of z = x / temperature.
struct RowSoftmax {
  float max = 0;      // max of z
  float sum = 0;      // sum of exp(z - max)
  float lse = 0;      // max + log(sum)
  float entropy = 0;  // -sum p log p (when asked for)
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
