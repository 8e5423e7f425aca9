// sample_shard_*: a step over tp simulated ranks (collectives done by hand) against ops::sample on
// the whole logits, bad arguments, and a parity case per phase on the inputs such a step gives.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "core/philox.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/kernels/sampling_rows.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

// The ranks' tensors of one step, phase after phase, and what the collectives delivered.
struct Step {
  int tp = 1;
  int64_t B = 0, Vs = 0;
  ops::SamplingTensors settings;
  std::vector<Tensor> shard, maxima, kinds, z, e, stats, counts, bounds, cands, token, logprob,
      draws;
  Tensor all_maxima, all_stats, hops, all_counts, all_cands, all_draws;
};

// The ranks' tensors laid end to end in rank order.
Tensor gather(const std::vector<Tensor>& parts) {
  int64_t n = 0;
  for (const Tensor& p : parts) n += p.numel();
  Tensor out = Tensor::empty({n}, DType::f32);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    std::memcpy(out.data_as<float>() + at, p.data_as<float>(), p.nbytes());
    at += p.numel();
  }
  return out;
}

// The ranks' tensors added elementwise in rank order.
Tensor sum(const std::vector<Tensor>& parts) {
  Tensor out = Tensor::zeros(parts[0].shape(), DType::f32);
  for (const Tensor& p : parts)
    for (int64_t i = 0; i < p.numel(); ++i) out.data_as<float>()[i] += p.data_as<float>()[i];
  return out;
}

// Runs every phase on every rank with the CPU ops.
Step run_step(const Tensor& logits, const std::vector<RowSpec>& rows, int tp) {
  Step s;
  s.tp = tp;
  s.B = logits.size(0);
  s.Vs = logits.size(1) / tp;
  REQUIRE(s.Vs * tp == logits.size(1));
  s.settings = make_settings(rows);
  const int64_t B = s.B, Vs = s.Vs;
  const auto shard = [&](int r) { return ops::VocabShard{r, tp}; };
  for (int r = 0; r < tp; ++r) {
    Tensor x = Tensor::empty({B, Vs}, DType::f32);
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(x.data_as<float>() + b * Vs, logits.data_as<float>() + b * tp * Vs + r * Vs,
                  static_cast<size_t>(Vs) * sizeof(float));
    s.shard.push_back(x);
    s.maxima.push_back(Tensor::zeros({B, 2}, DType::f32));
    s.kinds.push_back(Tensor::zeros({B}, DType::u8));
    ops::sample_shard_maxima(x, s.settings, shard(r), s.maxima[r], s.kinds[r]);
  }
  s.all_maxima = gather(s.maxima).view({tp, B, 2});
  for (int r = 0; r < tp; ++r) {
    s.z.push_back(Tensor::zeros({B, Vs}, DType::f32));
    s.e.push_back(Tensor::zeros({B, Vs}, DType::f32));
    s.stats.push_back(Tensor::zeros({B, 3}, DType::f32));
    ops::sample_shard_stats(s.shard[r], s.settings, shard(r), s.all_maxima, s.z[r], s.e[r],
                            s.stats[r]);
  }
  s.all_stats = gather(s.stats).view({tp, B, 3});
  s.hops = Tensor::zeros({std::max(tp - 1, 1), B}, DType::f32);
  if (tp > 1) s.hops = s.hops.narrow(0, tp - 1);
  for (int hop = 1; hop < tp; ++hop) {
    std::vector<Tensor> chain;
    for (int r = 0; r < tp; ++r) {
      chain.push_back(Tensor::zeros({B}, DType::f32));
      ops::sample_shard_chain(s.e[r], s.settings, shard(r), s.all_stats, s.hops, hop, chain[r]);
    }
    s.hops.narrow(hop - 1, 1).view({B}).copy_from(sum(chain));
  }
  for (int r = 0; r < tp; ++r) {
    s.counts.push_back(Tensor::zeros({B}, DType::f32));
    s.bounds.push_back(Tensor::zeros({B, 2}, DType::f32));
    ops::sample_shard_counts(s.z[r], s.settings, shard(r), s.all_maxima, s.all_stats, s.counts[r],
                             s.bounds[r]);
  }
  s.all_counts = gather(s.counts).view({tp, B});
  std::vector<int64_t> elements(static_cast<size_t>(tp));
  ops::sample_shard_elements(s.kinds[0], s.all_counts, Vs, elements);
  for (int r = 0; r < tp; ++r) {
    s.cands.push_back(Tensor::zeros({elements[static_cast<size_t>(r)]}, DType::f32));
    ops::sample_shard_candidates(s.z[r], s.settings, shard(r), s.all_counts, s.bounds[r],
                                 s.cands[r]);
  }
  s.all_cands = gather(s.cands);
  for (int r = 0; r < tp; ++r) {
    s.token.push_back(Tensor::zeros({B}, DType::i32));
    s.logprob.push_back(Tensor::zeros({B}, DType::f32));
    s.draws.push_back(Tensor::zeros({B, 2}, DType::f32));
    ops::sample_shard_decide(s.z[r], s.e[r], s.settings, shard(r), s.all_maxima, s.all_stats,
                             tp > 1 ? s.hops : Tensor(), s.all_counts, s.all_cands, s.token[r],
                             s.logprob[r], s.draws[r]);
  }
  s.all_draws = sum(s.draws);
  for (int r = 0; r < tp; ++r)
    ops::sample_shard_draws(s.kinds[r], s.all_draws, s.token[r], s.logprob[r]);
  return s;
}

