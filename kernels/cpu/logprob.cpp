// CPU log-softmax gather: per row, two passes (max, then sum of exp) over 16 fixed lanes.
#include "kernels/cpu/logprob.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/vocab_shards.h"

namespace tandem::ops::cpu {
namespace {

constexpr int L = kSoftmaxLanes;

template <class Op>
[[gnu::always_inline]] inline float lane_tree(float* acc, Op op) {
  for (int w = L / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] = op(acc[j], acc[j + w]);
  return acc[0];
}

// The larger value; NaN wins, so that a row holding NaN gets a NaN log-sum-exp.
[[gnu::always_inline]] inline float max_op(float a, float b) { return (a > b || a != a) ? a : b; }
[[gnu::always_inline]] inline float sum_op(float a, float b) { return a + b; }

// z = x / temperature; x / 1 is x exactly, so the unit-temperature instances skip the division
// and give the same bits.
template <bool kUnit>
[[gnu::always_inline]] inline float z_of(float x, float temperature) {
  return kUnit ? x : scaled_logit(x, temperature);
}

template <bool kEntropy, bool kUnit>
[[gnu::always_inline]] inline RowSoftmax row_softmax_impl(const float* x, int64_t V,
                                                          float temperature) {
  // max z = (max x) / temperature exactly: division by a positive number rounds monotonically.
  const int64_t full = V - V % L;
  float mx[L];
  for (int j = 0; j < L; ++j) mx[j] = -std::numeric_limits<float>::infinity();
  for (int64_t v0 = 0; v0 < full; v0 += L)
    for (int j = 0; j < L; ++j) mx[j] = max_op(x[v0 + j], mx[j]);
  for (int64_t v = full; v < V; ++v) mx[v - full] = max_op(x[v], mx[v - full]);
  const float m = z_of<kUnit>(lane_tree(mx, max_op), temperature);

  float s[L] = {}, ey[L] = {};
  for (int64_t v0 = 0; v0 < full; v0 += L) {
    for (int j = 0; j < L; ++j) {
      const float y = z_of<kUnit>(x[v0 + j], temperature) - m;
      const float e = softmax_exp(y);
      s[j] += e;
      if constexpr (kEntropy) ey[j] += e * (e > 0.0f ? y : 0.0f);  // 0 * -inf would be NaN
    }
  }
  for (int64_t v = full; v < V; ++v) {
    const float y = z_of<kUnit>(x[v], temperature) - m;
    const float e = softmax_exp(y);
    s[v - full] += e;
    if constexpr (kEntropy) ey[v - full] += e * (e > 0.0f ? y : 0.0f);
  }
  RowSoftmax r;
  r.max = m;
  r.sum = lane_tree(s, sum_op);
  const float log_sum = std::log(r.sum);
  r.lse = m + log_sum;
  if constexpr (kEntropy) {
    r.ey = lane_tree(ey, sum_op);
    r.entropy = log_sum - r.ey / r.sum;
  }
  return r;
}

// -sum p log p of a row with log-sum-exp lse, p = exp(z - lse), in the lane order.
template <bool kUnit>
[[gnu::always_inline]] inline float row_entropy(const float* x, int64_t V, float temperature,
                                                float lse) {
  const int64_t full = V - V % L;
  float acc[L] = {};
  for (int64_t v0 = 0; v0 < full; v0 += L) {
    for (int j = 0; j < L; ++j) {
      const float logp = z_of<kUnit>(x[v0 + j], temperature) - lse;
      const float p = softmax_exp(logp);
      acc[j] += p * (p > 0.0f ? logp : 0.0f);
    }
  }
  for (int64_t v = full; v < V; ++v) {
    const float logp = z_of<kUnit>(x[v], temperature) - lse;
    const float p = softmax_exp(logp);
    acc[v - full] += p * (p > 0.0f ? logp : 0.0f);
  }
  return -lane_tree(acc, sum_op);
}

// d/dz_v of a*logprob + b*entropy, divided by the temperature:
//   d logprob / dz_v = 1[v = target] - p_v,  d entropy / dz_v = -p_v (log p_v + H).
// A target outside [0, V) (a vocabulary shard without it) adds no 1. h: the row's entropy H when
// the row is a shard of the vocabulary (null: computed from this row).
template <bool kEntropy, bool kAccumulate, bool kUnit>
[[gnu::always_inline]] inline void backward_row(const float* x, int64_t V, int32_t target,
                                                float temperature, float lse, float a, float b,
                                                const float* h, float* g) {
  const float H = !kEntropy ? 0.0f : h ? *h : row_entropy<kUnit>(x, V, temperature, lse);
  for (int64_t v = 0; v < V; ++v) {
    const float logp = z_of<kUnit>(x[v], temperature) - lse;
    const float p = softmax_exp(logp);
    float d = a * (static_cast<float>(static_cast<int32_t>(static_cast<int32_t>(v) == target)) - p);
    if constexpr (kEntropy) d += b * (-p * ((p > 0.0f ? logp : -H) + H));  // 0 * -inf would be NaN
    if constexpr (!kUnit) d = d / temperature;
    g[v] = kAccumulate ? g[v] + d : d;
  }
}

TANDEM_CPU_CLONES void backward_row_any(const float* x, int64_t V, int32_t target,
                                        float temperature, float lse, float a, const float* b,
                                        const float* h, bool accumulate, float* g) {
  const float bv = b ? *b : 0.0f;
  const bool unit = temperature == 1.0f;
  if (b && accumulate) {
    unit ? backward_row<true, true, true>(x, V, target, temperature, lse, a, bv, h, g)
         : backward_row<true, true, false>(x, V, target, temperature, lse, a, bv, h, g);
  } else if (b) {
    unit ? backward_row<true, false, true>(x, V, target, temperature, lse, a, bv, h, g)
         : backward_row<true, false, false>(x, V, target, temperature, lse, a, bv, h, g);
  } else if (accumulate) {
    unit ? backward_row<false, true, true>(x, V, target, temperature, lse, a, bv, h, g)
         : backward_row<false, true, false>(x, V, target, temperature, lse, a, bv, h, g);
  } else {
    unit ? backward_row<false, false, true>(x, V, target, temperature, lse, a, bv, h, g)
         : backward_row<false, false, false>(x, V, target, temperature, lse, a, bv, h, g);
  }
}

}  // namespace

TANDEM_CPU_CLONES RowSoftmax row_softmax(const float* x, int64_t V, float temperature,
                                         bool with_entropy) {
  if (temperature == 1.0f) {
    return with_entropy ? row_softmax_impl<true, true>(x, V, temperature)
                        : row_softmax_impl<false, true>(x, V, temperature);
  }
  return with_entropy ? row_softmax_impl<true, false>(x, V, temperature)
                      : row_softmax_impl<false, false>(x, V, temperature);
}

void check_targets(const char* op, const int32_t* targets, int64_t T, int64_t V) {
  for (int64_t t = 0; t < T; ++t)
    TANDEM_CHECK(targets[t] >= 0 && targets[t] < V,
                 "{}: row {} has target id {}, outside the vocabulary [0, {})", op, t, targets[t],
                 V);
}

void logprob_gather(const Tensor& logits, const Tensor& targets, const Tensor& logprob,
                    const Tensor& lse, const Tensor& entropy, float temperature) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* x = logits.data_as<float>();
  const int32_t* tg = targets.data_as<int32_t>();
  check_targets("logprob_gather", tg, T, V);
  float* lp = logprob.data_as<float>();
  float* ls = lse.data_as<float>();
  float* ent = entropy.defined() ? entropy.data_as<float>() : nullptr;
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = x + t * V;
      const RowSoftmax st = row_softmax(row, V, temperature, ent != nullptr);
      lp[t] = token_logprob(row[tg[t]], temperature, st.lse);
      ls[t] = st.lse;
      if (ent) ent[t] = st.entropy;
    }
  });
}

