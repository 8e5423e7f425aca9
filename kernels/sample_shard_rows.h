// The per-row phases of sampling over vocabulary shards (ops::sample_shard_* in kernels/ops.h) on
// raw pointers, and the threshold counts and masses ops::sample searches on: one definition that
// the CPU ops (a row per task) and the CUDA kernels (a row per thread) both run, so the two give
// the same bits. Free of fmt, so .cu files include it.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/half.h"
#include "core/philox.h"
#include "kernels/cuda/logprob.h"  // scaled_logit, softmax_exp
#include "kernels/float_order.h"
#include "kernels/sample_kind.h"
#include "kernels/vocab_shards.h"

namespace tandem::ops {

// Masses are summed over 16 lanes (kMassLanes): lane j takes the elements i = j (mod 16) in
// increasing i, then the lanes combine in a fixed tree (combine_lanes, kernels/vocab_shards.h).

// Over n entries: how many have z >= t, how many z > t, and the sum of e over those with z >= t.
TANDEM_HD int64_t count_at_least(const float* z, int64_t n, float t) {
  int32_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += z[i] >= t ? 1 : 0;
  return c;
}

TANDEM_HD int64_t count_greater(const float* z, int64_t n, float t) {
  int32_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += z[i] > t ? 1 : 0;
  return c;
}

// In blocks of 16, so that CPU loops vectorise. e is read whatever z is: GCC 12's AVX2 build of a
// conditional read (a masked load) dropped terms.
TANDEM_HD float mass_at_least(const float* z, const float* e, int64_t n, float t) {
  constexpr int L = kMassLanes;
  const int64_t full = n - n % L;
  float acc[L] = {};
  for (int64_t i0 = 0; i0 < full; i0 += L) {
    for (int j = 0; j < L; ++j) {
      const float ej = e[i0 + j];
      acc[j] = add_rn(acc[j], z[i0 + j] >= t ? ej : 0.0f);
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float ei = e[i];
    acc[i - full] = add_rn(acc[i - full], z[i] >= t ? ei : 0.0f);
  }
  return combine_lanes(acc);
}

namespace shards {

constexpr float kInf = INFINITY;

// One call's arguments on the device it runs on; the gathered inputs are null until their phase.
struct ShardArgs {
  const float* x = nullptr;  // (B, Vs): the vocabulary entries [rank Vs, (rank + 1) Vs)
  int64_t B = 0, Vs = 0;
  int rank = 0, tp = 1;
  const float *temperature = nullptr, *top_p = nullptr, *min_p = nullptr;  // (B)
  const int32_t* top_k = nullptr;                                          // (B)
  const int64_t *seed = nullptr, *offset = nullptr;                        // (B)
  const float* z = nullptr;                                                // (B, Vs) x / tau
  const float* e = nullptr;           // (B, Vs) softmax_exp(z - max z)
  const float* all_maxima = nullptr;  // (tp, B, 2) [max, global id]
  const float* all_stats = nullptr;   // (tp, B, 3) [sum of e, rank 0's kept sum, threshold]
  const float* hops = nullptr;        // (tp - 1, B): rank h's end of the kept sum in row h - 1
  const float* all_counts = nullptr;  // (tp, B) the ranks' candidates per row
  const float* bounds = nullptr;      // (B, 2) [threshold, ties kept at it] of this rank
  const float* all_cands = nullptr;   // every rank's candidates, rank after rank
};

TANDEM_HD SampleRowKind row_kind(const ShardArgs& a, int64_t b) {
  return sample_row_kind(a.temperature[b], a.top_k[b], a.top_p[b], a.min_p[b], a.Vs * a.tp);
}

// The temperature z divides by: 1 for greedy rows (their logprob is under temperature 1).
TANDEM_HD float row_tau(const ShardArgs& a, int64_t b) {
  return a.temperature[b] > 0.0f ? a.temperature[b] : 1.0f;
}

TANDEM_HD float row_u(const ShardArgs& a, int64_t b) {
  return uniform_from_bits(
      philox_random(static_cast<uint64_t>(a.seed[b]), 0, static_cast<uint64_t>(a.offset[b])).v[0]);
}

// The global maximum and its lowest id: ranks hold increasing ids, so the first rank with the
// largest value (ops::sample's first argmax; vocab_shards::max_rank).
struct RowMax {
  float value, id;
};
TANDEM_HD RowMax global_max(const ShardArgs& a, int64_t b) {
  const float* m = a.all_maxima + b * 2;
  const int64_t stride = a.B * 2;
  const int r = vocab_shards::max_rank(m, a.tp, stride);
  return RowMax{m[r * stride], m[r * stride + 1]};
}

// The row's max z, sum of e and log-sum-exp: kernels/vocab_shards.h's, which the
// vocabulary-parallel head's logprobs (ops::logprob_shard_*) share.
TANDEM_HD float row_zmax(const ShardArgs& a, int64_t b) {
  return vocab_shards::row_zmax(a.all_maxima + b * 2, a.tp, a.B * 2, row_tau(a, b));
}

TANDEM_HD float row_sum(const ShardArgs& a, int64_t b) {
  return vocab_shards::ranks_sum(a.all_stats + b * 3, a.tp, a.B * 3);
}

TANDEM_HD float row_lse(const ShardArgs& a, int64_t b) {
  return vocab_shards::row_lse(row_zmax(a, b), row_sum(a, b));
}

// Rank r's end of the running kept sum: rank 0's from the stats, the others' from the chain.
TANDEM_HD float rank_end(const ShardArgs& a, int r, int64_t b) {
  return r == 0 ? a.all_stats[b * 3 + 1] : a.hops[(r - 1) * a.B + b];
}

// The running sum of the kept e (e >= floor) continued from `start`, one f32 addition after the
// other in vocabulary order: ops::sample's inverse-CDF chain, rank after rank.
TANDEM_HD float fold_kept(float start, const float* e, int64_t n, float floor) {
  float run = start;
  for (int64_t i = 0; i < n; ++i)
    if (e[i] >= floor) run = add_rn(run, e[i]);
  return run;
}

// The last index with e >= floor and e > 0, or -1.
TANDEM_HD int64_t last_kept(const float* e, int64_t n, float floor) {
  for (int64_t i = n - 1; i >= 0; --i)
    if (e[i] >= floor && e[i] > 0.0f) return i;
  return -1;
}

// Row b's candidates travel as every rank's whole shard of z (cheaper than [z, id] pairs when they
// are more than half the vocabulary).
TANDEM_HD bool dense(const float* all_counts, int64_t B, int64_t Vs, int tp, int64_t b) {
  int64_t total = 0;
  for (int r = 0; r < tp; ++r) total += static_cast<int64_t>(all_counts[r * B + b]);
  return 2 * total > Vs * tp;
}

// The f32 values rank r sends for row b.
TANDEM_HD int64_t row_elements(SampleRowKind kind, const float* all_counts, int64_t B, int64_t Vs,
                               int tp, int r, int64_t b) {
  if (kind != SampleRowKind::top_k && kind != SampleRowKind::nucleus) return 0;
  return dense(all_counts, B, Vs, tp, b) ? Vs : 2 * static_cast<int64_t>(all_counts[r * B + b]);
}
TANDEM_HD int64_t row_elements(const ShardArgs& a, int r, int64_t b) {
  return row_elements(row_kind(a, b), a.all_counts, a.B, a.Vs, a.tp, r, b);
}

// Where rank r's values of row b start in what rank r sends.
TANDEM_HD int64_t row_start(const ShardArgs& a, int r, int64_t b) {
  int64_t n = 0;
  for (int64_t c = 0; c < b; ++c) n += row_elements(a, r, c);
  return n;
}

// Phase 1: the rank's largest logit of row b and its lowest global id; the row's kind.
TANDEM_HD void maxima_row(const ShardArgs& a, int64_t b, float* maxima, uint8_t* kinds) {
  const float* x = a.x + b * a.Vs;
  const int64_t best = vocab_shards::shard_argmax(x, a.Vs);
  maxima[b * 2] = x[best];
  maxima[b * 2 + 1] = static_cast<float>(a.rank * a.Vs + best);
  kinds[b] = static_cast<uint8_t>(row_kind(a, b));
}

// Phase 2: z and e of row b, and the stats [sum of e, rank 0's end of the running kept sum
// (plain rows), nucleus threshold | last kept global id (plain rows) | max z].
TANDEM_HD void stats_row(const ShardArgs& a, int64_t b, float* z_out, float* e_out, float* stats) {
  const SampleRowKind kind = row_kind(a, b);
  const float tau = row_tau(a, b), zmax = row_zmax(a, b);
  float* z = z_out + b * a.Vs;
  float* e = e_out + b * a.Vs;
  const float sum = vocab_shards::shard_sums<false>(a.x + b * a.Vs, a.Vs, tau, zmax, z, e).sum;
  float kept = 0.0f, threshold = zmax;
  if (kind == SampleRowKind::plain) {
    if (a.rank == 0) kept = fold_kept(0.0f, e, a.Vs, a.min_p[b]);
    const int64_t last = last_kept(e, a.Vs, a.min_p[b]);
    threshold = last >= 0 ? static_cast<float>(a.rank * a.Vs + last) : -1.0f;
  }
  if (kind == SampleRowKind::nucleus) {
    const float target = mul_rn(a.top_p[b], sum);
    threshold = largest_value_where(
        -kInf, zmax, [&](float t) { return mass_at_least(z, e, a.Vs, t) >= target; });
  }
  stats[b * 3] = sum;
  stats[b * 3 + 1] = kept;
  stats[b * 3 + 2] = threshold;
}

// Phase 2b, hop `hop`: rank hop continues the running kept sum of a plain row from rank hop - 1's
// end; 0 from the other ranks and rows.
TANDEM_HD void chain_row(const ShardArgs& a, int64_t b, int hop, float* chain) {
  chain[b] = a.rank == hop && row_kind(a, b) == SampleRowKind::plain
                 ? fold_kept(rank_end(a, hop - 1, b), a.e + b * a.Vs, a.Vs, a.min_p[b])
                 : 0.0f;
}

// Phase 3: the rank's candidates of row b (top-k rows: its top min(k, Vs) with the ties to the
// lower ids; nucleus rows: z >= the least of the ranks' thresholds) and how they are told apart
// [threshold, ties kept at it].
TANDEM_HD void counts_row(const ShardArgs& a, int64_t b, float* counts, float* bounds) {
  const SampleRowKind kind = row_kind(a, b);
  const float* z = a.z + b * a.Vs;
  int64_t count = 0, ties = 0;
  float th = 0.0f;  // rows without candidates: unused
  if (kind == SampleRowKind::top_k && a.top_k[b] < a.Vs) {
    const int64_t k = a.top_k[b];
    th = largest_value_where(-kInf, row_zmax(a, b),
                             [&](float t) { return count_at_least(z, a.Vs, t) >= k; });
    ties = k - count_greater(z, a.Vs, th);
    count = k;
  } else if (kind == SampleRowKind::top_k) {
    th = -kInf;  // the whole shard
    count = a.Vs;
  } else if (kind == SampleRowKind::nucleus) {
    th = a.all_stats[b * 3 + 2];
    for (int r = 1; r < a.tp; ++r) {
      const float tr = a.all_stats[(r * a.B + b) * 3 + 2];
      th = tr < th ? tr : th;
    }
    count = count_at_least(z, a.Vs, th);
  }
  counts[b] = static_cast<float>(count);
  bounds[b * 2] = th;
  bounds[b * 2 + 1] = static_cast<float>(ties);
}

// Phase 4: the rank's candidates of row b into what it sends: [z, global id] pairs, or its whole
// shard of z for a dense row.
TANDEM_HD void candidates_row(const ShardArgs& a, int64_t b, float* cands) {
  const SampleRowKind kind = row_kind(a, b);
  if (kind != SampleRowKind::top_k && kind != SampleRowKind::nucleus) return;
  const float* z = a.z + b * a.Vs;
  float* out = cands + row_start(a, a.rank, b);
  if (dense(a.all_counts, a.B, a.Vs, a.tp, b)) {
    for (int64_t v = 0; v < a.Vs; ++v) out[v] = z[v];
    return;
  }
  const float th = a.bounds[b * 2];
  int64_t ties = static_cast<int64_t>(a.bounds[b * 2 + 1]);
  int64_t n = 0;
  for (int64_t v = 0; v < a.Vs; ++v) {
    const bool keep =
        kind == SampleRowKind::nucleus ? z[v] >= th : (z[v] > th || (z[v] == th && ties-- > 0));
    if (!keep) continue;
    out[n] = z[v];
    out[n + 1] = static_cast<float>(a.rank * a.Vs + v);
    n += 2;
  }
}

// Where row b's candidates lie in what the group gathered: rank r's at start[r], count[r] of
// them ([z, id] pairs, or z alone when whole).
inline constexpr int kMaxShardRanks = 64;
struct RowLayout {
  int64_t start[kMaxShardRanks], count[kMaxShardRanks];
  bool whole;
};
TANDEM_HD RowLayout row_layout(const ShardArgs& a, int64_t b) {
  RowLayout l;
  l.whole = dense(a.all_counts, a.B, a.Vs, a.tp, b);
  int64_t rank_start = 0;  // where rank r's values start
  for (int r = 0; r < a.tp; ++r) {
    const int64_t elements = row_elements(a, r, b);
    l.start[r] = rank_start + row_start(a, r, b);
    l.count[r] = l.whole ? elements : elements / 2;
    rank_start += row_start(a, r, a.B);
  }
  return l;
}

// Calls f(z, id) for row b's candidates of every rank, in rank order: vocabulary order. A dense
// row is every rank's whole shard of z, ids implied.
template <class F>
TANDEM_HD void for_each_candidate(const ShardArgs& a, const RowLayout& l, F f) {
  for (int r = 0; r < a.tp; ++r) {
    const float* from = a.all_cands + l.start[r];
    for (int64_t j = 0; j < l.count[r]; ++j)
      f(l.whole ? from[j] : from[2 * j],
        l.whole ? static_cast<int32_t>(r * a.Vs + j) : static_cast<int32_t>(from[2 * j + 1]));
  }
}

// ops::sample's steps on a top-k or nucleus row's candidates: top-k (the candidates hold the
// global top-k, so the threshold and the ties are the same), top-p against top_p times the top-k
// mass (nucleus rows: the ranks' sums), min-p and the inverse-CDF draw. The masses put the i-th
// top-k candidate in lane i mod 16, as ops::sample does on its compacted top-k list.
TANDEM_HD void decide_candidates(const ShardArgs& a, int64_t b, int32_t* token, float* logprob) {
  const bool top_k = row_kind(a, b) == SampleRowKind::top_k;
  const RowLayout layout = row_layout(a, b);
  const float zmax = row_zmax(a, b), lse = row_lse(a, b);
  const int64_t k = a.top_k[b];
  float th_k = -kInf;
  int64_t ties = 0;
  if (top_k) {
    th_k = largest_value_where(-kInf, zmax, [&](float t) {
      int64_t c = 0;
      for_each_candidate(a, layout, [&](float z, int32_t) { c += z >= t ? 1 : 0; });
      return c >= k;
    });
    int64_t greater = 0;
    for_each_candidate(a, layout, [&](float z, int32_t) { greater += z > th_k ? 1 : 0; });
    ties = k - greater;
  }
  // f(z, e, id) for the top-k candidates (every candidate of a nucleus row), in order.
  const auto for_each_top_k = [&](auto f) {
    int64_t left = ties;
    for_each_candidate(a, layout, [&](float z, int32_t id) {
      if (!top_k || z > th_k || (z == th_k && left-- > 0)) f(z, vocab_shards::entry_e(z, zmax), id);
    });
  };
  int64_t n = 0;
  const auto mass = [&](float t) {
    float acc[kMassLanes] = {};
    n = 0;
    for_each_top_k([&](float z, float e, int32_t) {
      acc[n % kMassLanes] = add_rn(acc[n % kMassLanes], z >= t ? e : 0.0f);
      ++n;
    });
    return combine_lanes(acc);
  };
  const float target_mass = top_k ? mass(-kInf) : row_sum(a, b);
  if (!top_k) mass(-kInf);  // n
  float th_p = -kInf;
  if (a.top_p[b] < 1.0f && n > 0) {
    const float target = mul_rn(a.top_p[b], target_mass);
    th_p = largest_value_where(-kInf, zmax, [&](float t) { return mass(t) >= target; });
  }
  const float floor = a.min_p[b];
  float total = 0.0f;
  for_each_top_k([&](float z, float e, int32_t) {
    if (z >= th_p && e >= floor) total = add_rn(total, e);
  });
  const float threshold = mul_rn(row_u(a, b), total);
  // The first kept token whose running sum exceeds the threshold; where rounding leaves none, the
  // last kept token with e > 0; where there is none, the greedy token.
  float running = 0.0f, pick_z = zmax;
  int32_t pick = -1, last = -1;
  float last_z = zmax;
  for_each_top_k([&](float z, float e, int32_t id) {
    if (pick >= 0 || z < th_p || e < floor) return;
    running = add_rn(running, e);
    if (running > threshold) {
      pick = id;
      pick_z = z;
    } else if (e > 0.0f) {
      last = id;
      last_z = z;
    }
  });
  if (pick < 0 && last >= 0) {
    pick = last;
    pick_z = last_z;
  }
  *token = pick >= 0 ? pick : static_cast<int32_t>(global_max(a, b).id);
  *logprob = sub_rn(pick_z, lse);
}

// A plain row's draw on the rank that holds it: the chain's ends say which rank's range holds the
// first kept token whose running sum passes u * (the last end); that rank repeats its part of the
// chain, the same additions in the same order. Where rounding leaves none, the rank holding the
// last kept token with e > 0; where there is none, the rank holding the greedy token. draws (2):
// [token, logprob] on that rank, zeros on the others.
TANDEM_HD void draw_plain(const ShardArgs& a, int64_t b, float* draws) {
  draws[0] = draws[1] = 0.0f;
  const float lse = row_lse(a, b);
  const float threshold = mul_rn(row_u(a, b), rank_end(a, a.tp - 1, b));
  int owner = -1;
  for (int r = 0; r < a.tp && owner < 0; ++r)
    if (rank_end(a, r, b) > threshold) owner = r;
  if (owner < 0) {
    float last = -1.0f;
    for (int r = 0; r < a.tp; ++r) {
      const float lr = a.all_stats[(r * a.B + b) * 3 + 2];
      last = lr > last ? lr : last;
    }
    if (last < 0.0f) {
      const RowMax m = global_max(a, b);
      if (static_cast<int64_t>(m.id) / a.Vs != a.rank) return;
      draws[0] = m.id;
      draws[1] = sub_rn(row_zmax(a, b), lse);
      return;
    }
    owner = static_cast<int>(static_cast<int64_t>(last) / a.Vs);
  }
  if (owner != a.rank) return;
  const float* z = a.z + b * a.Vs;
  const float* e = a.e + b * a.Vs;
  const float floor = a.min_p[b];
  int64_t pick = -1;
  float run = owner == 0 ? 0.0f : rank_end(a, owner - 1, b);
  for (int64_t v = 0; v < a.Vs && pick < 0; ++v) {
    if (e[v] < floor) continue;
    run = add_rn(run, e[v]);
    if (run > threshold) pick = v;
  }
  if (pick < 0) pick = last_kept(e, a.Vs, floor);
  draws[0] = static_cast<float>(a.rank * a.Vs + pick);
  draws[1] = sub_rn(z[pick], lse);
}

// Phase 5: the tokens of greedy, top-k and nucleus rows; this rank's share of the plain rows'
// draws (B, 2).
TANDEM_HD void decide_row(const ShardArgs& a, int64_t b, int32_t* token, float* logprob,
                          float* draws) {
  draws[b * 2] = draws[b * 2 + 1] = 0.0f;
  switch (row_kind(a, b)) {
    case SampleRowKind::greedy:
      token[b] = static_cast<int32_t>(global_max(a, b).id);
      logprob[b] = sub_rn(row_zmax(a, b), row_lse(a, b));  // z of the argmax at temperature 1
      break;
    case SampleRowKind::top_k:
    case SampleRowKind::nucleus:
      decide_candidates(a, b, token + b, logprob + b);
      break;
    case SampleRowKind::plain:
      draw_plain(a, b, draws + b * 2);
      break;
    case SampleRowKind::invalid:
      token[b] = -1;
      logprob[b] = NAN;
      break;
  }
}

// Phase 6: a plain row's token and logprob from the summed draws (B, 2).
TANDEM_HD void draws_row(const uint8_t* kinds, const float* all_draws, int64_t b, int32_t* token,
                         float* logprob) {
  if (kinds[b] != static_cast<uint8_t>(SampleRowKind::plain)) return;
  token[b] = static_cast<int32_t>(all_draws[b * 2]);
  logprob[b] = all_draws[b * 2 + 1];
}

}  // namespace shards
}  // namespace tandem::ops
