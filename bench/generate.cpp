// `tandem bench generate`: batch-1 greedy generation through the rollout engine with a real
// model (SmolLM2-135M-Instruct by default): decode and prefill tokens/s and load time, beside
// llama.cpp (llama-cpp-python on the
// same GGUF, bench/peers/llamacpp_generate.py, run in the same invocation) and the memory-bandwidth
// bound of decoding (measured bandwidth / bytes of the weights read per token).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/peers.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/loader.h"
#include "rollout/engine.h"

namespace tandem::bench {
namespace {

namespace fs = std::filesystem;

nlohmann::json run_peer(const std::string& model, const std::vector<int32_t>& prompt,
                        int64_t new_tokens, int repeats) {
  return run_peer_script(
      "llamacpp_generate.py",
      fmt::format("--model '{}' --prompt-ids {} --new-tokens {} --threads {} "
                  "--repeats {}",
                  model, fmt::join(prompt, ","), new_tokens, num_threads(), repeats));
}

void print(const Options& opt, const nlohmann::ordered_json& j) { print_line(opt, j); }

// One greedy request of new_tokens tokens (no stop ids, so always that many): the engine's first
// step prefills the prompt and samples the first token; every later step decodes one token.
struct Run {
  std::vector<int32_t> tokens;
  double prefill_seconds = 0;
  double decode_seconds = 0;  // the steps after the first token
  double decode_tokens_per_second() const {
    return decode_seconds > 0 ? static_cast<double>(tokens.size() - 1) / decode_seconds : 0.0;
  }
};

Run generate(rollout::Engine& engine, const std::vector<int32_t>& prompt, int64_t new_tokens) {
  rollout::Request request{"bench", prompt, {}};
  request.params.temperature = 0.0f;
  request.params.max_tokens = static_cast<int>(new_tokens);
  engine.submit(std::move(request));
  Run run;
  auto t0 = std::chrono::steady_clock::now();
  engine.step();
  run.prefill_seconds = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  while (engine.has_work()) engine.step();
  run.decode_seconds = seconds_since(t0);
  std::vector<rollout::RequestOutput> out = engine.poll();
  TANDEM_CHECK(out.size() == 1 && out[0].status == rollout::RequestStatus::done &&
                   out[0].samples.size() == 1 &&
                   static_cast<int64_t>(out[0].samples[0].tokens.size()) == new_tokens,
               "bench generate: the engine did not return {} tokens for the prompt ({})",
               new_tokens, out.empty() ? std::string("no output") : out[0].error);
  run.tokens = std::move(out[0].samples[0].tokens);
  return run;
}

// One sequence: the prompt computed in one step, its blocks never served from the prefix cache
// (each repeat computes the whole prompt again).
rollout::EngineOptions batch1_options(int64_t prompt_len, int64_t new_tokens) {
  rollout::EngineOptions eo;
  eo.block_size = 16;
  eo.max_context = prompt_len + new_tokens;
  eo.num_blocks = (eo.max_context + eo.block_size - 1) / eo.block_size;
  eo.max_batch_tokens = prompt_len;
  eo.max_seqs = 1;
  eo.prefix_cache = false;
  return eo;
}

}  // namespace

int run_generate_bench(const Options& opt, const std::string& model_path) {
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const int64_t prompt_len = 64, new_tokens = opt.quick ? 16 : 64;
  const int repeats = opt.quick ? 1 : 3;
  const Ceilings ceilings = measure_ceilings(opt);

  // A fixed prompt of 64 tokens.
  model::LoadedModel probe = model::load_model(path, DType::f32);
  std::string text;
  std::vector<int32_t> prompt;
  for (int i = 0; static_cast<int64_t>(prompt.size()) < prompt_len; ++i) {
    text += fmt::format("Question {}: what is {} plus {}? Answer briefly and explain. ", i, 12 + i,
                        7 * i);
    prompt = probe.tok().encode(text, false);
  }
  prompt.resize(static_cast<size_t>(prompt_len));
  const std::string model_name = fs::path(path).stem().string();

  int errors = 0;
  // llama.cpp on the given GGUF (the same file) and, for each precision tandem computes in, on a
  // GGUF of the same weights at that precision (bench/peers/requant_gguf.py, made once).
  auto peer_on = [&](const std::string& gguf) {
    nlohmann::json r = run_peer(gguf, prompt, new_tokens, repeats);
    if (r.contains("error")) {
      ++errors;
      nlohmann::ordered_json e{{"bench", "generate"},
                               {"case", "llama.cpp peer on " + fs::path(gguf).filename().string()},
                               {"error", r["error"]}};
      std::printf("%s\n", e.dump().c_str());
    }
    return r;
  };
  const bool gguf = path.ends_with(".gguf");
  const nlohmann::json same_file = gguf ? peer_on(path) : nlohmann::json{{"error", "not a GGUF"}};

  for (DType dtype : {DType::f32, DType::bf16}) {
    model::LoadedModel m = model::load_model(path, dtype);
    rollout::Engine engine(*m.weights, batch1_options(prompt_len, new_tokens));
    generate(engine, prompt, new_tokens);  // warm-up
    Run best = generate(engine, prompt, new_tokens);
    for (int r = 1; r < repeats; ++r) {
      Run run = generate(engine, prompt, new_tokens);
      if (run.decode_seconds < best.decode_seconds) best = std::move(run);
    }
    const std::string cs =
        fmt::format("{} {}{} batch 1, prompt {}, {} new", model_name, dtype_name(dtype),
                    opt.precision_suffix(), prompt_len, new_tokens);
    const double decode_tps = best.decode_tokens_per_second();
    const double prefill_tps = static_cast<double>(prompt_len) / best.prefill_seconds;
    const double bytes_per_token = static_cast<double>(m.weights->nbytes());
    const double bound = ceilings.gbytes * 1e9 / bytes_per_token;

    std::string precision_path;
    if (gguf) precision_path = precision_gguf(path, dtype);
    const nlohmann::json same_precision =
        precision_path.empty() ? nlohmann::json{{"error", "no GGUF at this precision"}}
                               : peer_on(precision_path);
    if (gguf && precision_path.empty()) ++errors;

    // One decode and one prefill line per peer run.
    for (const auto* peer : {&same_precision, &same_file}) {
      const bool has = !peer->contains("error");
      const std::string peer_name = peer == &same_file
                                        ? "llama.cpp on the same GGUF"
                                        : fmt::format("llama.cpp on a {} GGUF of the same weights",
                                                      dtype == DType::bf16 ? "BF16" : "F32");
      nlohmann::ordered_json d{
          {"bench", "generate"}, {"case", cs},          {"metric", "decode_tokens_per_s"},
          {"unit", "tokens/s"},  {"value", decode_tps}, {"threads", num_threads()}};
      nlohmann::ordered_json p{{"bench", "generate"},
                               {"case", cs},
                               {"metric", "prefill_tokens_per_s"},
                               {"unit", "tokens/s"},
                               {"value", prefill_tps}};
      if (has) {
        const double peer_tps =
            (*peer)["new_tokens"].get<double>() / std::max((*peer)["decode_s"].get<double>(), 1e-9);
        d["peer"] = peer_name;
        d["peer_value"] = peer_tps;
        d["ratio"] = decode_tps / peer_tps;
        // How many greedy tokens agree from the start.
        const auto peer_tokens = (*peer)["tokens"].get<std::vector<int32_t>>();
        size_t same = 0;
        while (same < std::min(peer_tokens.size(), best.tokens.size()) &&
               peer_tokens[same] == best.tokens[same])
          ++same;
        d["same_greedy_prefix"] = same;
        const double peer_pps =
            (*peer)["prompt_tokens"].get<double>() / (*peer)["prefill_s"].get<double>();
        p["peer"] = peer_name;
        p["peer_value"] = peer_pps;
        p["ratio"] = prefill_tps / peer_pps;
      }
      d["limit"] = bound;
      d["limit_source"] =
          fmt::format("{:.1f} GB/s / {:.0f} MB of weights", ceilings.gbytes, bytes_per_token / 1e6);
      d["fraction_of_limit"] = decode_tps / bound;
      print(opt, d);
      print(opt, p);
    }
    nlohmann::ordered_json l{{"bench", "generate"},
                             {"case", fmt::format("{} {} load", model_name, dtype_name(dtype))},
                             {"metric", "load_seconds"},
                             {"unit", "s"},
                             {"value", m.load_seconds},
                             {"limit", 1.0},
                             {"fraction_of_limit", m.load_seconds / 1.0}};
    print(opt, l);
  }
  return errors == 0 ? 0 : 1;
}

}  // namespace tandem::bench
