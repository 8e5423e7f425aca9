// `tandem bench rollout`: aggregate decode tokens/s of the rollout engine at batch 1, 8, 32, 64
// (prompts of 64 tokens, 64 new tokens, greedy) beside llama.cpp's batched API on a GGUF of the
// same weights at the same precision, with the machine's bound, for f32 and bf16 weights in the
// f32 precision and bf16 weights in the bf16 precision; and what group prefix sharing (n = 8
// samples of one prompt) saves in prefill work, KV memory and time.
#include <fmt/format.h>

#include <unistd.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>

#include "bench/bench.h"
#include "bench/peers.h"
#include "core/parallel.h"
#include "kernels/ops.h"
#include "model/loader.h"
#include "rollout/engine.h"

namespace tandem::bench {
namespace {

namespace fs = std::filesystem;

// B distinct prompts of `len` tokens: different texts, so nothing is shared between them.
std::vector<std::vector<int32_t>> make_prompts(const model::Tokenizer& tok, int64_t batch,
                                               int64_t len) {
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < batch; ++b) {
    std::string text;
    std::vector<int32_t> ids;
    for (int i = 0; static_cast<int64_t>(ids.size()) < len; ++i) {
      text += fmt::format("Case {}-{}: compute {} times {} and explain each step. ", b, i,
                          17 + 3 * b + i, 29 + b);
      ids = tok.encode(text, false);
    }
    ids.resize(static_cast<size_t>(len));
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

struct Timing {
  double prefill = 0, decode = 0;  // seconds; decode = the steps after the first token
  std::vector<int32_t> tokens0;    // sequence 0's tokens
  rollout::EngineStats stats;
  int64_t peak_blocks = 0;
};

// The engine's time for the batch: prefill (and first token) alone, then the whole generation;
// the best of `repeats`.
Timing run_engine(const model::Weights& w, const std::vector<std::vector<int32_t>>& prompts, int n,
                  int64_t new_tokens, int repeats) {
  rollout::EngineOptions eo;
  const int64_t samples = static_cast<int64_t>(prompts.size()) * n;
  eo.max_context = static_cast<int64_t>(prompts[0].size()) + new_tokens + 1;
  eo.num_blocks = samples * ((eo.max_context + eo.block_size - 1) / eo.block_size + 1) + 16;
  eo.max_seqs = std::max<int64_t>(samples, 1);
  eo.max_batch_tokens = std::max<int64_t>(
      2048, static_cast<int64_t>(prompts.size()) * static_cast<int64_t>(prompts[0].size()));
  auto requests = [&](int64_t max_tokens) {
    std::vector<rollout::Request> rs;
    for (size_t b = 0; b < prompts.size(); ++b) {
      rollout::SamplingParams sp;
      sp.n = n;
      sp.temperature = n > 1 ? 1.0f : 0.0f;
      sp.max_tokens = static_cast<int>(max_tokens);
      sp.seed = b;
      rs.push_back({fmt::format("r{}", b), prompts[b], sp});
    }
    return rs;
  };
  Timing best;
  for (int r = 0; r <= repeats; ++r) {  // the first run warms up
    Timing t;
    {
      rollout::Engine e(w, eo);
      t.prefill = seconds_of([&] { e.generate(requests(1)); });
      t.stats = e.stats();
    }
    rollout::Engine e(w, eo);
    std::vector<rollout::RequestOutput> outs;
    const double total = seconds_of([&] { outs = e.generate(requests(new_tokens)); });
    t.decode = total - t.prefill;
    t.tokens0 = outs[0].samples[0].tokens;
    t.peak_blocks = eo.num_blocks;
    if (r == 1 || (r > 1 && t.decode < best.decode)) best = std::move(t);
    if (repeats == 0) best = std::move(t);
  }
  return best;
}

}  // namespace

int run_rollout_bench(const Options& opt, const std::string& model_path) {
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const int64_t prompt_len = 64, new_tokens = opt.quick ? 16 : 64;
  const int repeats = opt.quick ? 1 : 2;
  const std::vector<int64_t> batches =
      opt.quick ? std::vector<int64_t>{1, 8} : std::vector<int64_t>{1, 8, 32, 64};
  const std::string model_name = fs::path(path).stem().string();
  int errors = 0;

  // The weights' dtype and whether the products run in the bf16 precision. By default f32 and
  // bf16 weights in the f32 precision (bf16 weights widened exactly), then bf16 weights in the
  // bf16 precision where the CPU has a bf16 path: the like-for-like row for the peer's BF16
  // GGUF, whose dot products also round the activations to bf16. --cpu-matmul bf16: both
  // dtypes in the bf16 precision.
  struct Series {
    DType dtype;
    bool bf16_compute;
  };
  const bool all_bf16 = opt.cpu_matmul == ops::MatmulPrecision::bf16;
  std::vector<Series> series = {{DType::f32, all_bf16}, {DType::bf16, all_bf16}};
  if (!all_bf16 && opt.device.is_cpu() &&
      ops::matmul_bf16_path() != ops::MatmulBf16Path::f32_kernel)
    series.push_back({DType::bf16, true});
  const int64_t G = 8;  // samples of the group prefix-sharing case
  const auto batch_case = [&](DType dtype, const std::string& suffix, int64_t B) {
    return fmt::format("{} {}{} batch {}, prompt {}, {} new", model_name, dtype_name(dtype), suffix,
                       B, prompt_len, new_tokens);
  };
  const auto group_case = [&](DType dtype, const std::string& suffix) {
    return fmt::format("{} {}{} group n={} sharing one prompt of {} vs {} prompts", model_name,
                       dtype_name(dtype), suffix, G, prompt_len, G);
  };
  const auto wanted = [&](const std::string& name) {
    return opt.filter.empty() || name.find(opt.filter) != std::string::npos;
  };
  // Each precision's ceilings, measured before its first case.
  std::optional<Ceilings> f32_ceilings, bf16_ceilings;

  for (const auto [dtype, bf16_compute] : series) {
    const std::string suffix = bf16_compute ? fmt::format(" {}", bf16_compute_name()) : "";
    bool any = wanted(group_case(dtype, suffix));
    for (int64_t B : batches) any = any || wanted(batch_case(dtype, suffix, B));
    if (!any) continue;
    const ops::ScopedMatmulPrecision precision(bf16_compute ? ops::MatmulPrecision::bf16
                                                            : ops::MatmulPrecision::f32);
    std::optional<Ceilings>& measured = bf16_compute ? bf16_ceilings : f32_ceilings;
    if (!measured) measured = measure_ceilings(opt);
    const Ceilings& ceilings = *measured;
    model::LoadedModel m = model::load_model(path, dtype);
    const std::string peer_gguf = path.ends_with(".gguf") ? precision_gguf(path, dtype) : "";
    const double weight_bytes = static_cast<double>(m.weights->nbytes());
    const double flops_per_token = 2.0 * static_cast<double>(m.weights->num_parameters());
    for (int64_t B : batches) {
      const std::string case_name = batch_case(dtype, suffix, B);
      if (!wanted(case_name)) continue;
      const auto prompts = make_prompts(m.tok(), B, prompt_len);
      const Timing t = run_engine(*m.weights, prompts, 1, new_tokens, repeats);
      const double steps = static_cast<double>(new_tokens - 1);
      const double value = static_cast<double>(B) * steps / t.decode;
      // Each decode step reads every weight once for the whole batch: B tokens per weight pass,
      // unless the FLOPs run out first.
      const double bw_bound = static_cast<double>(B) * ceilings.gbytes * 1e9 / weight_bytes;
      const double flop_bound = ceilings.gflops * 1e9 / flops_per_token;
      const double bound = std::min(bw_bound, flop_bound);
      nlohmann::ordered_json j{{"bench", "rollout"},
                               {"case", case_name},
                               {"metric", "decode_tokens_per_s"},
                               {"unit", "tokens/s"},
                               {"value", value},
                               {"batch", B},
                               {"threads", num_threads()},
                               {"prefill_tokens_per_s",
                                static_cast<double>(B * prompt_len) / std::max(t.prefill, 1e-9)}};
      if (!peer_gguf.empty()) {
        const fs::path pf = fs::temp_directory_path() / fmt::format("tandem-bench-prompts-{}.json",
                                                                    static_cast<long>(getpid()));
        std::ofstream(pf) << nlohmann::json(prompts).dump();
        const nlohmann::json peer = run_peer_script(
            "llamacpp_batched.py",
            fmt::format("--model '{}' --prompts '{}' --new-tokens {} --threads {} --repeats {}",
                        peer_gguf, pf.string(), new_tokens, num_threads(), repeats));
        fs::remove(pf);
        if (peer.contains("error")) {
          ++errors;
          j["peer_error"] = peer["error"];
        } else {
          const double peer_value =
              static_cast<double>(B) * steps / std::max(peer["decode_s"].get<double>(), 1e-9);
          j["peer"] = fmt::format("llama.cpp batched, {} GGUF of the same weights",
                                  dtype == DType::bf16 ? "BF16" : "F32");
          j["peer_value"] = peer_value;
          j["ratio"] = value / peer_value;
          const auto pt = peer["tokens"].get<std::vector<int32_t>>();
          size_t same = 0;
          while (same < std::min(pt.size(), t.tokens0.size()) && pt[same] == t.tokens0[same])
            ++same;
          j["same_greedy_prefix"] = same;
        }
      } else {
        ++errors;
        j["peer_error"] = "no GGUF of the same weights at this precision (scripts/bench-peers)";
      }
      j["limit"] = bound;
      j["limit_source"] = bw_bound <= flop_bound
                              ? fmt::format("{} x {:.1f} GB/s / {:.0f} MB of weights", B,
                                            ceilings.gbytes, weight_bytes / 1e6)
                              : fmt::format("{:.0f} GFLOP/s / {:.2f} GFLOP per token",
                                            ceilings.gflops, flops_per_token / 1e9);
      j["fraction_of_limit"] = value / bound;
      print_line(opt, j);
    }

    // Group prefix sharing: one prompt with 8 samples against 8 distinct prompts of the same
    // length (nothing to share). The prompt's KV blocks are computed and held once per group, so
    // prompt KV memory scales like the prefill tokens.
    const std::string group = group_case(dtype, suffix);
    if (!wanted(group)) continue;
    const auto one = make_prompts(m.tok(), 1, prompt_len);
    const auto eight = make_prompts(m.tok(), G, prompt_len);
    const Timing grouped = run_engine(*m.weights, one, static_cast<int>(G), 1, repeats);
    const Timing separate = run_engine(*m.weights, eight, 1, 1, repeats);
    nlohmann::ordered_json s{{"bench", "rollout"},
                             {"case", group},
                             {"metric", "prefill_seconds_saved_fraction"},
                             {"unit", "fraction"},
                             {"value", 1.0 - grouped.prefill / separate.prefill},
                             {"prefill_tokens_grouped", grouped.stats.prefill_tokens},
                             {"prefill_tokens_separate", separate.stats.prefill_tokens},
                             {"prefill_tokens_and_prompt_kv_saved_fraction",
                              1.0 - static_cast<double>(grouped.stats.prefill_tokens) /
                                        static_cast<double>(separate.stats.prefill_tokens)},
                             {"goal", 7.0 / 8.0}};
    print_line(opt, s);
  }
  return errors == 0 ? 0 : 1;
}

}  // namespace tandem::bench
