// Tests of trainer/optimizer and trainer/lr_schedule: AdamW against a plain f64 reference of
// torch's AdamW, weight-decay exclusions, global-norm clipping, skipping non-finite steps, the
// rollout copy, and the learning-rate schedules at their key steps.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/lr_schedule.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

using model::ModelConfig;
using model::NamedTensor;
using model::Weights;

// A tiny Qwen2 (q/k/v biases, tied embeddings) or Qwen3 (q/k norms, untied lm_head).
ModelConfig tiny_config(bool qwen3) {
  ModelConfig c = test::micro_model_config(qwen3);
  return c;
}

void fill_random(Weights& w, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  for (const NamedTensor& s : w.storage()) {
    Tensor t = s.tensor;
    t.copy_from(test::random_tensor(t.shape(), t.dtype(), ++seed, lo, hi));
  }
}

// torch.optim.AdamW's update in f64, on one flat tensor.
struct RefState {
  std::vector<double> p, m, v;
};

void ref_adamw_step(RefState& s, const std::vector<double>& g, double grad_scale, double lr,
                    double wd, const AdamWConfig& c, int64_t step) {
  const double b1 = c.beta1, b2 = c.beta2, eps = c.eps;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  for (size_t i = 0; i < s.p.size(); ++i) {
    const double gi = g[i] * grad_scale;
    s.p[i] *= 1.0 - lr * wd;
    s.m[i] = b1 * s.m[i] + (1.0 - b1) * gi;
    s.v[i] = b2 * s.v[i] + (1.0 - b2) * gi * gi;
    s.p[i] -= lr / bc1 * s.m[i] / (std::sqrt(s.v[i]) / std::sqrt(bc2) + eps);
  }
}

// max |a - b| / max |b| over the tensor.
double rel_error(const Tensor& ours, const std::vector<double>& ref) {
  return test::max_abs_diff(test::to_f64(ours), ref) / std::max(test::max_abs(ref), 1e-30);
}

double ref_norm(const Weights& g) {
  double ss = 0.0;
  for (const NamedTensor& s : g.storage()) {
    for (double x : test::to_f64(s.tensor)) ss += x * x;
  }
  return std::sqrt(ss);
}

void check_matches_reference(bool qwen3, float max_grad_norm, double grad_magnitude) {
  const ModelConfig config = tiny_config(qwen3);
  Weights params(config, DType::f32);
  fill_random(params, 11);
  AdamWConfig oc;
  oc.beta1 = 0.9f;
  oc.beta2 = 0.95f;
  oc.eps = 1e-8f;
  oc.weight_decay = 0.1f;
  oc.max_grad_norm = max_grad_norm;
  AdamW opt(params, oc);
  Weights grads(config, DType::f32, Device::cpu(), ArenaClass::gradients);

  std::vector<RefState> ref;
  for (const NamedTensor& s : params.storage()) {
    const auto p = test::to_f64(s.tensor);
    ref.push_back({p, std::vector<double>(p.size()), std::vector<double>(p.size())});
  }
  const float lrs[] = {1e-2f, 2e-2f, 5e-3f, 1e-2f, 3e-2f};
  for (int step = 1; step <= 5; ++step) {
    fill_random(grads, 1000 * static_cast<uint64_t>(step), -grad_magnitude, grad_magnitude);
    const double norm = ref_norm(grads);
    const double scale =
        max_grad_norm > 0.0f && norm > max_grad_norm ? max_grad_norm / (norm + 1e-6) : 1.0;
    const StepResult r = opt.step(grads, lrs[step - 1]);
    CHECK_FALSE(r.skipped);
    CHECK(r.step == step);
    CHECK(std::abs(r.grad_norm - norm) <= 1e-6 * norm);
    CHECK(std::abs(r.clip_scale - scale) <= 1e-6 * scale);
    for (size_t i = 0; i < ref.size(); ++i) {
      const std::string& name = params.storage()[i].name;
      const double wd = AdamW::decays(oc, name) ? oc.weight_decay : 0.0;
      ref_adamw_step(ref[i], test::to_f64(grads.storage()[i].tensor), scale, lrs[step - 1], wd, oc,
                     step);
      INFO("step " << step << " tensor " << name);
      CHECK(rel_error(params.storage()[i].tensor, ref[i].p) <= 1e-6);
      CHECK(rel_error(opt.m().storage()[i].tensor, ref[i].m) <= 1e-6);
      CHECK(rel_error(opt.v().storage()[i].tensor, ref[i].v) <= 1e-6);
    }
  }
}

