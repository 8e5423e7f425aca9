// The tiny job the multi-process job tests share (data-parallel, disaggregated): its TOML, `tandem
// train` on N ranks through `tandem launch`, and the step lines of its metrics.jsonl.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/hf.h"
#include "tests/testutil.h"

namespace tandem::test::dp_job {

inline std::string tandem_bin() { return std::string(TANDEM_BIN_DIR) + "/tandem"; }
// `tandem train` with the job's test hooks set from its flags (tests/workers/job_worker.cpp).
inline std::string job_worker_bin() { return std::string(TANDEM_BIN_DIR) + "/tandem_job_worker"; }

// The lines of a metrics.jsonl that record a training step (eval lines left out).
inline std::vector<nlohmann::json> step_lines(const std::filesystem::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(std::move(j));
  }
  return out;
}

// The largest |a - b| over every parameter of two HF directories.
inline double max_weight_diff(const std::string& a, const std::string& b) {
  const auto x = tandem::model::load_hf(a);
  const auto y = tandem::model::load_hf(b);
  double d = 0;
  for (size_t t = 0; t < x->storage().size(); ++t) {
    const float* p = x->storage()[t].tensor.data_as<float>();
    const float* q = y->storage()[t].tensor.data_as<float>();
    for (int64_t i = 0; i < x->storage()[t].tensor.numel(); ++i)
      d = std::max(d, static_cast<double>(std::abs(p[i] - q[i])));
  }
  return d;
}

// A tiny random model's 3-step job: 4 prompts x 4 samples a step, a regex reward. `trainer_keys`
// go into [trainer]; `tables` (whole TOML tables) come last.
inline std::string write_tiny_job(const tandem::test::TempDir& tmp, const std::string& model,
                                  const std::string& trainer_keys = "",
                                  const std::string& tables = "") {
  return tmp.write("job.toml", R"(
[model]
path = ")" + model + R"("
[data]
synthetic_size = 64
max_prompt_tokens = 96
[rollout]
prompts_per_step = 4
n = 4
max_new_tokens = 8
num_blocks = 64
[trainer]
steps = 3
lr = 1e-3
)" + trainer_keys + R"(
[[rewards]]
name = "has_e"
function = "regex_format"
pattern = '.*e.*'
[checkpoint]
every = 0
[eval]
every = 0
)" + tables);
}

// The data-parallel tests' job: that one with 2 minibatches, a sample line every step and a
// 30 s bound on every collective.
inline std::string write_job(const tandem::test::TempDir& tmp, const std::string& model) {
  return write_tiny_job(tmp, model, "minibatches = 2\n",
                        "[logging]\nsamples_every = 1\n[distributed]\ntimeout_s = 30\n");
}

// `tandem train` of the job on `ranks` processes (1: without a launcher) into tmp/<name>.
inline CommandResult train(const TempDir& tmp, const std::string& job, int ranks,
                           const std::string& name, const std::string& overrides = "") {
  const std::string args = fmt::format("train {} logging.dir={} checkpoint.dir={} {}", job,
                                       tmp.file(name), tmp.file(name + "/ckpt"), overrides);
  if (ranks == 1) return run_tandem(args, true, 120);
  return run_tandem(
      fmt::format("launch --nproc {} --grace-s 2 -- {} {}", ranks, tandem_bin(), args), true, 120);
}

}  // namespace tandem::test::dp_job
