// Sampling over vocabulary shards: the phases of TpSampler and the step over a Communicator.
#include "model/tp_sample.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/philox.h"
#include "kernels/cpu/logprob.h"
#include "kernels/cpu/sample.h"
#include "kernels/float_order.h"

namespace tandem::model {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// Token ids travel as f32 values, exact below 2^24.
constexpr int64_t kMaxVocab = int64_t{1} << 24;

using ops::cpu::count_at_least;
using ops::cpu::count_greater;
using ops::cpu::mass_at_least;

// The running sum of the kept e (e >= floor) continued from `start`, one f32 addition after the
// other in vocabulary order: ops::sample's inverse-CDF chain, rank after rank.
float fold_kept(float start, const float* e, int64_t n, float floor) {
  float run = start;
  for (int64_t i = 0; i < n; ++i)
    if (e[i] >= floor) run += e[i];
  return run;
}

// The last index with e >= floor and e > 0, or -1.
int64_t last_kept(const float* e, int64_t n, float floor) {
  for (int64_t i = n - 1; i >= 0; --i)
    if (e[i] >= floor && e[i] > 0.0f) return i;
  return -1;
}

template <class T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

}  // namespace

void TpSampler::start(const Tensor& logits, const ops::SamplingTensors& settings, int rank,
                      int tp) {
  TANDEM_CHECK(logits.device().is_cpu() && logits.dtype() == DType::f32 && logits.ndim() == 2,
               "tensor-parallel sampling: the logits shard must be (B, V/tp) f32 on the CPU");
  TANDEM_CHECK(tp >= 1 && rank >= 0 && rank < tp, "tensor-parallel sampling: rank {} of {}", rank,
               tp);
  B_ = logits.size(0);
  Vs_ = logits.size(1);
  rank_ = rank;
  tp_ = tp;
  v0_ = rank * Vs_;
  TANDEM_CHECK(Vs_ > 0 && Vs_ * tp < kMaxVocab,
               "tensor-parallel sampling: a vocabulary of {} tokens ({} per rank) is outside "
               "[1, 2^24), the ids it exchanges as f32",
               Vs_ * tp, Vs_);
  for (const Tensor* t : {&settings.temperature, &settings.top_k, &settings.top_p, &settings.min_p,
                          &settings.seed, &settings.offset})
    TANDEM_CHECK(t->device().is_cpu() && t->numel() == B_,
                 "tensor-parallel sampling: every setting must hold B = {} values on the CPU", B_);
  x_ = logits.data_as<float>();
  temperature_ = settings.temperature.data_as<float>();
  top_k_ = settings.top_k.data_as<int32_t>();
  top_p_ = settings.top_p.data_as<float>();
  min_p_ = settings.min_p.data_as<float>();
  seed_ = settings.seed.data_as<int64_t>();
  offset_ = settings.offset.data_as<int64_t>();
  const int64_t V = Vs_ * tp;
  grow(kind_, B_);
  grow(tau_, B_);
  for (int64_t b = 0; b < B_; ++b) {
    TANDEM_CHECK(temperature_[b] >= 0.0f && std::isfinite(temperature_[b]),
                 "sample: row {} has temperature {}, expected a finite value >= 0 (0 = greedy)", b,
                 temperature_[b]);
    TANDEM_CHECK(top_k_[b] >= 0, "sample: row {} has top_k {}, expected >= 0 (0 = off)", b,
                 top_k_[b]);
    TANDEM_CHECK(top_p_[b] > 0.0f && top_p_[b] <= 1.0f,
                 "sample: row {} has top_p {}, expected a value in (0, 1] (1 = off)", b, top_p_[b]);
    TANDEM_CHECK(min_p_[b] >= 0.0f && min_p_[b] <= 1.0f,
                 "sample: row {} has min_p {}, expected a value in [0, 1] (0 = off)", b, min_p_[b]);
    const size_t i = static_cast<size_t>(b);
    tau_[i] = temperature_[b] > 0.0f ? temperature_[b] : 1.0f;
    if (temperature_[b] == 0.0f) {
      kind_[i] = Kind::greedy;
    } else if (top_k_[b] > 0 && top_k_[b] < V) {
      kind_[i] = Kind::top_k;
    } else if (top_p_[b] < 1.0f) {
      kind_[i] = Kind::nucleus;
    } else {
      kind_[i] = Kind::plain;
    }
  }
  grow(zmax_, B_);
  grow(lse_, B_);
  grow(greedy_, B_);
  grow(token_, B_);
  grow(logprob_, B_);
  bytes_ = 0;
  stage_ = Stage::maxima;
}

