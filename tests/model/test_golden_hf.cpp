// Golden parity with Hugging Face transformers (files written by tests/golden/regenerate):
// tiny random Llama, Llama-3 (rope scaling), Qwen2 and Qwen3 models — logits, logprobs,
// entropies of a packed batch and the gradient of the mean logprob w.r.t. every parameter — and
// SmolLM2-135M-Instruct from its Q4_1 GGUF: prompt tokens, logits, logprobs and 32 greedy tokens
// (through the rollout engine).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "model/decoder.h"
#include "model/hf.h"
#include "model/loader.h"
#include "model/safetensors.h"
#include "rollout/engine.h"

using namespace tandem;
using namespace tandem::model;
namespace fs = std::filesystem;

namespace {

const fs::path kRepo = fs::path(TANDEM_SOURCE_DIR);
const fs::path kGolden = kRepo / "tests" / "golden";

// max |a - b| over max |b|: the error relative to the tensor's scale.
struct Err {
  double max_abs = 0, ref = 0;
  double rel() const { return ref > 0 ? max_abs / ref : max_abs; }
};

void add(Err& e, double got, double want) {
  e.max_abs = std::max(e.max_abs, std::abs(got - want));
  e.ref = std::max(e.ref, std::abs(want));
}

std::vector<int32_t> ints(const Tensor& t) {
  const int32_t* p = t.data_as<int32_t>();
  return {p, p + t.numel()};
}

}  // namespace

TEST_CASE("HF golden tiny models logits logprobs entropy and gradients", "[interop]") {
  for (const char* name : {"tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"}) {
    INFO(name);
    const fs::path dir = kGolden / name;
    std::unique_ptr<Weights> w = load_hf(dir.string(), DType::f32);
    SafetensorsFile g((dir / "golden.safetensors").string());
    const std::vector<int32_t> ids = ints(g.view("input_ids"));
    const std::vector<int32_t> cu = ints(g.view("cu_seqlens"));
    const Tensor want_logits = g.view("logits");
    const float* want_lp = g.view("logprobs").data_as<float>();
    const float* want_ent = g.view("entropy").data_as<float>();
    const int64_t V = w->config().vocab_size;

    std::vector<std::vector<int32_t>> seqs;
    std::vector<int64_t> golden_pos;  // golden position of each of our rows
    for (size_t b = 0; b + 1 < cu.size(); ++b) {
      seqs.emplace_back(ids.begin() + cu[b], ids.begin() + cu[b + 1]);
      for (int32_t t = cu[b]; t + 1 < cu[b + 1]; ++t) golden_pos.push_back(t);
    }
    const PackedBatch batch = PackedBatch::from_sequences(seqs);
    const int64_t T = batch.num_tokens();
    REQUIRE(T == static_cast<int64_t>(golden_pos.size()));

    Decoder dec(*w);
    Tensor logits = Tensor::empty({T, V}, DType::f32);
    dec.forward_logits(batch, logits);
    Err e_logits;
    for (int64_t r = 0; r < T; ++r)
      for (int64_t v = 0; v < V; ++v)
        add(e_logits, logits.data_as<float>()[r * V + v],
            want_logits.data_as<float>()[golden_pos[static_cast<size_t>(r)] * V + v]);

    Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
    dec.forward(batch, lp, ent);
    Err e_lp, e_ent;
    for (int64_t r = 0; r < T; ++r) {
      add(e_lp, lp.data_as<float>()[r], want_lp[golden_pos[static_cast<size_t>(r)]]);
      add(e_ent, ent.data_as<float>()[r], want_ent[golden_pos[static_cast<size_t>(r)]]);
    }
    // d(mean logprob over the T targets).
    Tensor dlp = Tensor::empty({T}, DType::f32);
    std::fill_n(dlp.data_as<float>(), T, 1.0f / static_cast<float>(T));
    Weights grads(w->config(), DType::f32, Device::cpu(), ArenaClass::gradients);
    grads.zero();
    dec.backward(dlp, Tensor(), grads);
    Err worst;
    std::string worst_name;
    int checked = 0;
    for (const NamedTensor& nt : grads.named()) {
      const Tensor want = g.view("grad." + nt.name);
      REQUIRE(want.numel() == nt.tensor.numel());
      Err e;
      for (int64_t i = 0; i < want.numel(); ++i)
        add(e, nt.tensor.data_as<float>()[i], want.data_as<float>()[i]);
      if (e.rel() >= worst.rel()) worst = e, worst_name = nt.name;
      ++checked;
    }
    WARN(name << ": rel err logits " << e_logits.rel() << ", logprobs " << e_lp.rel()
              << ", entropy " << e_ent.rel() << ", worst gradient " << worst.rel() << " ("
              << worst_name << ")");
    CHECK(e_logits.rel() <= 1e-4);
    CHECK(e_lp.rel() <= 1e-4);
    CHECK(e_ent.rel() <= 1e-4);
    CHECK(worst.rel() <= 1e-4);
    CHECK(checked == static_cast<int>(grads.named().size()));
  }
}