// Every kind of row: greedy, top-k, nucleus (dense and sparse), plain with and without min-p.
std::vector<RowSpec> mixed_rows(int64_t B, uint64_t seed) {
  const RowSpec kinds[] = {{.temperature = 0.0f},
                           {.temperature = 0.8f, .top_k = 9},
                           {.temperature = 1.0f, .top_p = 0.9f},
                           {.temperature = 1.3f},
                           {.temperature = 0.7f, .top_k = 40, .top_p = 0.8f, .min_p = 0.05f},
                           {.temperature = 2.0f, .top_p = 0.99f},
                           {.temperature = 1.0f, .min_p = 0.2f},
                           {.temperature = 0.5f, .top_p = 0.5f}};
  std::vector<RowSpec> rows;
  for (int64_t b = 0; b < B; ++b) {
    RowSpec r = kinds[b % 8];
    r.seed = static_cast<int64_t>(seed) + b;
    r.offset = b * 3;
    rows.push_back(r);
  }
  return rows;
}

Tensor sampled(const Tensor& logits, const std::vector<RowSpec>& rows, Tensor* logprob) {
  const int64_t B = logits.size(0);
  Tensor token = Tensor::zeros({B}, DType::i32);
  *logprob = Tensor::zeros({B}, DType::f32);
  ops::sample(logits, make_settings(rows), token, *logprob);
  return token;
}

}  // namespace

TEST_CASE("the shard phases draw the tokens of sample on the whole logits for every kind of row",
          "[unit]") {
  for (const int tp : {1, 2, 3, 4}) {
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      const int64_t B = 16, V = 240;
      const Tensor logits = random_tensor({B, V}, DType::f32, seed, -5.0, 5.0);
      const std::vector<RowSpec> rows = mixed_rows(B, seed);
      const Step s = run_step(logits, rows, tp);
      Tensor want_logprob;
      const Tensor want = sampled(logits, rows, &want_logprob);
      for (int r = 0; r < tp; ++r) {
        INFO("tp " << tp << " seed " << seed << " rank " << r);
        CHECK(bitwise_equal(s.token[r], s.token[0]));
        CHECK(bitwise_equal(s.logprob[r], s.logprob[0]));
      }
      for (int64_t b = 0; b < B; ++b) {
        INFO("tp " << tp << " seed " << seed << " row " << b);
        // A nucleus row's target sums the ranks' sums in rank order: it may differ on a
        // boundary, never for these seeded rows.
        CHECK(s.token[0].data_as<int32_t>()[b] == want.data_as<int32_t>()[b]);
        CHECK(s.logprob[0].data_as<float>()[b] ==
              Approx(want_logprob.data_as<float>()[b]).margin(1e-5));
      }
    }
  }
}

TEST_CASE("the shard phases refuse bad settings shards and sizes naming them", "[unit]") {
  const Tensor x = random_tensor({2, 50}, DType::f32, 3);
  Tensor maxima = Tensor::zeros({2, 2}, DType::f32), kinds = Tensor::zeros({2}, DType::u8);
  const std::vector<RowSpec> good(2);
  CHECK_THROWS_WITH(ops::sample_shard_maxima(x, make_settings({RowSpec{}, RowSpec{.top_p = 1.5f}}),
                                             {0, 2}, maxima, kinds),
                    Catch::Contains("sample: row 1 has top_p 1.5"));
  CHECK_THROWS_WITH(ops::sample_shard_maxima(x, make_settings(good), {2, 2}, maxima, kinds),
                    Catch::Contains("rank 2 of 2"));
  CHECK_THROWS_WITH(ops::sample_shard_maxima(x, make_settings(good), {0, 2},
                                             Tensor::zeros({2, 3}, DType::f32), kinds),
                    Catch::Contains("sample_shard_maxima: maxima has shape (2, 3)"));
  CHECK_THROWS_WITH(
      ops::sample_shard_maxima(x, make_settings(std::vector<RowSpec>(3)), {0, 2}, maxima, kinds),
      Catch::Contains("temperature has shape (3)"));
  const Step s = run_step(random_tensor({4, 60}, DType::f32, 4), mixed_rows(4, 4), 2);
  CHECK_THROWS_WITH(
      ops::sample_shard_candidates(s.z[0], s.settings, {0, 2}, s.all_counts, s.bounds[0],
                                   Tensor::zeros({s.cands[0].numel() + 1}, DType::f32)),
      Catch::Contains("rank 0 sends"));
}

