// tandem train as a user runs it: a short job on the bundled model, its metrics, checkpoint and
// resume; dynamic sampling's refill and its bitwise resume; config errors with their place; the
// weight publish of an f32 and a bf16 rollout engine on a tiny random model; the start-up checks
// (unusable directories, data beyond memory), a failed metrics write, the run directory's lock
// and a resume under a changed config.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "model/hf.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;

std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<nlohmann::json> step_lines(const fs::path& metrics) {
  std::vector<nlohmann::json> steps;
  for (auto& m : read_jsonl(metrics))
    if (m.contains("loss")) steps.push_back(std::move(m));
  return steps;
}

// A job file of three steps on that model (no eval, no checkpoint but the last): tmp's job.toml.
std::string tiny_job_file(const tandem::test::TempDir& tmp, const std::string& model) {
  return tmp.write("job.toml", R"(
[model]
path = ")" + model + R"("
[data]
synthetic_size = 64
max_prompt_tokens = 96
[rollout]
prompts_per_step = 2
n = 4
max_new_tokens = 8
num_blocks = 64
[trainer]
steps = 3
lr = 1e-3
[[rewards]]
name = "has_e"
function = "regex_format"
pattern = '.*e.*'
[checkpoint]
every = 0
[eval]
every = 0
[logging]
samples_every = 0
)");
}

// `tandem train` of that job in tmp's run/ and run/ckpt/, with overrides.
tandem::test::CommandResult train_tiny(const tandem::test::TempDir& tmp, const std::string& model,
                                       const std::string& overrides) {
  const std::string job = tiny_job_file(tmp, model);
  return tandem::test::run_tandem("train " + job + " logging.dir=" + tmp.file("run") +
                                      " checkpoint.dir=" + tmp.file("run/ckpt") + " " + overrides,
                                  true, 300);
}

// Three steps of train_tiny; their step lines.
std::vector<nlohmann::json> run_tiny_job(const tandem::test::TempDir& tmp, const std::string& model,
                                         const std::string& overrides) {
  const auto r = train_tiny(tmp, model, overrides);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("step 3/3") != std::string::npos);
  return step_lines(tmp.file("run/metrics.jsonl"));
}

}  // namespace

TEST_CASE(
    "tandem train with a bf16 rollout casts every weight on publish and recomputes old "
    "logprobs",
    "[e2e]") {
  const tandem::test::TempDir tmp("train-bf16");
  const int64_t bf16_bytes = tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  const auto steps = run_tiny_job(tmp, tmp.file("model"), "rollout.dtype=bf16");
  REQUIRE(steps.size() == 3);
  for (const auto& m : steps) {
    INFO(m.dump());
    CHECK(m["weight_sync/bytes"].get<int64_t>() == bf16_bytes);
    CHECK(m["weight_sync/cast_tensors"].get<int64_t>() > 0);
    CHECK(m["weight_sync/shared_tensors"].get<int64_t>() == 0);
    CHECK(m["weight_sync/copied_tensors"].get<int64_t>() == 0);
    // The engine samples from the bf16 copy and the trainer scores with its f32 weights: close,
    // not equal.
    CHECK(m["old_logp_recomputed"].get<int>() == 1);
    const double max_abs = m["rollout_trainer_logp/max_abs"].get<double>();
    CHECK(max_abs > 0);
    CHECK(max_abs < 0.1);
    CHECK(m["rollout_trainer_logp/mean_abs"].get<double>() > 0);
    CHECK(m["rollout_trainer_logp/mean_abs"].get<double>() <= max_abs);
    CHECK(m["token_mult_prob_error"].get<double>() > 0);
    CHECK(m.contains("time/publish_s"));
  }
}

