// Tests of pipeline stages: a model part's Weights (global names, copies, random init) and the
// decoder's forward_stage / backward_stage, run in sequence within one thread, against the whole
// model's decoder bitwise; micro-batches of different lengths in 1F1B order through the slots.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/decoder.h"
#include "model/hf.h"
#include "model/shard_layout.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/model/unit_call_recorder.h"
#include "tests/testutil.h"
#include "trainer/checkpoint.h"
#include "trainer/optimizer.h"
#include "trainer/parallel/grid.h"
#include "trainer/parallel/pipeline_schedule.h"

namespace tandem::model {
namespace {

using Kind = test::TinyKind;

ModelConfig config_of(Kind kind, int64_t layers) {
  ModelConfig c = test::tiny_model_config(kind);
  c.num_layers = layers;
  return c;
}

// A GRPO-like micro-batch: groups of completions sharing a prompt (packed once, head_rows on the
// completions) and a lone pair; `seed` varies the lengths and tokens.
PackedBatch prompts_batch(int64_t V, uint64_t seed) {
  const int k = static_cast<int>(seed % 5);
  const auto prompts = test::random_sequences({9 + k, 4, 3 + k}, V, seed);
  const auto comps = test::random_sequences({3, 6 + k, 2, 5, 4 + k, 7}, V, seed + 100);
  const std::vector<size_t> prompt_of{0, 0, 0, 1, 2, 2};
  std::vector<PackedBatch::PromptCompletion> pairs;
  for (size_t i = 0; i < comps.size(); ++i) pairs.push_back({prompts[prompt_of[i]], comps[i]});
  return PackedBatch::from_prompts(pairs, true);
}

// Storage tensors by name.
std::unordered_map<std::string, Tensor> by_name(const Weights& w) {
  std::unordered_map<std::string, Tensor> out;
  for (const NamedTensor& s : w.storage()) out.emplace(s.name, s.tensor);
  return out;
}

// The P parts of a pipeline over `whole`'s model (trainer::stage_layers' split), each with its
// weights copied from whole, its zeroed gradients and a decoder with P - s slots.
struct Pipeline {
  Pipeline(const Weights& whole, int stages, DecoderOptions options) {
    const ModelConfig& c = whole.config();
    for (int s = 0; s < stages; ++s) {
      const trainer::StageLayers l =
          trainer::stage_layers(static_cast<int>(c.num_layers), s, stages);
      const ModelPart part = ModelPart::stage(c, l.first, l.end - l.first);
      w.push_back(std::make_unique<Weights>(c, part, DType::f32));
      w.back()->copy_from(whole);
      g.push_back(
          std::make_unique<Weights>(c, part, DType::f32, Device::cpu(), ArenaClass::gradients));
      g.back()->zero();
      options.pipeline_slots = stages - s;
      dec.push_back(std::make_unique<Decoder>(*w.back(), options));
    }
  }
  int stages() const { return static_cast<int>(dec.size()); }
  std::vector<std::unique_ptr<Weights>> w, g;
  std::vector<std::unique_ptr<Decoder>> dec;
};

// One micro-batch's tensors: its batch, dlogprob and dentropy, outputs, and the hidden states and
// gradients at every stage boundary.
struct Micro {
  PackedBatch batch;
  Tensor dlogprob, dentropy, logprob, entropy;
  std::vector<Tensor> h, dh;  // (T, C) each: stage s's output, dL/d(stage s + 1's input)