namespace {

// The parity cases' inputs: rank 1 of 3 (the chain: rank 2, hop 2) of a simulated step.
enum In {
  kX,
  kTemperature,
  kTopK,
  kTopP,
  kMinP,
  kSeed,
  kOffset,
  kAllMaxima,
  kZ,
  kE,
  kAllStats,
  kHops,
  kAllCounts,
  kBounds,
  kAllCands,
  kKinds,
  kAllDraws,
  kInputs
};

constexpr int kTp = 3;
constexpr int64_t kB = 24, kVs = 700;

std::vector<Tensor> step_inputs(uint64_t seed, int rank) {
  const Tensor logits = random_tensor({kB, kTp * kVs}, DType::f32, seed, -6.0, 6.0);
  const Step s = run_step(logits, mixed_rows(kB, seed), kTp);
  const size_t r = static_cast<size_t>(rank);
  const ops::SamplingTensors& t = s.settings;
  return {s.shard[r],   t.temperature, t.top_k,     t.top_p,    t.min_p,     t.seed,
          t.offset,     s.all_maxima,  s.z[r],      s.e[r],     s.all_stats, s.hops,
          s.all_counts, s.bounds[r],   s.all_cands, s.kinds[r], s.all_draws};
}

ops::SamplingTensors settings_of(const std::vector<Tensor>& in) {
  return {in[kTemperature], in[kTopK], in[kTopP], in[kMinP], in[kSeed], in[kOffset]};
}

void add_shard_case(const std::string& name, int rank,
                    std::function<std::vector<Tensor>(const std::vector<Tensor>&)> outputs,
                    std::function<void(const std::vector<Tensor>&, const std::vector<Tensor>&)> run,
                    double max_nmse = 1e-12) {
  add_parity_case({.name = name,
                   .inputs = [rank](uint64_t seed) { return step_inputs(seed, rank); },
                   .outputs = std::move(outputs),
                   .run = std::move(run),
                   .max_nmse = max_nmse,
                   .min_int_match = 1.0});
}

std::vector<Tensor> f32_zeros(std::initializer_list<Shape> shapes) {
  std::vector<Tensor> out;
  for (const Shape& s : shapes) out.push_back(Tensor::zeros(s, DType::f32));
  return out;
}

}  // namespace

// The CUDA phases run the CPU's arithmetic in its order (kernels/sample_shard_rows.h): the same
// bits are expected, the tolerance only reports how far they are off.
TANDEM_PARITY_CASES(sample_shards) {
  const ops::VocabShard one{1, kTp};
  const std::string shape = fmt::format("(B {}, Vs {}, tp {})", kB, kVs, kTp);
  add_shard_case(
      "sample_shard_maxima " + shape, 1,
      [](const std::vector<Tensor>&) {
        return std::vector<Tensor>{Tensor::zeros({kB, 2}, DType::f32),
                                   Tensor::zeros({kB}, DType::u8)};
      },
      [one](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_maxima(in[kX], settings_of(in), one, out[0], out[1]);
      });
  add_shard_case(
      "sample_shard_stats " + shape, 1,
      [](const std::vector<Tensor>&) {
        return f32_zeros({{kB, kVs}, {kB, kVs}, {kB, 3}});
      },
      [one](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_stats(in[kX], settings_of(in), one, in[kAllMaxima], out[0], out[1],
                                out[2]);
      });
  add_shard_case(
      "sample_shard_chain hop 2 " + shape, 2,
      [](const std::vector<Tensor>&) { return f32_zeros({{kB}}); },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_chain(in[kE], settings_of(in), {2, kTp}, in[kAllStats], in[kHops], 2,
                                out[0]);
      });
  add_shard_case(
      "sample_shard_counts " + shape, 1,
      [](const std::vector<Tensor>&) {
        return f32_zeros({{kB}, {kB, 2}});
      },
      [one](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_counts(in[kZ], settings_of(in), one, in[kAllMaxima], in[kAllStats],
                                 out[0], out[1]);
      });
  add_shard_case(
      "sample_shard_candidates " + shape, 1,
      [](const std::vector<Tensor>& in) {
        std::vector<int64_t> elements(kTp);
        ops::sample_shard_elements(in[kKinds], in[kAllCounts], kVs, elements);
        return f32_zeros({{elements[1]}});
      },
      [one](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_candidates(in[kZ], settings_of(in), one, in[kAllCounts], in[kBounds],
                                     out[0]);
      });
  add_shard_case(
      "sample_shard_decide " + shape, 1,
      [](const std::vector<Tensor>&) {
        return std::vector<Tensor>{Tensor::zeros({kB}, DType::i32), Tensor::zeros({kB}, DType::f32),
                                   Tensor::zeros({kB, 2}, DType::f32)};
      },
      [one](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_decide(in[kZ], in[kE], settings_of(in), one, in[kAllMaxima],
                                 in[kAllStats], in[kHops], in[kAllCounts], in[kAllCands], out[0],
                                 out[1], out[2]);
      });
  add_shard_case(
      "sample_shard_draws " + shape, 1,
      [](const std::vector<Tensor>&) {
        return std::vector<Tensor>{Tensor::zeros({kB}, DType::i32),
                                   Tensor::zeros({kB}, DType::f32)};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
        ops::sample_shard_draws(in[kKinds], in[kAllDraws], out[0], out[1]);
      });
}