TEST_CASE("tandem train with the default f32 rollout publishes without moving a byte", "[e2e]") {
  const tandem::test::TempDir tmp("train-f32");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Old logprobs reused from the rollout by default; recomputed on request they equal the
  // engine's bitwise (same weights, same kernels).
  for (const std::string recompute : {"false", "true"}) {
    INFO("trainer.always_recompute_old=" << recompute);
    std::filesystem::remove_all(tmp.file("run"));
    const auto steps =
        run_tiny_job(tmp, tmp.file("model"), "trainer.always_recompute_old=" + recompute);
    REQUIRE(steps.size() == 3);
    for (const auto& m : steps) {
      INFO(m.dump());
      CHECK(m["weight_sync/bytes"].get<int64_t>() == 0);
      CHECK(m["weight_sync/shared_tensors"].get<int64_t>() > 0);
      CHECK(m["weight_sync/cast_tensors"].get<int64_t>() == 0);
      CHECK(m["old_logp_recomputed"].get<int>() == (recompute == "true" ? 1 : 0));
      if (recompute == "true")
        CHECK(m["rollout_trainer_logp/max_abs"].get<double>() == 0);
      else  // the old logprobs are the rollout's: no difference is logged
        CHECK(!m.contains("rollout_trainer_logp/max_abs"));
    }
  }
}

TEST_CASE("tandem train with bf16 CPU matmuls: engine and trainer logprobs agree bitwise",
          "[e2e]") {
  const tandem::test::TempDir tmp("train-bf16-matmul");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // The engine's packed weights (AMX) and the trainer's per-call packing round alike; without
  // AMX both take the portable path. Either way the difference is exactly 0.
  const auto steps = run_tiny_job(tmp, tmp.file("model"),
                                  "placement.cpu_matmul=bf16 trainer.always_recompute_old=true");
  REQUIRE(steps.size() == 3);
  for (const auto& m : steps) {
    INFO(m.dump());
    CHECK(m["old_logp_recomputed"].get<int>() == 1);
    CHECK(m["rollout_trainer_logp/max_abs"].get<double>() == 0);
    CHECK(std::isfinite(m["loss"].get<double>()));
  }
}

