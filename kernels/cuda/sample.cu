// CUDA sampling: one block per row; the thresholds of top-k and top-p by binary search over the
// float bit patterns with block reductions (no sort), then the inverse CDF over per-thread chunks.
// The definition is written out in kernels/cpu/sample.cpp; this kernel implements the same one.
#include <cmath>

#include "core/philox.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/logprob.h"
#include "kernels/cuda/sample.h"
#include "kernels/float_order.h"
#include "kernels/sample_kind.h"

namespace tandem::ops::cuda {
namespace {

struct CountOp {
  __device__ long long operator()(long long a, long long b) const { return a + b; }
};
struct MinIndexOp {
  __device__ long long operator()(long long a, long long b) const { return a < b ? a : b; }
};
struct MaxIndexOp {
  __device__ long long operator()(long long a, long long b) const { return a > b ? a : b; }
};
// The larger value, NaN ignored (the CPU's first argmax compares with >).
struct ArgmaxValueOp {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};

// How many v in [0, V) satisfy keep(v), over the block.
template <class Keep>
__device__ long long block_count(int64_t V, Keep keep) {
  long long c = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) c += keep(v) ? 1 : 0;
  return block_reduce(c, CountOp{});
}

// The lowest id of the largest logit.
__device__ int64_t block_first_argmax(const float* x, int64_t V) {
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = ArgmaxValueOp{}(x[v], m);
  m = block_reduce(m, ArgmaxValueOp{});
  long long first = V;
  for (int64_t v = threadIdx.x; v < V && first == V; v += blockDim.x)
    if (x[v] == m) first = v;
  first = block_reduce(first, MinIndexOp{});
  return first < V ? first : 0;
}

__global__ void sample_kernel(const float* logits, int64_t V, const float* temperature,
                              const int32_t* top_k, const float* top_p, const float* min_p,
                              const int64_t* seed, const int64_t* offset, int32_t* token,
                              float* logprob) {
  const int64_t b = blockIdx.x;
  const float* x = logits + b * V;
  const float tau = temperature[b];
  const int64_t k = top_k[b];
  const float tp = top_p[b], mp = min_p[b];
  if (!sampling_settings_valid(tau, top_k[b], tp, mp)) {
    if (threadIdx.x == 0) {
      token[b] = -1;
      logprob[b] = NAN;
    }
    return;
  }
  if (tau == 0.0f) {
    const int64_t a = block_first_argmax(x, V);
    const RowSoftmax st = block_row_softmax<false>(x, V, 1.0f);
    if (threadIdx.x == 0) {
      token[b] = static_cast<int32_t>(a);
      logprob[b] = token_logprob(x[a], 1.0f, st.lse);
    }
    return;
  }
  const RowSoftmax st = block_row_softmax<false>(x, V, tau);
  const auto z_of = [&](int64_t v) { return scaled_logit(x[v], tau); };
  const auto e_of = [&](float z) { return softmax_exp(sub_rn(z, st.max)); };

  // Top-k: keep z > th_k, and z == th_k for ids up to tie_last.
  float th_k = -INFINITY;
  int64_t tie_last = V;
  if (k > 0 && k < V) {
    th_k = largest_value_where(-INFINITY, st.max, [&](float t) {
      return block_count(V, [&](int64_t v) { return z_of(v) >= t; }) >= k;
    });
    const long long ties = k - block_count(V, [&](int64_t v) { return z_of(v) > th_k; });
    if (block_count(V, [&](int64_t v) { return z_of(v) == th_k; }) > ties) {
      int64_t lo = 0, hi = V - 1;  // the smallest c with `ties` tied ids in [0, c]
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (block_count(V, [&](int64_t v) { return v <= mid && z_of(v) == th_k; }) >= ties) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      tie_last = lo;
    }
  }
  const auto in_top_k = [&](int64_t v, float z) {
    return z > th_k || (z == th_k && v <= tie_last);
  };

  // Top-p over the top-k tokens.
  float th_p = -INFINITY;
  if (tp < 1.0f) {
    const auto mass = [&](float t) {
      float acc = 0.0f;
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
        const float z = z_of(v);
        if (in_top_k(v, z) && z >= t) acc = add_rn(acc, e_of(z));
      }
      return block_reduce(acc, SumOp{});
    };
    const float target = mul_rn(tp, mass(-INFINITY));
    th_p = largest_value_where(-INFINITY, st.max, [&](float t) { return mass(t) >= target; });
  }
  // e of a kept token, 0 for the others.
  const auto kept_e = [&](int64_t v) {
    const float z = z_of(v);
    const float e = e_of(z);
    return in_top_k(v, z) && z >= th_p && e >= mp ? e : 0.0f;
  };

  // Inverse CDF: thread i owns the contiguous chunk i of the row; an exclusive scan of the chunk
  // sums finds the chunk where the running sum passes u * total, whose thread walks it in order.
  __shared__ float scan[kRowThreads];
  const int64_t chunk = (V + blockDim.x - 1) / blockDim.x;
  const int64_t begin = min(V, threadIdx.x * chunk), end = min(V, begin + chunk);
  float mine = 0.0f;
  long long last_positive = -1;
  for (int64_t v = begin; v < end; ++v) {
    const float e = kept_e(v);
    mine = add_rn(mine, e);
    if (e > 0.0f) last_positive = v;
  }
  scan[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned off = 1; off < blockDim.x; off <<= 1) {
    const float add = threadIdx.x >= off ? scan[threadIdx.x - off] : 0.0f;
    __syncthreads();
    scan[threadIdx.x] = add_rn(scan[threadIdx.x], add);
    __syncthreads();
  }
  const float total = scan[blockDim.x - 1];
  const float before = threadIdx.x > 0 ? scan[threadIdx.x - 1] : 0.0f;
  const float u = uniform_from_bits(
      philox_random(static_cast<uint64_t>(seed[b]), 0, static_cast<uint64_t>(offset[b])).v[0]);
  const float threshold = mul_rn(u, total);
  long long pick = V;
  if (mine > 0.0f && before <= threshold && scan[threadIdx.x] > threshold) {
    float running = before;
    for (int64_t v = begin; v < end && pick == V; ++v) {
      const float e = kept_e(v);
      running = add_rn(running, e);
      if (e > 0.0f && running > threshold) pick = v;
    }
    if (pick == V) pick = last_positive;  // rounding left the chunk's end short
  }
  pick = block_reduce(pick, MinIndexOp{});
  if (pick == V) pick = block_reduce(last_positive, MaxIndexOp{});
  if (pick < 0) pick = block_first_argmax(x, V);  // nothing kept: a row holding NaN
  if (threadIdx.x == 0) {
    token[b] = static_cast<int32_t>(pick);
    logprob[b] = token_logprob(x[pick], tau, st.lse);
  }
}

}  // namespace

void sample(const float* logits, int64_t B, int64_t V, const float* temperature,
            const int32_t* top_k, const float* top_p, const float* min_p, const int64_t* seed,
            const int64_t* offset, int32_t* token, float* logprob, void* stream) {
  if (B == 0) return;
  sample_kernel<<<static_cast<unsigned>(B), kRowThreads, 0, native(stream)>>>(
      logits, V, temperature, top_k, top_p, min_p, seed, offset, token, logprob);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::ops::cuda
