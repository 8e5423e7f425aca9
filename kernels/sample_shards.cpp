// sample_shard_*: checks and dispatch of sampling over vocabulary shards.
#include <initializer_list>

#include "core/error.h"
#include "kernels/check.h"
#include "kernels/cpu/sample.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/sample.h"
#endif

namespace tandem::ops {

using namespace detail;
using shards::ShardArgs;

namespace {

// Token ids travel as f32 values, exact below 2^24.
constexpr int64_t kMaxVocab = int64_t{1} << 24;

// The checks every phase makes: `rows` (B, Vs) f32 (the logits shard, or its z or e: the field of
// ShardArgs it fills), the shard, the settings (B), and every tensor on rows' device; the
// arguments the backends take.
ShardArgs shard_args(const char* op, const char* name, const Tensor& rows,
                     const float* ShardArgs::*field, const SamplingTensors& settings,
                     VocabShard shard, std::initializer_list<const Tensor*> others,
                     const Stream& stream) {
  check_dtype(op, name, rows, {DType::f32});
  check_ndim(op, name, rows, 2);
  const int64_t B = rows.size(0), Vs = rows.size(1);
  TANDEM_CHECK(shard.count >= 1 && shard.count <= shards::kMaxShardRanks && shard.rank >= 0 &&
                   shard.rank < shard.count,
               "{}: rank {} of {}: expected 0 <= rank < tp <= {}", op, shard.rank, shard.count,
               shards::kMaxShardRanks);
  TANDEM_CHECK(Vs > 0 && Vs * shard.count < kMaxVocab,
               "{}: a vocabulary of {} tokens ({} per rank) is outside [1, 2^24), the ids it "
               "exchanges as f32",
               op, Vs * shard.count, Vs);
  check_sampling_tensors(op, settings, B);
  const SamplingTensors& s = settings;
  check_device(op, rows.device(),
               {&rows, &s.temperature, &s.top_k, &s.top_p, &s.min_p, &s.seed, &s.offset});
  for (const Tensor* t : others) check_placement(op, rows.device(), {t}, stream);
  ShardArgs a;
  a.*field = rows.data_as<float>();
  a.B = B;
  a.Vs = Vs;
  a.rank = shard.rank;
  a.tp = shard.count;
  a.temperature = s.temperature.data_as<float>();
  a.top_k = s.top_k.data_as<int32_t>();
  a.top_p = s.top_p.data_as<float>();
  a.min_p = s.min_p.data_as<float>();
  a.seed = s.seed.data_as<int64_t>();
  a.offset = s.offset.data_as<int64_t>();
  return a;
}

// t checked as (shape) f32; its data.
float* f32_at(const char* op, const char* name, const Tensor& t, const Shape& shape) {
  check_f32(op, name, t, shape);
  return t.data_as<float>();
}

}  // namespace

void sample_shard_maxima(const Tensor& logits, const SamplingTensors& settings, VocabShard shard,
                         const Tensor& maxima, const Tensor& kinds, const Stream& stream) {
  constexpr const char* op = "sample_shard_maxima";
  ShardArgs a =
      shard_args(op, "logits", logits, &ShardArgs::x, settings, shard, {&maxima, &kinds}, stream);
  float* m = f32_at(op, "maxima", maxima, {a.B, 2});
  check_tensor(op, "kinds", kinds, DType::u8, {a.B});
  TANDEM_ON_CUDA(logits.device(), sample_shard_maxima, a, m, kinds.data_as<uint8_t>(),
                 stream.handle);
  cpu::check_sampling_settings(settings);
  cpu::sample_shard_maxima(a, m, kinds.data_as<uint8_t>());
}

void sample_shard_stats(const Tensor& logits, const SamplingTensors& settings, VocabShard shard,
                        const Tensor& all_maxima, const Tensor& z, const Tensor& e,
                        const Tensor& stats, const Stream& stream) {
  constexpr const char* op = "sample_shard_stats";
  ShardArgs a = shard_args(op, "logits", logits, &ShardArgs::x, settings, shard,
                           {&all_maxima, &z, &e, &stats}, stream);
  a.all_maxima = f32_at(op, "all_maxima", all_maxima, {a.tp, a.B, 2});
  float *zs = f32_at(op, "z", z, logits.shape()), *es = f32_at(op, "e", e, logits.shape());
  float* st = f32_at(op, "stats", stats, {a.B, 3});
  TANDEM_ON_CUDA(logits.device(), sample_shard_stats, a, zs, es, st, stream.handle);
  cpu::sample_shard_stats(a, zs, es, st);
}

void sample_shard_chain(const Tensor& e, const SamplingTensors& settings, VocabShard shard,
                        const Tensor& all_stats, const Tensor& hops, int hop, const Tensor& chain,
                        const Stream& stream) {
  constexpr const char* op = "sample_shard_chain";
  ShardArgs a =
      shard_args(op, "e", e, &ShardArgs::e, settings, shard, {&all_stats, &hops, &chain}, stream);
  TANDEM_CHECK(hop >= 1 && hop < a.tp, "{}: hop {} of tp {}: expected 1 <= hop < tp", op, hop,
               a.tp);
  a.all_stats = f32_at(op, "all_stats", all_stats, {a.tp, a.B, 3});
  a.hops = f32_at(op, "hops", hops, {a.tp - 1, a.B});
  float* c = f32_at(op, "chain", chain, {a.B});
  TANDEM_ON_CUDA(e.device(), sample_shard_chain, a, hop, c, stream.handle);
  cpu::sample_shard_chain(a, hop, c);
}

void sample_shard_counts(const Tensor& z, const SamplingTensors& settings, VocabShard shard,
                         const Tensor& all_maxima, const Tensor& all_stats, const Tensor& counts,
                         const Tensor& bounds, const Stream& stream) {
  constexpr const char* op = "sample_shard_counts";
  ShardArgs a = shard_args(op, "z", z, &ShardArgs::z, settings, shard,
                           {&all_maxima, &all_stats, &counts, &bounds}, stream);
  a.all_maxima = f32_at(op, "all_maxima", all_maxima, {a.tp, a.B, 2});
  a.all_stats = f32_at(op, "all_stats", all_stats, {a.tp, a.B, 3});
  float *n = f32_at(op, "counts", counts, {a.B}), *bo = f32_at(op, "bounds", bounds, {a.B, 2});
  TANDEM_ON_CUDA(z.device(), sample_shard_counts, a, n, bo, stream.handle);
  cpu::sample_shard_counts(a, n, bo);
}

void sample_shard_candidates(const Tensor& z, const SamplingTensors& settings, VocabShard shard,
                             const Tensor& all_counts, const Tensor& bounds, const Tensor& cands,
                             const Stream& stream) {
  constexpr const char* op = "sample_shard_candidates";
  ShardArgs a = shard_args(op, "z", z, &ShardArgs::z, settings, shard,
                           {&all_counts, &bounds, &cands}, stream);
  a.all_counts = f32_at(op, "all_counts", all_counts, {a.tp, a.B});
  a.bounds = f32_at(op, "bounds", bounds, {a.B, 2});
  check_dtype(op, "cands", cands, {DType::f32});
  check_ndim(op, "cands", cands, 1);
  TANDEM_ON_CUDA(z.device(), sample_shard_candidates, a, cands.data_as<float>(), stream.handle);
  // On the CPU the counts are at hand: cands must hold exactly what the rank sends.
  int64_t mine = 0;
  for (int64_t b = 0; b < a.B; ++b) mine += shards::row_elements(a, a.rank, b);
  TANDEM_CHECK(cands.numel() == mine, "{}: cands {} holds {} values, rank {} sends {}", op,
               cands.shape().str(), cands.numel(), a.rank, mine);
  cpu::sample_shard_candidates(a, cands.data_as<float>());
}

void sample_shard_decide(const Tensor& z, const Tensor& e, const SamplingTensors& settings,
                         VocabShard shard, const Tensor& all_maxima, const Tensor& all_stats,
                         const Tensor& hops, const Tensor& all_counts, const Tensor& all_cands,
                         const Tensor& token, const Tensor& logprob, const Tensor& draws,
                         const Stream& stream) {
  constexpr const char* op = "sample_shard_decide";
  ShardArgs a = shard_args(
      op, "z", z, &ShardArgs::z, settings, shard,
      {&e, &all_maxima, &all_stats, &hops, &all_counts, &all_cands, &token, &logprob, &draws},
      stream);
  a.e = f32_at(op, "e", e, z.shape());
  a.all_maxima = f32_at(op, "all_maxima", all_maxima, {a.tp, a.B, 2});
  a.all_stats = f32_at(op, "all_stats", all_stats, {a.tp, a.B, 3});
  a.hops = a.tp > 1 ? f32_at(op, "hops", hops, {a.tp - 1, a.B}) : nullptr;
  a.all_counts = f32_at(op, "all_counts", all_counts, {a.tp, a.B});
  if (all_cands.defined()) {
    check_dtype(op, "all_cands", all_cands, {DType::f32});
    check_ndim(op, "all_cands", all_cands, 1);
    a.all_cands = all_cands.data_as<float>();
  }
  check_tensor(op, "token", token, DType::i32, {a.B});
  float *lp = f32_at(op, "logprob", logprob, {a.B}), *dr = f32_at(op, "draws", draws, {a.B, 2});
  TANDEM_ON_CUDA(z.device(), sample_shard_decide, a, token.data_as<int32_t>(), lp, dr,
                 stream.handle);
  int64_t gathered = 0;
  for (int r = 0; r < a.tp; ++r)
    for (int64_t b = 0; b < a.B; ++b) gathered += shards::row_elements(a, r, b);
  TANDEM_CHECK(gathered == 0 || (all_cands.defined() && all_cands.numel() == gathered),
               "{}: all_cands holds {} values, the ranks send {}", op,
               all_cands.defined() ? all_cands.numel() : 0, gathered);
  cpu::sample_shard_decide(a, token.data_as<int32_t>(), lp, dr);
}

void sample_shard_draws(const Tensor& kinds, const Tensor& all_draws, const Tensor& token,
                        const Tensor& logprob, const Stream& stream) {
  constexpr const char* op = "sample_shard_draws";
  check_dtype(op, "kinds", kinds, {DType::u8});
  check_ndim(op, "kinds", kinds, 1);
  const int64_t B = kinds.size(0);
  check_f32(op, "all_draws", all_draws, {B, 2});
  check_tensor(op, "token", token, DType::i32, {B});
  check_f32(op, "logprob", logprob, {B});
  check_placement(op, kinds.device(), {&kinds, &all_draws, &token, &logprob}, stream);
  TANDEM_ON_CUDA(kinds.device(), sample_shard_draws, kinds.data_as<uint8_t>(),
                 all_draws.data_as<float>(), B, token.data_as<int32_t>(), logprob.data_as<float>(),
                 stream.handle);
  cpu::sample_shard_draws(kinds.data_as<uint8_t>(), all_draws.data_as<float>(), B,
                          token.data_as<int32_t>(), logprob.data_as<float>());
}

void sample_shard_elements(const Tensor& kinds, const Tensor& all_counts, int64_t Vs,
                           std::span<int64_t> elements) {
  constexpr const char* op = "sample_shard_elements";
  check_dtype(op, "kinds", kinds, {DType::u8});
  check_ndim(op, "kinds", kinds, 1);
  const int64_t B = kinds.size(0), tp = static_cast<int64_t>(elements.size());
  check_f32(op, "all_counts", all_counts, {tp, B});
  TANDEM_CHECK(kinds.device().is_cpu() && all_counts.device().is_cpu(),
               "{}: kinds and all_counts must be on the CPU", op);
  const uint8_t* k = kinds.data_as<uint8_t>();
  for (int r = 0; r < tp; ++r) {
    elements[static_cast<size_t>(r)] = 0;
    for (int64_t b = 0; b < B; ++b)
      elements[static_cast<size_t>(r)] +=
          shards::row_elements(static_cast<SampleRowKind>(k[b]), all_counts.data_as<float>(), B, Vs,
                               static_cast<int>(tp), r, b);
  }
}

}  // namespace tandem::ops