TEST_CASE("tandem train runs a short job writes metrics and resumes from its checkpoint", "[e2e]") {
  REQUIRE(fs::exists(kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const tandem::test::TempDir tmp("train-job");
  const std::string common =
      "train " + (kRepo / "configs" / "default.toml").string() +
      " model.path=" + (kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string() +
      " rollout.prompts_per_step=2 rollout.n=2 rollout.max_new_tokens=8 eval.every=2"
      " eval.max_prompts=2 eval.pass_k=2 checkpoint.every=2 logging.dir=" +
      tmp.file("run") + " checkpoint.dir=" + tmp.file("run/ckpt");
  auto r = tandem::test::run_tandem(common + " trainer.steps=2");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("step 2/2") != std::string::npos);
  CHECK(fs::exists(tmp.file("run/ckpt/step-2/policy/config.json")));
  CHECK(fs::exists(tmp.file("run/ckpt/step-2/policy/tokenizer.json")));
  CHECK(fs::exists(tmp.file("run/report.html")));
  auto metrics = read_jsonl(tmp.file("run/metrics.jsonl"));
  int steps = 0, evals = 0;
  for (const auto& m : metrics) {
    if (m.contains("loss")) {
      ++steps;
      for (const char* k : {"reward/mean", "kl_ref", "entropy", "grad_norm", "lr",
                            "response_length/mean", "tokens_per_s", "time/rollout_s"})
        CHECK(m.contains(k));
    }
    if (m.contains("eval/pass@1")) ++evals;
  }
  CHECK(steps == 2);
  CHECK(evals == 2);  // before the first step and at step 2

  r = tandem::test::run_tandem(common + " trainer.steps=3");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("resumed from") != std::string::npos);
  CHECK(r.out.find("step 3/3") != std::string::npos);
  CHECK(fs::exists(tmp.file("run/ckpt/step-3")));
}

TEST_CASE("tandem train names the line of a bad config value and exits non-zero", "[e2e]") {
  const tandem::test::TempDir tmp("train-bad");
  const std::string path = tmp.file("job.toml");
  std::ofstream(path) << "[model]\npath = \"x.gguf\"\n\n[trainer]\nlr = \"fast\"\n\n"
                         "[[rewards]]\nname = \"ok\"\nfunction = \"math_match\"\n";
  auto r = tandem::test::run_tandem("train " + path);
  CHECK(r.status != 0);
  CHECK(r.out.find(path + ":5") != std::string::npos);
  CHECK(r.out.find("trainer.lr") != std::string::npos);
  std::ofstream(path) << "[model]\npath = \"x.gguf\"\n\n[[rewards]]\nname = \"ok\"\n"
                         "function = \"math_match\"\n";
  r = tandem::test::run_tandem("train " + path + " trainer.lr=1e-6");
  CHECK(r.status != 0);
  CHECK(r.out.find("x.gguf") != std::string::npos);  // the model path is checked before work
}

TEST_CASE("tandem train scores its samples with the remote Python reward server", "[e2e]") {
  REQUIRE(fs::exists(kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const std::string python = tandem::test::require_python_with_thrift();
  tandem::test::Subprocess server({python, (kRepo / "examples/python/reward_server.py").string(),
                                   "--port", "0", "--token", "e2e-token"});
  const std::string line = server.wait_for_line("listening on ", 30000);
  INFO(server.output());
  REQUIRE(!line.empty());
  const std::string port = line.substr(13);

  const tandem::test::TempDir tmp("train-remote");
  const std::string job = tmp.write(
      "job.toml",
      "[model]\npath = \"" + (kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string() +
          "\"\n\n[data]\nsource = \"synthetic\"\ntask = \"arithmetic\"\nsystem_prompt = \"End "
          "your answer with #### followed by the number.\"\n\n[rollout]\nprompts_per_step = "
          "2\nn = 2\nmax_new_tokens = 8\n\n[trainer]\nsteps = 3\n\n[eval]\nevery = 0\n\n"
          "[checkpoint]\ndir = \"" +
          tmp.file("run/ckpt") + "\"\nevery = 0\n\n[logging]\ndir = \"" + tmp.file("run") +
          "\"\n\n[[rewards]]\nname = \"remote_math\"\nkind = \"remote\"\naddress = "
          "\"127.0.0.1:" +
          port +
          "\"\ntimeout_ms = 5000\nbatch_size = 3\nmax_concurrency = 2\ntoken_env = "
          "\"TANDEM_TEST_REWARD_TOKEN\"\n");
  auto r = tandem::test::run_tandem("train " + job, true, 300);
  INFO(r.out);
  CHECK(r.status != 0);  // the token's variable is not set
  CHECK(r.out.find("TANDEM_TEST_REWARD_TOKEN (token_env) is not set") != std::string::npos);

  r = tandem::test::run_tandem("train " + job, true, 300, "TANDEM_TEST_REWARD_TOKEN=e2e-token");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("step 3/3") != std::string::npos);
  int steps = 0;
  for (const auto& m : read_jsonl(tmp.file("run/metrics.jsonl"))) {
    if (!m.contains("loss")) continue;
    ++steps;
    REQUIRE(m.contains("reward/remote_math/failed"));
    CHECK(m["reward/remote_math/failed"].get<double>() == 0.0);  // every sample was judged
  }
  CHECK(steps == 3);
  CHECK(server.stop() == 0);
}

TEST_CASE("tandem train with dynamic sampling refills the batch and resumes bitwise", "[e2e]") {
  REQUIRE(fs::exists(kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const tandem::test::TempDir tmp("train-refill");
  // Whether a completion holds a digit: in groups of two, often the same for both samples (no
  // signal), so round 0 rarely gives both groups a reward variance.
  const std::string job = tmp.write("job.toml", R"(
[model]
path = ")" + (kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string() +
                                                    R"("
[data]
synthetic_size = 256
system_prompt = "Solve the problem. End your answer with #### followed by the number."
max_prompt_tokens = 128
seed = 3
[rollout]
prompts_per_step = 2
n = 2
max_new_tokens = 8
seed = 5
num_blocks = 64
max_batch_tokens = 512
[trainer]
steps = 3
lr = 1e-5
micro_batch_tokens = 512
[trainer.algorithm]
dynamic_sampling = true
max_refill_rounds = 2
[trainer.optimizer]
weight_decay = 0.0
[trainer.schedule]
kind = "constant"
[[rewards]]
name = "digit"
function = "regex_format"
pattern = '.*\d.*'
[checkpoint]
every = 1
keep_last = 5
[eval]
every = 0
[logging]
samples_every = 0
)");
  auto run = [&](const std::string& dir, int steps) {
    const auto r = tandem::test::run_tandem("train " + job + " logging.dir=" + tmp.file(dir) +
                                                " checkpoint.dir=" + tmp.file(dir + "/ckpt") +
                                                " trainer.steps=" + std::to_string(steps),
                                            true, 600);
    INFO(r.out);
    REQUIRE(r.status == 0);
    return r.out;
  };
  const std::string straight = run("a", 3);
  CHECK(straight.find("refills)") != std::string::npos);  // the progress line shows the groups

  const auto steps = step_lines(tmp.file("a/metrics.jsonl"));
  REQUIRE(steps.size() == 3);
  int64_t drawn = 0, refills = 0;
  for (const auto& m : steps) {
    INFO(m.dump());
    const auto generated = m["dynamic_sampling/groups_generated"].get<int64_t>();
    const auto kept = m["dynamic_sampling/groups_kept"].get<int64_t>();
    const auto rounds = m["dynamic_sampling/refill_rounds"].get<int64_t>();
    CHECK(kept <= 2);
    CHECK(rounds <= 2);
    CHECK(generated >= 2 + rounds);  // every refill round draws at least one prompt
    CHECK(generated <= 2 * (1 + rounds));
    if (kept < 2) CHECK(rounds == 2);  // it only gives up when the rounds run out
    CHECK(m["samples_trained"].get<int64_t>() == 2 * kept);
    CHECK(m["update_skipped"].get<int>() == (kept == 0 ? 1 : 0));
    drawn += generated;
    refills += rounds;
  }
  CHECK(refills > 0);  // the reward left some group without signal: the batch was refilled
  // The stream's position counts every prompt drawn, refills included.
  const auto state =
      nlohmann::json::parse(read_bytes(tmp.file("a/ckpt/step-3/trainer_state.json")));
  CHECK(state["data_epoch"].get<int64_t>() == 0);
  CHECK(state["data_position"].get<int64_t>() == drawn);

  // Stopped after step 1 and resumed: the same batches, weights and optimizer state, bitwise.
  run("b", 1);
  const std::string resumed = run("b", 3);
  CHECK(resumed.find("resumed from") != std::string::npos);
  const auto again = step_lines(tmp.file("b/metrics.jsonl"));
  REQUIRE(again.size() == 3);
  for (size_t i = 0; i < 3; ++i)
    for (const char* k : {"loss", "reward/mean", "grad_norm", "dynamic_sampling/groups_generated",
                          "dynamic_sampling/groups_kept", "dynamic_sampling/refill_rounds"}) {
      INFO("step " << i + 1 << " " << k);
      CHECK(again[i][k] == steps[i][k]);
    }
  for (const char* f : {"policy/model.safetensors", "optimizer.safetensors"}) {
    INFO(f);
    CHECK(read_bytes(tmp.file(std::string("a/ckpt/step-3/") + f)) ==
          read_bytes(tmp.file(std::string("b/ckpt/step-3/") + f)));
  }
}

TEST_CASE("tandem train skips prompts longer than data.max_prompt_tokens and counts them",
          "[e2e]") {
  const tandem::test::TempDir tmp("train-long-prompts");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Five short prompts and three far past the 96-token limit: those are never cut and trained on.
  std::string lines;
  for (int i = 0; i < 5; ++i)
    lines +=
        nlohmann::json{
            {"id", "short" + std::to_string(i)}, {"prompt", "Say hello."}, {"answer", "hello"}}
            .dump() +
        "\n";
  std::string lengthy;
  for (int w = 0; w < 150; ++w) lengthy += "lengthy ";
  for (int i = 0; i < 3; ++i)
    lines +=
        nlohmann::json{{"id", "long" + std::to_string(i)}, {"prompt", lengthy}, {"answer", "no"}}
            .dump() +
        "\n";
  const std::string data = tmp.write("data.jsonl", lines);
  const auto steps = run_tiny_job(
      tmp, tmp.file("model"),
      "data.source=jsonl data.path=" + data + " eval.split_fraction=0 logging.samples_every=1");
  REQUIRE(steps.size() == 3);
  int64_t skipped = 0;
  for (const auto& m : steps) skipped += m["data/prompts_skipped_too_long"].get<int64_t>();
  // Six prompts drawn in three steps from a shuffled stream of eight: the first epoch's three
  // long ones at least were met and skipped.
  CHECK(skipped >= 3);
  for (const auto& s : read_jsonl(tmp.file("run/samples.jsonl")))
    CHECK(s["prompt"].get<std::string>().find("lengthy") == std::string::npos);
}

TEST_CASE("tandem train renders prompts as model.chat_template says", "[e2e]") {
  const tandem::test::TempDir tmp("train-chat-template");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  run_tiny_job(tmp, tmp.file("model"), "model.chat_template=none logging.samples_every=1");
  const auto samples = read_jsonl(tmp.file("run/samples.jsonl"));
  REQUIRE(samples.size() == 3);
  for (const auto& s : samples) {
    const std::string prompt = s["prompt"].get<std::string>();
    INFO(prompt);
    CHECK(prompt.find("<|im_start|>") == std::string::npos);
    CHECK(prompt.rfind("What is", 0) == 0);
  }
}

TEST_CASE("tandem train refuses unusable run directories before loading the model", "[e2e]") {
  const tandem::test::TempDir tmp("train-dirs");
  // model.path exists but is no model: the directories are checked before it is loaded.
  const std::string job =
      tmp.write("job.toml", "[[rewards]]\nname = \"ok\"\nfunction = \"math_match\"\n");
  const std::string file = tmp.write("a-file", "x");
  auto r = tandem::test::run_tandem("train " + job + " model.path=" + job + " logging.dir=" + file);
  INFO(r.out);
  CHECK(r.status == 1);  // not an abort
  CHECK(r.out.find("logging.dir '" + file + "' is not a directory") != std::string::npos);
  CHECK(r.out.find("override 'logging.dir=") != std::string::npos);

  r = tandem::test::run_tandem("train " + job + " model.path=" + job + " logging.dir=" +
                               tmp.file("run") + " checkpoint.dir=" + file + "/ckpt");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("checkpoint.dir '" + file + "/ckpt' cannot be created") != std::string::npos);
}

TEST_CASE("tandem train refuses a synthetic data set beyond memory with one line", "[e2e]") {
  const tandem::test::TempDir tmp("train-huge-data");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Inside the key's documented range, far beyond this machine's memory.
  const auto r = train_tiny(tmp, tmp.file("model"), "data.synthetic_size=1000000000");
  INFO(r.out);
  CHECK(r.status == 1);  // not an abort on std::bad_alloc
  CHECK(r.out.find("data.synthetic_size 1000000000 needs about") != std::string::npos);
}

TEST_CASE("tandem train refuses a KV cache or a batch beyond memory naming the key", "[e2e]") {
  const tandem::test::TempDir tmp("train-huge-engine");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Inside the keys' documented ranges, far beyond this machine's memory: refused before the
  // engine allocates, naming the key to lower and where it was set.
  for (const std::string key : {"rollout.num_blocks", "rollout.max_batch_tokens"}) {
    const auto r = train_tiny(tmp, tmp.file("model"),
                              key + (key == "rollout.num_blocks" ? "=100000000" : "=1000000000"));
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(r.out.find("of memory available: lower " + key + " (override '" + key + "=") !=
          std::string::npos);
    CHECK(r.out.find("out of host memory") == std::string::npos);
  }
}

TEST_CASE("tandem train fails when its metrics cannot be written", "[e2e]") {
  const tandem::test::TempDir tmp("train-disk-full");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  fs::create_directories(tmp.file("run"));
  fs::create_symlink("/dev/full", tmp.file("run/metrics.jsonl"));  // every write: ENOSPC
  const auto r = train_tiny(tmp, tmp.file("model"), "trainer.steps=1");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("metrics.jsonl: write failed: No space left on device") != std::string::npos);
}

TEST_CASE("tandem train locks its run and checkpoint directories for the job's life", "[e2e]") {
  const tandem::test::TempDir tmp("train-lock");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // A save killed mid-way by a process that is gone: removed when the next job starts.
  const fs::path stale = tmp.file("run/ckpt/.tmp-step-7-999999999");
  fs::create_directories(stale / "policy");
  tmp.write("run/ckpt/.tmp-step-7-999999999/policy/model.safetensors", "half a model");

  // The first job runs until stopped.
  tandem::test::Subprocess first({"/bin/sh", "-c",
                                  "exec " + std::string(TANDEM_BIN_DIR) + "/tandem train " +
                                      tiny_job_file(tmp, tmp.file("model")) +
                                      " trainer.steps=100000 logging.dir=" + tmp.file("run") +
                                      " checkpoint.dir=" + tmp.file("run/ckpt") + " 2>&1"});
  const std::string line = first.wait_for_line("step 1/", 120000);
  INFO(first.output());
  REQUIRE(!line.empty());
  CHECK(first.output().find("removed " + stale.string()) != std::string::npos);
  CHECK(first.output().find("process 999999999, no longer running") != std::string::npos);
  CHECK(!fs::exists(stale));

  const std::string holder = "pid " + std::to_string(first.pid()) + " on host ";
  auto r = train_tiny(tmp, tmp.file("model"), "");  // the same run and checkpoint directories
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("logging.dir '") != std::string::npos);
  CHECK(r.out.find("is in use by another tandem job (" + holder) != std::string::npos);

  r = train_tiny(tmp, tmp.file("model"),
                 "logging.dir=" + tmp.file("other") + " checkpoint.dir=" + tmp.file("run/ckpt"));
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("checkpoint.dir '") != std::string::npos);
  CHECK(r.out.find(holder) != std::string::npos);
  CHECK(!fs::exists(tmp.file("other/metrics.jsonl")));

  CHECK(first.stop() == 130);  // Ctrl-C: the step ends, a checkpoint is written
  // Once the holder is gone the directory is free again.
  r = train_tiny(tmp, tmp.file("model"), "checkpoint.resume=none trainer.steps=1");
  INFO(r.out);
  CHECK(r.status == 0);
}

TEST_CASE("tandem train resumes with a changed config only when allowed and records it", "[e2e]") {
  const tandem::test::TempDir tmp("train-resume-config");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  auto r = train_tiny(tmp, tmp.file("model"), "trainer.steps=1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  REQUIRE(fs::exists(tmp.file("run/ckpt/step-1/trainer_state.json")));

  // A run extended, with other logging: the same training, resumed without a word.
  r = train_tiny(tmp, tmp.file("model"), "trainer.steps=2 logging.samples_every=1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("resumed from") != std::string::npos);
  CHECK(r.out.find("changed config") == std::string::npos);

  r = train_tiny(tmp, tmp.file("model"), "trainer.steps=3 trainer.lr=0.5 rollout.temperature=0.5");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("was written under another config") != std::string::npos);
  CHECK(r.out.find("trainer.lr: 0.001 -> 0.5") != std::string::npos);
  CHECK(r.out.find("rollout.temperature: 1.0 -> 0.5") != std::string::npos);
  CHECK(r.out.find("trainer.steps") == std::string::npos);
  CHECK(r.out.find("checkpoint.allow_config_change=true") != std::string::npos);
  CHECK(!fs::exists(tmp.file("run/ckpt/step-3")));

  r = train_tiny(tmp, tmp.file("model"),
                 "trainer.steps=3 trainer.lr=0.5 checkpoint.allow_config_change=true");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("trainer.lr: 0.001 -> 0.5") != std::string::npos);
  // The new checkpoint records the config the run used.
  const auto state =
      nlohmann::json::parse(read_bytes(tmp.file("run/ckpt/step-3/trainer_state.json")));
  const std::string config = state["config"].get<std::string>();
  CHECK(config.find("lr = 0.5") != std::string::npos);
  CHECK(config.find("lr = 0.001") == std::string::npos);
}

TEST_CASE("tandem train with trainer.algorithm.downsample trains the max-variance pair of a group",
          "[e2e]") {
  const tandem::test::TempDir tmp("train-downsample");
  tandem::test::write_tiny_smollm2_hf(tmp.file("model"));
  // Groups of 4, 2 of each trained: 4 of the 8 samples a step. A pair of the highest and lowest
  // reward, when the group's rewards differ, is {0, 1}: advantages +a and -a, whatever the rest of
  // the group (all four would give 1 of 4 correct, say, an uneven +1.5 and -0.5).
  const auto steps = run_tiny_job(tmp, tmp.file("model"), "trainer.algorithm.downsample=2");
  REQUIRE(steps.size() == 3);
  int with_signal = 0;
  for (const auto& m : steps) {
    INFO(m.dump());
    CHECK(m["samples_trained"].get<int64_t>() == 4);
    CHECK(m["samples_downsampled"].get<int64_t>() == 4);
    const double hi = m["advantage/max"].get<double>(), lo = m["advantage/min"].get<double>();
    CHECK(hi == Approx(-lo).margin(1e-6));
    with_signal += hi > 0 ? 1 : 0;
  }
  CHECK(with_signal > 0);
}