TEST_CASE("HF golden SmolLM2 GGUF tokens logits and greedy decoding", "[interop]") {
  const fs::path gguf = kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  INFO("the bundled model is fetched by scripts/setup (scripts/fetch-model)");
  REQUIRE(fs::exists(gguf));
  LoadedModel m = load_model(gguf.string(), DType::f32);
  const nlohmann::json prompts =
      nlohmann::json::parse(std::ifstream(kGolden / "smollm2-gguf" / "prompts.json"));
  SafetensorsFile g((kGolden / "smollm2-gguf" / "golden.safetensors").string());
  const int64_t V = m.config().vocab_size;
  Decoder dec(*m.weights);
  rollout::EngineOptions eo;  // one sequence of up to 128 tokens
  eo.max_context = 128;
  eo.num_blocks = eo.max_context / eo.block_size;
  eo.max_batch_tokens = eo.max_context;
  eo.max_seqs = 1;
  rollout::Engine engine(*m.weights, eo);
  for (size_t i = 0; i < prompts["prompts"].size(); ++i) {
    INFO("prompt " << i);
    const auto& p = prompts["prompts"][i];
    const std::string key = "prompt" + std::to_string(i);
    const std::vector<int32_t> want_ids = ints(g.view(key + ".ids"));
    const bool chat = p["rendered"].get<std::string>() != p["text"].get<std::string>();
    CHECK(encode_prompt(m.tok(), p["text"].get<std::string>(), chat) == want_ids);

    // Logits of every prompt position: one extra (ignored) token makes the last position a row.
    std::vector<int32_t> seq = want_ids;
    seq.push_back(0);
    const std::vector<std::vector<int32_t>> seqs{seq};
    const PackedBatch batch = PackedBatch::from_sequences(seqs);
    const int64_t n = static_cast<int64_t>(want_ids.size());
    Tensor logits = Tensor::empty({n, V}, DType::f32);
    dec.forward_logits(batch, logits);
    const Tensor want_last = g.view(key + ".logits_last");
    Err e_logits;
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t v = 0; v < V; ++v)
        add(e_logits, logits.data_as<float>()[(n - 2 + r) * V + v],
            want_last.data_as<float>()[r * V + v]);

    const std::vector<std::vector<int32_t>> prompt_only{want_ids};
    const PackedBatch pb = PackedBatch::from_sequences(prompt_only);
    Tensor lp = Tensor::empty({n - 1}, DType::f32);
    dec.forward(pb, lp, Tensor());
    const float* want_lp = g.view(key + ".logprobs").data_as<float>();
    Err e_lp;
    for (int64_t r = 0; r < n - 1; ++r) add(e_lp, lp.data_as<float>()[r], want_lp[r]);

    // 32 greedy tokens through the rollout engine (no stop ids: always 32).
    rollout::Request request{key, want_ids, {}};
    request.params.temperature = 0.0f;
    request.params.max_tokens = 32;
    const std::vector<rollout::RequestOutput> out = engine.generate({request});
    REQUIRE(out.size() == 1);
    REQUIRE(out[0].samples.size() == 1);
    WARN(key << ": rel err logits " << e_logits.rel() << ", prompt logprobs " << e_lp.rel());
    CHECK(e_logits.rel() <= 1e-3);
    CHECK(e_lp.rel() <= 1e-3);
    CHECK(out[0].samples[0].tokens == ints(g.view(key + ".greedy")));
  }
}