  Micro(PackedBatch b, const ModelConfig& c, int stages, uint64_t seed) : batch(std::move(b)) {
    const int64_t T = batch.num_tokens();
    dlogprob = test::random_tensor({T}, DType::f32, seed, -1.0, 1.0);
    dentropy = test::random_tensor({T}, DType::f32, seed + 1, -0.5, 0.5);
    logprob = Tensor::empty({T}, DType::f32);
    entropy = Tensor::empty({T}, DType::f32);
    for (int s = 0; s + 1 < stages; ++s) {
      h.push_back(Tensor::empty({T, c.hidden_size}, DType::f32));
      dh.push_back(Tensor::empty({T, c.hidden_size}, DType::f32));
    }
  }
};

constexpr float kTemperature = 0.9f;

void stage_forward(Pipeline& p, int s, int64_t id, Micro& m) {
  const Tensor h_in = s == 0 ? Tensor() : m.h[static_cast<size_t>(s - 1)];
  if (s + 1 == p.stages())
    p.dec[static_cast<size_t>(s)]->forward_stage(id, m.batch, h_in, m.logprob, m.entropy,
                                                 kTemperature);
  else
    p.dec[static_cast<size_t>(s)]->forward_stage(id, m.batch, h_in, m.h[static_cast<size_t>(s)]);
}

void stage_backward(Pipeline& p, int s, int64_t id, Micro& m) {
  const Tensor dh_in = s == 0 ? Tensor() : m.dh[static_cast<size_t>(s - 1)];
  Weights& g = *p.g[static_cast<size_t>(s)];
  if (s + 1 == p.stages())
    p.dec[static_cast<size_t>(s)]->backward_stage(id, m.dlogprob, m.dentropy, g, dh_in);
  else
    p.dec[static_cast<size_t>(s)]->backward_stage(id, m.dh[static_cast<size_t>(s)], g, dh_in);
}

// Every stage's tensors against whole's of the same name, bitwise; `skip`: a name left out.
void check_parts_equal_whole(const Pipeline& p, const Weights& whole, const std::string& skip) {
  const auto want = by_name(whole);
  for (int s = 0; s < p.stages(); ++s)
    for (const NamedTensor& t : p.g[static_cast<size_t>(s)]->storage()) {
      if (t.name == skip) continue;
      INFO("stage " << s << " " << t.name);
      CHECK(test::bitwise_equal(t.tensor, want.at(t.name)));
    }
}

TEST_CASE("a model part's weights hold its layers under their global names", "[unit]") {
  for (const bool tied : {true, false}) {
    INFO((tied ? "tied" : "untied"));
    const ModelConfig c = config_of(tied ? Kind::qwen2 : Kind::qwen3, 4);
    Weights whole(c, DType::f32);
    init_random(whole, 5);
    const size_t layer_names = whole.named().size() - (tied ? 2 : 3);  // of the 4 layers
    REQUIRE(layer_names % 4 == 0);

    Weights mid(c, ModelPart{2, 2, false, false}, DType::f32);
    CHECK(!mid.whole());
    CHECK(mid.layers.size() == 2);
    CHECK(!mid.embed.defined());
    CHECK(!mid.final_norm.defined());
    CHECK(!mid.lm_head.defined());
    CHECK(mid.named().size() == layer_names / 2);
    int in2 = 0, in3 = 0;
    for (const NamedTensor& t : mid.named()) {
      INFO(t.name);
      in2 += t.name.starts_with("model.layers.2.");
      in3 += t.name.starts_with("model.layers.3.");
      CHECK(t.tensor.defined());
    }
    CHECK(in2 == static_cast<int>(layer_names / 4));
    CHECK(in3 == static_cast<int>(layer_names / 4));
    for (const NamedTensor& t : mid.storage())
      CHECK((t.name.starts_with("model.layers.2.") || t.name.starts_with("model.layers.3.")));
    CHECK(mid.find("model.layers.0.input_layernorm.weight") == nullptr);
    CHECK_THROWS_WITH(mid.at("model.norm.weight"), Catch::Contains("layers 2..3 of 4"));
    // layers[i] is global layer 2 + i: the copy from the whole model lands there.
    mid.copy_from(whole);
    CHECK(test::bitwise_equal(mid.layers[1].down, whole.layers[3].down));
    CHECK(test::bitwise_equal(mid.at("model.layers.2.self_attn.q_proj.weight"),
                              whole.at("model.layers.2.self_attn.q_proj.weight")));

    // The first stage holds the embedding, the last the norm and the head (tied: its own copy of
    // the embedding matrix, under the embedding's name).
    const ModelPart first = ModelPart::stage(c, 0, 2), last = ModelPart::stage(c, 2, 2);
    CHECK((first.embedding && !first.head && !last.embedding && last.head));
    Weights w0(c, first, DType::f32), w1(c, last, DType::f32);
    CHECK((w0.embed.defined() && !w0.lm_head.defined() && !w0.final_norm.defined()));
    CHECK((!w1.embed.defined() && w1.lm_head.defined() && w1.final_norm.defined()));
    CHECK((w1.find("lm_head.weight") != nullptr) == !tied);
    if (tied) CHECK(w1.find("model.embed_tokens.weight") != nullptr);
    CHECK(w0.num_parameters() + w1.num_parameters() ==
          whole.num_parameters() + (tied ? c.vocab_size * c.hidden_size : 0));

    // init_random gives a part the whole model's values (a tied head copy the embedding's).
    init_random(w0, 5);
    init_random(w1, 5);
    const auto want = by_name(whole);
    for (const Weights* part : {&w0, &w1})
      for (const NamedTensor& t : part->storage()) {
        INFO(t.name);
        CHECK(test::bitwise_equal(t.tensor, want.at(t.name)));
      }
    CHECK(test::bitwise_equal(w1.lm_head, whole.lm_head));

    // A part copies only from a table that holds all of it.
    Weights other(c, ModelPart{1, 2, false, false}, DType::f32);
    CHECK_THROWS_WITH(other.copy_from(mid), Catch::Contains("model.layers.1."));
    // An unbound part binds its own storage tensors.
    const auto table = Weights::unbound(c, last, DType::f32);
    int64_t n = 0;
    for (size_t i = 0; i < table->storage().size(); ++i) n += table->storage_shape(i).numel();
    CHECK(n == w1.num_parameters());
    const Tensor flat = Tensor::empty({n}, DType::f32);
    table->bind(0, table->storage().size(), flat);
    CHECK((table->lm_head.defined() && table->layers[1].gate.defined()));
    CHECK_THROWS_WITH(Weights(c, ModelPart{3, 2, false, true}, DType::f32),
                      Catch::Contains("layers [3, 5)"));
  }
}

TEST_CASE(
    "a model part steps under AdamW as the whole model; sharded AdamW, checkpoints and "
    "save_hf refuse one",
    "[unit]") {
  const ModelConfig c = config_of(Kind::qwen2, 4);  // tied: the last stage's copy steps too
  const ModelPart last = ModelPart::stage(c, 2, 2);
  Weights whole(c, DType::f32), part(c, last, DType::f32);
  init_random(whole, 11);
  part.copy_from(whole);
  // Without clipping the update is per element: the part's tensors step as the whole model's.
  const trainer::AdamWConfig config{.max_grad_norm = 0.0f};
  trainer::AdamW whole_opt(whole, config), part_opt(part, config);
  for (int step = 0; step < 2; ++step) {
    Weights& gw = whole_opt.gradients();
    init_random(gw, 20 + static_cast<uint64_t>(step));
    part_opt.gradients().copy_from(gw);
    whole_opt.step(gw, 1e-2f);
    part_opt.step(part_opt.gradients(), 1e-2f);
  }
  const auto want = by_name(whole);
  for (const NamedTensor& t : part.storage()) {
    INFO(t.name);
    CHECK(test::bitwise_equal(t.tensor, want.at(t.name)));
  }
  CHECK(part_opt.m().part() == last);
  const test::TempDir dir("part_refused");
  CHECK_THROWS_WITH(trainer::save_checkpoint(dir.file("ckpt"), 1, part, part_opt, {}),
                    Catch::Contains("checkpoint: the policy holds a model part"));
  CHECK_THROWS_WITH(save_hf(part, dir.file("hf")), Catch::Contains("model part"));
}

// Runs one micro-batch through the whole model and through P stages in sequence (forward 0..P-1,
// backward P-1..0) and checks the logprobs, entropies and gradients bitwise.
void check_stages_match_whole(Kind kind, int64_t layers, int stages, const PackedBatch& batch,
                              bool recompute) {
  const ModelConfig c = config_of(kind, layers);
  Weights whole(c, DType::f32);
  init_random(whole, 40 + static_cast<uint64_t>(kind));
  Weights whole_g(c, DType::f32, Device::cpu(), ArenaClass::gradients);
  whole_g.zero();
  const DecoderOptions options{.max_tokens = 32, .recompute = recompute};
  Decoder dec(whole, options);
  Micro ref(batch, c, stages, 7), m(batch, c, stages, 7);
  dec.forward(ref.batch, ref.logprob, ref.entropy, kTemperature);
  dec.backward(ref.dlogprob, ref.dentropy, whole_g);

  Pipeline p(whole, stages, options);
  for (int s = 0; s < stages; ++s) stage_forward(p, s, 0, m);
  for (int s = stages - 1; s >= 0; --s) {
    // Tied: the head's lm_head gradient joins the embedding's before the embedding's scatter-add,
    // as the whole model adds them (the trainer sums the two copies instead).
    if (s == 0 && c.tie_word_embeddings) p.g[0]->embed.copy_from(p.g.back()->lm_head);
    stage_backward(p, s, 0, m);
  }
  CHECK(test::bitwise_equal(m.logprob, ref.logprob));
  CHECK(test::bitwise_equal(m.entropy, ref.entropy));
  // Tied: the last stage's copy holds the head's part only, checked through stage 0's sum.
  check_parts_equal_whole(p, whole_g, c.tie_word_embeddings ? "model.embed_tokens.weight" : "");
  if (c.tie_word_embeddings)
    CHECK(test::bitwise_equal(p.g[0]->embed, whole_g.embed));
  else
    CHECK(test::bitwise_equal(p.g.back()->lm_head, whole_g.lm_head));
}

TEST_CASE("pipeline stages in sequence give the whole model's logprobs and gradients bitwise",
          "[unit]") {
  for (Kind kind : {Kind::llama_tied, Kind::llama_untied_rope3, Kind::qwen2, Kind::qwen3}) {
    for (int stages : {2, 3}) {
      INFO(test::tiny_kind_name(kind) << ", " << stages << " stages");
      const int64_t V = test::tiny_model_config(kind).vocab_size;
      // Every row through the head, and a GRPO layout (shared prompts, head_rows).
      check_stages_match_whole(
          kind, 5, stages, PackedBatch::from_sequences(test::random_sequences({9, 4, 13}, V, 60)),
          false);
      check_stages_match_whole(kind, 5, stages, prompts_batch(V, 70), false);
    }
  }
  // With recompute, each stage recomputes its own layers.
  check_stages_match_whole(Kind::qwen3, 4, 3, prompts_batch(101, 80), true);
  check_stages_match_whole(Kind::qwen2, 4, 2, prompts_batch(101, 81), true);
}

// Runs the micro-batches through the pipeline in 1F1B order (trainer::one_f_one_b), one thread
// taking each stage's next action once its input is there.
void run_one_f_one_b(Pipeline& p, std::vector<Micro>& micro) {
  const int P = p.stages(), n = static_cast<int>(micro.size());
  std::vector<std::vector<trainer::PipeAction>> plan;
  for (int s = 0; s < P; ++s) plan.push_back(trainer::one_f_one_b(s, P, n));
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  // forwarded[s][i], backwarded[s][i]: stage s has run that pass of micro-batch i.
  std::vector<std::vector<bool>> fwd(static_cast<size_t>(P), std::vector<bool>(micro.size())),
      bwd = fwd;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      const auto su = static_cast<size_t>(s);
      if (next[su] == plan[su].size()) continue;
      const trainer::PipeAction a = plan[su][next[su]];
      const auto i = static_cast<size_t>(a.micro_batch);
      if (a.pass == trainer::PipePass::forward) {
        if (s > 0 && !fwd[su - 1][i]) continue;
        stage_forward(p, s, a.micro_batch, micro[i]);
        fwd[su][i] = true;
      } else {
        if (s + 1 < P && !bwd[su + 1][i]) continue;
        stage_backward(p, s, a.micro_batch, micro[i]);
        bwd[su][i] = true;
      }
      ++next[su];
      progress = true;
    }
  }
  for (int s = 0; s < P; ++s)
    REQUIRE(next[static_cast<size_t>(s)] == plan[static_cast<size_t>(s)].size());
}

