// Tensor-parallel training through model::Decoder (DecoderOptions::tp_group), ranks as threads:
// on 2 and 3 ranks each rank's forward gives the whole model's logprobs and entropies and its
// backward the cut_tp_shard of the whole model's gradients, within f32 rounding; score gives
// forward's bits, recompute the same bits, a group of one rank the plain decoder's bits; KV heads
// replicated over ranks are refused in training naming the sizes; the group's all-reduces and
// all-gathers are tp_training_collectives' counts and bytes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/error.h"
#include "model/decoder.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/model/unit_call_recorder.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"

namespace tandem::model {
namespace {

using Kind = test::TinyKind;

// A tiny model of `kind` whose sizes 2 and 3 divide: V = 96, F = 96, H heads of D = 8 (C = 64,
// 2 layers, as tests/model/tiny_model.h's).
ModelConfig tp_config(Kind kind, int64_t H, int64_t Hkv) {
  ModelConfig c = test::tiny_model_config(kind);
  c.vocab_size = 96;
  c.intermediate_size = 96;
  c.num_heads = H;
  c.num_kv_heads = Hkv;
  c.head_dim = 8;
  return c;
}

struct Case {
  Kind kind;
  int64_t H, Hkv;
  int tp;
};

// Every family at 2 and 3 ranks: tied and untied embeddings, Qwen2's biases, Qwen3's q/k norms
// with two query heads a KV head; llama untied at 2 ranks with Hkv = 2, one KV head a shard.
const std::vector<Case> kCases = {
    {Kind::llama_tied, 6, 6, 2},
    {Kind::llama_tied, 6, 6, 3},
    {Kind::llama_untied_rope3, 6, 2, 2},
    {Kind::llama_untied_rope3, 6, 6, 3},
    {Kind::qwen2, 6, 6, 2},
    {Kind::qwen2, 6, 6, 3},
    {Kind::qwen3, 12, 6, 2},
    {Kind::qwen3, 12, 6, 3},
};

std::vector<int32_t> random_ids(int n, int64_t V, uint64_t seed) {
  const Tensor t = test::random_ints({n}, DType::i32, seed, 0, V);
  return std::vector<int32_t>(t.data_as<int32_t>(), t.data_as<int32_t>() + n);
}

// A trainer's batch: a group of three completions of one prompt (packed once, shared), a lone
// pair, and a pair with a one-token prompt; head_rows = the completion rows.
PackedBatch prompt_batch(int64_t V, uint64_t seed) {
  std::vector<std::vector<int32_t>> ids;
  for (const int n : {7, 4, 1, 5, 3, 6, 4, 3}) ids.push_back(random_ids(n, V, seed++));
  const std::vector<PackedBatch::PromptCompletion> pairs = {
      {ids[0], ids[3]}, {ids[0], ids[4]}, {ids[0], ids[5]}, {ids[1], ids[6]}, {ids[2], ids[7]}};
  PackedBatch b = PackedBatch::from_prompts(pairs, true);
  REQUIRE(!b.prefix.empty());
  return b;
}

// The same batch with every row through the head.
PackedBatch all_rows(PackedBatch b) {
  b.head_rows.clear();
  return b;
}

std::vector<float> values(const Tensor& t) {
  return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// What one decoder gave: logprobs and entropies (T) and each gradient storage tensor.
struct Result {
  std::vector<float> logprob, entropy;
  std::vector<std::vector<float>> grads;
};

// forward then backward of the batch on dec into fresh gradients of config c.
Result train_step(Decoder& dec, const ModelConfig& c, const PackedBatch& batch,
                  const Tensor& dlogprob, const Tensor& dentropy, float temperature,
                  bool keep_entropy = true) {
  const int64_t T = batch.num_tokens();
  Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
  Weights grads(c, DType::f32, Device::cpu(), ArenaClass::gradients);
  grads.zero();
  dec.forward(batch, lp, keep_entropy ? ent : Tensor(), temperature);
  dec.backward(dlogprob, dentropy, grads);
  Result r;
  r.logprob = values(lp);
  if (keep_entropy) r.entropy = values(ent);
  for (const NamedTensor& s : grads.storage()) r.grads.push_back(values(s.tensor));
  return r;
}

// Not bitwise: the sums a rank splits (dot products over heads and MLP columns, the vocabulary's
// log-sum-exp, the all-reduces adding the ranks' parts) are reordered, so each value carries a
// few more f32 roundings (6e-8 relative each) of terms up to the tensor's largest, through two
// layers and back. Bound: 1e-5 of the tensor's largest |value| (measured: at most 2.4e-6); a
// missing or doubled rank's part is off by a sizeable fraction of it.
constexpr double kTolerance = 1e-5;

double max_abs_of(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

void check_close(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0;
  for (size_t i = 0; i < got.size(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
  INFO("max difference " << diff << ", largest value " << max_abs_of(want));
  CHECK(diff <= kTolerance * max_abs_of(want) + 1e-30);
}

// Per row weights of the loss sum_t dlogprob_t logprob_t + dentropy_t entropy_t.
Tensor row_weights(int64_t T, uint64_t seed) {
  return test::random_tensor({T}, DType::f32, seed, -1.0, 1.0);
}

// What a rank's group did in one forward and backward of the batch: tp_training_collectives'
// all-reduces and all-gathers, nothing else.
void check_collectives(const CallStats& calls, const ModelConfig& c, const PackedBatch& batch,
                       int tp, bool recompute) {
  const int64_t T = batch.num_tokens();
  const int64_t R = batch.head_rows.empty() ? T : static_cast<int64_t>(batch.head_rows.size());
  const TpCollectives want = tp_training_collectives(c, T, R, tp, recompute);
  REQUIRE(calls.by_call.count("all_reduce") == 1);
  const CallStats::Tally reduces = calls.by_call.at("all_reduce");
  CHECK(reduces.calls == want.reduce_calls);
  CHECK(reduces.bytes == want.reduce_bytes);
  REQUIRE(calls.by_call.count("all_gather") == 1);
  const CallStats::Tally gathers = calls.by_call.at("all_gather");
  CHECK(gathers.calls == want.gather_calls);
  CHECK(gathers.bytes == want.gather_bytes);
  CHECK(calls.by_call.size() == 2);
}

// The decoder options of a rank of tp training the model of `full`.
DecoderOptions tp_options(const ModelConfig& full, Communicator& comm, bool recompute = false) {
  DecoderOptions o;
  o.max_tokens = 16;  // grows
  o.recompute = recompute;
  o.tp_group = &comm;
  o.tp_kv_heads = full.num_kv_heads;
  return o;
}

}  // namespace

TEST_CASE(
    "tensor-parallel training on 2 and 3 ranks gives the whole model's logprobs and "
    "gradient shards",
    "[unit]") {
  const float temperature = 0.8f;
  for (const Case& k : kCases) {
    const ModelConfig c = tp_config(k.kind, k.H, k.Hkv);
    INFO(test::tiny_kind_name(k.kind) << ", H " << k.H << ", Hkv " << k.Hkv << ", tp " << k.tp);
    Weights full(c, DType::f32);
    test::fill_random_weights(full, 40 + static_cast<uint64_t>(k.kind));
    const std::vector<PackedBatch> batches = {prompt_batch(c.vocab_size, 50),
                                              all_rows(prompt_batch(c.vocab_size, 50))};
    const int64_t T = batches[0].num_tokens();
    const Tensor dl = row_weights(T, 60), de = row_weights(T, 61);

    // The whole model on one rank, and its gradients cut as each rank's shard.
    std::vector<Result> want;
    std::vector<std::vector<std::unique_ptr<Weights>>> want_shards;
    Decoder whole(full, {.max_tokens = 16});
    for (const PackedBatch& batch : batches) {
      want.push_back(train_step(whole, c, batch, dl, de, temperature));
      Weights g(c, DType::f32);
      for (size_t i = 0; i < g.storage().size(); ++i)
        std::copy(want.back().grads[i].begin(), want.back().grads[i].end(),
                  g.storage()[i].tensor.data_as<float>());
      std::vector<std::unique_ptr<Weights>> shards;
      for (int r = 0; r < k.tp; ++r) shards.push_back(cut_tp_shard(g, r, k.tp));
      want_shards.push_back(std::move(shards));
    }

    std::vector<std::vector<Result>> got(static_cast<size_t>(k.tp));
    std::vector<std::vector<CallStats>> calls(static_cast<size_t>(k.tp));
    const test::TempDir tmp("decoder-tp-train");
    test::on_ranks(k.tp, tmp.file("store"), [&](int r, Communicator& comm) {
      const std::unique_ptr<Weights> shard = cut_tp_shard(full, r, k.tp);
      Decoder dec(*shard, tp_options(c, comm));
      for (const PackedBatch& batch : batches) {
        CallStats& counted = calls[static_cast<size_t>(r)].emplace_back();
        comm.set_call_stats(&counted);
        got[static_cast<size_t>(r)].push_back(
            train_step(dec, shard->config(), batch, dl, de, temperature));
        comm.set_call_stats(nullptr);
      }
    });

    for (size_t b = 0; b < batches.size(); ++b) {
      INFO((b == 0 ? "head rows of shared prompts" : "every row"));
      for (int r = 0; r < k.tp; ++r) {
        INFO("rank " << r);
        const Result& g = got[static_cast<size_t>(r)][b];
        check_collectives(calls[static_cast<size_t>(r)][b], c, batches[b], k.tp, false);
        REQUIRE(g.grads.size() == want_shards[b][static_cast<size_t>(r)]->storage().size());
        check_close(g.logprob, want[b].logprob);
        check_close(g.entropy, want[b].entropy);
        // Every rank the same bits: each sum over the group is made once and shared.
        CHECK(same_bits(g.logprob, got[0][b].logprob));
        CHECK(same_bits(g.entropy, got[0][b].entropy));
        const Weights& shard = *want_shards[b][static_cast<size_t>(r)];
        for (size_t i = 0; i < g.grads.size(); ++i) {
          const NamedTensor& s = shard.storage()[i];
          INFO(s.name);
          check_close(g.grads[i], values(s.tensor));
        }
        // Replicated parameters (the norms) get the same gradient bits on every rank.
        for (size_t i = 0; i < g.grads.size(); ++i) {
          const std::string& name = shard.storage()[i].name;
          if (name.find("norm") == std::string::npos) continue;
          INFO(name);
          CHECK(same_bits(g.grads[i], got[0][b].grads[i]));
        }
      }
    }
  }
}

TEST_CASE("tensor-parallel score gives forward's bits and recompute the same bits and hook calls",
          "[unit]") {
  using Recorder = test::UnitCallRecorder;
  const float temperature = 0.9f;
  for (const Case& k : {Case{Kind::qwen3, 12, 6, 2}, Case{Kind::qwen2, 6, 6, 3}}) {
    const ModelConfig c = tp_config(k.kind, k.H, k.Hkv);
    INFO(test::tiny_kind_name(k.kind) << ", tp " << k.tp);
    Weights full(c, DType::f32);
    test::fill_random_weights(full, 70 + static_cast<uint64_t>(k.kind));
    const std::vector<PackedBatch> batches = {prompt_batch(c.vocab_size, 80),
                                              all_rows(prompt_batch(c.vocab_size, 80))};
    const int64_t T = batches[0].num_tokens();
    const Tensor dl = row_weights(T, 90), de = row_weights(T, 91);

    Recorder whole_calls;
    {
      Decoder whole(full, {.max_tokens = 16, .unit_hooks = &whole_calls});
      train_step(whole, c, batches[0], dl, de, temperature);
    }

    struct RankOut {
      std::vector<Result> plain, recomputed;
      std::vector<std::vector<float>> scored, chunked;  // logprob then entropy, per batch
      std::vector<std::string> calls;
      std::vector<CallStats> recompute_calls;  // per batch
    };
    std::vector<RankOut> out(static_cast<size_t>(k.tp));
    const test::TempDir tmp("decoder-tp-score");
    test::on_ranks(k.tp, tmp.file("store"), [&](int r, Communicator& comm) {
      RankOut& o = out[static_cast<size_t>(r)];
      const std::unique_ptr<Weights> shard = cut_tp_shard(full, r, k.tp);
      const ModelConfig& sc = shard->config();
      Decoder plain(*shard, tp_options(c, comm));
      Decoder recompute(*shard, tp_options(c, comm, true));
      DecoderOptions chunks = tp_options(c, comm);
      chunks.score_rows = 5;
      Decoder chunked(*shard, chunks);
      for (const PackedBatch& batch : batches) {
        o.plain.push_back(train_step(plain, sc, batch, dl, de, temperature));
        // Without entropy_out: backward's entropy term still has the forward's entropies.
        comm.set_call_stats(&o.recompute_calls.emplace_back());
        o.recomputed.push_back(train_step(recompute, sc, batch, dl, de, temperature, false));
        comm.set_call_stats(nullptr);
        Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
        plain.score(batch, lp, ent, temperature);
        o.scored.push_back(values(lp));
        o.scored.push_back(values(ent));
        chunked.score(batch, lp, ent, temperature);
        o.chunked.push_back(values(lp));
        o.chunked.push_back(values(ent));
      }
      Recorder calls;
      DecoderOptions hooked = tp_options(c, comm);
      hooked.unit_hooks = &calls;
      Decoder with_hooks(*shard, hooked);
      train_step(with_hooks, sc, batches[0], dl, de, temperature);
      o.calls = calls.calls;
    });

    for (int r = 0; r < k.tp; ++r) {
      INFO("rank " << r);
      const RankOut& o = out[static_cast<size_t>(r)];
      for (size_t b = 0; b < batches.size(); ++b) {
        INFO((b == 0 ? "head rows of shared prompts" : "every row"));
        const Result &p = o.plain[b], &q = o.recomputed[b];
        // score's chunk of score_rows = 256 rows is forward's head rows: the same sums.
        CHECK(same_bits(o.scored[2 * b], p.logprob));
        CHECK(same_bits(o.scored[2 * b + 1], p.entropy));
        // Chunks of 5 rows: the head's statistics are gathered and added in rank order whatever
        // the rows beside them (kernels/vocab_shards.h), so the same bits too.
        CHECK(same_bits(o.chunked[2 * b], p.logprob));
        CHECK(same_bits(o.chunked[2 * b + 1], p.entropy));
        CHECK(same_bits(q.logprob, p.logprob));
        check_collectives(o.recompute_calls[b], c, batches[b], k.tp, true);
        for (size_t i = 0; i < p.grads.size(); ++i) {
          INFO("gradient storage " << i);
          CHECK(same_bits(q.grads[i], p.grads[i]));
        }
      }
      CHECK(o.calls == whole_calls.calls);
    }
  }
}

TEST_CASE("a tensor-parallel group of one rank trains with the plain decoder's bits", "[unit]") {
  const ModelConfig c = tp_config(Kind::qwen3, 12, 6);
  Weights w(c, DType::f32);
  test::fill_random_weights(w, 100);
  const std::vector<PackedBatch> batches = {prompt_batch(c.vocab_size, 110),
                                            all_rows(prompt_batch(c.vocab_size, 110))};
  const int64_t T = batches[0].num_tokens();
  const Tensor dl = row_weights(T, 120), de = row_weights(T, 121);
  std::vector<Result> want, got;
  Decoder plain(w, {.max_tokens = 16});
  for (const PackedBatch& batch : batches)
    want.push_back(train_step(plain, c, batch, dl, de, 0.7f));
  const test::TempDir tmp("decoder-tp-one");
  test::on_ranks(1, tmp.file("store"), [&](int, Communicator& comm) {
    Decoder dec(w, {.max_tokens = 16, .tp_group = &comm});
    CHECK(dec.vocab_size() == c.vocab_size);
    for (const PackedBatch& batch : batches) got.push_back(train_step(dec, c, batch, dl, de, 0.7f));
  });
  REQUIRE(got.size() == want.size());
  for (size_t b = 0; b < want.size(); ++b) {
    CHECK(same_bits(got[b].logprob, want[b].logprob));
    CHECK(same_bits(got[b].entropy, want[b].entropy));
    REQUIRE(got[b].grads.size() == want[b].grads.size());
    for (size_t i = 0; i < want[b].grads.size(); ++i)
      CHECK(same_bits(got[b].grads[i], want[b].grads[i]));
  }
}

TEST_CASE("tensor-parallel training refuses KV heads replicated over ranks naming the sizes",
          "[unit]") {
  // Hkv = 2 at tp = 4: each KV head on 2 ranks, every shard one KV head. Scoring (a forward
  // only) serves it and matches the whole model.
  const ModelConfig c = tp_config(Kind::llama_tied, 4, 2);
  Weights full(c, DType::f32);
  test::fill_random_weights(full, 130);
  const PackedBatch batch = prompt_batch(c.vocab_size, 140);
  const int64_t T = batch.num_tokens();
  Decoder whole(full, {.max_tokens = 16});
  Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
  whole.forward(batch, lp, ent);
  const std::vector<float> want_lp = values(lp), want_ent = values(ent);

  const int tp = 4;
  struct RankOut {
    std::string replicated, unknown, wrong;
    std::vector<float> lp, ent;
  };
  std::vector<RankOut> out(tp);
  const test::TempDir tmp("decoder-tp-refuse");
  test::on_ranks(tp, tmp.file("store"), [&](int r, Communicator& comm) {
    RankOut& o = out[static_cast<size_t>(r)];
    const std::unique_ptr<Weights> shard = cut_tp_shard(full, r, tp);
    auto forward_error = [&](int64_t kv_heads) {
      DecoderOptions opt = tp_options(c, comm);
      opt.tp_kv_heads = kv_heads;
      Decoder dec(*shard, opt);
      Tensor l = Tensor::empty({T}, DType::f32);
      try {
        dec.forward(batch, l, Tensor());
      } catch (const Error& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    o.replicated = forward_error(2);
    o.unknown = forward_error(0);
    o.wrong = forward_error(3);
    Decoder dec(*shard, tp_options(c, comm));
    Tensor l = Tensor::empty({T}, DType::f32), e = Tensor::empty({T}, DType::f32);
    dec.score(batch, l, e);
    o.lp = values(l);
    o.ent = values(e);
  });
  for (const RankOut& o : out) {
    CHECK_THAT(o.replicated, Catch::Contains("num_key_value_heads = 2 is less than the "
                                             "tensor-parallel size 4: each KV head is replicated "
                                             "on 2 ranks"));
    CHECK_THAT(o.unknown, Catch::Contains("set DecoderOptions::tp_kv_heads"));
    CHECK_THAT(o.wrong, Catch::Contains("tp_kv_heads = 3 does not fit a shard of 1 KV heads at "
                                        "the tensor-parallel size 4"));
    check_close(o.lp, want_lp);
    check_close(o.ent, want_ent);
  }
}

}  // namespace tandem::model