TpSampler::Collective TpSampler::gather(const char* what, std::vector<float>& in,
                                        std::vector<float>& out, int64_t out_n) {
  const int64_t n = out_n / tp_;
  grow(out, out_n);
  bytes_ += out_n * static_cast<int64_t>(sizeof(float));
  return {Collective::Op::gather,
          what,
          Tensor::wrap(in.data(), {n}, DType::f32),
          Tensor::wrap(out.data(), {out_n}, DType::f32),
          {}};
}

bool TpSampler::next(Collective& c) {
  const auto any = [&](Kind k) {
    return std::any_of(kind_.begin(), kind_.begin() + B_, [k](Kind x) { return x == k; });
  };
  switch (stage_) {
    case Stage::maxima: {
      grow(maxima_, 2 * B_);
      for (int64_t b = 0; b < B_; ++b) {
        const float* x = x_ + b * Vs_;
        int64_t best = 0;
        for (int64_t v = 1; v < Vs_; ++v)
          if (x[v] > x[best]) best = v;
        maxima_[static_cast<size_t>(2 * b)] = x[best];
        maxima_[static_cast<size_t>(2 * b + 1)] = static_cast<float>(v0_ + best);
      }
      stage_ = Stage::stats;
      c = gather("maxima", maxima_, all_maxima_, tp_ * B_ * 2);
      return true;
    }
    case Stage::stats:
      phase_stats();
      stage_ = Stage::chain;
      hop_ = 0;
      c = gather("stats", stats_, all_stats_, tp_ * B_ * 3);
      return true;
    case Stage::chain:
      // Hop h: rank h continues the running kept sum from rank h - 1's end (known to all from
      // the previous gather) and every rank learns its end.
      if (any(Kind::plain)) {
        grow(ends_, tp_ * B_);
        for (int64_t b = 0; b < B_; ++b)
          ends_[static_cast<size_t>(hop_ * B_ + b)] =
              hop_ == 0 ? all_stats_[static_cast<size_t>((0 * B_ + b) * 3 + 1)]
                        : all_chain_[static_cast<size_t>(b)];
        if (++hop_ < tp_) {
          grow(chain_, B_);
          for (int64_t b = 0; b < B_; ++b) {
            const size_t i = static_cast<size_t>(b);
            chain_[i] = 0.0f;
            if (kind_[i] != Kind::plain || rank_ != hop_) continue;
            chain_[i] = fold_kept(ends_[static_cast<size_t>((hop_ - 1) * B_ + b)],
                                  e_.data() + b * Vs_, Vs_, min_p_[b]);
          }
          // Only rank hop_ sends a value (the others zeros): x + 0 = x, a broadcast of B f32.
          grow(all_chain_, B_);
          bytes_ += B_ * static_cast<int64_t>(sizeof(float));
          c = {Collective::Op::sum,
               "chain",
               Tensor::wrap(chain_.data(), {B_}, DType::f32),
               Tensor::wrap(all_chain_.data(), {B_}, DType::f32),
               {}};
          return true;
        }
      }
      stage_ = Stage::counts;
      [[fallthrough]];
    case Stage::counts:
      phase_candidates();
      stage_ = Stage::candidates;
      if (any(Kind::nucleus)) {
        c = gather("counts", counts_, all_counts_, tp_ * B_);
        return true;
      }
      // Only top-k rows have candidates: every rank sends min(top_k, V/tp) of them.
      grow(all_counts_, tp_ * B_);
      for (int r = 0; r < tp_; ++r)
        std::copy(counts_.begin(), counts_.begin() + B_, all_counts_.begin() + r * B_);
      [[fallthrough]];
    case Stage::candidates:
      stage_ = Stage::decide;
      cand_counts_.assign(static_cast<size_t>(tp_), 0);
      if (any(Kind::top_k) || any(Kind::nucleus)) {
        int64_t total = 0;
        for (int r = 0; r < tp_; ++r) {
          for (int64_t b = 0; b < B_; ++b)
            cand_counts_[static_cast<size_t>(r)] += row_elements(r, b);
          total += cand_counts_[static_cast<size_t>(r)];
        }
        pack_candidates();
        c = gather("candidates", cands_, all_cands_, total);
        c.in = Tensor::wrap(cands_.data(), {cand_counts_[static_cast<size_t>(rank_)]}, DType::f32);
        c.counts = cand_counts_;
        return true;
      }
      [[fallthrough]];
    case Stage::decide:
      phase_decide();
      stage_ = Stage::draws;
      if (any(Kind::plain)) {
        grow(all_draws_, 2 * B_);
        bytes_ += 2 * B_ * static_cast<int64_t>(sizeof(float));
        c = {Collective::Op::sum,
             "draws",
             Tensor::wrap(draws_.data(), {2 * B_}, DType::f32),
             Tensor::wrap(all_draws_.data(), {2 * B_}, DType::f32),
             {}};
        return true;
      }
      [[fallthrough]];
    case Stage::draws:
      for (int64_t b = 0; b < B_; ++b) {
        if (kind_[static_cast<size_t>(b)] != Kind::plain || drawn_[static_cast<size_t>(b)])
          continue;
        token_[static_cast<size_t>(b)] =
            static_cast<int32_t>(all_draws_[static_cast<size_t>(2 * b)]);
        logprob_[static_cast<size_t>(b)] = all_draws_[static_cast<size_t>(2 * b + 1)];
      }
      stage_ = Stage::done;
      return false;
    case Stage::done:
      break;
  }
  TANDEM_CHECK(false, "tensor-parallel sampling: next() called after the step ended; start one");
  return false;
}

