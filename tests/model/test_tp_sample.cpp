// Sampling over vocabulary shards (model/tp_sample.h) against ops::sample on the full logits:
// tp = 1, 2, 3 and 4 ranks simulated in one process (each collective done by hand between the
// ranks' phases), random rows and settings, and the bytes a step moves; the vocabulary-parallel
// head (model/vocab_parallel.h) gives the sampled tokens the sampler's logprobs bit for bit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/philox.h"
#include "kernels/ops.h"
#include "model/tp_sample.h"
#include "model/vocab_parallel.h"
#include "tests/kernels/sampling_rows.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct Drawn {
  std::vector<int32_t> token;
  std::vector<float> logprob;
  int64_t bytes = 0;
};

Drawn sample_full(const Tensor& logits, const std::vector<RowSpec>& rows) {
  const int64_t B = logits.size(0);
  Tensor token = Tensor::zeros({B}, DType::i32), logprob = Tensor::zeros({B}, DType::f32);
  ops::sample(logits, make_settings(rows), token, logprob);
  Drawn d;
  d.token.assign(token.data_as<int32_t>(), token.data_as<int32_t>() + B);
  d.logprob.assign(logprob.data_as<float>(), logprob.data_as<float>() + B);
  return d;
}

// tp samplers, one per simulated rank, stepped together; each collective is done here: gathers
// concatenate the ranks' inputs in rank order, sums add them in rank order. Checks that every
// rank asks for the same collectives and ends with the same bits; returns rank 0's results.
Drawn sample_sharded(const Tensor& logits, const std::vector<RowSpec>& rows, int tp) {
  const int64_t B = logits.size(0), V = logits.size(1), Vs = V / tp;
  REQUIRE(Vs * tp == V);
  const ops::SamplingTensors settings = make_settings(rows);
  std::vector<Tensor> shards;
  std::vector<model::TpSampler> samplers(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    Tensor shard = Tensor::empty({B, Vs}, DType::f32);
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(shard.data_as<float>() + b * Vs, logits.data_as<float>() + b * V + r * Vs,
                  static_cast<size_t>(Vs) * sizeof(float));
    shards.push_back(shard);
    samplers[static_cast<size_t>(r)].start(shard, settings, r, tp);
  }
  for (;;) {
    std::vector<model::TpSampler::Collective> c(static_cast<size_t>(tp));
    const bool more = samplers[0].next(c[0]);
    for (int r = 1; r < tp; ++r) {
      REQUIRE(samplers[static_cast<size_t>(r)].next(c[static_cast<size_t>(r)]) == more);
      if (more) REQUIRE(std::string(c[static_cast<size_t>(r)].what) == c[0].what);
    }
    if (!more) break;
    std::vector<float> out;
    if (c[0].op == model::TpSampler::Collective::Op::gather) {
      for (int r = 0; r < tp; ++r) {
        const Tensor& in = c[static_cast<size_t>(r)].in;
        if (!c[0].counts.empty()) REQUIRE(c[0].counts[static_cast<size_t>(r)] == in.numel());
        out.insert(out.end(), in.data_as<float>(), in.data_as<float>() + in.numel());
      }
    } else {
      out.assign(static_cast<size_t>(c[0].in.numel()), 0.0f);
      for (int r = 0; r < tp; ++r)
        for (size_t i = 0; i < out.size(); ++i)
          out[i] += c[static_cast<size_t>(r)].in.data_as<float>()[i];
    }
    for (int r = 0; r < tp; ++r) {
      const Tensor& o = c[static_cast<size_t>(r)].out;
      REQUIRE(o.numel() == static_cast<int64_t>(out.size()));
      std::memcpy(o.data_as<float>(), out.data(), out.size() * sizeof(float));
    }
  }
  Drawn d;
  d.token.assign(samplers[0].tokens().begin(), samplers[0].tokens().end());
  d.logprob.assign(samplers[0].logprobs().begin(), samplers[0].logprobs().end());
  d.bytes = samplers[0].step_bytes();
  for (int r = 1; r < tp; ++r) {
    const model::TpSampler& s = samplers[static_cast<size_t>(r)];
    CHECK(std::vector<int32_t>(s.tokens().begin(), s.tokens().end()) == d.token);
    CHECK(std::memcmp(s.logprobs().data(), d.logprob.data(), d.logprob.size() * sizeof(float)) ==
          0);
    CHECK(s.step_bytes() == d.bytes);
  }
  return d;
}

