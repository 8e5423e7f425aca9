// `tandem bench step`: seconds per GRPO step of the colocated job (trainer/job: rollout, rewards
// and advantages, old and reference logprobs, update, weight publish) with B = 8 prompts x G = 8
// samples of at most 64 new tokens on the synthetic arithmetic task (configs/default.toml's
// rewards, loss, optimizer and sampling; SmolLM2-135M-Instruct in f32 by default), beside TRL's
// GRPOTrainer on the CPU (bench/peers/trl_grpo_step.py) with the same weights as an HF directory,
// the same prompts in the same order, group size, lengths, stop tokens, temperature and beta.
#include <fmt/format.h>

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "bench/bench.h"
#include "bench/peers.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/ops.h"
#include "model/hf.h"
#include "model/loader.h"
#include "trainer/data.h"
#include "trainer/job.h"

namespace tandem::bench {
namespace {

namespace fs = std::filesystem;

// The phases of one step, named as the peer names them, and the job's metrics that make them up.
struct Phase {
  const char* name;
  std::vector<const char*> keys;
};
const std::vector<Phase>& phases_of_step() {
  static const std::vector<Phase> phases = {
      {"rollout", {"time/rollout_s"}},
      {"reward", {"time/reward_s"}},
      {"old_ref_logp", {"time/old_logp_s", "time/ref_logp_s"}},
      {"update", {"time/update_s"}},
      {"publish", {"time/publish_s"}}};
  return phases;
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// The weights of `path` as an f32 HF directory (with the tokenizer) for the peer: written once
// into models/peers/; an HF directory is used as it is.
std::string hf_directory(const std::string& path, const model::LoadedModel& m) {
  if (fs::is_directory(path)) return path;
  std::string stem = fs::path(path).stem().string();
  if (const size_t dot = stem.rfind('.'); dot != std::string::npos) stem = stem.substr(0, dot);
  const fs::path dir = repo_root() / "models" / "peers" / (stem + ".F32.hf");
  if (fs::exists(dir / "model.safetensors")) return dir.string();
  fs::create_directories(dir.parent_path());
  model::SaveOptions so;
  so.dtype = DType::f32;
  so.extra_files = model::hf_tokenizer_files(m.tok().data());
  model::save_hf(*m.weights, dir.string(), so);
  return dir.string();
}

nlohmann::json reward_specs(const trainer::JobConfig& job) {
  nlohmann::json specs = nlohmann::json::array();
  for (const trainer::RewardSpec& r : job.rewards)
    specs.push_back({{"name", r.name},
                     {"kind", r.kind},
                     {"function", r.function},
                     {"pattern", r.pattern},
                     {"weight", r.weight}});
  return specs;
}

std::string loss_type(const trainer::JobConfig& job) {
  switch (job.trainer.grpo.loss.aggregation) {
    case trainer::LossAggregation::kTokenMean:
      return "dapo";
    case trainer::LossAggregation::kSeqMeanTokenMean:
      return "grpo";
    case trainer::LossAggregation::kSeqMeanTokenSumNorm:
      return "dr_grpo";
    case trainer::LossAggregation::kTokenSum:
      break;
  }
  return "";
}

std::string scale_rewards(const trainer::JobConfig& job) {
  switch (job.trainer.grpo.advantage.scale) {
    case trainer::AdvantageScale::kGroupStd:
      return "group";
    case trainer::AdvantageScale::kBatchStd:
      return "batch";
    case trainer::AdvantageScale::kNone:
      return "none";
  }
  return "";
}

}  // namespace

int run_step_bench(const Options& opt, const std::string& model_path) {
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const int64_t B = opt.quick ? 2 : 8, G = opt.quick ? 2 : 8, new_tokens = opt.quick ? 8 : 64;
  const int64_t measured = opt.quick ? 1 : 3;  // steps timed after one warm-up step
  const fs::path tmp =
      fs::temp_directory_path() / fmt::format("tandem-bench-step-{}", static_cast<long>(getpid()));
  const fs::path config = repo_root() / "configs" / "default.toml";
  TANDEM_CHECK(fs::exists(config),
               "bench step: {} not found (it sets the job's loss, rewards and "
               "sampling)",
               config.string());

  // The demo job at the benchmark's batch: every step is one more rollout and update, nothing
  // else (no eval, no checkpoint, no resume). The KV pool holds every sample at full length.
  trainer::JobConfig job = trainer::load_job_config(config.string());
  const int64_t blocks_per_sample =
      (job.data.max_prompt_tokens + new_tokens + job.rollout.block_size) / job.rollout.block_size;
  const std::vector<std::string> base_overrides = {
      "model.path=" + path,
      fmt::format("rollout.prompts_per_step={}", B),
      fmt::format("rollout.n={}", G),
      fmt::format("rollout.max_new_tokens={}", new_tokens),
      fmt::format("rollout.num_blocks={}",
                  std::max(job.rollout.num_blocks, B * G * blocks_per_sample)),
      fmt::format("trainer.steps={}", measured + 1),
      "eval.every=0",
      "logging.samples_every=0",
      "logging.dir=" + (tmp / "run").string(),
      "checkpoint.dir=" + (tmp / "checkpoints").string(),
      "checkpoint.resume=none"};
  job = trainer::load_job_config(config.string(), base_overrides);

  // The peer's inputs: the prompts the job's stream hands out, rendered as the job renders them,
  // and the weights as an HF directory.
  std::string peer_model;
  nlohmann::json prompts = nlohmann::json::array();
  std::vector<int32_t> stop_ids;
  std::string model_name;
  {
    const model::LoadedModel m = model::load_model(path, DType::f32);
    model_name = fs::path(path).stem().string();
    stop_ids = m.stop_ids();
    trainer::PromptStream stream(trainer::job_dataset(job).train,
                                 static_cast<uint64_t>(job.data.seed), true);
    for (int64_t step = 0; step <= measured; ++step) {
      for (const trainer::Example& ex : stream.next_batch(B)) {
        std::vector<int32_t> ids =
            trainer::render_prompt(m.tok(), ex, true, job.data.system_prompt);
        if (static_cast<int64_t>(ids.size()) > job.data.max_prompt_tokens)
          ids.erase(ids.begin(), ids.end() - job.data.max_prompt_tokens);
        prompts.push_back({{"text", m.tok().decode(ids)}, {"ids", ids}, {"answer", ex.answer}});
      }
    }
    peer_model = hf_directory(path, m);
  }

  // f32, then (on a CPU with AMX-BF16 or AVX512-BF16) the job with placement.cpu_matmul = "bf16"
  // beside TRL with bf16 = True (torch.autocast on the CPU): each in its own precision.
  int errors = 0;
  for (const bool bf16 : {false, true}) {
    if (bf16 && ops::matmul_bf16_path() == ops::MatmulBf16Path::f32_kernel) continue;
    const std::string precision = bf16 ? bf16_compute_name() : "f32";
    if (!opt.filter.empty() && precision.find(opt.filter) == std::string::npos) continue;
    std::vector<std::string> overrides = base_overrides;
    overrides.push_back(fmt::format("placement.cpu_matmul={}", bf16 ? "bf16" : "f32"));
    overrides.push_back(fmt::format("placement.cpu_matmul_kernel={}",
                                    name_of(ops::kMatmulKernelNames, opt.cpu_matmul_kernel)));
    overrides.push_back(fmt::format("placement.cpu_matmul_backward={}",
                                    name_of(ops::kMatmulBackwardNames, opt.cpu_matmul_backward)));
    job = trainer::load_job_config(config.string(), overrides);
    std::vector<nlohmann::ordered_json> steps;
    trainer::JobHooks hooks;
    hooks.on_step = [&](const nlohmann::ordered_json& metrics) { steps.push_back(metrics); };
    hooks.checkpoints = false;
    const std::atomic<bool> stop{false};
    trainer::run_job(job, stop, hooks);
    TANDEM_CHECK(static_cast<int64_t>(steps.size()) == measured + 1,
                 "bench step: the job ran {} "
                 "steps, expected {}",
                 steps.size(), measured + 1);
    steps.erase(steps.begin());  // the warm-up step

    std::vector<double> totals, tokens;
    for (const auto& s : steps) {
      totals.push_back(s["time/step_s"].get<double>());
      tokens.push_back(s["response_tokens"].get<double>());
    }
    const double step_s = mean(totals);
    const std::string case_name = fmt::format("{} {} GRPO B={} x G={}, <= {} new tokens",
                                              model_name, precision, B, G, new_tokens);
    nlohmann::ordered_json j{{"bench", "step"},
                             {"case", case_name},
                             {"metric", "seconds_per_step"},
                             {"unit", "s"},
                             {"value", step_s},
                             {"step_seconds", totals},
                             {"response_tokens", mean(tokens)},
                             {"steps", measured},
                             {"threads", num_threads()},
                             {"kl_beta", job.trainer.grpo.loss.kl_beta},
                             {"temperature", job.rollout.temperature}};
    nlohmann::ordered_json phases;
    for (const Phase& p : phases_of_step()) {
      std::vector<double> v;
      for (const auto& s : steps) {
        double sum = 0;
        for (const char* key : p.keys) sum += s[key].get<double>();
        v.push_back(sum);
      }
      phases[p.name] = mean(v);
    }
    j["phases"] = phases;

    // Everything the peer needs in one file: the job's settings, the prompts and the stop tokens.
    const trainer::JobConfig& c = job;
    const nlohmann::json peer_input{{"batch", B},
                                    {"group", G},
                                    {"max_new_tokens", new_tokens},
                                    {"steps", measured},
                                    {"threads", num_threads()},
                                    {"temperature", c.rollout.temperature},
                                    {"top_p", c.rollout.top_p},
                                    {"top_k", c.rollout.top_k},
                                    {"min_p", c.rollout.min_p},
                                    {"seed", c.rollout.seed},
                                    {"beta", c.trainer.grpo.loss.kl_beta},
                                    {"lr", c.trainer.schedule.lr},
                                    {"eps_low", c.trainer.grpo.loss.eps_low},
                                    {"eps_high", c.trainer.grpo.loss.eps_high},
                                    {"loss_type", loss_type(c)},
                                    {"scale_rewards", scale_rewards(c)},
                                    {"max_grad_norm", c.trainer.optimizer.max_grad_norm},
                                    {"weight_decay", c.trainer.optimizer.weight_decay},
                                    {"rewards", reward_specs(c)},
                                    {"bf16", bf16},
                                    {"stop_ids", stop_ids},
                                    {"prompts", prompts}};
    fs::create_directories(tmp);
    const fs::path input = tmp / "peer-input.json";
    std::ofstream(input) << peer_input.dump();
    const nlohmann::json peer = run_peer_script(
        "trl_grpo_step.py", fmt::format("--model '{}' --input '{}'", peer_model, input.string()));
    std::error_code ec;
    fs::remove_all(tmp, ec);
    if (peer.contains("error")) {
      ++errors;
      j["peer_error"] = peer["error"];
    } else {
      const double peer_s = peer["step_s"].get<double>();
      j["peer"] =
          fmt::format("TRL {} GRPOTrainer (transformers {}, PyTorch {}, CPU{})",
                      peer["trl"].get<std::string>(), peer["transformers"].get<std::string>(),
                      peer["torch"].get<std::string>(), bf16 ? ", bf16" : "");
      j["peer_value"] = peer_s;
      j["ratio"] = peer_s / step_s;  // > 1: tandem's step is faster
      j["peer_step_seconds"] = peer["step_seconds"];
      j["peer_phases"] = peer["phases"];
      j["peer_response_tokens"] = peer["response_tokens"];
      j["peer_same_prompt_ids"] = peer["same_prompt_ids"];
    }
    print_line(opt, j);
    // A line per phase, with the peer's time for it where the peer has that phase (TRL's update is
    // the rest of its step; it publishes nothing).
    for (const Phase& p : phases_of_step()) {
      const double ours = phases[p.name].get<double>();
      nlohmann::ordered_json pj{{"bench", "step"},
                                {"case", fmt::format("{}: {}", case_name, p.name)},
                                {"metric", "phase_seconds_per_step"},
                                {"unit", "s"},
                                {"value", ours},
                                {"fraction_of_step", ours / step_s}};
      if (j.contains("peer_phases") && j["peer_phases"].contains(p.name)) {
        const double theirs = j["peer_phases"][p.name].get<double>();
        pj["peer"] = j["peer"];
        pj["peer_value"] = theirs;
        if (ours > 1e-6 && theirs > 1e-6) pj["ratio"] = theirs / ours;
      }
      print_line(opt, pj);
    }
  }
  return errors == 0 ? 0 : 1;
}

}  // namespace tandem::bench
