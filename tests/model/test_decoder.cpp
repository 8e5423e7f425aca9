// Tests of model/decoder: the forward against a plain f64 reference, gradients by finite
// differences, packing and recompute invariance, and prefill/decode through a paged KV cache
// giving bitwise the training forward's logprobs; on CUDA, the same against the CPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <numeric>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace tandem::model {
namespace {

using test::to_f64;

using Kind = test::TinyKind;
const char* kind_name(Kind k) { return test::tiny_kind_name(k); }
ModelConfig tiny_config(Kind kind) { return test::tiny_model_config(kind); }
void fill_random(Weights& w, uint64_t seed) { test::fill_random_weights(w, seed); }

// ---------------------------------------------------------------------------------------------
// The reference: the HF network written out with plain loops in f64, one whole sequence.

struct RefWeights {
  explicit RefWeights(const Weights& w) : c(w.config()) {
    auto get = [&](const std::string& name) { return to_f64(w.at(name)); };
    embed = get("model.embed_tokens.weight");
    final_norm = get("model.norm.weight");
    lm_head = c.tie_word_embeddings ? embed : get("lm_head.weight");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string p = hf_layer_prefix(l);
      Layer L;
      L.in_norm = get(p + "input_layernorm.weight");
      L.post_norm = get(p + "post_attention_layernorm.weight");
      L.q = get(p + "self_attn.q_proj.weight");
      L.k = get(p + "self_attn.k_proj.weight");
      L.v = get(p + "self_attn.v_proj.weight");
      L.o = get(p + "self_attn.o_proj.weight");
      if (c.attention_bias) {
        L.bq = get(p + "self_attn.q_proj.bias");
        L.bk = get(p + "self_attn.k_proj.bias");
        L.bv = get(p + "self_attn.v_proj.bias");
      }
      if (c.qk_norm) {
        L.qn = get(p + "self_attn.q_norm.weight");
        L.kn = get(p + "self_attn.k_norm.weight");
      }
      L.gate = get(p + "mlp.gate_proj.weight");
      L.up = get(p + "mlp.up_proj.weight");
      L.down = get(p + "mlp.down_proj.weight");
      layers.push_back(std::move(L));
    }
  }
  struct Layer {
    std::vector<double> in_norm, post_norm, q, k, v, o, bq, bk, bv, qn, kn, gate, up, down;
  };
  ModelConfig c;
  std::vector<double> embed, final_norm, lm_head;
  std::vector<Layer> layers;
};

using Mat = std::vector<std::vector<double>>;

// y (n, N) = x (n, K) · w (N, K)^T [+ b]
Mat linear(const Mat& x, const std::vector<double>& w, int64_t N, const std::vector<double>& b) {
  const size_t K = x[0].size();
  Mat y(x.size(), std::vector<double>(static_cast<size_t>(N)));
  for (size_t t = 0; t < x.size(); ++t)
    for (size_t i = 0; i < static_cast<size_t>(N); ++i) {
      double s = b.empty() ? 0.0 : b[i];
      for (size_t k = 0; k < K; ++k) s += x[t][k] * w[i * K + k];
      y[t][i] = s;
    }
  return y;
}

// RMSNorm of each group of `width` values of each row.
Mat rmsnorm_ref(const Mat& x, const std::vector<double>& w, double eps) {
  const size_t width = w.size();
  Mat y = x;
  for (auto& row : y)
    for (size_t g = 0; g < row.size(); g += width) {
      double ss = 0;
      for (size_t i = 0; i < width; ++i) ss += row[g + i] * row[g + i];
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(width) + static_cast<double>(eps));
      for (size_t i = 0; i < width; ++i) row[g + i] = row[g + i] * r * w[i];
    }
  return y;
}