TEST_CASE("1F1B through pipeline slots gives the gradients of micro-batches run one by one",
          "[unit]") {
  for (Kind kind : {Kind::qwen2, Kind::qwen3}) {
    for (const bool recompute : {false, true}) {
      INFO(test::tiny_kind_name(kind) << (recompute ? ", recompute" : ""));
      const ModelConfig c = config_of(kind, 4);
      const int P = 3;
      Weights whole(c, DType::f32);
      init_random(whole, 90 + static_cast<uint64_t>(kind));
      const DecoderOptions options{.max_tokens = 16, .recompute = recompute};
      // Five micro-batches of different lengths, every one of them above max_tokens: the slots
      // grow.
      std::vector<Micro> piped, single;
      for (uint64_t i = 0; i < 5; ++i) {
        const PackedBatch b = i % 2 == 0
                                  ? prompts_batch(c.vocab_size, 200 + i)
                                  : PackedBatch::from_sequences(test::random_sequences(
                                        {5 + static_cast<int>(i), 17}, c.vocab_size, 300 + i));
        piped.emplace_back(b, c, P, 400 + 2 * i);
        single.emplace_back(b, c, P, 400 + 2 * i);
      }
      REQUIRE(piped[0].batch.num_tokens() != piped[2].batch.num_tokens());

      Pipeline pipe(whole, P, options);
      run_one_f_one_b(pipe, piped);
      // The same stages, one micro-batch at a time (forward through all, backward through all).
      Pipeline one(whole, P, options);
      for (size_t i = 0; i < single.size(); ++i) {
        for (int s = 0; s < P; ++s) stage_forward(one, s, static_cast<int64_t>(i), single[i]);
        for (int s = P - 1; s >= 0; --s) stage_backward(one, s, static_cast<int64_t>(i), single[i]);
      }
      for (size_t i = 0; i < piped.size(); ++i) {
        INFO("micro-batch " << i);
        CHECK(test::bitwise_equal(piped[i].logprob, single[i].logprob));
        CHECK(test::bitwise_equal(piped[i].entropy, single[i].entropy));
      }
      for (int s = 0; s < P; ++s) {
        const auto want = by_name(*one.g[static_cast<size_t>(s)]);
        for (const NamedTensor& t : pipe.g[static_cast<size_t>(s)]->storage()) {
          INFO("stage " << s << " " << t.name);
          CHECK(test::bitwise_equal(t.tensor, want.at(t.name)));
        }
      }
      // Untied, every parameter sums the micro-batches in the same order as the whole model's
      // decoder run on them one after the other.
      if (!c.tie_word_embeddings) {
        Weights whole_g(c, DType::f32, Device::cpu(), ArenaClass::gradients);
        whole_g.zero();
        Decoder dec(whole, options);
        for (Micro& m : single) {
          dec.forward(m.batch, m.logprob, m.entropy, kTemperature);
          dec.backward(m.dlogprob, m.dentropy, whole_g);
        }
        check_parts_equal_whole(pipe, whole_g, "");
      }
    }
  }
}