void TpSampler::phase_stats() {
  grow(z_, B_ * Vs_);
  grow(e_, B_ * Vs_);
  grow(stats_, 3 * B_);
  for (int64_t b = 0; b < B_; ++b) {
    const size_t i = static_cast<size_t>(b);
    // The global maximum and its lowest id: ranks hold increasing ids, so the first rank with
    // the largest value (ops::sample's first argmax).
    float m = all_maxima_[i * 2];
    float id = all_maxima_[i * 2 + 1];
    for (int r = 1; r < tp_; ++r) {
      const float* mr = &all_maxima_[static_cast<size_t>((r * B_ + b) * 2)];
      if (mr[0] > m) {
        m = mr[0];
        id = mr[1];
      }
    }
    greedy_[i] = static_cast<int32_t>(id);
    // max z = (max x) / temperature exactly, as row_softmax has it.
    const float tau = tau_[i];
    const float zmax = ops::scaled_logit(m, tau);
    zmax_[i] = zmax;
    const float* x = x_ + b * Vs_;
    float* z = z_.data() + b * Vs_;
    float* e = e_.data() + b * Vs_;
    for (int64_t v = 0; v < Vs_; ++v) {
      z[v] = ops::scaled_logit(x[v], tau);
      e[v] = ops::softmax_exp(z[v] - zmax);
    }
    const float sum = mass_at_least(z, e, Vs_, -kInf);
    // Plain rows: rank 0's end of the running kept sum (its start is 0; the other ranks continue
    // it in the chain), and the rank's last kept token (the draw when rounding leaves none).
    float kept = 0.0f, threshold = zmax;
    if (kind_[i] == Kind::plain) {
      if (rank_ == 0) kept = fold_kept(0.0f, e, Vs_, min_p_[b]);
      const int64_t last = last_kept(e, Vs_, min_p_[b]);
      threshold = last >= 0 ? static_cast<float>(v0_ + last) : -1.0f;
    }
    if (kind_[i] == Kind::nucleus) {
      const float target = top_p_[b] * sum;
      threshold = ops::largest_value_where(
          -kInf, zmax, [&](float t) { return mass_at_least(z, e, Vs_, t) >= target; });
    }
    stats_[i * 3] = sum;
    stats_[i * 3 + 1] = kept;
    stats_[i * 3 + 2] = threshold;
  }
}