std::vector<double> rope_inv_freq_ref(const ModelConfig& c) {
  const int64_t D = c.head_dim;
  std::vector<double> f(static_cast<size_t>(D / 2));
  const ops::RopeParams& p = c.rope;
  for (int64_t i = 0; i < D / 2; ++i) {
    double inv = std::pow(static_cast<double>(p.theta), -2.0 * static_cast<double>(i) / D);
    if (p.factor != 0.0f) {  // HF _compute_llama3_parameters
      const double orig = static_cast<double>(p.original_max_position);
      const double low_wl = orig / p.low_freq_factor, high_wl = orig / p.high_freq_factor;
      const double wl = 2 * std::numbers::pi / inv;
      if (wl > low_wl) {
        inv = inv / p.factor;
      } else if (wl >= high_wl) {
        const double smooth =
            (orig / wl - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
        inv = (1 - smooth) * inv / p.factor + smooth * inv;
      }
    }
    f[static_cast<size_t>(i)] = inv;
  }
  return f;
}

void rope_ref(Mat& x, int64_t D, const std::vector<double>& inv_freq) {
  for (size_t t = 0; t < x.size(); ++t)
    for (size_t h = 0; h < x[t].size(); h += static_cast<size_t>(D))
      for (int64_t i = 0; i < D / 2; ++i) {
        const double a = static_cast<double>(t) * inv_freq[static_cast<size_t>(i)];
        double& x1 = x[t][h + static_cast<size_t>(i)];
        double& x2 = x[t][h + static_cast<size_t>(i + D / 2)];
        const double r1 = x1 * std::cos(a) - x2 * std::sin(a);
        const double r2 = x2 * std::cos(a) + x1 * std::sin(a);
        x1 = r1, x2 = r2;
      }
}

// Logits (n, V) of one whole sequence.
Mat reference_logits(const RefWeights& w, const std::vector<int32_t>& seq) {
  const ModelConfig& c = w.c;
  const int64_t C = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t F = c.intermediate_size, V = c.vocab_size;
  const size_t n = seq.size();
  const double eps = c.rms_norm_eps;
  const std::vector<double> inv_freq = rope_inv_freq_ref(c);
  Mat h(n, std::vector<double>(static_cast<size_t>(C)));
  for (size_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < C; ++i)
      h[t][static_cast<size_t>(i)] = w.embed[static_cast<size_t>(seq[t] * C + i)];
  for (const RefWeights::Layer& L : w.layers) {
    const Mat x = rmsnorm_ref(h, L.in_norm, eps);
    Mat q = linear(x, L.q, H * D, L.bq), k = linear(x, L.k, Hkv * D, L.bk);
    const Mat v = linear(x, L.v, Hkv * D, L.bv);
    if (c.qk_norm) {
      q = rmsnorm_ref(q, L.qn, eps);
      k = rmsnorm_ref(k, L.kn, eps);
    }
    rope_ref(q, D, inv_freq);
    rope_ref(k, D, inv_freq);
    Mat att(n, std::vector<double>(static_cast<size_t>(H * D), 0.0));
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    for (size_t t = 0; t < n; ++t)
      for (int64_t hq = 0; hq < H; ++hq) {
        const size_t qo = static_cast<size_t>(hq * D), ko = static_cast<size_t>(hq / (H / Hkv) * D);
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (size_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i)
            d += q[t][qo + static_cast<size_t>(i)] * k[j][ko + static_cast<size_t>(i)];
          s[j] = d * scale;
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (size_t j = 0; j <= t; ++j)
          for (int64_t i = 0; i < D; ++i)
            att[t][qo + static_cast<size_t>(i)] += s[j] / z * v[j][ko + static_cast<size_t>(i)];
      }
    const Mat o = linear(att, L.o, C, {});
    for (size_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < C; ++i) h[t][static_cast<size_t>(i)] += o[t][static_cast<size_t>(i)];
    const Mat x2 = rmsnorm_ref(h, L.post_norm, eps);
    const Mat g = linear(x2, L.gate, F, {}), u = linear(x2, L.up, F, {});
    Mat a(n, std::vector<double>(static_cast<size_t>(F)));
    for (size_t t = 0; t < n; ++t)
      for (size_t i = 0; i < static_cast<size_t>(F); ++i)
        a[t][i] = g[t][i] / (1 + std::exp(-g[t][i])) * u[t][i];
    const Mat d = linear(a, L.down, C, {});
    for (size_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < C; ++i) h[t][static_cast<size_t>(i)] += d[t][static_cast<size_t>(i)];
  }
  return linear(rmsnorm_ref(h, w.final_norm, eps), w.lm_head, V, {});
}

// ---------------------------------------------------------------------------------------------

const std::vector<Kind> kAllKinds = {Kind::llama_tied, Kind::llama_untied_rope3, Kind::qwen2,
                                     Kind::qwen3};

TEST_CASE("decoder forward matches a plain f64 reference for every architecture", "[unit]") {
  for (Kind kind : kAllKinds) {
    // bf16 weights: the reference reads the same rounded values, the CPU widens them exactly.
    const DType dtype = kind == Kind::qwen2 ? DType::bf16 : DType::f32;
    INFO(kind_name(kind) << " " << dtype_name(dtype));
    const ModelConfig c = tiny_config(kind);
    Weights w(c, dtype);
    fill_random(w, 100 + static_cast<uint64_t>(kind));
    Decoder dec(w, {.max_tokens = 64});
    const auto seqs = test::random_sequences({9, 21}, c.vocab_size, 5);
    const PackedBatch batch = PackedBatch::from_sequences(seqs);
    const int64_t T = batch.num_tokens(), V = c.vocab_size;
    Tensor logits = Tensor::empty({T, V}, DType::f32);
    dec.forward_logits(batch, logits);
    Tensor logprob = Tensor::empty({T}, DType::f32), entropy = Tensor::empty({T}, DType::f32);
    const float temperature = 0.8f;
    dec.forward(batch, logprob, entropy, temperature);
    const std::vector<double> got = to_f64(logits), lp = to_f64(logprob), ent = to_f64(entropy);

    const RefWeights ref(w);
    double max_err = 0, max_ref = 0, max_lp_err = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      const Mat want = reference_logits(ref, seqs[b]);
      for (size_t j = 0; j + 1 < seqs[b].size(); ++j) {
        const size_t row =
            static_cast<size_t>(batch.row_of(static_cast<int64_t>(b), static_cast<int64_t>(j) + 1));
        double mx = -1e300;
        for (int64_t v = 0; v < V; ++v) {
          const double r = want[j][static_cast<size_t>(v)];
          max_err = std::max(
              max_err, std::fabs(got[row * static_cast<size_t>(V) + static_cast<size_t>(v)] - r));
          max_ref = std::max(max_ref, std::fabs(r));
          mx = std::max(mx, r / temperature);
        }
        double z = 0, ez = 0;
        for (int64_t v = 0; v < V; ++v) {
          const double e = std::exp(want[j][static_cast<size_t>(v)] / temperature - mx);
          z += e;
          ez += e * (want[j][static_cast<size_t>(v)] / temperature - mx);
        }
        const double want_lp =
            want[j][static_cast<size_t>(seqs[b][j + 1])] / temperature - mx - std::log(z);
        const double want_ent = std::log(z) - ez / z;
        max_lp_err =
            std::max({max_lp_err, std::fabs(lp[row] - want_lp), std::fabs(ent[row] - want_ent)});
      }
    }
    INFO("max |logit error| " << max_err << " of max |logit| " << max_ref << ", logprob/entropy "
                              << max_lp_err);
    CHECK(max_ref > 1.0);              // the model is not degenerate
    CHECK(max_err <= 2e-6 * max_ref);  // about 10 f32 ulps of the largest logit
    CHECK(max_lp_err <= 2e-6 * max_ref);
  }
}

