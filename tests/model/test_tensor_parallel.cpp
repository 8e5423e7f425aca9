// Tests of model/tensor_parallel: each rank's shard holds exactly its heads, MLP columns and
// vocabulary rows of the full weights (KV heads split or replicated), and sizes that do not divide
// the model are refused naming the parameter and the sizes.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "model/tensor_parallel.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace tandem::model {
namespace {

ModelConfig config_with(int64_t H, int64_t Hkv, int64_t F, int64_t V, bool tied, bool bias,
                        bool qk_norm) {
  ModelConfig c;
  c.vocab_size = V;
  c.hidden_size = 32;
  c.intermediate_size = F;
  c.num_layers = 2;
  c.num_heads = H;
  c.num_kv_heads = Hkv;
  c.head_dim = 8;
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  c.qk_norm = qk_norm;
  return c;
}

ModelConfig smollm2_shape() {
  ModelConfig c = config_with(9, 3, 1536, 49152, true, false, false);
  c.hidden_size = 576;
  c.head_dim = 64;
  c.num_layers = 30;
  return c;
}

std::vector<double> values(const Tensor& t) { return test::to_f64(t); }

// Columns [c0, c0 + n) of a (rows, N) tensor, row after row.
std::vector<double> columns(const Tensor& t, int64_t c0, int64_t n) {
  const std::vector<double> v = test::to_f64(t);
  const int64_t N = t.size(1);
  std::vector<double> out;
  for (int64_t r = 0; r < t.size(0); ++r)
    out.insert(out.end(), v.begin() + r * N + c0, v.begin() + r * N + c0 + n);
  return out;
}

void check_shard(const Weights& full, const Weights& w, const TpSplit& s) {
  const ModelConfig& c = full.config();
  const int64_t D = c.head_dim;
  const int64_t q0 = s.q_head0 * D, nq = s.num_q_heads * D;
  const int64_t k0 = s.kv_head0 * D, nk = s.num_kv_heads * D;
  CHECK(w.config().num_heads * s.size == c.num_heads);
  CHECK(w.config().vocab_size * s.size == c.vocab_size);
  CHECK(values(w.embed) == values(full.embed.narrow(s.vocab0, s.num_vocab)));
  CHECK(values(w.lm_head) == values(full.lm_head.narrow(s.vocab0, s.num_vocab)));
  CHECK(values(w.final_norm) == values(full.final_norm));
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights &a = w.layers[l], &b = full.layers[l];
    CHECK(values(a.input_norm) == values(b.input_norm));
    CHECK(values(a.post_norm) == values(b.post_norm));
    CHECK(values(a.q) == values(b.q.narrow(q0, nq)));
    CHECK(values(a.k) == values(b.k.narrow(k0, nk)));
    CHECK(values(a.v) == values(b.v.narrow(k0, nk)));
    if (c.attention_bias) {
      CHECK(values(a.q_bias) == values(b.q_bias.narrow(q0, nq)));
      CHECK(values(a.k_bias) == values(b.k_bias.narrow(k0, nk)));
      CHECK(values(a.v_bias) == values(b.v_bias.narrow(k0, nk)));
    }
    if (c.qk_norm) {
      CHECK(values(a.q_norm) == values(b.q_norm));
      CHECK(values(a.k_norm) == values(b.k_norm));
    }
    CHECK(values(a.o) == columns(b.o, q0, nq));
    CHECK(values(a.gate) == values(b.gate.narrow(s.f0, s.num_f)));
    CHECK(values(a.up) == values(b.up.narrow(s.f0, s.num_f)));
    CHECK(values(a.down) == columns(b.down, s.f0, s.num_f));
  }
}