TEST_CASE("pipeline stage misuse throws naming the micro-batch, the slots or the shape", "[unit]") {
  const ModelConfig c = config_of(Kind::qwen3, 4);
  Weights whole(c, DType::f32);
  init_random(whole, 3);
  const ModelPart first = ModelPart::stage(c, 0, 2), last = ModelPart::stage(c, 2, 2);
  Weights w0(c, first, DType::f32), w1(c, last, DType::f32);
  w0.copy_from(whole);
  w1.copy_from(whole);
  Weights g0(c, first, DType::f32, Device::cpu(), ArenaClass::gradients);
  Decoder d0(w0, {.max_tokens = 16, .pipeline_slots = 2});
  Decoder d1(w1, {.max_tokens = 16});
  const PackedBatch b =
      PackedBatch::from_sequences(test::random_sequences({7, 6}, c.vocab_size, 1));
  const int64_t T = b.num_tokens(), C = c.hidden_size;
  Tensor h = Tensor::empty({T, C}, DType::f32), dh = Tensor::empty({T, C}, DType::f32);
  Tensor lp = Tensor::empty({T}, DType::f32);

  CHECK_THROWS_WITH(d0.backward_stage(7, dh, g0, Tensor()),
                    Catch::Contains("micro-batch 7 is not in flight (in flight: none)"));
  d0.forward_stage(3, b, Tensor(), h);
  CHECK_THROWS_WITH(d0.forward_stage(3, b, Tensor(), h),
                    Catch::Contains("micro-batch 3 is already in flight"));
  d0.forward_stage(5, b, Tensor(), h);
  CHECK_THROWS_WITH(d0.forward_stage(6, b, Tensor(), h),
                    Catch::Contains("micro-batches 3, 5), but DecoderOptions::pipeline_slots = 2"));
  CHECK_THROWS_WITH(d0.backward_stage(4, dh, g0, Tensor()),
                    Catch::Contains("micro-batch 4 is not in flight (in flight: 3, 5)"));
  // The first stage embeds: no h_in, no dh_in; h_out and dh_out (T, C).
  CHECK_THROWS_WITH(d1.forward_stage(0, b, Tensor(), lp, Tensor(), 1.0f),
                    Catch::Contains("micro-batch 0's h_in must be f32(11, 64)"));
  CHECK_THROWS_WITH(
      d1.forward_stage(0, b, Tensor::empty({T + 1, C}, DType::f32), lp, Tensor(), 1.0f),
      Catch::Contains("got f32(12, 64)"));
  CHECK_THROWS_WITH(
      d0.backward_stage(3, Tensor::empty({T, C - 1}, DType::f32), g0, Tensor()),
      Catch::Contains("backward_stage of micro-batch 3's dh_out must be f32(11, 64)"));
  CHECK_THROWS_WITH(d0.backward_stage(3, dh, g0, dh), Catch::Contains("dh_in must be undefined"));
  // Each part its own calls: the head's outputs on the last stage only.
  CHECK_THROWS_WITH(d0.forward_stage(1, b, Tensor(), lp, Tensor(), 1.0f),
                    Catch::Contains("has no head"));
  CHECK_THROWS_WITH(d1.forward_stage(1, b, h, h), Catch::Contains("holds the head"));
  // Gradients of another part, and the whole-model calls.
  Weights g1(c, last, DType::f32, Device::cpu(), ArenaClass::gradients);
  CHECK_THROWS_WITH(d0.backward_stage(3, dh, g1, Tensor()), Catch::Contains("same model and part"));
  CHECK_THROWS_WITH(d0.forward(b, lp, Tensor()), Catch::Contains("model part (layers 0..1 of 4"));
  CHECK_THROWS_WITH(d0.score(b, lp, Tensor()), Catch::Contains("forward_stage and backward_stage"));
  // A stage's slot is consumed by its backward; drop_stage forgets one.
  g0.zero();
  d0.backward_stage(5, dh, g0, Tensor());
  d0.drop_stage(3);
  CHECK_THROWS_WITH(d0.backward_stage(3, dh, g0, Tensor()),
                    Catch::Contains("micro-batch 3 is not in flight (in flight: none)"));
  // A whole-model call drops every micro-batch in flight, and a stage call forward's state.
  Decoder dw(whole, {.max_tokens = 16, .pipeline_slots = 2});
  Weights gw(c, DType::f32, Device::cpu(), ArenaClass::gradients);
  dw.forward_stage(0, b, Tensor(), lp, Tensor(), 1.0f);
  dw.forward(b, lp, Tensor());
  CHECK_THROWS_WITH(dw.backward_stage(0, lp, Tensor(), gw, Tensor()),
                    Catch::Contains("micro-batch 0 is not in flight (in flight: none)"));
  dw.forward(b, lp, Tensor());
  dw.forward_stage(1, b, Tensor(), lp, Tensor(), 1.0f);
  CHECK_THROWS_WITH(dw.backward(lp, Tensor(), gw), Catch::Contains("no training forward"));
  // Memory: a stage plans its own layers (and no head) per slot.
  Decoder d0_one(w0, {.max_tokens = 16});
  CHECK(d0.activation_bytes() == 2 * d0_one.activation_bytes());
  CHECK(d0_one.activation_bytes() < Decoder(whole, {.max_tokens = 16}).activation_bytes());
}

}  // namespace

