// `tandem bench train`: training tokens/s — forward, backward of the mean token logprob, AdamW —
// for a model's shape (default: the bundled SmolLM2-135M) on B x L tokens, beside PyTorch
// (transformers' LlamaForCausalLM on the CPU, same shapes, bench/peers/torch_train.py) and the
// FLOP ceiling (6 x parameters per token at the GEMM rate, measured again right before each
// step: this machine kind's speed drifts by a fifth within minutes), with the step broken into
// phases (ops::set_op_timing: each phase's time, FLOPs and rate against that ceiling). On a CPU
// with AMX-BF16 or AVX512-BF16 a second line does the same with the matmuls in bf16
// (ops::MatmulPrecision), beside PyTorch under bf16 autocast.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <tuple>

#include "bench/bench.h"
#include "bench/peers.h"
#include "bench/update_step.h"
#include "core/parallel.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/loader.h"
#include "trainer/optimizer.h"

namespace tandem::bench {

namespace {

// The phase of the step an op's time belongs to: the matmuls by direction, with the head (the
// products whose N is the vocabulary) apart, then attention, the other layer ops, the head's
// log-softmax, the optimizer.
std::string phase_of(const ops::OpTime& t, int64_t vocab) {
  const bool head = t.n == vocab;
  if (t.op == "matmul") return head ? "lm_head forward" : "matmul forward";
  if (t.op == "matmul_backward_input") return head ? "lm_head dX" : "matmul backward dX";
  if (t.op == "matmul_backward_weight") return head ? "lm_head dW" : "matmul backward dW";
  if (t.op == "attention") return "attention forward";
  if (t.op == "attention_backward") return "attention backward";
  if (t.op == "logprob_gather") return "logprob forward";
  if (t.op == "logprob_gather_backward") return "logprob backward";
  if (t.op == "adamw") return "AdamW";
  if (t.op == "global_norm" || t.op == "sum_squares") return "gradient norm";
  if (t.op.ends_with("_backward")) return "norms, rope, SwiGLU, embedding backward";
  return "norms, rope, SwiGLU, embedding forward";
}

}  // namespace

int run_train_bench(const Options& opt, const std::string& model_path) {
  namespace fs = std::filesystem;
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const int64_t B = 4, L = opt.quick ? 65 : 257;  // L tokens: L - 1 targets per sequence
  const int steps = opt.quick ? 1 : 3;
  model::LoadedModel m = model::load_model(path, DType::f32);
  const model::ModelConfig& c = m.config();

  std::vector<std::vector<int32_t>> seqs;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> s;
    for (int64_t t = 0; t < L; ++t)
      s.push_back(static_cast<int32_t>((b * 7919 + t * 104729) % c.vocab_size));
    seqs.push_back(std::move(s));
  }
  const model::PackedBatch batch = model::PackedBatch::from_sequences(seqs);
  const int64_t T = batch.num_tokens();
  UpdateStep update(*m.weights, batch);
  const double flops_per_token = 6.0 * static_cast<double>(m.weights->num_parameters());
  // Causal attention's multiply-adds, forward: QK^T and PV over each sequence's triangle;
  // backward: five such products (the scores again, dV, dP, dQ, dK).
  const double attention_flops = 2.0 * 2.0 * static_cast<double>(c.num_layers * c.num_heads) *
                                 static_cast<double>(c.head_dim) * static_cast<double>(B) *
                                 static_cast<double>(L * (L + 1) / 2);
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const nlohmann::json cfg{
      {"vocab", c.vocab_size},  {"hidden", c.hidden_size},    {"intermediate", c.intermediate_size},
      {"layers", c.num_layers}, {"heads", c.num_heads},       {"kv_heads", c.num_kv_heads},
      {"head_dim", c.head_dim}, {"rope_theta", c.rope.theta}, {"tied", c.tie_word_embeddings}};
  int errors = 0;
  // f32: every product in f32, against PyTorch in f32 and the f32 GEMM rate. bf16: the matmuls'
  // operands rounded to bf16 (AMX or AVX512-BF16 where the CPU has it; weights, optimizer and
  // everything else stay f32), against PyTorch under torch.autocast("cpu", bfloat16) and our
  // bf16 GEMM rate.
  for (const bool bf16 : {false, true}) {
    const std::string case_name =
        fmt::format("{} {} {} x {} tokens", fs::path(path).stem().string(),
                    bf16 ? bf16_compute_name() : "f32", B, L - 1);
    if (bf16 && ops::matmul_bf16_path() == ops::MatmulBf16Path::f32_kernel) continue;
    if (!opt.filter.empty() && case_name.find(opt.filter) == std::string::npos) continue;
    const ops::ScopedMatmulPrecision precision(bf16 ? ops::MatmulPrecision::bf16
                                                    : ops::MatmulPrecision::f32);
    std::vector<double> times, limits, fractions;
    std::map<std::string, std::vector<double>> phase_times;
    std::map<std::string, double> phase_flops;
    std::string gemm_source;
    for (int i = 0; i <= steps; ++i) {
      double gemm_gflops = 0;
      if (i > 0) {
        std::tie(gemm_gflops, gemm_source) =
            bf16 ? measure_cpu_bf16_gemm_ceiling(opt) : measure_cpu_gemm_ceiling(opt);
      }
      ops::take_op_times();
      ops::set_op_timing(true);
      const auto t0 = std::chrono::steady_clock::now();
      update.run(1e-5f);
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ops::set_op_timing(false);
      if (i == 0) continue;
      std::map<std::string, double> step_phases;
      double in_ops = 0;
      for (const ops::OpTime& o : ops::take_op_times()) {
        const std::string phase = phase_of(o, c.vocab_size);
        step_phases[phase] += o.seconds;
        in_ops += o.seconds;
        if (i == 1) phase_flops[phase] += 2.0 * static_cast<double>(o.m * o.n * o.k * o.calls);
      }
      step_phases["outside the ops (gradient zeroing, glue)"] = t - in_ops;
      for (const auto& [phase, s] : step_phases) phase_times[phase].push_back(s);
      times.push_back(t);
      limits.push_back(gemm_gflops * 1e9 / flops_per_token);
      fractions.push_back(static_cast<double>(T) / t / limits.back());
    }
    const double step_s = median(times);
    const double value = static_cast<double>(T) / step_s;
    const double limit = median(limits);
    phase_flops["attention forward"] = attention_flops;
    phase_flops["attention backward"] = 2.5 * attention_flops;

    nlohmann::ordered_json j{
        {"bench", "train"},        {"case", case_name}, {"metric", "train_tokens_per_s"},
        {"unit", "tokens/s"},      {"value", value},    {"step_ms", 1e3 * step_s},
        {"threads", num_threads()}};
    const nlohmann::json peer = run_peer_script(
        "torch_train.py",
        fmt::format("--config '{}' --batch {} --len {} --threads {} --steps {}{}", cfg.dump(), B, L,
                    num_threads(), steps, bf16 ? " --autocast-bf16" : ""));
    if (peer.contains("error")) {
      ++errors;
      j["peer_error"] = peer["error"];
    } else {
      const double peer_value =
          peer["tokens"].get<double>() / std::max(peer["step_s"].get<double>(), 1e-9);
      j["peer"] =
          fmt::format("PyTorch {} (transformers {}, CPU{})", peer["torch"].get<std::string>(),
                      peer["transformers"].get<std::string>(), bf16 ? ", autocast bf16" : "");
      j["peer_value"] = peer_value;
      j["ratio"] = value / peer_value;
    }
    j["limit"] = limit;
    j["limit_source"] = fmt::format(
        "{:.0f} GFLOP/s / {:.2f} GFLOP per token ({}, median of the rates measured "
        "right before each step)",
        limit * flops_per_token / 1e9, flops_per_token / 1e9, gemm_source);
    // Each step against the GEMM rate measured just before it, then the median.
    j["fraction_of_limit"] = median(fractions);
    j["step_fractions_of_limit"] = fractions;
    // Each phase: its median time over the steps (on the row, as bench step has them, and a row
    // of its own with its FLOPs and its rate against the median GEMM rate, the ceiling; phases
    // without FLOPs, memory-bound, have rate 0).
    const double ceiling_gflops = limit * flops_per_token / 1e9;
    nlohmann::ordered_json phases;
    for (const auto& [phase, ts] : phase_times) phases[phase] = median(ts);
    j["phases"] = phases;
    print_line(opt, j);
    for (const auto& [phase, ts] : phase_times) {
      const double s = median(ts), gflop = phase_flops[phase] / 1e9;
      print_line(opt, nlohmann::ordered_json{
                          {"bench", "train"},
                          {"case", fmt::format("{}: {}", case_name, phase)},
                          {"metric", "phase_seconds_per_step"},
                          {"unit", "s"},
                          {"value", s},
                          {"fraction_of_step", s / step_s},
                          {"gflop", gflop},
                          {"gflop_per_s", s > 0 ? gflop / s : 0.0},
                          {"gemm_ceiling_gflop_per_s", ceiling_gflops},
                          {"fraction_of_gemm_ceiling", s > 0 ? gflop / s / ceiling_gflops : 0.0}});
    }
  }
  return errors == 0 ? 0 : 1;
}

}  // namespace tandem::bench