TEST_CASE("tensor-parallel shards hold their heads MLP columns and vocabulary rows", "[unit]") {
  struct Case {
    ModelConfig c;
    std::vector<int> sizes;
  };
  const std::vector<Case> cases = {
      {config_with(4, 2, 24, 40, false, false, false), {1, 2, 4}},  // KV split at 2, shared at 4
      {config_with(4, 1, 24, 40, true, true, false), {2, 4}},       // one KV head, biases, tied
      {config_with(8, 4, 24, 40, false, false, true), {2, 4, 8}},   // q/k norms
  };
  for (const Case& k : cases) {
    Weights full(k.c, DType::f32);
    test::fill_random_weights(full, 5);
    for (int size : k.sizes) {
      std::vector<int64_t> q_heads, kv_heads;
      for (int rank = 0; rank < size; ++rank) {
        INFO("H " << k.c.num_heads << " Hkv " << k.c.num_kv_heads << " rank " << rank << " of "
                  << size);
        const TpSplit s = tp_split(k.c, rank, size);
        const auto shard = cut_tp_shard(full, rank, size);
        CHECK(shard->config().num_kv_heads == s.num_kv_heads);
        check_shard(full, *shard, s);
        for (int64_t h = 0; h < s.num_q_heads; ++h) q_heads.push_back(s.q_head0 + h);
        for (int64_t h = 0; h < s.num_kv_heads; ++h) kv_heads.push_back(s.kv_head0 + h);
        // Every query head of the rank uses one of the rank's KV heads (GQA groups stay whole).
        const int64_t group = k.c.num_heads / k.c.num_kv_heads;
        CHECK(s.q_head0 / group >= s.kv_head0);
        CHECK((s.q_head0 + s.num_q_heads - 1) / group < s.kv_head0 + s.num_kv_heads);
      }
      // The query heads are split: each once, in order. KV heads: each once when split, each on
      // size / Hkv consecutive ranks when replicated.
      std::vector<int64_t> all_q(static_cast<size_t>(k.c.num_heads));
      for (size_t h = 0; h < all_q.size(); ++h) all_q[h] = static_cast<int64_t>(h);
      CHECK(q_heads == all_q);
      std::vector<int64_t> expect_kv;
      for (int64_t h = 0; h < k.c.num_kv_heads; ++h)
        for (int64_t i = 0; i < std::max<int64_t>(1, size / k.c.num_kv_heads); ++i)
          expect_kv.push_back(h);
      CHECK(kv_heads == expect_kv);
    }
  }
}

TEST_CASE("tensor-parallel slices describe each rank's tensor of every parameter", "[unit]") {
  for (const bool tied : {false, true}) {
    ModelConfig c = config_with(4, 2, 24, 40, tied, true, true);
    Weights full(c, DType::f32);
    for (const int size : {2, 4}) {
      for (int rank = 0; rank < size; ++rank) {
        const TpSplit split = tp_split(c, rank, size);
        Weights shard(tp_shard_config(c, size), DType::f32);
        REQUIRE(shard.named().size() == full.named().size());
        for (size_t i = 0; i < full.named().size(); ++i) {
          const NamedTensor &f = full.named()[i], &w = shard.named()[i];
          INFO(f.name << " rank " << rank << " of " << size);
          CHECK(w.name == f.name);
          const TpSlice s = tp_slice(c, split, f.name);
          if (s.dim == -1) {
            CHECK(w.tensor.shape() == f.tensor.shape());
            CHECK(s.length == f.tensor.size(0));
          } else {
            CHECK(w.tensor.size(s.dim) == s.length);
            CHECK(s.begin + s.length <= f.tensor.size(s.dim));
            CHECK(w.tensor.ndim() == f.tensor.ndim());
            if (f.tensor.ndim() == 2) CHECK(w.tensor.size(1 - s.dim) == f.tensor.size(1 - s.dim));
          }
        }
      }
    }
  }
  CHECK_THROWS_WITH(tp_slice(config_with(4, 2, 24, 40, false, false, false),
                             tp_split(config_with(4, 2, 24, 40, false, false, false), 0, 2),
                             "model.layers.0.self_attn.qkv_proj.weight"),
                    Catch::Contains("'model.layers.0.self_attn.qkv_proj.weight' is not a "
                                    "parameter"));
}

TEST_CASE("tensor-parallel split names the parameter and sizes that do not divide", "[unit]") {
  // SmolLM2-135M: 9 query heads and 3 KV heads; 3 ranks divide it, 2 do not.
  const ModelConfig smol = smollm2_shape();
  CHECK_THROWS_WITH(tp_split(smol, 0, 2),
                    Catch::Contains("num_attention_heads = 9 is not divisible by the "
                                    "tensor-parallel size 2") &&
                        Catch::Contains("1, 3 or 9"));
  const ModelConfig s3 = tp_shard_config(smol, 3);
  CHECK(s3.num_heads == 3);
  CHECK(s3.num_kv_heads == 1);
  CHECK(s3.intermediate_size == 512);
  CHECK(s3.vocab_size == 16384);
  CHECK(tp_split(smol, 2, 3).vocab0 == 32768);
  CHECK_THROWS_WITH(tp_split(config_with(12, 4, 24, 48, false, false, false), 0, 3),
                    Catch::Contains("num_key_value_heads = 4 and the tensor-parallel size 3"));
  CHECK_THROWS_WITH(tp_split(config_with(4, 2, 90, 48, false, false, false), 0, 4),
                    Catch::Contains("intermediate_size = 90 is not divisible by the "
                                    "tensor-parallel size 4"));
  CHECK_THROWS_WITH(tp_split(config_with(4, 2, 24, 101, false, false, false), 1, 2),
                    Catch::Contains("vocab_size = 101 is not divisible by the tensor-parallel "
                                    "size 2") &&
                        Catch::Contains("(1 of the sizes up to 64)"));
  CHECK_THROWS_WITH(tp_split(smol, 3, 3), Catch::Contains("rank 3 of a group of 3"));
}

}  // namespace
}  // namespace tandem::model