// loss = sum_t wl_t * logprob_t + we_t * entropy_t
struct GradSetup {
  explicit GradSetup(Kind kind)
      : c(tiny_config(kind)),
        w(c, DType::f32),
        grads(c, DType::f32, Device::cpu(), ArenaClass::gradients) {
    fill_random(w, 300 + static_cast<uint64_t>(kind));
    batch = PackedBatch::from_sequences(test::random_sequences({7, 12, 5}, c.vocab_size, 40));
    const int64_t T = batch.num_tokens();
    wl = test::random_tensor({T}, DType::f32, 11, -1.0, 1.0);
    we = test::random_tensor({T}, DType::f32, 12, -0.5, 0.5);
    logprob = Tensor::empty({T}, DType::f32);
    entropy = Tensor::empty({T}, DType::f32);
  }
  ModelConfig c;
  Weights w, grads;
  PackedBatch batch;
  Tensor wl, we, logprob, entropy;
  float temperature = 0.9f;
};

void check_gradients(Kind kind) {
  // Hundreds of tiny forwards: one thread is faster than waking a pool on a busy machine.
  struct OneThread {
    int saved = num_threads();
    OneThread() { set_num_threads(1); }
    ~OneThread() { set_num_threads(saved); }
  } one_thread;
  {
    INFO(kind_name(kind));
    GradSetup s(kind);
    Decoder dec(s.w, {.max_tokens = 32});
    s.grads.zero();
    dec.forward(s.batch, s.logprob, s.entropy, s.temperature);
    dec.backward(s.wl, s.we, s.grads);
    const auto loss = [&] {
      dec.forward(s.batch, s.logprob, s.entropy, s.temperature);
      return test::weighted_sum(s.logprob, s.wl) + test::weighted_sum(s.entropy, s.we);
    };
    const std::span<const NamedTensor> params = s.w.storage(), grads = s.grads.storage();
    REQUIRE(params.size() == grads.size());
    for (size_t i = 0; i < params.size(); ++i) {
      REQUIRE(params[i].name == grads[i].name);
      CHECK(test::max_abs(to_f64(grads[i].tensor)) > 0);
      test::check_gradient(params[i].tensor, loss, grads[i].tensor,
                           std::string(kind_name(kind)) + " " + params[i].name,
                           {.probes = 12, .eps = 1e-2, .rtol = 2e-2, .seed = 17 + i});
    }
    // Gradients accumulate: a second backward adds the same again.
    const std::vector<double> once = to_f64(s.grads.layers[1].qkv);
    dec.forward(s.batch, s.logprob, s.entropy, s.temperature);
    dec.backward(s.wl, s.we, s.grads);
    const std::vector<double> twice = to_f64(s.grads.layers[1].qkv);
    double err = 0;
    for (size_t i = 0; i < once.size(); ++i) err = std::max(err, std::fabs(twice[i] - 2 * once[i]));
    CHECK(err <= 1e-5 * test::max_abs(once));
    CHECK_THROWS_AS(dec.backward(s.wl, s.we, s.grads), Error);  // consumed
  }
}

TEST_CASE("decoder gradients match central finite differences for llama tied and untied",
          "[unit]") {
  check_gradients(Kind::llama_tied);
  check_gradients(Kind::llama_untied_rope3);
}

TEST_CASE("decoder gradients match central finite differences for qwen2 and qwen3", "[unit]") {
  check_gradients(Kind::qwen2);
  check_gradients(Kind::qwen3);
}

TEST_CASE("decoder logprobs of a packed batch equal each sequence alone bitwise", "[unit]") {
  for (Kind kind : kAllKinds) {
    INFO(kind_name(kind));
    const ModelConfig c = tiny_config(kind);
    Weights w(c, DType::f32);
    fill_random(w, 500 + static_cast<uint64_t>(kind));
    Decoder dec(w, {.max_tokens = 8});  // grows for the packed batch
    const auto seqs = test::random_sequences({13, 4, 22}, c.vocab_size, 60);
    const PackedBatch packed = PackedBatch::from_sequences(seqs);
    const int64_t T = packed.num_tokens();
    Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
    dec.forward(packed, lp, ent);
    for (size_t b = 0; b < seqs.size(); ++b) {
      const PackedBatch one = PackedBatch::from_sequences(std::span(&seqs[b], 1));
      const int64_t n = one.num_tokens();
      Tensor lp1 = Tensor::empty({n}, DType::f32), ent1 = Tensor::empty({n}, DType::f32);
      dec.forward(one, lp1, ent1);
      CHECK(test::bitwise_equal(lp1, lp.narrow(packed.cu_seqlens[b], n)));
      CHECK(test::bitwise_equal(ent1, ent.narrow(packed.cu_seqlens[b], n)));
    }
  }
}