// Random logits rows of several shapes: a wide spread, a peaked row, small integers (many ties).
Tensor random_logits(int64_t B, int64_t V, uint64_t seed) {
  Tensor x = random_tensor({B, V}, DType::f32, seed, -4.0, 4.0);
  float* p = x.data_as<float>();
  for (int64_t b = 0; b < B; ++b) {
    float* row = p + b * V;
    if (b % 4 == 1) row[(b * 37) % V] += 12.0f;
    if (b % 4 == 2)
      for (int64_t v = 0; v < V; ++v) row[v] = std::round(row[v]);
    if (b % 4 == 3)
      for (int64_t v = 0; v < V; ++v) row[v] *= 3.0f;
  }
  return x;
}

std::vector<RowSpec> random_settings(int64_t B, int64_t V, uint64_t seed) {
  const float temperatures[] = {0.0f, 0.6f, 1.0f, 1.4f};
  const int32_t top_ks[] = {
      0, 0, 1, 7, 50, static_cast<int32_t>(V) - 1, static_cast<int32_t>(V) + 5};
  const float top_ps[] = {1.0f, 1.0f, 0.9f, 0.5f, 0.97f};
  const float min_ps[] = {0.0f, 0.0f, 0.05f, 0.3f};
  std::vector<RowSpec> rows(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const Philox4x32 r = philox_random(seed, 1, static_cast<uint64_t>(b));
    RowSpec& s = rows[static_cast<size_t>(b)];
    s.temperature = temperatures[r.v[0] % 4];
    s.top_k = top_ks[r.v[1] % 7];
    s.top_p = top_ps[r.v[2] % 5];
    s.min_p = min_ps[r.v[3] % 4];
    s.seed = static_cast<int64_t>(seed * 1000 + static_cast<uint64_t>(b));
    s.offset = b % 5;
  }
  return rows;
}

}  // namespace