void TpSampler::phase_candidates() {
  grow(counts_, B_);
  grow(row_th_, B_);
  grow(row_ties_, B_);
  for (int64_t b = 0; b < B_; ++b) {
    const size_t i = static_cast<size_t>(b);
    float sum = 0.0f;
    for (int r = 0; r < tp_; ++r) sum += all_stats_[static_cast<size_t>((r * B_ + b) * 3)];
    lse_[i] = zmax_[i] + std::log(sum);
    if (kind_[i] == Kind::greedy) {
      token_[i] = greedy_[i];
      logprob_[i] = ops::sub_rn(zmax_[i], lse_[i]);  // z of the argmax at temperature 1
    }
    const float* z = z_.data() + b * Vs_;
    int64_t count = 0;
    if (kind_[i] == Kind::top_k && top_k_[b] < Vs_) {
      // The rank's top-k by ops::sample's rule (ties to the lower ids).
      const int64_t k = top_k_[b];
      row_th_[i] = ops::largest_value_where(
          -kInf, zmax_[i], [&](float t) { return count_at_least(z, Vs_, t) >= k; });
      row_ties_[i] = k - count_greater(z, Vs_, row_th_[i]);
      count = k;
    } else if (kind_[i] == Kind::top_k) {
      row_th_[i] = -kInf;
      row_ties_[i] = 0;
      count = Vs_;
    } else if (kind_[i] == Kind::nucleus) {
      float th = all_stats_[i * 3 + 2];
      for (int r = 1; r < tp_; ++r)
        th = std::min(th, all_stats_[static_cast<size_t>((r * B_ + b) * 3 + 2)]);
      row_th_[i] = th;
      row_ties_[i] = 0;
      count = count_at_least(z, Vs_, th);
    }
    counts_[i] = static_cast<float>(count);
  }
}

bool TpSampler::dense(int64_t b) const {
  int64_t total = 0;
  for (int r = 0; r < tp_; ++r)
    total += static_cast<int64_t>(all_counts_[static_cast<size_t>(r * B_ + b)]);
  return 2 * total > Vs_ * tp_;
}

int64_t TpSampler::row_elements(int r, int64_t b) const {
  const Kind kind = kind_[static_cast<size_t>(b)];
  if (kind != Kind::top_k && kind != Kind::nucleus) return 0;
  return dense(b) ? Vs_ : 2 * static_cast<int64_t>(all_counts_[static_cast<size_t>(r * B_ + b)]);
}

void TpSampler::pack_candidates() {
  grow(cands_, 2 * B_ * Vs_);
  int64_t n = 0;  // elements written
  for (int64_t b = 0; b < B_; ++b) {
    const size_t i = static_cast<size_t>(b);
    if (kind_[i] != Kind::top_k && kind_[i] != Kind::nucleus) continue;
    const float* z = z_.data() + b * Vs_;
    if (dense(b)) {
      std::copy(z, z + Vs_, cands_.begin() + n);
      n += Vs_;
      continue;
    }
    const float th = row_th_[i];
    int64_t ties = row_ties_[i];
    for (int64_t v = 0; v < Vs_; ++v) {
      const bool keep =
          kind_[i] == Kind::nucleus ? z[v] >= th : (z[v] > th || (z[v] == th && ties-- > 0));
      if (!keep) continue;
      cands_[static_cast<size_t>(n)] = z[v];
      cands_[static_cast<size_t>(n + 1)] = static_cast<float>(v0_ + v);
      n += 2;
    }
  }
}