TEST_CASE("decoder recompute gives bitwise the same logprobs and gradients", "[unit]") {
  for (Kind kind : {Kind::llama_untied_rope3, Kind::qwen2, Kind::qwen3}) {
    INFO(kind_name(kind));
    GradSetup s(kind);
    Weights g2(s.c, DType::f32, Device::cpu(), ArenaClass::gradients);
    Decoder plain(s.w, {.max_tokens = 32, .recompute = false});
    Decoder recompute(s.w, {.max_tokens = 32, .recompute = true});
    CHECK(recompute.activation_bytes() < plain.activation_bytes());
    s.grads.zero();
    g2.zero();
    plain.forward(s.batch, s.logprob, s.entropy, s.temperature);
    plain.backward(s.wl, s.we, s.grads);
    Tensor lp2 = Tensor::empty(s.logprob.shape(), DType::f32);
    recompute.forward(s.batch, lp2, Tensor(), s.temperature);
    recompute.backward(s.wl, s.we, g2);  // the entropy term needs no saved entropy
    CHECK(test::bitwise_equal(s.logprob, lp2));
    for (size_t i = 0; i < s.grads.storage().size(); ++i) {
      INFO(s.grads.storage()[i].name);
      CHECK(test::bitwise_equal(s.grads.storage()[i].tensor, g2.storage()[i].tensor));
    }
  }
}

// Every gradient tensor of b within 1e-5 of a's largest |value| of that tensor (the same sums up
// to rounding).
void check_gradients_close(const Weights& a, const Weights& b) {
  for (size_t i = 0; i < a.storage().size(); ++i) {
    INFO(a.storage()[i].name);
    const std::vector<double> x = test::to_f64(a.storage()[i].tensor);
    const std::vector<double> y = test::to_f64(b.storage()[i].tensor);
    double scale = 0;
    for (double v : x) scale = std::max(scale, std::abs(v));
    CHECK(test::max_abs_diff(x, y) <= 1e-5 * scale + 1e-12);
  }
}

TEST_CASE("decoder head rows: the selected rows' logprobs bitwise, zeros elsewhere, same gradients",
          "[unit]") {
  for (Kind kind : {Kind::llama_tied, Kind::llama_untied_rope3, Kind::qwen3}) {
    INFO(kind_name(kind));
    GradSetup s(kind);
    const int64_t T = s.batch.num_tokens();
    // Every third row and the last one; the other rows' weights are zero in the full pass.
    PackedBatch sel = s.batch;
    std::vector<float> wl(static_cast<size_t>(T), 0.0f), we(static_cast<size_t>(T), 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      if (t % 3 != 1 && t != T - 1) continue;
      sel.head_rows.push_back(static_cast<int32_t>(t));
      wl[static_cast<size_t>(t)] = s.wl.data_as<float>()[t];
      we[static_cast<size_t>(t)] = s.we.data_as<float>()[t];
    }
    const Tensor dl = Tensor::wrap(wl.data(), {T}, DType::f32);
    const Tensor de = Tensor::wrap(we.data(), {T}, DType::f32);
    Weights g_sel(s.c, DType::f32, Device::cpu(), ArenaClass::gradients);
    Decoder dec(s.w, {.max_tokens = 32});
    s.grads.zero();
    g_sel.zero();
    dec.forward(s.batch, s.logprob, s.entropy, s.temperature);
    dec.backward(dl, de, s.grads);
    Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
    dec.forward(sel, lp, ent, s.temperature);
    dec.backward(dl, de, g_sel);
    for (int64_t t = 0; t < T; ++t) {
      INFO("row " << t);
      const bool in = wl[static_cast<size_t>(t)] != 0.0f;
      CHECK(lp.data_as<float>()[t] == (in ? s.logprob.data_as<float>()[t] : 0.0f));
      CHECK(ent.data_as<float>()[t] == (in ? s.entropy.data_as<float>()[t] : 0.0f));
    }
    // The same sums without the zero terms of the other rows: equal up to rounding.
    check_gradients_close(s.grads, g_sel);
  }
}

TEST_CASE("decoder rejects head rows out of order or out of range", "[unit]") {
  const ModelConfig c = tiny_config(Kind::llama_tied);
  Weights w(c, DType::f32);
  fill_random(w, 2);
  Decoder dec(w, {.max_tokens = 16});
  PackedBatch b = PackedBatch::from_sequences(std::vector<std::vector<int32_t>>{{1, 2, 3, 4}});
  Tensor lp = Tensor::empty({3}, DType::f32);
  b.head_rows = {2, 1};
  CHECK_THROWS_WITH(dec.forward(b, lp, Tensor()), Catch::Contains("head_rows[1] = 1"));
  b.head_rows = {0, 3};
  CHECK_THROWS_WITH(dec.forward(b, lp, Tensor()), Catch::Contains("head_rows[1] = 3"));
}