void logprob_gather_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                             const Tensor& targets, const Tensor& lse, const Tensor& dlogits,
                             float temperature, bool accumulate) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* x = logits.data_as<float>();
  const int32_t* tg = targets.data_as<int32_t>();
  check_targets("logprob_gather_backward", tg, T, V);
  const float* dlp = dlogprob.data_as<float>();
  const float* dent = dentropy.defined() ? dentropy.data_as<float>() : nullptr;
  const float* ls = lse.data_as<float>();
  float* dx = dlogits.data_as<float>();
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      backward_row_any(x + t * V, V, tg[t], temperature, ls[t], dlp[t], dent ? dent + t : nullptr,
                       nullptr, accumulate, dx + t * V);
    }
  });
}

void logprob_shard_maxima(const Tensor& logits, const Tensor& maxima) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* x = logits.data_as<float>();
  float* m = maxima.data_as<float>();
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = x + t * V;
      m[t] = row[vocab_shards::shard_argmax(row, V)];
    }
  });
}

namespace {

TANDEM_CPU_CLONES void shard_stats_row(const float* row, int64_t V, int64_t local,
                                       const float* all_maxima, int tp, int64_t stride,
                                       float temperature, float* o) {
  const float zmax = vocab_shards::row_zmax(all_maxima, tp, stride, temperature);
  const vocab_shards::ShardSums s = vocab_shards::shard_sums<true>(row, V, temperature, zmax);
  // The shared sums leave NaN entries out (sampling's masses do); a trainer's row with NaN gets a
  // NaN lse, so that the loss shows it.
  bool nan = false;
  for (int64_t v = 0; v < V; ++v) nan |= row[v] != row[v];
  const bool held = local >= 0 && local < V;
  o[0] = nan ? std::numeric_limits<float>::quiet_NaN() : s.sum;
  o[1] = s.ey;
  o[2] = held ? scaled_logit(row[local], temperature) : 0.0f;
  o[3] = held ? 1.0f : 0.0f;
}

}  // namespace