void TpSampler::phase_decide() {
  grow(drawn_, B_);
  std::fill(drawn_.begin(), drawn_.begin() + B_, 0);
  grow(draws_, 2 * B_);
  std::fill(draws_.begin(), draws_.begin() + 2 * B_, 0.0f);
  // Where each rank's elements of the next row start in all_cands_.
  cursor_.assign(static_cast<size_t>(tp_), 0);
  for (int r = 1; r < tp_; ++r)
    cursor_[static_cast<size_t>(r)] =
        cursor_[static_cast<size_t>(r - 1)] + cand_counts_[static_cast<size_t>(r - 1)];
  for (int64_t b = 0; b < B_; ++b) {
    const size_t i = static_cast<size_t>(b);
    const Kind kind = kind_[i];
    if (kind == Kind::top_k || kind == Kind::nucleus) {
      // The row's candidates of every rank, in rank order: vocabulary order. A dense row is
      // every rank's whole shard of z, ids implied.
      const bool whole = dense(b);
      int64_t n = 0;
      for (int r = 0; r < tp_; ++r) {
        const int64_t elements = row_elements(r, b), count = whole ? elements : elements / 2;
        const float* from = all_cands_.data() + cursor_[static_cast<size_t>(r)];
        grow(cz_, n + count);
        grow(cid_, n + count);
        for (int64_t j = 0; j < count; ++j) {
          cz_[static_cast<size_t>(n + j)] = whole ? from[j] : from[2 * j];
          cid_[static_cast<size_t>(n + j)] =
              whole ? static_cast<int32_t>(r * Vs_ + j) : static_cast<int32_t>(from[2 * j + 1]);
        }
        cursor_[static_cast<size_t>(r)] += elements;
        n += count;
      }
      decide_row(b, n);
    } else if (kind == Kind::plain) {
      // ops::sample's draw: the first kept token whose running sum exceeds u * (the whole sum).
      // The chain's ends say which rank's range holds it; that rank repeats its part of the
      // chain, the same additions in the same order, so the same token.
      const float* end = &ends_[i];  // rank r's end: end[r * B]
      const float u = uniform_from_bits(
          philox_random(static_cast<uint64_t>(seed_[b]), 0, static_cast<uint64_t>(offset_[b]))
              .v[0]);
      const float threshold = u * end[(tp_ - 1) * B_];
      int owner = -1;
      for (int r = 0; r < tp_ && owner < 0; ++r)
        if (end[r * B_] > threshold) owner = r;
      if (owner < 0) {
        // Rounding left none: the last kept token with e > 0, on whichever rank holds it.
        float last = -1.0f;
        for (int r = 0; r < tp_; ++r)
          last = std::max(last, all_stats_[static_cast<size_t>((r * B_ + b) * 3 + 2)]);
        if (last < 0.0f) {
          token_[i] = greedy_[i];
          logprob_[i] = ops::sub_rn(zmax_[i], lse_[i]);
          drawn_[i] = 1;
          continue;
        }
        owner = static_cast<int>(static_cast<int64_t>(last) / Vs_);
      }
      if (owner != rank_) continue;
      const float* z = z_.data() + b * Vs_;
      const float* e = e_.data() + b * Vs_;
      const float floor = min_p_[b];
      int64_t pick = -1;
      float run = owner == 0 ? 0.0f : end[(owner - 1) * B_];
      for (int64_t v = 0; v < Vs_ && pick < 0; ++v) {
        if (e[v] < floor) continue;
        run += e[v];
        if (run > threshold) pick = v;
      }
      if (pick < 0) pick = last_kept(e, Vs_, floor);
      draws_[i * 2] = static_cast<float>(v0_ + pick);
      draws_[i * 2 + 1] = ops::sub_rn(z[pick], lse_[i]);
    }
  }
}