TEST_CASE("decoder score of a long input gives forward's bits in memory linear in its length",
          "[unit]") {
  for (Kind kind : kAllKinds) {
    INFO(kind_name(kind));
    ModelConfig c = tiny_config(kind);
    c.num_layers = 4;    // forward keeps every layer's activations, score one layer's
    c.vocab_size = 400;  // and (T, V) logits twice, score one chunk of rows
    Weights w(c, DType::f32);
    fill_random(w, 1200 + static_cast<uint64_t>(kind));
    // A long prompt and completion and a short pair packed after them: 13 chunks of 64 rows.
    const auto seqs = test::random_sequences({700, 90}, c.vocab_size, 1210);
    PackedBatch batch = PackedBatch::from_sequences(seqs);
    const int64_t T = batch.num_tokens();
    Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
    Decoder train(w);
    train.forward(batch, lp, ent);

    const int64_t rows = 64;
    Decoder dec(w, {.max_tokens = 1, .score_rows = rows});
    Tensor slp = Tensor::empty({T}, DType::f32), sent = Tensor::empty({T}, DType::f32);
    dec.score(batch, slp, sent);
    CHECK(test::bitwise_equal(lp, slp));
    CHECK(test::bitwise_equal(ent, sent));
    // Per token: two residual streams and one layer's activations (6 C, q, k, v, attention
    // output and lse, 3 F of the MLP, norms' rstd, ids); per chunk: its logits and hidden states.
    const int64_t C = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
    const int64_t per_token =
        4 * (6 * C + 3 * (H + Hkv) * D + 2 * H + Hkv + 3 * c.intermediate_size + 8);
    const int64_t per_chunk = 4 * rows * (c.vocab_size + 2 * C + 4);
    const size_t bound = static_cast<size_t>(T * per_token + per_chunk + (64 << 10));
    INFO("score's arena " << dec.activation_bytes() << " bytes, bound " << bound << ", forward's "
                          << Decoder::plan_bytes(c, T, false));
    CHECK(dec.activation_bytes() <= bound);

    // The completion's rows only (the second sequence's and the end of the first): the same
    // bits there, zeros elsewhere, the arena as it was.
    for (int64_t t = 600; t < T; t += t < 699 ? 1 : 3)
      batch.head_rows.push_back(static_cast<int32_t>(t));
    const size_t before = dec.activation_bytes();
    dec.score(batch, slp, Tensor());
    CHECK(dec.activation_bytes() == before);
    size_t selected = 0, same = 0, zero = 0;
    for (int64_t t = 0; t < T; ++t) {
      const bool in = selected < batch.head_rows.size() && batch.head_rows[selected] == t;
      const float got = slp.data_as<float>()[t];
      if (in) {
        ++selected;
        same += std::memcmp(&got, lp.data_as<float>() + t, sizeof(float)) == 0;
      } else {
        zero += got == 0.0f;
      }
    }
    CHECK(same == batch.head_rows.size());
    CHECK(zero == static_cast<size_t>(T) - batch.head_rows.size());
  }
}

TEST_CASE("decoder with shared prompts: completion logprobs bitwise, gradients equal", "[unit]") {
  for (Kind kind : {Kind::llama_tied, Kind::qwen2, Kind::qwen3}) {
    INFO(kind_name(kind));
    const ModelConfig c = tiny_config(kind);
    Weights w(c, DType::f32);
    fill_random(w, 900 + static_cast<uint64_t>(kind));
    // Two groups (prompts of 19 and 2 tokens), a lone pair between them, a one-token prompt pair.
    const auto prompts = test::random_sequences({19, 7, 2, 1}, c.vocab_size, 910);
    const auto comps = test::random_sequences({1, 12, 5, 3, 4, 9, 2}, c.vocab_size, 920);
    const std::vector<size_t> prompt_of{0, 0, 0, 1, 2, 2, 3};
    std::vector<PackedBatch::PromptCompletion> pairs;
    for (size_t i = 0; i < comps.size(); ++i) pairs.push_back({prompts[prompt_of[i]], comps[i]});
    const PackedBatch whole = PackedBatch::from_prompts(pairs, false);
    const PackedBatch shared = PackedBatch::from_prompts(pairs, true);
    REQUIRE(whole.prefix.empty());
    REQUIRE(shared.num_sequences() == 7 + 2);  // two prompt prefixes
    REQUIRE(shared.head_rows.size() == whole.head_rows.size());
    CHECK(shared.num_tokens() == whole.num_tokens() - 2 * 18 - 1 * 1);

    Decoder dec(w, {.max_tokens = 16});
    const int64_t Tw = whole.num_tokens(), Ts = shared.num_tokens();
    Tensor lw = Tensor::empty({Tw}, DType::f32), ew = Tensor::empty({Tw}, DType::f32);
    Tensor ls = Tensor::empty({Ts}, DType::f32), es = Tensor::empty({Ts}, DType::f32);
    // The same weight per completion token on both sides.
    std::vector<float> dw(static_cast<size_t>(Tw), 0.0f), ds(static_cast<size_t>(Ts), 0.0f);
    std::vector<float> gw(static_cast<size_t>(Tw), 0.0f), gs(static_cast<size_t>(Ts), 0.0f);
    for (size_t r = 0; r < whole.head_rows.size(); ++r) {
      const float a = 0.1f + 0.01f * static_cast<float>(r), e = -0.05f * static_cast<float>(r % 3);
      dw[static_cast<size_t>(whole.head_rows[r])] = ds[static_cast<size_t>(shared.head_rows[r])] =
          a;
      gw[static_cast<size_t>(whole.head_rows[r])] = gs[static_cast<size_t>(shared.head_rows[r])] =
          e;
    }
    Weights g_whole(c, DType::f32, Device::cpu(), ArenaClass::gradients);
    Weights g_shared(c, DType::f32, Device::cpu(), ArenaClass::gradients);
    g_whole.zero();
    g_shared.zero();
    dec.forward(whole, lw, ew);
    dec.backward(Tensor::wrap(dw.data(), {Tw}, DType::f32),
                 Tensor::wrap(gw.data(), {Tw}, DType::f32), g_whole);
    dec.forward(shared, ls, es);
    dec.backward(Tensor::wrap(ds.data(), {Ts}, DType::f32),
                 Tensor::wrap(gs.data(), {Ts}, DType::f32), g_shared);
    int64_t equal = 0;
    for (size_t r = 0; r < whole.head_rows.size(); ++r) {
      const int64_t a = whole.head_rows[r], b = shared.head_rows[r];
      equal += lw.data_as<float>()[a] == ls.data_as<float>()[b] &&
               ew.data_as<float>()[a] == es.data_as<float>()[b];
    }
    CHECK(equal == static_cast<int64_t>(whole.head_rows.size()));
    check_gradients_close(g_whole, g_shared);
  }
}

