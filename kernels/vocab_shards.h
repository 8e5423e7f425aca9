// The statistics of a row whose vocabulary is split over tensor-parallel ranks (its max, a rank's
// sum of exp, the log-sum-exp), defined once for both ops that combine them: sampling over shards
// (ops::sample_shard_*, the logprobs a rollout reports) and the vocabulary-parallel head
// (ops::logprob_shard_*, the logprobs the trainer computes), so that the two give the same bits
// for the same logits. Free of fmt, so .cu files include it.
//
// Rank r of tp holds the entries of a row x that come r-th in vocabulary order; z = x / tau.
//  max z: the ranks' largest x, the first largest in rank order, divided by tau (division by a
//         positive number rounds monotonically: that is the largest z);
//  e:     softmax_exp(z - max z) of every entry;
//  a rank's sum: its e added in 16 lanes (entry i into lane i mod 16 in increasing i, the lanes
//         combined in a fixed tree: row_softmax's order on the CPU), NaN entries left out;
//  lse:   max z + log(the ranks' sums added in rank order, one f32 addition after the other);
//  a token's logprob: its z - lse.
// The ranks exchange their maxima and then their sums by all-gathers, never by all-reduces: a
// reduction's order over the ranks is the library's, and another order gives other bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "kernels/cuda/logprob.h"  // scaled_logit, softmax_exp

namespace tandem::ops {

inline constexpr int kMassLanes = 16;

// The lanes' sums combined in the fixed tree (8, 4, 2, 1).
TANDEM_HD float combine_lanes(float* acc) {
  for (int w = kMassLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] = add_rn(acc[j], acc[j + w]);
  return acc[0];
}

namespace vocab_shards {

TANDEM_HD float log_f32(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}

// The index of a rank's largest x among its n entries, the first of equals (NaN is never larger).
TANDEM_HD int64_t shard_argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t v = 1; v < n; ++v)
    if (x[v] > x[best]) best = v;
  return best;
}

// The rank holding the row's largest x, the first in rank order, from the ranks' largest x
// (rank r's at maxima[r * stride]).
TANDEM_HD int max_rank(const float* maxima, int tp, int64_t stride) {
  int best = 0;
  for (int r = 1; r < tp; ++r)
    if (maxima[r * stride] > maxima[best * stride]) best = r;
  return best;
}

// The row's max z.
TANDEM_HD float row_zmax(const float* maxima, int tp, int64_t stride, float tau) {
  return scaled_logit(maxima[max_rank(maxima, tp, stride) * stride], tau);
}

// e of an entry whose z is z, in a row whose max z is zmax.
TANDEM_HD float entry_e(float z, float zmax) { return softmax_exp(sub_rn(z, zmax)); }

// A rank's part of the row: its sum of e and, with kEy, its sum of e (z - max z) (0 where e is 0,
// for the entropy).
struct ShardSums {
  float sum = 0.0f, ey = 0.0f;
};

// Over a rank's n entries x of a row whose max z is zmax. z_out and e_out (n), where not null,
// receive each entry's z and e. In blocks of 16, so that CPU loops vectorise.
template <bool kEy>
TANDEM_HD ShardSums shard_sums(const float* x, int64_t n, float tau, float zmax,
                               float* z_out = nullptr, float* e_out = nullptr) {
  constexpr int L = kMassLanes;
  constexpr float kNegInf = -INFINITY;
  float s[L] = {}, ey[L] = {};
  const auto add = [&](int64_t i, int j) {
    const float z = scaled_logit(x[i], tau);
    const float y = sub_rn(z, zmax);
    const float e = softmax_exp(y);
    if (z_out != nullptr) {
      z_out[i] = z;
      e_out[i] = e;
    }
    s[j] = add_rn(s[j], z >= kNegInf ? e : 0.0f);
    if constexpr (kEy) ey[j] = add_rn(ey[j], mul_rn(e, e > 0.0f ? y : 0.0f));  // 0 * -inf is NaN
  };
  const int64_t full = n - n % L;
  for (int64_t i0 = 0; i0 < full; i0 += L)
    for (int j = 0; j < L; ++j) add(i0 + j, j);
  for (int64_t i = full; i < n; ++i) add(i, static_cast<int>(i - full));
  ShardSums r;
  r.sum = combine_lanes(s);
  if constexpr (kEy) r.ey = combine_lanes(ey);
  return r;
}

// The ranks' values (rank r's at v[r * stride]) added in rank order: the row's sum of e (or of
// e (z - max z)).
TANDEM_HD float ranks_sum(const float* v, int tp, int64_t stride) {
  float sum = 0.0f;
  for (int r = 0; r < tp; ++r) sum = add_rn(sum, v[r * stride]);
  return sum;
}

// The row's log-sum-exp from its max z and its sum of e (ranks_sum of the ranks' sums).
TANDEM_HD float row_lse(float zmax, float sum) { return add_rn(zmax, log_f32(sum)); }

}  // namespace vocab_shards
}  // namespace tandem::ops
