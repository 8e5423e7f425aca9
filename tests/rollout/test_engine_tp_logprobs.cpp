// A tensor-parallel engine's logprobs against the tensor-parallel trainer's, ranks as threads: on
// 2 and 3 ranks (vocabulary, heads and MLP split) the logprob the rollout reports for each sampled
// token is, bit for bit, the one the decoder's training forward and score compute for it under the
// same weights and temperature (the row statistics over vocabulary shards have one definition,
// kernels/vocab_shards.h; the layers' sums add the ranks' parts in rank order, Net::tp_sum).
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/decoder.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "rollout/engine.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"

namespace tandem::rollout {
namespace {

std::vector<int32_t> random_prompt(int n, int64_t V, uint64_t seed) {
  const Tensor ids = test::random_ints({n}, DType::i32, seed, 0, V);
  return std::vector<int32_t>(ids.data_as<int32_t>(), ids.data_as<int32_t>() + n);
}

// Plain, top-k, top-p and min-p rows at the trainer's temperature; groups share a prompt.
std::vector<Request> requests(int64_t V, float temperature) {
  std::vector<Request> rs;
  const auto add = [&](const std::string& id, int prompt, int n, uint64_t seed, int max_tokens) {
    Request r{id, random_prompt(prompt, V, seed), {}};
    r.params.n = n;
    r.params.seed = seed;
    r.params.max_tokens = max_tokens;
    r.params.temperature = temperature;
    rs.push_back(std::move(r));
  };
  add("plain", 5, 3, 31, 24);
  add("top-k", 11, 3, 32, 20);
  add("top-p", 3, 2, 33, 24);
  add("min-p", 8, 3, 34, 20);
  rs[1].params.top_k = 20;
  rs[2].params.top_p = 0.9f;
  rs[3].params.min_p = 0.05f;
  return rs;
}

}  // namespace

TEST_CASE("tensor-parallel rollout logprobs equal the tensor-parallel trainer's bitwise",
          "[unit]") {
  const float temperature = 0.7f;
  // At 3 ranks a library all-reduce (Gloo's ring adds an element's parts in an order set by its
  // place in the buffer) made decode's few rows and the training forward's many differ in the
  // hidden state itself: 6 of 240 logprobs, by up to 2.5e-5. 2 ranks add two parts, an order-free
  // sum, either way.
  for (const auto& [tp, dtype] : {std::pair{2, DType::f32}, std::pair{2, DType::bf16},
                                  std::pair{3, DType::f32}, std::pair{3, DType::bf16}}) {
    INFO("tp " << tp << ", weights " << dtype_name(dtype));
    // V = 96, F = 96 and 6 heads (KV heads too) split over 2 or 3 ranks.
    model::ModelConfig c = test::tiny_model_config(test::TinyKind::llama_tied);
    c.vocab_size = 96;
    c.intermediate_size = 96;
    c.num_heads = 6;
    c.num_kv_heads = 6;
    c.head_dim = 8;
    model::Weights full(c, dtype);
    test::fill_random_weights(full, dtype == DType::f32 ? 500 : 501);
    const std::vector<Request> rs = requests(c.vocab_size, temperature);

    struct RankOut {
      int64_t compared = 0, forward_equal = 0, score_equal = 0;
    };
    std::vector<RankOut> out(static_cast<size_t>(tp));
    const test::TempDir tmp("engine-tp-logprobs");
    test::on_ranks(tp, tmp.file("store"), [&](int r, Communicator& comm) {
      const std::unique_ptr<model::Weights> shard = model::cut_tp_shard(full, r, tp);
      EngineOptions o;
      o.block_size = 4;
      o.num_blocks = 256;
      o.max_batch_tokens = 10;  // the 11-token prompt is prefilled in chunks
      o.max_seqs = 16;
      o.max_context = 64;
      std::vector<RequestOutput> outs;
      {
        Engine engine(*shard, o, nullptr, &comm);
        outs = engine.generate(rs);
      }

      std::vector<std::vector<int32_t>> seqs;
      std::vector<std::pair<size_t, size_t>> who;
      for (size_t q = 0; q < outs.size(); ++q) {
        REQUIRE(outs[q].status == RequestStatus::done);
        for (size_t i = 0; i < outs[q].samples.size(); ++i) {
          std::vector<int32_t> seq = rs[q].prompt;
          const std::vector<int32_t>& tokens = outs[q].samples[i].tokens;
          seq.insert(seq.end(), tokens.begin(), tokens.end());
          seqs.push_back(seq);
          who.emplace_back(q, i);
        }
      }
      model::DecoderOptions d;
      d.max_tokens = 256;
      d.tp_group = &comm;
      d.tp_kv_heads = c.num_kv_heads;
      model::Decoder dec(*shard, d);
      const model::PackedBatch batch = model::PackedBatch::from_sequences(seqs);
      const int64_t T = batch.num_tokens();
      Tensor forward_lp = Tensor::empty({T}, DType::f32), score_lp = Tensor::empty({T}, DType::f32);
      dec.forward(batch, forward_lp, Tensor(), temperature);
      dec.score(batch, score_lp, Tensor(), temperature);

      RankOut& ro = out[static_cast<size_t>(r)];
      for (size_t b = 0; b < seqs.size(); ++b) {
        const auto [q, i] = who[b];
        const SampleOutput& s = outs[q].samples[i];
        const int64_t n = static_cast<int64_t>(rs[q].prompt.size());
        REQUIRE(s.logprobs.size() == s.tokens.size());
        for (size_t t = 0; t < s.tokens.size(); ++t) {
          const int64_t row = batch.row_of(static_cast<int64_t>(b), n + static_cast<int64_t>(t));
          ro.forward_equal +=
              std::memcmp(&s.logprobs[t], forward_lp.data_as<float>() + row, 4) == 0 ? 1 : 0;
          ro.score_equal +=
              std::memcmp(&s.logprobs[t], score_lp.data_as<float>() + row, 4) == 0 ? 1 : 0;
          ++ro.compared;
        }
      }
    });
    for (int r = 0; r < tp; ++r) {
      INFO("rank " << r);
      const RankOut& ro = out[static_cast<size_t>(r)];
      CHECK(ro.compared == 3 * 24 + 3 * 20 + 2 * 24 + 3 * 20);
      CHECK(ro.forward_equal == ro.compared);  // bitwise
      CHECK(ro.score_equal == ro.compared);
    }
  }
}

}  // namespace tandem::rollout
