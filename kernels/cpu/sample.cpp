// CPU sampling: temperature, top-k, top-p and min-p filters by binary search on thresholds (no
// sort of the vocabulary), then an inverse-CDF draw from the row's Philox stream.
//
// The definition both backends implement, per row (z = x / temperature, e_v = softmax_exp(z_v -
// max z), which is p_v times a constant of the row):
//  - temperature 0: the lowest id of the largest logit; its logprob under temperature 1.
//  - top-k (0 < k < V): th_k = the largest value of z with count(z >= th_k) >= k; keep every v
//    with z_v > th_k, and of those with z_v == th_k the lowest ids, until exactly k are kept.
//  - top-p (top_p < 1): over the top-k tokens, th_p = the largest of their z with
//    mass(z >= th_p) >= top_p * mass(all of them), mass summing e over the top-k tokens; keep the
//    top-k tokens with z >= th_p (all of a tie at th_p stay).
//  - min-p (min_p > 0): keep the tokens with e_v >= min_p, i.e. p_v >= min_p * max p (the largest
//    token has e = 1).
//  - the draw: u = uniform_from_bits(philox_random(seed, 0, offset).v[0]); the first kept token in
//    vocabulary order whose running sum of e exceeds u * (sum of the kept e). Where rounding
//    leaves none, the last kept token with e > 0.
// Masses are f32 sums in a fixed order (16 lanes here, the block's order on CUDA), so a case on a
// boundary may fall differently on the two backends by rounding, never by definition.
#include "kernels/cpu/sample.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "kernels/cpu/clones.h"
#include "kernels/cpu/logprob.h"
#include "kernels/float_order.h"

namespace tandem::ops::cpu {
namespace {

constexpr int L = kSoftmaxLanes;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct RowSettings {
  float temperature;
  int32_t top_k;
  float top_p, min_p;
  uint64_t seed, offset;
};

// A row's scratch, per thread, grown once to the largest V seen.
struct Scratch {
  std::vector<float> z, e, kept_z, kept_e;  // (V)
  std::vector<int32_t> kept_id;             // (V)
};

Scratch& scratch_for(int64_t V) {
  thread_local Scratch s;
  const size_t n = static_cast<size_t>(V);
  if (s.z.size() < n) {
    s.z.resize(n);
    s.e.resize(n);
    s.kept_z.resize(n);
    s.kept_e.resize(n);
    s.kept_id.resize(n);
  }
  return s;
}

}  // namespace

void check_sampling_settings(const SamplingTensors& settings) {
  const float* temperature = settings.temperature.data_as<float>();
  const int32_t* top_k = settings.top_k.data_as<int32_t>();
  const float* top_p = settings.top_p.data_as<float>();
  const float* min_p = settings.min_p.data_as<float>();
  for (int64_t b = 0; b < settings.temperature.numel(); ++b) {
    TANDEM_CHECK(temperature[b] >= 0.0f && std::isfinite(temperature[b]),
                 "sample: row {} has temperature {}, expected a finite value >= 0 (0 = greedy)", b,
                 temperature[b]);
    TANDEM_CHECK(top_k[b] >= 0, "sample: row {} has top_k {}, expected >= 0 (0 = off)", b,
                 top_k[b]);
    TANDEM_CHECK(top_p[b] > 0.0f && top_p[b] <= 1.0f,
                 "sample: row {} has top_p {}, expected a value in (0, 1] (1 = off)", b, top_p[b]);
    TANDEM_CHECK(min_p[b] >= 0.0f && min_p[b] <= 1.0f,
                 "sample: row {} has min_p {}, expected a value in [0, 1] (0 = off)", b, min_p[b]);
  }
}

static_assert(kSoftmaxLanes == kMassLanes, "sample's masses run in row_softmax's lanes");

// The threshold searches' counts and masses (kernels/sample_shard_rows.h), built per vector width.
TANDEM_CPU_CLONES int64_t count_at_least(const float* z, int64_t n, float t) {
  return ops::count_at_least(z, n, t);
}
TANDEM_CPU_CLONES int64_t count_greater(const float* z, int64_t n, float t) {
  return ops::count_greater(z, n, t);
}
TANDEM_CPU_CLONES float mass_at_least(const float* z, const float* e, int64_t n, float t) {
  return ops::mass_at_least(z, e, n, t);
}

namespace {

// z = x / tau and e = exp(z - max), as row_softmax computes them.
TANDEM_CPU_CLONES void scale_and_exp(const float* x, int64_t V, float tau, float max, float* z,
                                     float* e) {
  for (int64_t v = 0; v < V; ++v) {
    z[v] = scaled_logit(x[v], tau);
    e[v] = softmax_exp(z[v] - max);
  }
}

// The largest value of x that is not NaN (-inf if none), in lanes, so that the loop vectorises.
TANDEM_CPU_CLONES float largest_number(const float* x, int64_t V) {
  const int64_t full = V - V % L;
  float mx[L];
  for (int j = 0; j < L; ++j) mx[j] = -kInf;
  for (int64_t v0 = 0; v0 < full; v0 += L)
    for (int j = 0; j < L; ++j) mx[j] = x[v0 + j] > mx[j] ? x[v0 + j] : mx[j];
  for (int64_t v = full; v < V; ++v) mx[v - full] = x[v] > mx[v - full] ? x[v] : mx[v - full];
  float m = mx[0];
  for (int j = 1; j < L; ++j) m = mx[j] > m ? mx[j] : m;
  return m;
}

// The first v with x[v] == m; V if none. Blocks of L are tested whole (a loop that vectorises)
// before the block that holds it is searched.
TANDEM_CPU_CLONES int64_t first_equal(const float* x, int64_t V, float m) {
  const int64_t full = V - V % L;
  int64_t v0 = 0;
  for (; v0 < full; v0 += L) {
    int hits = 0;
    for (int j = 0; j < L; ++j) hits |= x[v0 + j] == m ? 1 : 0;
    if (hits != 0) break;
  }
  for (int64_t v = v0; v < V; ++v)
    if (x[v] == m) return v;
  return V;
}

// The v a scan `if (x[v] > x[best]) best = v` from best = 0 ends at: the first of the largest
// values that are not NaN, or 0 when x[0] is NaN (nothing compares greater than NaN).
int32_t first_argmax(const float* x, int64_t V) {
  if (std::isnan(x[0])) return 0;
  const int64_t v = first_equal(x, V, largest_number(x, V));
  return static_cast<int32_t>(v < V ? v : 0);
}

void sample_row(const float* x, int64_t V, const RowSettings& s, int32_t* token, float* logprob) {
  if (s.temperature == 0.0f) {
    const int32_t a = first_argmax(x, V);
    *token = a;
    *logprob = token_logprob(x[a], 1.0f, row_softmax(x, V, 1.0f, false).lse);
    return;
  }
  const float tau = s.temperature;
  const RowSoftmax st = row_softmax(x, V, tau, false);
  Scratch& sc = scratch_for(V);
  float* z = sc.z.data();
  float* e = sc.e.data();
  scale_and_exp(x, V, tau, st.max, z, e);
  // The thresholds lie in [-inf, max z]: every search below starts from there.

  // Top-k: the candidates, in vocabulary order.
  float* cz = sc.kept_z.data();
  float* ce = sc.kept_e.data();
  int32_t* id = sc.kept_id.data();
  int64_t n = 0;
  if (s.top_k > 0 && s.top_k < V) {
    const int64_t k = s.top_k;
    const float th =
        largest_value_where(-kInf, st.max, [&](float t) { return count_at_least(z, V, t) >= k; });
    int64_t ties = k - count_greater(z, V, th);
    for (int64_t v = 0; v < V; ++v) {
      if (z[v] > th || (z[v] == th && ties-- > 0)) {
        cz[n] = z[v];
        ce[n] = e[v];
        id[n] = static_cast<int32_t>(v);
        ++n;
      }
    }
  } else {
    for (int64_t v = 0; v < V; ++v) {
      cz[v] = z[v];
      ce[v] = e[v];
      id[v] = static_cast<int32_t>(v);
    }
    n = V;
  }

  // Top-p over the top-k candidates.
  float th_p = -kInf;
  if (s.top_p < 1.0f && n > 0) {
    const float target = s.top_p * mass_at_least(cz, ce, n, -kInf);
    th_p = largest_value_where(-kInf, st.max,
                               [&](float t) { return mass_at_least(cz, ce, n, t) >= target; });
  }

  // Top-p and min-p, compacting the candidates in place.
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (cz[i] >= th_p && ce[i] >= s.min_p) {
      ce[kept] = ce[i];
      id[kept] = id[i];
      ++kept;
    }
  }