TEST_CASE("AdamW matches an f64 reference of torch AdamW over five steps", "[unit]") {
  check_matches_reference(false, 0.0f, 1.0);
  check_matches_reference(true, 0.0f, 1.0);
}

TEST_CASE("AdamW with clipping matches the f64 reference and clip_grad_norm_", "[unit]") {
  check_matches_reference(false, 0.5f, 1.0);  // norm ~ 30: every step clipped
  check_matches_reference(true, 1e3f, 1.0);   // above the norm: never clipped
}

TEST_CASE("AdamW decays only the tensors the exclusions allow", "[unit]") {
  AdamWConfig c;
  CHECK_FALSE(AdamW::decays(c, "model.layers.0.input_layernorm.weight"));
  CHECK_FALSE(AdamW::decays(c, "model.layers.1.post_attention_layernorm.weight"));
  CHECK_FALSE(AdamW::decays(c, "model.norm.weight"));
  CHECK_FALSE(AdamW::decays(c, "model.layers.0.self_attn.q_norm.weight"));
  CHECK_FALSE(AdamW::decays(c, "model.layers.0.self_attn.qkv_proj.bias"));
  CHECK(AdamW::decays(c, "model.layers.0.self_attn.qkv_proj.weight"));
  CHECK(AdamW::decays(c, "model.layers.0.mlp.gate_up_proj.weight"));
  CHECK(AdamW::decays(c, "model.embed_tokens.weight"));
  CHECK(AdamW::decays(c, "lm_head.weight"));
  c.decay_embeddings = false;
  c.decay_norms = true;
  c.decay_biases = true;
  CHECK_FALSE(AdamW::decays(c, "model.embed_tokens.weight"));
  CHECK_FALSE(AdamW::decays(c, "lm_head.weight"));
  CHECK(AdamW::decays(c, "model.norm.weight"));
  CHECK(AdamW::decays(c, "model.layers.0.self_attn.qkv_proj.bias"));

  // With zero gradients only the decay moves a parameter: decayed tensors shrink by exactly
  // (1 - lr wd), excluded ones stay bitwise.
  for (bool qwen3 : {false, true}) {
    for (bool decay_embeddings : {true, false}) {
      const ModelConfig config = tiny_config(qwen3);
      Weights params(config, DType::f32), before(config, DType::f32);
      fill_random(params, 5);
      before.copy_from(params);
      AdamWConfig oc;
      oc.weight_decay = 0.5f;
      oc.decay_embeddings = decay_embeddings;
      AdamW opt(params, oc);
      Weights grads(config, DType::f32, Device::cpu(), ArenaClass::gradients);
      grads.zero();
      opt.step(grads, 0.1f);
      int decayed = 0, kept = 0;
      for (size_t i = 0; i < params.storage().size(); ++i) {
        const std::string& name = params.storage()[i].name;
        INFO(name << " decay_embeddings " << decay_embeddings);
        const bool norm = name.find("norm") != std::string::npos;
        const bool bias = name.ends_with(".bias");
        const bool embedding = name == "model.embed_tokens.weight" || name == "lm_head.weight";
        const bool want = !norm && !bias && (!embedding || decay_embeddings);
        const Tensor& now = params.storage()[i].tensor;
        const Tensor& was = before.storage()[i].tensor;
        if (want) {
          ++decayed;
          const auto a = test::to_f64(now), b = test::to_f64(was);
          const float factor = static_cast<float>(1.0 - 0.1 * 0.5);
          for (size_t k = 0; k < a.size(); ++k) {
            REQUIRE(a[k] == static_cast<double>(static_cast<float>(b[k]) * factor));
          }
        } else {
          ++kept;
          CHECK(test::bitwise_equal(now, was));
        }
      }
      CHECK(decayed > 0);
      CHECK(kept >= 5);  // 2 layers x 2 norms + model.norm, and biases or q/k norms
    }
  }
}

