// CUDA log-softmax gather and its backward: one block of kRowThreads per row.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/logprob.h"

namespace tandem::ops::cuda {
namespace {

template <bool kEntropy>
__global__ void logprob_gather_kernel(const float* logits, const int32_t* targets, float* logprob,
                                      float* lse, float* entropy, int64_t V, float temperature) {
  const int64_t t = blockIdx.x;
  const float* x = logits + t * V;
  const RowSoftmax st = block_row_softmax<kEntropy>(x, V, temperature);
  if (threadIdx.x != 0) return;
  const int32_t target = targets[t];
  logprob[t] = target >= 0 && target < V ? token_logprob(x[target], temperature, st.lse) : NAN;
  lse[t] = st.lse;
  if constexpr (kEntropy) entropy[t] = st.entropy;
}

// d/dz_v of a*logprob + b*entropy, divided by the temperature:
//   d logprob / dz_v = 1[v = target] - p_v,  d entropy / dz_v = -p_v (log p_v + H).
template <bool kEntropy>
__global__ void logprob_gather_backward_kernel(const float* dlogprob, const float* dentropy,
                                               const float* logits, const int32_t* targets,
                                               const float* lse, float* dlogits, int64_t V,
                                               float temperature, bool accumulate) {
  const int64_t t = blockIdx.x;
  const float* x = logits + t * V;
  float* g = dlogits + t * V;
  const float row_lse = lse[t];
  const int32_t target = targets[t];
  const float a = dlogprob[t];
  float b = 0.0f, H = 0.0f;
  if constexpr (kEntropy) {
    b = dentropy[t];
    float acc = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const float logp = sub_rn(scaled_logit(x[v], temperature), row_lse);
      const float p = softmax_exp(logp);
      acc = add_rn(acc, mul_rn(p, p > 0.0f ? logp : 0.0f));
    }
    H = -block_reduce(acc, SumOp{});
  }
  const float bad = target >= 0 && target < V ? 0.0f : NAN;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float logp = sub_rn(scaled_logit(x[v], temperature), row_lse);
    const float p = softmax_exp(logp);
    float d = mul_rn(a, sub_rn(v == target ? 1.0f : 0.0f, p));
    if constexpr (kEntropy) d = add_rn(d, mul_rn(b, -mul_rn(p, p > 0.0f ? add_rn(logp, H) : 0.0f)));
    d = add_rn(div_rn(d, temperature), bad);
    g[v] = accumulate ? add_rn(g[v], d) : d;
  }
}

}  // namespace

void logprob_gather(const float* logits, const int32_t* targets, float* logprob, float* lse,
                    float* entropy, int64_t T, int64_t V, float temperature, void* stream) {
  if (T == 0) return;
  if (entropy != nullptr) {
    logprob_gather_kernel<true><<<static_cast<unsigned>(T), kRowThreads, 0, native(stream)>>>(
        logits, targets, logprob, lse, entropy, V, temperature);
  } else {
    logprob_gather_kernel<false><<<static_cast<unsigned>(T), kRowThreads, 0, native(stream)>>>(
        logits, targets, logprob, lse, entropy, V, temperature);
  }
  CUDA_CHECK_LAUNCH();
}

void logprob_gather_backward(const float* dlogprob, const float* dentropy, const float* logits,
                             const int32_t* targets, const float* lse, float* dlogits, int64_t T,
                             int64_t V, float temperature, bool accumulate, void* stream) {
  if (T == 0) return;
  if (dentropy != nullptr) {
    logprob_gather_backward_kernel<true>
        <<<static_cast<unsigned>(T), kRowThreads, 0, native(stream)>>>(
            dlogprob, dentropy, logits, targets, lse, dlogits, V, temperature, accumulate);
  } else {
    logprob_gather_backward_kernel<false>
        <<<static_cast<unsigned>(T), kRowThreads, 0, native(stream)>>>(
            dlogprob, dentropy, logits, targets, lse, dlogits, V, temperature, accumulate);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::ops::cuda