// ops::sample's steps on the row's candidates cz_, cid_ (n, vocabulary order).
void TpSampler::decide_row(int64_t b, int64_t n) {
  const size_t i = static_cast<size_t>(b);
  const float zmax = zmax_[i];
  grow(ce_, n);
  grow(run_, n);
  float* cz = cz_.data();
  float* ce = ce_.data();
  int32_t* id = cid_.data();
  for (int64_t j = 0; j < n; ++j) ce[j] = ops::softmax_exp(cz[j] - zmax);
  // Top-k: the candidates hold the global top-k, so the threshold and the ties are the same.
  float target_mass;
  if (kind_[i] == Kind::top_k) {
    const int64_t k = top_k_[b];
    const float th = ops::largest_value_where(
        -kInf, zmax, [&](float t) { return count_at_least(cz, n, t) >= k; });
    int64_t ties = k - count_greater(cz, n, th);
    int64_t kept = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (cz[j] > th || (cz[j] == th && ties-- > 0)) {
        cz[kept] = cz[j];
        ce[kept] = ce[j];
        id[kept] = id[j];
        ++kept;
      }
    }
    n = kept;
    target_mass = mass_at_least(cz, ce, n, -kInf);
  } else {
    float sum = 0.0f;
    for (int r = 0; r < tp_; ++r) sum += all_stats_[static_cast<size_t>((r * B_ + b) * 3)];
    target_mass = sum;
  }
  float th_p = -kInf;
  if (top_p_[b] < 1.0f && n > 0) {
    const float target = top_p_[b] * target_mass;
    th_p = ops::largest_value_where(-kInf, zmax,
                                    [&](float t) { return mass_at_least(cz, ce, n, t) >= target; });
  }
  int64_t kept = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (cz[j] >= th_p && ce[j] >= min_p_[b]) {
      cz[kept] = cz[j];
      ce[kept] = ce[j];
      id[kept] = id[j];
      ++kept;
    }
  }
  const float u = uniform_from_bits(
      philox_random(static_cast<uint64_t>(seed_[b]), 0, static_cast<uint64_t>(offset_[b])).v[0]);
  float* run = run_.data();
  float running = 0.0f;
  for (int64_t j = 0; j < kept; ++j) run[j] = running += ce[j];
  const float threshold = u * running;
  int64_t pick = std::upper_bound(run, run + kept, threshold) - run;
  if (pick == kept) pick = -1;
  for (int64_t j = kept - 1; pick < 0 && j >= 0; --j)
    if (ce[j] > 0.0f) pick = j;
  token_[i] = pick >= 0 ? id[pick] : greedy_[i];
  logprob_[i] = ops::sub_rn(pick >= 0 ? cz[pick] : zmax, lse_[i]);
}

void sample_over_shards(Communicator& group, TpSampler& sampler, const Tensor& logits,
                        const ops::SamplingTensors& settings, const Tensor& token,
                        const Tensor& logprob) {
  const int64_t B = logits.size(0);
  TANDEM_CHECK(token.device().is_cpu() && token.dtype() == DType::i32 && token.numel() == B &&
                   logprob.device().is_cpu() && logprob.dtype() == DType::f32 &&
                   logprob.numel() == B,
               "tensor-parallel sampling: token and logprob must be (B = {}) i32 and f32 on the "
               "CPU",
               B);
  sampler.start(logits, settings, group.rank(), group.size());
  TpSampler::Collective c;
  while (sampler.next(c)) {
    // maxima (tp, B, 2), stats (tp, B, 3), counts (tp, B), candidates (every rank's), draws
    // (B, 2): f32, c.out's bytes (TpSampler::step_bytes adds them up).
    if (c.op == TpSampler::Collective::Op::sum) {
      c.out.copy_from(c.in);
      group.all_reduce(c.out, ReduceOp::sum);
    } else if (c.counts.empty()) {
      group.all_gather(c.in, c.out);
    } else {
      group.all_gather_v(c.in, c.out, c.counts);
    }
  }
  std::copy(sampler.tokens().begin(), sampler.tokens().end(), token.data_as<int32_t>());
  std::copy(sampler.logprobs().begin(), sampler.logprobs().end(), logprob.data_as<float>());
}

Tensor gather_vocab_rows(Communicator& group, const Tensor& shard_rows) {
  TANDEM_CHECK(
      shard_rows.device().is_cpu() && shard_rows.dtype() == DType::f32 && shard_rows.ndim() == 2,
      "gather_vocab_rows: the rows must be (R, V/tp) f32 on the CPU");
  const int64_t R = shard_rows.size(0), Vs = shard_rows.size(1), tp = group.size();
  Tensor gathered = Tensor::empty({tp, R, Vs}, DType::f32);
  group.all_gather(shard_rows.view({R * Vs}), gathered.view({tp * R * Vs}));  // R V f32
  Tensor out = Tensor::empty({R, tp * Vs}, DType::f32);
  const float* g = gathered.data_as<float>();
  float* o = out.data_as<float>();
  for (int64_t r = 0; r < tp; ++r)
    for (int64_t i = 0; i < R; ++i)
      std::copy(g + (r * R + i) * Vs, g + (r * R + i + 1) * Vs, o + i * tp * Vs + r * Vs);
  return out;
}

}  // namespace tandem::model