TEST_CASE("decoder rejects a bad shared-prompt layout", "[unit]") {
  const ModelConfig c = tiny_config(Kind::llama_tied);
  Weights w(c, DType::f32);
  fill_random(w, 3);
  Decoder dec(w, {.max_tokens = 16});
  const std::vector<int32_t> prompt{1, 2, 3}, c1{4, 5}, c2{6};
  const std::vector<PackedBatch::PromptCompletion> pairs{{prompt, c1}, {prompt, c2}};
  PackedBatch b = PackedBatch::from_prompts(pairs, true);
  REQUIRE(b.prefix == std::vector<int32_t>{-1, 0, 0});
  Tensor lp = Tensor::empty({b.num_tokens()}, DType::f32);
  CHECK_NOTHROW(dec.forward(b, lp, Tensor()));
  PackedBatch bad = b;
  bad.prefix = {-1, 0};
  CHECK_THROWS_WITH(dec.forward(bad, lp, Tensor()), Catch::Contains("prefix has 2 entries"));
  bad.prefix = {-1, 2, 0};
  CHECK_THROWS_WITH(dec.forward(bad, lp, Tensor()), Catch::Contains("prefix[1] = 2"));
  bad = b;
  bad.positions[static_cast<size_t>(b.cu_seqlens[1])] = 5;
  CHECK_THROWS_WITH(dec.forward(bad, lp, Tensor()), Catch::Contains("starts at position 5"));
  const std::vector<int32_t> empty;
  const std::vector<PackedBatch::PromptCompletion> none{{prompt, empty}};
  CHECK_THROWS_WITH(PackedBatch::from_prompts(none, true), Catch::Contains("pair 0"));
}

// ---------------------------------------------------------------------------------------------
// A paged cache for the inference tests: each sequence owns a scattered list of blocks.

struct PagedCache {
  PagedCache(const ModelConfig& c, int64_t num_blocks, int64_t P, int64_t B, Device dev,
             uint64_t seed)
      : P(P), lengths(static_cast<size_t>(B), 0), device(dev) {
    for (int64_t l = 0; l < c.num_layers; ++l) {
      view.k_cache.push_back(
          Tensor::zeros({num_blocks, c.num_kv_heads, c.head_dim, P}, DType::f32, dev));
      view.v_cache.push_back(
          Tensor::zeros({num_blocks, P, c.num_kv_heads, c.head_dim}, DType::f32, dev));
    }
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    // A seeded shuffle: blocks of one sequence are scattered over the pool.
    const Tensor r = test::random_ints({num_blocks}, DType::i32, seed, 0, 1 << 30);
    for (int64_t i = num_blocks - 1; i > 0; --i)
      std::swap(ids[static_cast<size_t>(i)],
                ids[static_cast<size_t>(r.data_as<int32_t>()[i] % (i + 1))]);
    const int64_t per = num_blocks / B;
    for (int64_t b = 0; b < B; ++b)
      blocks.emplace_back(ids.begin() + b * per, ids.begin() + (b + 1) * per);
  }
  // Appends counts[b] tokens to sequence b (0 allowed only when the sequence is not in the
  // step: pass `in_step`), filling slot_mapping and the block lists of the sequences in step.
  void step(const std::vector<int64_t>& counts) {
    std::vector<int32_t> indptr{0}, indices, last, slots;
    for (size_t b = 0; b < counts.size(); ++b) {
      if (counts[b] == 0) continue;
      for (int64_t i = 0; i < counts[b]; ++i) {
        const int64_t pos = lengths[b] + i;
        slots.push_back(
            static_cast<int32_t>(blocks[b][static_cast<size_t>(pos / P)] * P + pos % P));
      }
      lengths[b] += counts[b];
      const int64_t nb = (lengths[b] + P - 1) / P;
      for (int64_t i = 0; i < nb; ++i) indices.push_back(blocks[b][static_cast<size_t>(i)]);
      indptr.push_back(static_cast<int32_t>(indices.size()));
      last.push_back(static_cast<int32_t>(lengths[b] - (nb - 1) * P));
    }
    auto dev = [&](const std::vector<int32_t>& v) {
      std::vector<double> d(v.begin(), v.end());
      return test::tensor_from(d, {static_cast<int64_t>(v.size())}, DType::i32).to(device);
    };
    view.kv_indptr = dev(indptr);
    view.kv_indices = dev(indices);
    view.kv_last_len = dev(last);
    view.slot_mapping = dev(slots);
  }
  int64_t P;
  std::vector<int64_t> lengths;
  std::vector<std::vector<int32_t>> blocks;
  Device device;
  KvCacheView view;
};