TEST_CASE("AdamW clipping scales the gradients as if they had been scaled first", "[unit]") {
  const ModelConfig config = tiny_config(false);
  Weights a(config, DType::f32), b(config, DType::f32);
  fill_random(a, 3);
  b.copy_from(a);
  AdamWConfig clipped;
  clipped.max_grad_norm = 0.25f;
  AdamWConfig unclipped;
  unclipped.max_grad_norm = 0.0f;
  AdamW opt_a(a, clipped), opt_b(b, unclipped);
  Weights grads(config, DType::f32, Device::cpu(), ArenaClass::gradients);
  Weights scaled(config, DType::f32, Device::cpu(), ArenaClass::gradients);
  for (int step = 0; step < 3; ++step) {
    fill_random(grads, 77 + static_cast<uint64_t>(step) * 100);
    const StepResult r = opt_a.step(grads, 1e-2f);
    REQUIRE(r.grad_norm > 1.0f);
    CHECK(r.clip_scale == 0.25f / (r.grad_norm + 1e-6f));
    CHECK(std::abs(r.grad_norm * r.clip_scale - 0.25f) < 1e-6f);
    scaled.copy_from(grads);
    for (const NamedTensor& s : scaled.storage()) ops::scale(s.tensor, r.clip_scale);
    const StepResult rb = opt_b.step(scaled, 1e-2f);
    CHECK(rb.clip_scale == 1.0f);
    for (size_t i = 0; i < a.storage().size(); ++i) {
      CHECK(test::bitwise_equal(a.storage()[i].tensor, b.storage()[i].tensor));
      CHECK(test::bitwise_equal(opt_a.m().storage()[i].tensor, opt_b.m().storage()[i].tensor));
      CHECK(test::bitwise_equal(opt_a.v().storage()[i].tensor, opt_b.v().storage()[i].tensor));
    }
  }
  // Gradient norm as ops::global_norm and an f64 sum agree.
  CHECK(std::abs(AdamW::grad_norm(grads) - ref_norm(grads)) <= 1e-6 * ref_norm(grads));
}

TEST_CASE("AdamW skips non-finite gradient norms and fails after too many in a row", "[unit]") {
  const ModelConfig config = tiny_config(true);
  Weights params(config, DType::f32), before(config, DType::f32);
  fill_random(params, 9);
  AdamWConfig oc;
  oc.max_consecutive_skips = 3;
  AdamW opt(params, oc);
  Weights grads(config, DType::f32, Device::cpu(), ArenaClass::gradients);
  fill_random(grads, 19);
  REQUIRE(opt.step(grads, 1e-3f).step == 1);
  before.copy_from(params);
  Weights m_before(config, DType::f32);
  m_before.copy_from(opt.m());

  Weights bad(config, DType::f32, Device::cpu(), ArenaClass::gradients);
  bad.copy_from(grads);
  const float poison[] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()};
  for (int i = 0; i < 2; ++i) {
    bad.layers[1].down.data_as<float>()[3] = poison[i];
    const StepResult r = opt.step(bad, 1e-3f);
    CHECK(r.skipped);
    CHECK_FALSE(std::isfinite(r.grad_norm));
    CHECK(r.step == 1);
    CHECK(r.consecutive_skips == i + 1);
  }
  for (size_t i = 0; i < params.storage().size(); ++i) {
    CHECK(test::bitwise_equal(params.storage()[i].tensor, before.storage()[i].tensor));
    CHECK(test::bitwise_equal(opt.m().storage()[i].tensor, m_before.storage()[i].tensor));
  }
  // A finite step resets the run of skips.
  const StepResult ok = opt.step(grads, 1e-3f);
  CHECK_FALSE(ok.skipped);
  CHECK(ok.step == 2);
  CHECK(opt.counters().consecutive_skips == 0);
  CHECK(opt.counters().skipped_total == 2);
  opt.step(bad, 1e-3f);
  opt.step(bad, 1e-3f);
  CHECK_THROWS_WITH(opt.step(bad, 1e-3f), Catch::Contains("max_consecutive_skips = 3") &&
                                              Catch::Contains("3 steps in a row"));
}

TEST_CASE("AdamW writes the new parameters into a bf16 rollout copy", "[unit]") {
  const ModelConfig config = tiny_config(false);
  Weights params(config, DType::f32), rollout(config, DType::bf16);
  fill_random(params, 21);
  rollout.zero();
  AdamW opt(params, {});
  Weights grads(config, DType::f32, Device::cpu(), ArenaClass::gradients);
  fill_random(grads, 22);
  opt.step(grads, 1e-2f, &rollout);
  Weights expected(config, DType::bf16);
  expected.copy_from(params);
  for (size_t i = 0; i < params.storage().size(); ++i) {
    CHECK(test::bitwise_equal(rollout.storage()[i].tensor, expected.storage()[i].tensor));
  }
  Weights other(tiny_config(true), DType::f32, Device::cpu(), ArenaClass::gradients);
  CHECK_THROWS_WITH(opt.step(other, 1e-2f), Catch::Contains("gradients"));
  AdamWConfig badc;
  badc.beta2 = 1.0f;
  CHECK_THROWS_WITH(AdamW(params, badc), Catch::Contains("optimizer.beta2"));
}

