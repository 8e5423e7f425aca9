// Tests of the tandem job config: defaults, the error of each kind of bad input with its line or
// override, overrides, the shipped configs, printing back, and docs/config.md covering the schema.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/model/tiny_model.h"
#include "trainer/job_config.h"
#include "trainer/job_grid.h"
#include "trainer/rollout_group.h"

using namespace tandem::trainer;

namespace {

std::filesystem::path repo_root() { return std::filesystem::path(TANDEM_SOURCE_DIR); }

const std::string kMinimal =
    "[model]\npath = \"m.gguf\"\n"
    "[[rewards]]\nname = \"correct\"\nfunction = \"math_match\"\n";

std::string error_of(const std::string& text, std::vector<std::string> overrides = {}) {
  try {
    parse_job_config(text, "job.toml", overrides);
  } catch (const tandem::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string read(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("job config defaults are the trainer's own defaults", "[unit]") {
  JobConfig j = parse_job_config(kMinimal, "job.toml");
  const GrpoConfig grpo;
  const AdamWConfig adamw;
  const LrScheduleConfig sched;
  CHECK(j.model.path == "m.gguf");
  CHECK(j.source == "job.toml");
  CHECK(j.trainer.grpo.loss.eps_low == grpo.loss.eps_low);
  CHECK(j.trainer.grpo.loss.eps_high == grpo.loss.eps_high);
  CHECK(j.trainer.grpo.loss.aggregation == grpo.loss.aggregation);
  CHECK(j.trainer.grpo.loss.kl_estimator == KlEstimator::kK3);
  CHECK(j.trainer.grpo.advantage.eps == grpo.advantage.eps);
  CHECK(j.trainer.optimizer.beta2 == adamw.beta2);
  CHECK(j.trainer.optimizer.eps == adamw.eps);
  CHECK(j.trainer.schedule.lr == sched.lr);
  CHECK(j.trainer.schedule.kind == sched.kind);
  CHECK(j.rollout.n == 8);
  CHECK(j.placement.mode == "colocated");
  // derived: the schedule spans the run's optimizer steps
  CHECK(j.trainer.schedule.total_steps == j.trainer.steps);
  REQUIRE(j.rewards.size() == 1);
  CHECK(j.rewards[0].kind == "builtin");
  CHECK(j.rewards[0].weight == 1.0);
  CHECK(j.rewards[0].fallback == 0.0);
}

TEST_CASE("job config gives each bad field its own message with the line", "[unit]") {
  struct Case {
    std::string text, message;
  };
  const std::vector<Case> cases = {
      {kMinimal + "[rollout]\nnn = 8\n",
       "job.toml:7:1: unknown key 'rollout.nn' (did you mean "
       "'rollout.n'?)"},
      {kMinimal + "[trainer]\nlr = \"fast\"\n",
       "job.toml:7:6: trainer.lr: expected a number, found the string \"fast\""},
      {kMinimal + "[rollout]\nn = 1\n", "job.toml:7:5: rollout.n: expected an integer >= 2"},
      {kMinimal + "[trainer.algorithm]\neps_low = 1.5\n",
       "job.toml:7:11: trainer.algorithm.eps_low: expected a number >= 0"},
      {kMinimal + "[trainer.algorithm]\nloss_aggregation = \"mean\"\n",
       "job.toml:7:20: trainer.algorithm.loss_aggregation: expected one of \"token-mean\""},
      {kMinimal + "[trainer.algorithm]\ndual_clip_c = 0.5\n",
       "job.toml:7:15: trainer.algorithm.dual_clip_c: expected 0 (off) or a number > 1"},
      {kMinimal + "[rollout]\nprompts_per_step = 3\nn = 3\n[trainer]\nminibatches = 2\n",
       "job.toml:10:15: trainer.minibatches: 2 does not divide the batch "
       "rollout.prompts_per_step * rollout.n = 3 * 3 = 9 (job.toml:7:20, job.toml:8:5)"},
      {kMinimal + "[[rewards]]\nname = \"r\"\nkind = \"remote\"\naddress = \"localhost\"\n",
       "job.toml:9:11: rewards[1].address: expected host:port"},
      {kMinimal + "[[rewards]]\nname = \"p\"\nkind = \"plugin\"\n",
       "rewards[1].path: required for kind = \"plugin\""},
      {kMinimal + "[[rewards]]\nname = \"correct\"\nfunction = \"exact_match\"\n",
       "job.toml:7:8: rewards[1].name: 'correct' is used twice"},
      {kMinimal + "[data]\nsource = \"jsonl\"\n", "job.toml (default): data.path: required when"},
      {kMinimal + "[trainer.schedule]\nwarmup_steps = 500\n",
       "job.toml:7:16: trainer.schedule.warmup_steps: 500 is more than the schedule's 100"},
      {"[model]\npath = \"m\"\n", "rewards: at least one [[rewards]] entry is needed"},
      {"[[rewards]]\nname = \"a\"\nfunction = \"math_match\"\n",
       "job.toml: model.path: required but not set"},
      {kMinimal + "[placement]\nmode = \"split\"\n",
       "job.toml:7:8: placement.mode: expected one of \"colocated\""},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    CHECK_THAT(error_of(c.text), Catch::Contains(c.message));
  }
}

TEST_CASE("job config takes rollout dtype f32 or bf16 and names the line of another", "[unit]") {
  CHECK(parse_job_config(kMinimal, "job.toml").rollout.dtype == "f32");
  CHECK(parse_job_config(kMinimal + "[rollout]\ndtype = \"bf16\"\n", "job.toml").rollout.dtype ==
        "bf16");
  CHECK_THAT(error_of(kMinimal + "[rollout]\ndtype = \"f16\"\n"),
             Catch::Contains("job.toml:7:9: rollout.dtype: expected one of \"f32\", \"bf16\""));
  CHECK_THAT(error_of(kMinimal, {"rollout.dtype=\"f16\""}),
             Catch::Contains("override 'rollout.dtype=\"f16\"': rollout.dtype: expected one of"));
}

TEST_CASE("job config chooses the CPU matmul kernels by key and names the line of a bad one",
          "[unit]") {
  const JobConfig d = parse_job_config(kMinimal, "job.toml");
  CHECK(d.placement.cpu_matmul == tandem::ops::MatmulPrecision::f32);
  CHECK(d.placement.cpu_matmul_kernel == tandem::ops::MatmulKernel::automatic);
  CHECK(d.placement.cpu_matmul_backward == tandem::ops::MatmulBackward::outer);
  const JobConfig j = parse_job_config(kMinimal +
                                           "[placement]\ncpu_matmul = \"bf16\"\n"
                                           "cpu_matmul_kernel = \"avx512bf16\"\n"
                                           "cpu_matmul_backward = \"transpose\"\n",
                                       "job.toml");
  CHECK(j.placement.cpu_matmul == tandem::ops::MatmulPrecision::bf16);
  CHECK(j.placement.cpu_matmul_kernel == tandem::ops::MatmulKernel::avx512_bf16);
  CHECK(j.placement.cpu_matmul_backward == tandem::ops::MatmulBackward::transpose);
  const std::vector<std::string> portable = {"placement.cpu_matmul_kernel=portable"};
  CHECK(parse_job_config(kMinimal, "job.toml", portable).placement.cpu_matmul_kernel ==
        tandem::ops::MatmulKernel::portable);
  // Printed back under the same names.
  const std::string printed = to_toml(j);
  CHECK_THAT(printed, Catch::Contains("cpu_matmul_kernel = \"avx512bf16\""));
  CHECK_THAT(printed, Catch::Contains("cpu_matmul_backward = \"transpose\""));
  CHECK_THAT(
      error_of(kMinimal + "[placement]\ncpu_matmul_kernel = \"amx\"\n"),
      Catch::Contains("job.toml:7:21: placement.cpu_matmul_kernel: expected one of \"auto\", "
                      "\"avx512bf16\", \"portable\""));
  CHECK_THAT(error_of(kMinimal, {"placement.cpu_matmul_backward=inner"}),
             Catch::Contains("override 'placement.cpu_matmul_backward=inner': "
                             "placement.cpu_matmul_backward: expected one of \"outer\", "
                             "\"transpose\""));
}

TEST_CASE("job config overrides win over the file", "[unit]") {
  const std::string text = kMinimal + "[trainer]\nlr = 3e-6\n[rollout]\nn = 4\n";
  JobConfig j = parse_job_config(
      text, "job.toml",
      std::vector<std::string>{"trainer.lr=1e-6", "rollout.n=8", "model.path=\"x\"",
                               "trainer.algorithm.ratio_level=sequence", "logging.dir=runs/y"});
  CHECK(j.trainer.schedule.lr == 1e-6f);
  CHECK(j.rollout.n == 8);
  CHECK(j.model.path == "x");
  CHECK(j.trainer.grpo.loss.ratio_level == RatioLevel::kSequence);
  CHECK(j.trainer.step.loss.ratio_level == RatioLevel::kSequence);
  CHECK(j.logging.dir == "runs/y");
  CHECK(j.where("rollout.n") == "override 'rollout.n=8'");
  CHECK(j.where("trainer.lr") == "override 'trainer.lr=1e-6'");
  CHECK(j.where("trainer.epochs") == "job.toml (default)");
  CHECK(parse_job_config(text, "job.toml").where("model.path") == "job.toml:2:8");
  CHECK_THAT(error_of(text, {"rollout.n=1"}),
             Catch::Contains("override 'rollout.n=1': rollout.n: expected an integer >= 2"));
  CHECK_THAT(error_of(text, {"trainer.minibatches=3"}),
             Catch::Contains("override 'trainer.minibatches=3': trainer.minibatches: 3 does not "
                             "divide"));
}

TEST_CASE("both shipped job configs validate", "[unit]") {
  JobConfig d = load_job_config((repo_root() / "configs/default.toml").string());
  CHECK(d.model.path == "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  CHECK(d.data.source == "synthetic");
  CHECK(d.rollout.prompts_per_step * d.rollout.n == 32);
  CHECK(d.rollout.max_new_tokens == 32);
  CHECK(d.rewards.size() == 2);
  JobConfig g = load_job_config((repo_root() / "configs/gsm8k-qwen2.5-0.5b.toml").string());
  CHECK(g.data.source == "jsonl");
  CHECK(g.placement.device == "cuda");
  CHECK(g.trainer.schedule.kind == LrScheduleKind::cosine);
  CHECK_THROWS_WITH(load_job_config("/nonexistent/job.toml"),
                    Catch::Contains("/nonexistent/job.toml: cannot open"));
  CHECK_THROWS_WITH(load_job_config((repo_root() / "configs").string()),
                    Catch::Contains("configs: is a directory"));
}

TEST_CASE("job config printed as TOML parses back to the same job", "[unit]") {
  std::vector<std::string> variants = {"trainer.algorithm.advantage_baseline=leave-one-out",
                                       "trainer.algorithm.advantage_scale=none",
                                       "trainer.algorithm.loss_aggregation=seq-mean-token-sum-norm",
                                       "trainer.algorithm.kl_estimator=k2",
                                       "trainer.algorithm.kl_beta=0.04",
                                       "trainer.algorithm.is_level=sequence",
                                       "trainer.algorithm.is_mode=mask",
                                       "trainer.optimizer.beta2=0.95",
                                       "trainer.optimizer.eps=1e-7",
                                       "trainer.lr=3e-7",
                                       "trainer.schedule.kind=cosine",
                                       "data.extra_fields=[\"a\", \"b\"]"};
  for (const auto& path :
       {std::string("configs/default.toml"), std::string("configs/gsm8k-qwen2.5-0.5b.toml")}) {
    JobConfig j = load_job_config((repo_root() / path).string(), variants);
    std::string printed = to_toml(j);
    JobConfig back = parse_job_config(printed, "printed.toml");
    auto body = [](const std::string& s) { return s.substr(s.find('\n')); };  // after the title
    CHECK(body(to_toml(back)) == body(printed));
    CHECK(back.trainer.grpo.advantage.baseline == AdvantageBaseline::kLeaveOneOut);
    CHECK(back.trainer.grpo.loss.aggregation == LossAggregation::kSeqMeanTokenSumNorm);
    CHECK(back.trainer.grpo.loss.seq_sum_norm == static_cast<double>(j.rollout.max_new_tokens));
    CHECK(back.trainer.optimizer.beta2 == 0.95f);
    CHECK(back.trainer.optimizer.eps == 1e-7f);
    CHECK(back.trainer.schedule.lr == 3e-7f);
    CHECK(back.trainer.schedule.total_steps == j.trainer.schedule.total_steps);
    CHECK(back.data.extra_fields == std::vector<std::string>{"a", "b"});
    REQUIRE(back.rewards.size() == j.rewards.size());
    CHECK(back.rewards[0].name == j.rewards[0].name);
    CHECK(back.rewards.back().pattern == j.rewards.back().pattern);
  }
}

TEST_CASE("docs config.md documents every key of the job schema", "[unit]") {
  const auto docs_path = repo_root() / "docs/config.md";
  const std::string generated = job_config_markdown();
  if (std::getenv("TANDEM_REGENERATE_DOCS")) {  // rewrites the generated part of docs/config.md
    std::string doc = read(docs_path);
    const std::string begin = "<!-- BEGIN GENERATED: job schema -->\n";
    const std::string end = "<!-- END GENERATED -->";
    auto b = doc.find(begin), e = doc.find(end);
    REQUIRE(b != std::string::npos);
    REQUIRE(e != std::string::npos);
    doc = doc.substr(0, b + begin.size()) + generated + doc.substr(e);
    std::ofstream(docs_path) << doc;
  }
  const std::string doc = read(docs_path);
  for (const auto& f : job_schema()->fields()) {
    INFO(f.key);
    CHECK_THAT(doc, Catch::Contains("`" + f.key + "`"));
    if (f.items)
      for (const auto& item : f.items->fields())
        CHECK_THAT(doc, Catch::Contains("`" + f.key + "[]." + item.key + "`"));
  }
  INFO(
      "docs/config.md is out of date: run TANDEM_REGENERATE_DOCS=1 build/bin/tandem_tests "
      "\"docs config.md documents every key of the job schema\"");
  CHECK_THAT(doc, Catch::Contains(generated));
}

TEST_CASE("job config weight_sync section reaches the publisher and names bad values", "[unit]") {
  const JobConfig d = parse_job_config(kMinimal, "job.toml");
  CHECK(d.weight_sync.bucket_mb == 64);
  CHECK(d.weight_sync.staged);
  CHECK(!d.weight_sync.checksums);
  CHECK(!d.weight_sync.canary);
  CHECK(d.weight_sync.canary_tokens == 16);
  // 0: by rollout.dtype.
  CHECK(d.weight_sync.canary_tolerance == kCanaryToleranceF32);
  CHECK(parse_job_config(kMinimal + "[rollout]\ndtype = \"bf16\"\n", "job.toml")
            .weight_sync.canary_tolerance == kCanaryToleranceBf16);

  const JobConfig j = parse_job_config(
      kMinimal +
          "[weight_sync]\nbucket_mb = 2\nstaged = false\nchecksums = true\ncanary = true\n"
          "canary_tokens = 8\ncanary_tolerance = 0.5\n",
      "job.toml");
  CHECK(j.weight_sync.canary);
  CHECK(j.weight_sync.canary_tokens == 8);
  CHECK(j.weight_sync.canary_tolerance == 0.5);
  const tandem::weight_sync::SyncOptions o = sync_options(j.weight_sync);
  CHECK(o.bucket_bytes == int64_t{2} << 20);
  CHECK(!o.staged);
  CHECK(o.checksums);
  // Printed back, the resolved job parses to the same section.
  const JobConfig back = parse_job_config(to_toml(j), "printed.toml");
  CHECK(back.weight_sync.bucket_mb == 2);
  CHECK(back.weight_sync.canary_tolerance == 0.5);

  CHECK_THAT(error_of(kMinimal + "[weight_sync]\nbucket_mb = 0\n"),
             Catch::Contains("job.toml:7:13: weight_sync.bucket_mb: expected an integer >= 1"));
  CHECK_THAT(
      error_of(kMinimal + "[weight_sync]\ncanary_tolerance = -1\n"),
      Catch::Contains("job.toml:7:20: weight_sync.canary_tolerance: expected a number >= 0"));
  CHECK_THAT(error_of(kMinimal + "[weight_sync]\ncanary = \"yes\"\n"),
             Catch::Contains("job.toml:7:10: weight_sync.canary: expected a boolean"));
  CHECK_THAT(error_of(kMinimal + "[weight_sync]\ncanary_toke = 4\n"),
             Catch::Contains("unknown key 'weight_sync.canary_toke' (did you mean "
                             "'weight_sync.canary_tokens'?)"));
  // The probe is one completion of the engine: no longer than rollout.max_new_tokens.
  CHECK_THAT(error_of(kMinimal + "[rollout]\nmax_new_tokens = 8\n[weight_sync]\ncanary = true\n"),
             Catch::Contains("job.toml (default): weight_sync.canary_tokens: 16 is more than "
                             "rollout.max_new_tokens = 8 (job.toml:7:18)"));
  CHECK_THAT(error_of(kMinimal + "[rollout]\nmax_new_tokens = 8\n",
                      {"weight_sync.canary=true", "weight_sync.canary_tokens=9"}),
             Catch::Contains("override 'weight_sync.canary_tokens=9': weight_sync.canary_tokens: "
                             "9 is more than rollout.max_new_tokens = 8"));
  // Off, the probe's length is not checked.
  CHECK(parse_job_config(kMinimal + "[rollout]\nmax_new_tokens = 8\n", "job.toml")
            .weight_sync.canary_tokens == 16);
}

TEST_CASE("job config refuses trainer layouts the grid trainer does not run yet and names the key",
          "[unit]") {
  const JobConfig j = parse_job_config(kMinimal, "job.toml",
                                       std::vector<std::string>{"trainer.tp=2", "trainer.pp=3"});
  CHECK(j.trainer.tp == 2);
  CHECK(j.trainer.pp == 3);
  // Tensor parallelism and pipeline stages run at every level.
  for (const char* level : {"optimizer", "gradients", "parameters"})
    for (const char* grid : {"trainer.tp=2", "trainer.pp=2"}) {
      const JobConfig g = parse_job_config(
          kMinimal, "job.toml",
          std::vector<std::string>{grid, fmt::format("trainer.shard=\"{}\"", level)});
      CHECK(g.trainer.tp * g.trainer.pp == 2);
    }
  CHECK_THAT(error_of(kMinimal, {"trainer.pp=2", "placement.device=\"cuda\""}),
             Catch::Contains("trainer.pp") && Catch::Contains("cpu only"));
  CHECK_THAT(error_of(kMinimal, {"trainer.tp=0"}), Catch::Contains("trainer.tp"));
}

TEST_CASE("the grid trainer's sizes are checked against the world and the model", "[unit]") {
  // 2 layers, 4 heads, 2 KV heads, F = 96; a vocabulary 2 and 4 split.
  tandem::model::ModelConfig c =
      tandem::test::tiny_model_config(tandem::test::TinyKind::llama_tied);
  c.vocab_size = 96;
  const auto error_for = [&](std::vector<std::string> overrides, int64_t world) -> std::string {
    try {
      check_trainer_grid(parse_job_config(kMinimal, "job.toml", overrides), world, c);
    } catch (const tandem::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  CHECK(error_for({"trainer.tp=2", "trainer.pp=2"}, 4) == "(no error)");
  CHECK(error_for({"trainer.tp=2", "trainer.pp=2"}, 8) == "(no error)");
  CHECK_THAT(error_for({"trainer.tp=2", "trainer.pp=2"}, 6),
             Catch::Contains("does not divide the 6 ranks started"));
  // 4 prompts a step (the default) over 3 data-parallel replicas.
  CHECK_THAT(error_for({"trainer.tp=2", "rollout.prompts_per_step=4"}, 6),
             Catch::Contains("3 data-parallel replicas"));
  // 4 heads and 2 KV heads: tp 4 divides the heads but replicates the KV heads.
  CHECK_THAT(error_for({"trainer.tp=4"}, 4), Catch::Contains("does not divide the model's 2 "
                                                             "key-value heads"));
  CHECK_THAT(error_for({"trainer.tp=3"}, 3), Catch::Contains("trainer.tp = 3 does not fit"));
  CHECK_THAT(error_for({"trainer.pp=3"}, 3),
             Catch::Contains("trainer.pp = 3 does not fit") && Catch::Contains("of 2 layers"));
}

TEST_CASE("job config takes rollout.max_staleness for a disaggregated job and names the key else",
          "[unit]") {
  const std::vector<std::string> disaggregated{"placement.mode=\"disaggregated\"",
                                               "placement.workers=[\"127.0.0.1:9101\"]"};
  CHECK(parse_job_config(kMinimal, "job.toml").rollout.max_staleness == 0);
  std::vector<std::string> async = disaggregated;
  async.push_back("rollout.max_staleness=2");
  CHECK(parse_job_config(kMinimal, "job.toml", async).rollout.max_staleness == 2);
  // Colocated: refused, naming the key.
  CHECK_THAT(error_of(kMinimal, {"rollout.max_staleness=1"}),
             Catch::Contains("rollout.max_staleness") && Catch::Contains("disaggregated"));
  CHECK_THAT(error_of(kMinimal, {"rollout.max_staleness=-1"}),
             Catch::Contains("rollout.max_staleness"));
  // Old logprobs the trainer recomputes need the importance weight to reach the behaviour policy.
  std::vector<std::string> epochs = async;
  epochs.push_back("trainer.epochs=2");
  CHECK_THAT(error_of(kMinimal, epochs),
             Catch::Contains("rollout.max_staleness") && Catch::Contains("is_level"));
  epochs.push_back("trainer.algorithm.is_level=\"token\"");
  CHECK(parse_job_config(kMinimal, "job.toml", epochs).trainer.step.epochs == 2);
  // On several ranks too.
  for (const char* ranks : {"placement.ranks=2", "trainer.pp=2"}) {
    std::vector<std::string> wide = async;
    wide.push_back(ranks);
    CHECK(parse_job_config(kMinimal, "job.toml", wide).rollout.max_staleness == 2);
  }
}

TEST_CASE("job config takes a disaggregated job on several ranks and refuses a rollout split",
          "[unit]") {
  std::vector<std::string> keys{"placement.mode=\"disaggregated\"",
                                "placement.workers=[\"127.0.0.1:9101\"]", "placement.ranks=2"};
  CHECK(parse_job_config(kMinimal, "job.toml", keys).placement.ranks == 2);
  keys.push_back("trainer.pp=2");
  CHECK(parse_job_config(kMinimal, "job.toml", keys).trainer.pp == 2);
  keys.push_back("placement.rollout_tp=2");
  CHECK_THAT(error_of(kMinimal, keys),
             Catch::Contains("placement.rollout_tp") && Catch::Contains("workers"));
}

TEST_CASE("job config takes trainer.algorithm.downsample of 2 to rollout.n and divides its batch",
          "[unit]") {
  CHECK(parse_job_config(kMinimal, "job.toml").trainer.shaping.downsample == 0);
  const std::vector<std::string> four{"rollout.n=16", "trainer.algorithm.downsample=4"};
  const JobConfig j = parse_job_config(kMinimal, "job.toml", four);
  CHECK(j.trainer.shaping.downsample == 4);
  for (const char* bad : {"trainer.algorithm.downsample=1", "trainer.algorithm.downsample=17"})
    CHECK_THAT(error_of(kMinimal, {"rollout.n=16", bad}),
               Catch::Contains("trainer.algorithm.downsample: expected 0 (off) or 2 to "
                               "rollout.n = 16 samples of a group"));
  // The minibatches divide the batch trained on: prompts_per_step * downsample.
  const std::vector<std::string> thirds{"rollout.prompts_per_step=3", "rollout.n=8",
                                        "trainer.algorithm.downsample=2", "trainer.minibatches=3"};
  CHECK(parse_job_config(kMinimal, "job.toml", thirds).trainer.step.minibatches == 3);
  CHECK_THAT(error_of(kMinimal, {"rollout.prompts_per_step=3", "rollout.n=8",
                                 "trainer.algorithm.downsample=3", "trainer.minibatches=2"}),
             Catch::Contains("2 does not divide the batch rollout.prompts_per_step * "
                             "trainer.algorithm.downsample = 3 * 3 = 9"));
}