TEST_CASE(
    "a pipeline stage's decoder makes the unit calls walk_unit_calls makes on the units its "
    "shard layout numbers",
    "[unit]") {
  using Recorder = test::UnitCallRecorder;
  for (const Kind kind : {Kind::llama_tied, Kind::llama_untied_rope3}) {
    const ModelConfig c = config_of(kind, 4);
    Weights whole(c, DType::f32);
    init_random(whole, 9);
    for (const int stages : {1, 2, 3}) {
      INFO(test::tiny_kind_name(kind) << ", " << stages << " stages");
      Pipeline p(whole, stages, {.max_tokens = 64});
      std::vector<Recorder> forward(static_cast<size_t>(stages)), backward = forward;
      for (int s = 0; s < stages; ++s) {
        const ModelPart& part = p.w[static_cast<size_t>(s)]->part();
        // The units PartUnits numbers are the shard layout's of the part's table.
        const ShardLayout layout(*p.w[static_cast<size_t>(s)], 2);
        const PartUnits units(c, part);
        REQUIRE(layout.units().size() == units.count);
        if (part.embedding) CHECK(layout.units()[units.embed].name == "model.embed_tokens");
        for (int64_t l = 0; l < part.num_layers; ++l)
          CHECK(layout.units()[units.layer(l)].name ==
                "model.layers." + std::to_string(part.first_layer + l));
        if (part.head) CHECK(layout.units()[units.head].name == "head");
        if (units.head_embed != PartUnits::kNone)
          CHECK(layout.units()[units.head_embed].name == "model.embed_tokens");
        CHECK((units.head_embed != PartUnits::kNone) == (part.head && c.tie_word_embeddings));
        p.dec[static_cast<size_t>(s)] = std::make_unique<Decoder>(
            *p.w[static_cast<size_t>(s)],
            DecoderOptions{.max_tokens = 64, .unit_hooks = &forward[static_cast<size_t>(s)]});
      }
      Micro m(prompts_batch(c.vocab_size, 4), c, stages, 31);
      for (int s = 0; s < stages; ++s) stage_forward(p, s, 0, m);
      for (int s = 0; s < stages; ++s)  // the same decoders, now recording backward's calls
        p.dec[static_cast<size_t>(s)] = std::make_unique<Decoder>(
            *p.w[static_cast<size_t>(s)],
            DecoderOptions{.max_tokens = 64, .unit_hooks = &backward[static_cast<size_t>(s)]});
      for (int s = 0; s < stages; ++s) stage_forward(p, s, 0, m);
      for (int s = 0; s < stages; ++s) backward[static_cast<size_t>(s)].calls.clear();
      for (int s = stages - 1; s >= 0; --s) stage_backward(p, s, 0, m);
      for (int s = 0; s < stages; ++s) {
        INFO("stage " << s);
        const ModelPart& part = p.w[static_cast<size_t>(s)]->part();
        Recorder want_f, want_b;
        walk_unit_calls(c, part, UnitPass::forward, want_f);
        walk_unit_calls(c, part, UnitPass::backward, want_b);
        CHECK(forward[static_cast<size_t>(s)].calls == want_f.calls);
        CHECK(backward[static_cast<size_t>(s)].calls == want_b.calls);
        // Every unit's gradients are opened and closed once, every acquire released.
        std::vector<int> open(PartUnits(c, part).count, 0), held = open;
        for (const std::string& call : want_b.calls) {
          const size_t u = std::stoul(call.substr(call.find(' ') + 1));
          if (call.starts_with("begin")) ++open[u];
          if (call.starts_with("end")) CHECK(--open[u] == 0);
          if (call.starts_with("acquire")) ++held[u];
          if (call.starts_with("release")) CHECK(--held[u] == 0);
        }
        CHECK(std::all_of(open.begin(), open.end(), [](int n) { return n == 0; }));
      }
    }
  }
}

}  // namespace tandem::model
