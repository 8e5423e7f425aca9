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

const fs::path kRepo = fs::path(__FILE__).parent_path() / ".." / "..";

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