TEST_CASE("sampling over vocabulary shards draws the tokens of the full-vocabulary sampler",
          "[unit]") {
  // Greedy, temperature, top-k, top-p, min-p and their combinations on random rows. Greedy,
  // top-k and plain rows repeat ops::sample's sums in its order: the same tokens. Top-p-only
  // rows compare against top_p times the ranks' sums added in rank order, so a threshold
  // exactly on a boundary could fall differently by rounding (none does on these seeded rows);
  // logprobs differ in the last bits of that sum.
  for (const int tp : {1, 2, 3, 4}) {
    for (const int64_t V : {int64_t{240}, int64_t{1200}}) {
      const int64_t B = 64;
      const uint64_t seed = static_cast<uint64_t>(V * 10 + tp);
      const Tensor logits = random_logits(B, V, seed);
      const std::vector<RowSpec> rows = random_settings(B, V, seed);
      const Drawn full = sample_full(logits, rows);
      const Drawn sharded = sample_sharded(logits, rows, tp);
      for (int64_t b = 0; b < B; ++b) {
        const RowSpec& s = rows[static_cast<size_t>(b)];
        INFO("tp " << tp << " V " << V << " row " << b << ": temperature " << s.temperature
                   << " top_k " << s.top_k << " top_p " << s.top_p << " min_p " << s.min_p);
        CHECK(sharded.token[static_cast<size_t>(b)] == full.token[static_cast<size_t>(b)]);
        CHECK(std::fabs(sharded.logprob[static_cast<size_t>(b)] -
                        full.logprob[static_cast<size_t>(b)]) <= 1e-5);
        // One shard adds the sums in ops::sample's order: the same bits.
        if (tp == 1)
          CHECK(std::memcmp(&sharded.logprob[static_cast<size_t>(b)],
                            &full.logprob[static_cast<size_t>(b)], sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE(
    "the vocabulary-parallel head gives a token sampled over shards the sampler's logprob "
    "bitwise",
    "[unit]") {
  // A tensor-parallel rollout's logprob of a token and the tensor-parallel trainer's for it: one
  // definition of the row's max and lse (kernels/vocab_shards.h), so the same bits at every tp.
  // The whole row's logprob_gather adds the row's sum in another order: on these rows it differs
  // in the last bits from the sharded one somewhere, so a route of other sums would be caught.
  const int64_t B = 64, V = 240;
  for (const int tp : {2, 3, 4}) {
    const uint64_t seed = 500 + static_cast<uint64_t>(tp);
    const Tensor logits = random_logits(B, V, seed);
    const std::vector<RowSpec> rows = random_settings(B, V, seed);
    const Drawn drawn = sample_sharded(logits, rows, tp);
    const Tensor tokens = Tensor::wrap(const_cast<int32_t*>(drawn.token.data()), {B}, DType::i32);
    // The trainer's temperature: the row's, 1 for greedy rows (their logprob is at temperature 1).
    int64_t compared = 0, unlike_whole_row = 0;
    for (const float temperature : {0.6f, 1.0f, 1.4f}) {
      Tensor whole = Tensor::empty({B}, DType::f32), whole_lse = Tensor::empty({B}, DType::f32);
      ops::logprob_gather(logits, tokens, whole, whole_lse, Tensor(), temperature);
      std::vector<std::vector<float>> got(static_cast<size_t>(tp));
      const TempDir tmp("tp-sample-head");
      std::mutex mu;
      on_ranks(tp, tmp.file("store"), [&](int r, Communicator& comm) {
        const int64_t Vs = V / tp;
        Tensor shard = Tensor::empty({B, Vs}, DType::f32);
        for (int64_t b = 0; b < B; ++b)
          std::memcpy(shard.data_as<float>() + b * Vs, logits.data_as<float>() + b * V + r * Vs,
                      static_cast<size_t>(Vs) * sizeof(float));
        Tensor lp = Tensor::empty({B}, DType::f32), lse = Tensor::empty({B}, DType::f32),
               ent = Tensor::empty({B}, DType::f32);
        model::vocab_parallel_logprob(comm, shard, tokens, r * Vs, V, lp, lse, ent, temperature);
        const std::lock_guard<std::mutex> lock(mu);
        got[static_cast<size_t>(r)].assign(lp.data_as<float>(), lp.data_as<float>() + B);
      });
      for (int64_t b = 0; b < B; ++b) {
        const RowSpec& s = rows[static_cast<size_t>(b)];
        if ((s.temperature > 0.0f ? s.temperature : 1.0f) != temperature) continue;
        INFO("tp " << tp << " row " << b << ": temperature " << s.temperature << " top_k "
                   << s.top_k << " top_p " << s.top_p << " min_p " << s.min_p);
        const float want = drawn.logprob[static_cast<size_t>(b)];
        for (int r = 0; r < tp; ++r)
          CHECK(std::memcmp(&got[static_cast<size_t>(r)][static_cast<size_t>(b)], &want,
                            sizeof(float)) == 0);
        unlike_whole_row +=
            std::memcmp(whole.data_as<float>() + b, &want, sizeof(float)) != 0 ? 1 : 0;
        ++compared;
      }
    }
    INFO("tp " << tp);
    CHECK(compared == B);
    CHECK(unlike_whole_row > 0);
  }
}

TEST_CASE("sampling over vocabulary shards matches every setting alone at many offsets", "[unit]") {
  // One setting for all rows, each row its own draw: the boundary-free agreement per filter.
  const int64_t B = 96, V = 600;
  const Tensor logits = random_logits(B, V, 77);
  for (const RowSpec spec :
       {RowSpec{.temperature = 0.0f}, RowSpec{.temperature = 1.0f},
        RowSpec{.temperature = 0.8f, .top_k = 20}, RowSpec{.temperature = 1.1f, .top_p = 0.8f},
        RowSpec{.temperature = 0.9f, .min_p = 0.1f},
        RowSpec{.temperature = 0.7f, .top_k = 40, .top_p = 0.9f, .min_p = 0.02f},
        RowSpec{.temperature = 1.3f, .top_p = 0.95f, .min_p = 0.01f}}) {
    std::vector<RowSpec> rows(static_cast<size_t>(B), spec);
    for (int64_t b = 0; b < B; ++b) {
      rows[static_cast<size_t>(b)].seed = 5 + b;
      rows[static_cast<size_t>(b)].offset = b;
    }
    const Drawn full = sample_full(logits, rows);
    for (const int tp : {2, 3, 4}) {
      const Drawn sharded = sample_sharded(logits, rows, tp);
      INFO("tp " << tp << ": temperature " << spec.temperature << " top_k " << spec.top_k
                 << " top_p " << spec.top_p << " min_p " << spec.min_p);
      CHECK(sharded.token == full.token);
      for (int64_t b = 0; b < B; ++b)
        CHECK(std::fabs(sharded.logprob[static_cast<size_t>(b)] -
                        full.logprob[static_cast<size_t>(b)]) <= 1e-5);
    }
  }
}

TEST_CASE("sampling over vocabulary shards moves a few floats per row instead of the logits",
          "[unit]") {
  // B = 32 rows of SmolLM2's vocabulary (49152) at TP = 3. The all-gather of the logits it
  // replaces delivered B V f32 to every rank: 6291456 bytes per step.
  const int64_t B = 32, V = 49152;
  const int tp = 3;
  const Tensor logits = random_logits(B, V, 3);
  const int64_t gather_bytes = B * V * 4;
  CHECK(gather_bytes == 6291456);
  auto bytes_of = [&](RowSpec spec) {
    std::vector<RowSpec> rows(static_cast<size_t>(B), spec);
    for (int64_t b = 0; b < B; ++b) rows[static_cast<size_t>(b)].seed = b;
    const Drawn full = sample_full(logits, rows);
    const Drawn sharded = sample_sharded(logits, rows, tp);
    CHECK(sharded.token == full.token);
    return sharded.bytes;
  };
  // Temperature alone: maxima (tp, B, 2), stats (tp, B, 3), tp - 1 hops of the running sum (B)
  // and the draws (B, 2), f32.
  CHECK(bytes_of(RowSpec{.temperature = 1.0f}) ==
        (tp * B * 2 + tp * B * 3 + (tp - 1) * B + B * 2) * 4);
  CHECK(bytes_of(RowSpec{.temperature = 1.0f}) == 2432);
  // Greedy: maxima and stats.
  CHECK(bytes_of(RowSpec{.temperature = 0.0f}) == 1920);
  // Top-k 50 (with top-p): and every rank's 50 candidates, [z, id] each.
  CHECK(bytes_of(RowSpec{.temperature = 1.0f, .top_k = 50, .top_p = 0.9f}) ==
        1920 + tp * B * 50 * 2 * 4);
  // Top-p alone: counts (tp, B) and the candidates, as many as the rows' nuclei need: many on
  // these nearly flat rows (logits uniform in [-4, 4]), fewer on sharper ones (temperature
  // 0.25). Seeded rows, so exact counts (the table of docs/rollout.md).
  CHECK(bytes_of(RowSpec{.temperature = 1.0f, .top_p = 0.9f}) == 3105928);
  CHECK(bytes_of(RowSpec{.temperature = 0.25f, .top_p = 0.9f}) == 738040);
}

TEST_CASE("sampling over vocabulary shards refuses bad settings naming the row", "[unit]") {
  const Tensor shard = random_logits(2, 60, 5);
  model::TpSampler sampler;
  for (const RowSpec bad : {RowSpec{.temperature = -1.0f}, RowSpec{.top_k = -2},
                            RowSpec{.top_p = 0.0f}, RowSpec{.min_p = 1.5f}}) {
    const std::vector<RowSpec> rows = {RowSpec{}, bad};
    CHECK_THROWS_WITH(sampler.start(shard, make_settings(rows), 1, 3),
                      Catch::Contains("sample: row 1 has"));
  }
  const std::vector<RowSpec> rows(2);
  CHECK_THROWS_WITH(sampler.start(shard, make_settings(rows), 3, 3),
                    Catch::Contains("rank 3 of 3"));
}
