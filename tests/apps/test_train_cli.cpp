// tandem train as a user runs it: a short job on the bundled model, its metrics, checkpoint and
// resume; config errors with their place.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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

}  // namespace

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
  const std::string python = tandem::test::python_with_thrift();
  if (python.empty())
    FAIL(
        "no python3 with the thrift package (tried $TANDEM_PYTHON, python3, /usr/bin/python3): "
        "run scripts/setup (it installs python3-thrift and thrift-compiler)");
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