void logprob_shard_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                         const Tensor& all_maxima, const Tensor& stats, float temperature) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const int tp = static_cast<int>(all_maxima.size(0));
  const float* x = logits.data_as<float>();
  const int32_t* tg = targets.data_as<int32_t>();
  const float* m = all_maxima.data_as<float>();
  float* st = stats.data_as<float>();
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      shard_stats_row(x + t * V, V, tg[t] - vocab_begin, m + t, tp, T, temperature, st + t * 4);
  });
}

void logprob_shard_combine(const Tensor& all_maxima, const Tensor& all_stats, const Tensor& logprob,
                           const Tensor& lse, const Tensor& entropy, float temperature) {
  namespace vs = vocab_shards;
  const int tp = static_cast<int>(all_maxima.size(0));
  const int64_t T = all_maxima.size(1);
  const float* m = all_maxima.data_as<float>();
  const float* g = all_stats.data_as<float>();
  float* lp = logprob.data_as<float>();
  float* ls = lse.data_as<float>();
  float* ent = entropy.defined() ? entropy.data_as<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    // Rank r's [sum of e, sum of e (z - max z), target's z, holds the target] at g + 4 (r T + t).
    const float* row = g + t * 4;
    float target_z = 0.0f;
    for (int r = 0; r < tp; ++r)
      if (row[r * T * 4 + 3] != 0.0f) target_z = row[r * T * 4 + 2];
    const float sum = vs::ranks_sum(row, tp, T * 4);
    ls[t] = vs::row_lse(vs::row_zmax(m + t, tp, T, temperature), sum);
    lp[t] = sub_rn(target_z, ls[t]);
    if (ent) ent[t] = vs::log_f32(sum) - vs::ranks_sum(row + 1, tp, T * 4) / sum;
  }
}

void logprob_shard_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_begin, const Tensor& lse,
                            const Tensor& entropy, const Tensor& dlogits, float temperature,
                            bool accumulate) {
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* x = logits.data_as<float>();
  const int32_t* tg = targets.data_as<int32_t>();
  const float* dlp = dlogprob.data_as<float>();
  const float* dent = dentropy.defined() ? dentropy.data_as<float>() : nullptr;
  const float* ent = dent ? entropy.data_as<float>() : nullptr;
  const float* ls = lse.data_as<float>();
  float* dx = dlogits.data_as<float>();
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      // Outside the shard the local target is past the row's end (or negative): no 1 to add.
      const int64_t local = tg[t] - vocab_begin;
      const int32_t target = local >= 0 && local < V ? static_cast<int32_t>(local) : -1;
      backward_row_any(x + t * V, V, target, temperature, ls[t], dlp[t], dent ? dent + t : nullptr,
                       ent ? ent + t : nullptr, accumulate, dx + t * V);
    }
  });
}

}  // namespace tandem::ops::cpu