// Prompts prefilled (optionally in two chunks), then `steps` decode steps of tokens drawn by
// ops::sample.
// Returns the full sequences and the logits rows (one per generated token, in order of
// generation per sequence: rows[b][i] = logits predicting seqs[b][prompt_len + i]).
struct Rollout {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<std::vector<Tensor>> rows;      // (V) each, on the CPU
  std::vector<std::vector<Tensor>> logprobs;  // (1) each: the sampler's logprob of the token
};

Rollout run_rollout(Decoder& dec, const std::vector<std::vector<int32_t>>& prompts, int steps,
                    bool chunked, Device device) {
  const ModelConfig& c = dec.config();
  const int64_t B = static_cast<int64_t>(prompts.size()), V = c.vocab_size;
  PagedCache cache(c, 48, 4, B, device, 99);
  Rollout r{prompts, std::vector<std::vector<Tensor>>(static_cast<size_t>(B)),
            std::vector<std::vector<Tensor>>(static_cast<size_t>(B))};
  Tensor logits = Tensor::empty({B, V}, DType::f32, device);
  auto prefill = [&](size_t from_frac_num, size_t frac_den) {
    // Tokens [n * from / den, n * (from + 1) / den) of each prompt.
    std::vector<int32_t> tokens, positions, cu{0};
    std::vector<int64_t> counts;
    for (const auto& p : prompts) {
      const size_t a = p.size() * from_frac_num / frac_den,
                   e = p.size() * (from_frac_num + 1) / frac_den;
      for (size_t j = a; j < e; ++j) {
        tokens.push_back(p[j]);
        positions.push_back(static_cast<int32_t>(j));
      }
      cu.push_back(static_cast<int32_t>(tokens.size()));
      counts.push_back(static_cast<int64_t>(e - a));
    }
    cache.step(counts);
    dec.prefill(tokens, positions, cu, cache.view, logits);
  };
  if (chunked) {
    prefill(0, 2);
    prefill(1, 2);
  } else {
    prefill(0, 1);
  }
  // The engine's sampler: temperature 1, no filters, a seed per sequence, offset = step.
  auto column = [&](double v, DType dt) {
    return test::tensor_from(std::vector<double>(static_cast<size_t>(B), v), {B}, dt).to(device);
  };
  const ops::SamplingTensors settings{column(1.0, DType::f32),
                                      column(0.0, DType::i32),
                                      column(1.0, DType::f32),
                                      column(0.0, DType::f32),
                                      Tensor(),
                                      Tensor()};
  Tensor token = Tensor::empty({B}, DType::i32, device);
  Tensor logprob = Tensor::empty({B}, DType::f32, device);
  for (int step = 0;; ++step) {
    ops::SamplingTensors st = settings;
    std::vector<double> seeds, offsets;
    for (int64_t b = 0; b < B; ++b) seeds.push_back(static_cast<double>(31 + b));
    offsets.assign(static_cast<size_t>(B), static_cast<double>(step));
    st.seed = test::tensor_from(seeds, {B}, DType::i64).to(device);
    st.offset = test::tensor_from(offsets, {B}, DType::i64).to(device);
    ops::sample(logits, st, token, logprob, Stream{device, nullptr});
    const Tensor host = logits.to(Device::cpu());
    const Tensor tok = token.to(Device::cpu()), lp = logprob.to(Device::cpu());
    std::vector<int32_t> next(static_cast<size_t>(B)), positions(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      r.rows[static_cast<size_t>(b)].push_back(host.narrow(b, 1).view({V}).to(Device::cpu()));
      r.logprobs[static_cast<size_t>(b)].push_back(lp.narrow(b, 1).to(Device::cpu()));
      next[static_cast<size_t>(b)] = tok.data_as<int32_t>()[b];
      positions[static_cast<size_t>(b)] =
          static_cast<int32_t>(r.seqs[static_cast<size_t>(b)].size());
      r.seqs[static_cast<size_t>(b)].push_back(next[static_cast<size_t>(b)]);
    }
    if (step == steps) break;
    cache.step(std::vector<int64_t>(static_cast<size_t>(B), 1));
    dec.decode(next, positions, cache.view, logits);
  }
  return r;
}