  // Inverse CDF in vocabulary order: the running sums, once (into cz, free by now), then the
  // first one above the threshold by binary search (sums of non-negative terms never decrease).
  const float u = uniform_from_bits(philox_random(s.seed, 0, s.offset).v[0]);
  float running = 0.0f;
  for (int64_t i = 0; i < kept; ++i) cz[i] = running += ce[i];
  const float threshold = u * running;
  int64_t pick = std::upper_bound(cz, cz + kept, threshold) - cz;
  if (pick == kept) pick = -1;
  for (int64_t i = kept - 1; pick < 0 && i >= 0; --i)
    if (ce[i] > 0.0f) pick = i;
  const int32_t tok = pick >= 0 ? id[pick] : first_argmax(x, V);
  *token = tok;
  *logprob = token_logprob(x[tok], tau, st.lse);
}

}  // namespace

void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob) {
  const int64_t B = logits.size(0), V = logits.size(1);
  const float* x = logits.data_as<float>();
  const float* temperature = settings.temperature.data_as<float>();
  const int32_t* top_k = settings.top_k.data_as<int32_t>();
  const float* top_p = settings.top_p.data_as<float>();
  const float* min_p = settings.min_p.data_as<float>();
  const int64_t* seed = settings.seed.data_as<int64_t>();
  const int64_t* offset = settings.offset.data_as<int64_t>();
  check_sampling_settings(settings);
  int32_t* tok = token.data_as<int32_t>();
  float* lp = logprob.data_as<float>();
  parallel_for(B, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const RowSettings s{temperature[b],
                          top_k[b],
                          top_p[b],
                          min_p[b],
                          static_cast<uint64_t>(seed[b]),
                          static_cast<uint64_t>(offset[b])};
      sample_row(x + b * V, V, s, tok + b, lp + b);
    }
  });
}

}  // namespace tandem::ops::cpu