// ---------------------------------------------------------------------------------------------
// Learning-rate schedules.

TEST_CASE("LR schedules give the HF and verl values at their key steps", "[unit]") {
  const double lr = 1e-3;
  auto near = [&](float got, double factor) {
    return std::abs(static_cast<double>(got) - lr * factor) <= 1e-6 * lr;
  };
  LrScheduleConfig c;
  c.lr = 1e-3f;
  {
    const LrSchedule s(c);
    CHECK(near(s.lr_at(0), 1.0));
    CHECK(near(s.lr_at(12345), 1.0));
  }
  c.kind = LrScheduleKind::warmup_constant;
  c.warmup_steps = 10;
  {
    const LrSchedule s(c);
    CHECK(s.lr_at(0) == 0.0f);
    CHECK(near(s.lr_at(5), 0.5));
    CHECK(near(s.lr_at(9), 0.9));
    CHECK(near(s.lr_at(10), 1.0));
    CHECK(near(s.lr_at(1000), 1.0));
  }
  c.kind = LrScheduleKind::cosine;
  c.total_steps = 110;
  c.min_lr_ratio = 0.1;
  {
    const LrSchedule s(c);
    CHECK(s.lr_at(0) == 0.0f);
    CHECK(near(s.lr_at(10), 1.0));                                           // warmup end
    CHECK(near(s.lr_at(60), 0.55));                                          // mid: (1 + min) / 2
    CHECK(near(s.lr_at(35), 0.55 + 0.45 * std::cos(std::numbers::pi / 4)));  // a quarter in
    CHECK(near(s.lr_at(110), 0.1));                                          // end
    CHECK(near(s.lr_at(500), 0.1));                                          // past the end
  }
  c.min_lr_ratio = 0.0;  // exactly HF's get_cosine_schedule_with_warmup
  c.warmup_steps = 0;
  c.warmup_ratio = 0.1;  // verl: int(0.1 * 110) = 11 warmup steps
  {
    const LrSchedule s(c);
    CHECK(s.warmup_steps() == 11);
    CHECK(near(s.lr_at(11), 1.0));
    const double progress = (50.0 - 11.0) / 99.0;
    CHECK(near(s.lr_at(50), 0.5 * (1.0 + std::cos(std::numbers::pi * progress))));
    CHECK(s.lr_at(110) == 0.0f);
  }
  c.kind = LrScheduleKind::linear;
  c.warmup_ratio = 0.0;
  c.total_steps = 100;
  c.min_lr_ratio = 0.2;
  {
    const LrSchedule s(c);
    CHECK(near(s.lr_at(0), 1.0));
    CHECK(near(s.lr_at(50), 0.6));
    CHECK(near(s.lr_at(100), 0.2));
    CHECK(near(s.lr_at(200), 0.2));
  }
  CHECK(lr_schedule_from_name("cosine", "job.toml") == LrScheduleKind::cosine);
}

TEST_CASE("LR schedule configs with bad values name the field", "[unit]") {
  auto fails = [](LrScheduleConfig c, const std::string& field) {
    CHECK_THROWS_WITH(LrSchedule(c), Catch::Contains(field));
  };
  LrScheduleConfig c;
  c.kind = LrScheduleKind::cosine;
  fails(c, "lr_schedule.total_steps");
  c.total_steps = 10;
  c.warmup_steps = -1;
  fails(c, "lr_schedule.warmup_steps");
  c.warmup_steps = 20;
  fails(c, "exceeds lr_schedule.total_steps");
  c.warmup_steps = 2;
  c.warmup_ratio = 0.1;
  fails(c, "not both");
  c.warmup_ratio = 0.0;
  c.min_lr_ratio = 1.5;
  fails(c, "lr_schedule.min_lr_ratio");
  c.min_lr_ratio = 0.0;
  c.lr = std::numeric_limits<float>::infinity();
  fails(c, "lr_schedule.lr");
  LrScheduleConfig k;
  k.warmup_steps = 3;
  fails(k, "warmup_constant");
  CHECK_THROWS_WITH(lr_schedule_from_name("cosin", "job.toml line 7"),
                    Catch::Contains("job.toml line 7") && Catch::Contains("'cosin'"));
}

}  // namespace
}  // namespace tandem::trainer