TEST_CASE("decoder prefill and paged decode give the training forward's logprobs bitwise",
          "[unit]") {
  for (Kind kind : kAllKinds) {
    for (bool chunked : {false, true}) {
      const DType dtype = kind == Kind::qwen3 ? DType::bf16 : DType::f32;
      INFO(kind_name(kind) << (chunked ? " chunked prefill " : " one prefill ")
                           << dtype_name(dtype));
      const ModelConfig c = tiny_config(kind);
      Weights w(c, dtype);
      fill_random(w, 700 + static_cast<uint64_t>(kind));
      Decoder dec(w, {.max_tokens = 64});
      const auto prompts = test::random_sequences({5, 11, 8}, c.vocab_size, 80);
      const int steps = 6;
      const Rollout r = run_rollout(dec, prompts, steps, chunked, Device::cpu());

      // The trainer's view: the full sequences packed, logprobs of every completion token.
      const PackedBatch batch = PackedBatch::from_sequences(r.seqs);
      const int64_t T = batch.num_tokens(), V = c.vocab_size;
      Tensor lp = Tensor::empty({T}, DType::f32), logits = Tensor::empty({T, V}, DType::f32);
      dec.forward(batch, lp, Tensor());
      dec.forward_logits(batch, logits);
      for (size_t b = 0; b < prompts.size(); ++b)
        for (int i = 0; i <= steps; ++i) {
          INFO("sequence " << b << " generated token " << i);
          const int64_t j = static_cast<int64_t>(prompts[b].size()) + i;
          if (j >= static_cast<int64_t>(r.seqs[b].size())) break;
          const int64_t row = batch.row_of(static_cast<int64_t>(b), j);
          const Tensor& got = r.rows[b][static_cast<size_t>(i)];
          CHECK(test::bitwise_equal(got, logits.narrow(row, 1).view({V})));
          // The rollout's logprob of the sampled token, by the same op the trainer runs.
          Tensor target = test::tensor_from(
              {static_cast<double>(r.seqs[b][static_cast<size_t>(j)])}, {1}, DType::i32);
          Tensor one_lp = Tensor::empty({1}, DType::f32), lse = Tensor::empty({1}, DType::f32);
          ops::logprob_gather(got.view({1, V}), target, one_lp, lse, Tensor());
          CHECK(test::bitwise_equal(one_lp, lp.narrow(row, 1)));
          // And the sampler's own report of it.
          CHECK(test::bitwise_equal(r.logprobs[b][static_cast<size_t>(i)], lp.narrow(row, 1)));
        }
    }
  }
}

TEST_CASE("decoder rejects bad input with one clear error", "[unit]") {
  const ModelConfig c = tiny_config(Kind::llama_tied);
  Weights w(c, DType::f32);
  fill_random(w, 1);
  Decoder dec(w, {.max_tokens = 16, .recompute = false, .grow = false});
  CHECK_THROWS_WITH(PackedBatch::from_sequences(std::vector<std::vector<int32_t>>{{1, 2}, {3}}),
                    Catch::Contains("sequence 1 has 1 tokens"));
  PackedBatch b = PackedBatch::from_sequences(std::vector<std::vector<int32_t>>{{1, 2, 3}});
  Tensor lp = Tensor::empty({2}, DType::f32);
  b.targets[1] = 101;
  CHECK_THROWS_WITH(dec.forward(b, lp, Tensor()), Catch::Contains("target 101 at position 1"));
  b.targets[1] = 3;
  b.tokens[0] = -4;
  CHECK_THROWS_WITH(dec.forward(b, lp, Tensor()), Catch::Contains("token -4 at position 0"));
  b.tokens[0] = 1;
  CHECK_THROWS_WITH(dec.forward(b, Tensor::empty({3}, DType::f32), Tensor()),
                    Catch::Contains("logprob_out"));
  const PackedBatch big =
      PackedBatch::from_sequences(test::random_sequences({40}, c.vocab_size, 3));
  Tensor lp_big = Tensor::empty({big.num_tokens()}, DType::f32);
  CHECK_THROWS_WITH(dec.forward(big, lp_big, Tensor()), Catch::Contains("max_tokens"));
  Weights g(c, DType::f32, Device::cpu(), ArenaClass::gradients);
  CHECK_THROWS_WITH(dec.backward(lp, Tensor(), g), Catch::Contains("no training forward"));
}

TEST_CASE("decoder on CUDA matches the CPU and decodes its own forward's logprobs", "[gpu]") {
  test::skip_without_gpu();
  for (Kind kind : kAllKinds) {
    INFO(kind_name(kind));
    const ModelConfig c = tiny_config(kind);
    Weights w(c, DType::f32);
    fill_random(w, 900 + static_cast<uint64_t>(kind));
    Weights wg(c, DType::f32, Device::cuda());
    wg.copy_from(w);
    Decoder cpu(w, {.max_tokens = 64}), gpu(wg, {.max_tokens = 64});
    const auto prompts = test::random_sequences({5, 11, 8}, c.vocab_size, 80);
    const Rollout r = run_rollout(gpu, prompts, 5, false, Device::cuda());
    const PackedBatch batch = PackedBatch::from_sequences(r.seqs);
    const int64_t T = batch.num_tokens(), V = c.vocab_size;
    Tensor lc = Tensor::empty({T, V}, DType::f32);
    Tensor lg = Tensor::empty({T, V}, DType::f32, Device::cuda());
    cpu.forward_logits(batch, lc);
    gpu.forward_logits(batch, lg);
    const double err = test::nmse(to_f64(lg), to_f64(lc));
    INFO("nmse of CUDA (bf16 matmuls) against CPU logits: " << err);
    CHECK(err < 1e-3);
    Tensor lpg = Tensor::empty({T}, DType::f32, Device::cuda());
    gpu.forward(batch, lpg, Tensor());
    const Tensor lp = lpg.to(Device::cpu());
    const Tensor logits = lg.to(Device::cpu());
    int mismatched = 0;
    for (size_t b = 0; b < prompts.size(); ++b)
      for (size_t i = 0; i < r.rows[b].size(); ++i) {
        const int64_t j = static_cast<int64_t>(prompts[b].size() + i);
        if (j >= static_cast<int64_t>(r.seqs[b].size())) break;
        const int64_t row = batch.row_of(static_cast<int64_t>(b), j);
        if (!test::bitwise_equal(r.rows[b][i], logits.narrow(row, 1).view({V}))) ++mismatched;
      }
    INFO("decode logits rows not bitwise equal to the CUDA training forward: " << mismatched);
    CHECK(mismatched == 0);
    CHECK(test::all_finite(lp));
  }
}

}  // namespace
}  // namespace tandem::model
