// tandem generate, score and convert as a user runs them, on the bundled SmolLM2-135M-Instruct
// and the tiny golden models: their outputs, and their refusals (convert's --out that it did not
// write, score's lines past the model's context) and score's memory on a long input.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testutil.h"

#include "model/hf.h"
#include "model/weights.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;
const std::string kSmol = (kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string();

using Run = tandem::test::CommandResult;
Run run(const std::string& args, bool merge_stderr = true) {
  return tandem::test::run_tandem(args, merge_stderr);
}

// A shell command line exec'd in a child (so that the peak resident memory wait4 reports is the
// command's own, with its children's): its exit status and peak in MiB.
struct Measured {
  int status = -1;
  double peak_mib = 0;
};
Measured run_measured(const std::string& cmd) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  rusage u{};
  REQUIRE(wait4(pid, &status, 0, &u) == pid);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, static_cast<double>(u.ru_maxrss) / 1024.0};
}

}  // namespace

TEST_CASE("tandem generate answers a chat prompt greedily with SmolLM2", "[e2e]") {
  INFO("the bundled model is fetched by scripts/setup");
  REQUIRE(fs::exists(kSmol));
  const Run r = run("generate --model " + kSmol +
                    " --prompt 'What is 12+7?' --chat --temperature 0 --max-tokens 32");
  INFO(r.out);
  CHECK(r.status == 0);
  // transformers' greedy answer for the same GGUF starts the same way (tests/golden/smollm2-gguf).
  CHECK(r.out.find("12 + 7 = ") != std::string::npos);
  CHECK(r.out.find("tokens/s") != std::string::npos);
}

TEST_CASE("tandem generate names a missing model and exits non-zero", "[e2e]") {
  const Run r = run("generate --model /nonexistent/model.gguf --prompt hi");
  CHECK(r.status != 0);
  CHECK(r.out.find("/nonexistent/model.gguf") != std::string::npos);
}

TEST_CASE("tandem score prints per-token logprobs and names bad lines", "[e2e]") {
  REQUIRE(fs::exists(kSmol));
  const tandem::test::TempDir tmp("cli-score");
  const fs::path in = tmp.file("score.jsonl");
  {
    std::ofstream f(in);
    f << R"({"prompt": "The capital of France is", "completion": " Paris."})"
      << "\n\n";
    f << R"({"id": 7, "prompt_ids": [504, 3575, 282], "completion_ids": [4649, 314]})"
      << "\n";
  }
  Run r = run("score --model " + kSmol + " --input " + in.string(), false);
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::istringstream lines(r.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    const size_t tokens = j["completion_ids"].size();
    CHECK(tokens >= 2);
    CHECK(j["logprobs"].size() == tokens);
    CHECK(j["entropies"].size() == tokens);
    double sum = 0;
    for (const auto& v : j["logprobs"]) {
      CHECK(v.get<double>() <= 0.0);
      sum += v.get<double>();
    }
    CHECK(j["sum_logprob"].get<double>() == Approx(sum).margin(1e-4));
    if (n == 0) CHECK(j["line"] == 1);
    if (n == 1) CHECK(j["id"] == 7);
    ++n;
  }
  CHECK(n == 2);

  { std::ofstream(in, std::ios::app) << "{\"prompt\": 3}\n"; }
  r = run("score --model " + kSmol + " --input " + in.string());
  CHECK(r.status != 0);
  CHECK(r.out.find(in.string() + ":4") != std::string::npos);
  CHECK(r.out.find("prompt") != std::string::npos);
}

TEST_CASE("tandem convert writes an HF directory with the same weights and a tokenizer", "[e2e]") {
  const fs::path src = kRepo / "tests" / "golden" / "tiny-qwen2";
  const tandem::test::TempDir tmp("cli-convert");
  const fs::path out = tmp.file("tiny-qwen2");
  Run r = run("convert --model " + src.string() + " --out " + out.string());
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto a = tandem::model::load_hf(src.string());
  auto b = tandem::model::load_hf(out.string());
  REQUIRE(a->named().size() == b->named().size());
  for (size_t i = 0; i < a->named().size(); ++i) {
    const auto& x = a->named()[i].tensor;
    const auto& y = b->named()[i].tensor;
    CHECK(a->named()[i].name == b->named()[i].name);
    CHECK(std::memcmp(x.data(), y.data(), x.nbytes()) == 0);
  }

  REQUIRE(fs::exists(kSmol));
  const fs::path smol = tmp.file("smollm2");
  r = run("convert --model " + kSmol + " --out " + smol.string() + " --dtype bf16");
  REQUIRE(r.status == 0);
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors",
                        "tokenizer.json", "tokenizer_config.json"})
    CHECK(fs::exists(smol / f));
}

TEST_CASE("tandem convert --random-init writes seeded random weights of a config's shape",
          "[e2e]") {
  const tandem::test::TempDir tmp("cli-convert-random");
  const std::string small = tmp.write("small.json", R"({
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
    "bos_token_id": 1, "eos_token_id": 2})");
  auto convert = [&](const std::string& out, const std::string& flags) {
    return run("convert --model " + kSmol + " --out " + tmp.file(out) + " " + flags);
  };
  Run r = convert("a", "--random-init " + small + " --seed 3");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(fs::exists(fs::path(tmp.file("a")) / "tokenizer.json"));
  REQUIRE(convert("b", "--random-init " + small + " --seed 3").status == 0);
  REQUIRE(convert("c", "--random-init " + small + " --seed 4").status == 0);
  auto a = tandem::model::load_hf(tmp.file("a"));
  auto b = tandem::model::load_hf(tmp.file("b"));
  auto c = tandem::model::load_hf(tmp.file("c"));
  CHECK(a->config().hidden_size == 32);
  CHECK(a->config().num_layers == 2);
  CHECK(a->config().num_kv_heads == 2);
  for (size_t i = 0; i < a->storage().size(); ++i) {
    const tandem::Tensor& x = a->storage()[i].tensor;
    const std::string& name = a->storage()[i].name;
    INFO(name);
    CHECK(tandem::test::bitwise_equal(x, b->storage()[i].tensor));  // the seed decides
    CHECK_FALSE(tandem::test::bitwise_equal(x, c->storage()[i].tensor));
    // The ranges that keep activations O(1): norms near 1, matrices by 1/sqrt(fan-in).
    const std::vector<double> v = tandem::test::to_f64(x);
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    const double bound = name.find("norm") != std::string::npos    ? 1.3
                         : name.find("embed") != std::string::npos ? 1.0
                                                                   : 1.7 / std::sqrt(x.size(1));
    CHECK(*hi <= bound);
    CHECK(*lo >= (name.find("norm") != std::string::npos ? 0.7 : -bound));
    CHECK(*hi - *lo > 0.5 * (name.find("norm") != std::string::npos ? 0.6 : 2 * bound));
  }

  // The published shape the docs train across ranks parses; a vocabulary smaller than the
  // tokenizer's is refused naming the file.
  CHECK(tandem::model::config_from_hf_file((kRepo / "configs/models/smollm2-360m.json").string())
            .num_layers == 32);
  const std::string tiny_vocab = tmp.write("tiny-vocab.json", R"({
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5})");
  r = convert("d", "--random-init " + tiny_vocab);
  CHECK(r.status != 0);
  CHECK(r.out.find("tiny-vocab.json': vocab_size 100 cannot hold the 49152 tokens") !=
        std::string::npos);
}

TEST_CASE("tandem generate --prompts -n prints a group of samples per prompt", "[e2e]") {
  REQUIRE(fs::exists(kSmol));
  const tandem::test::TempDir tmp("cli-generate");
  const std::string in = tmp.file("prompts.jsonl");
  {
    std::ofstream f(in);
    f << R"({"id": "sum", "prompt": "What is 2+2?"})"
      << "\n";
    f << R"({"prompt_ids": [504, 3575, 282, 4649, 314]})"
      << "\n";
  }
  const Run r = run("generate --model " + kSmol + " --prompts " + in +
                        " -n 4 --chat --temperature 0.8 --seed 5 --max-tokens 12",
                    false);
  INFO(r.out);
  REQUIRE(r.status == 0);
  std::istringstream lines(r.out);
  std::string line;
  std::vector<nlohmann::json> outs;
  while (std::getline(lines, line)) outs.push_back(nlohmann::json::parse(line));
  REQUIRE(outs.size() == 2);
  CHECK(outs[0]["id"] == "sum");
  CHECK(outs[1]["id"] == "2");
  for (const auto& o : outs) {
    CHECK(o["status"] == "done");
    REQUIRE(o["samples"].size() == 4);
    for (const auto& s : o["samples"]) {
      CHECK(s["tokens"].size() >= 1);
      CHECK(s["tokens"].size() <= 12);
      CHECK(s["logprobs"].size() == s["tokens"].size());
      for (const auto& lp : s["logprobs"]) CHECK(lp.get<double>() <= 0.0);
    }
  }
  // The same seed gives the same samples.
  const Run again = run("generate --model " + kSmol + " --prompts " + in +
                            " -n 4 --chat --temperature 0.8 --seed 5 --max-tokens 12",
                        false);
  CHECK(again.out == r.out);
}

TEST_CASE("tandem convert never removes what it did not write", "[e2e]") {
  const std::string src = (kRepo / "tests" / "golden" / "tiny-qwen2").string();
  const tandem::test::TempDir tmp("cli-convert-out");
  auto convert = [&](const std::string& out, const std::string& flags = "") {
    return run("convert --model " + src + " --out " + out + " " + flags);
  };
  auto read = [](const std::string& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };

  // A regular file is never replaced, with --overwrite neither.
  const std::string file = tmp.write("notes.txt", "keep me");
  for (const std::string flags : {"", "--overwrite"}) {
    const Run r = convert(file, flags);
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(r.out.find("not a directory") != std::string::npos);
    CHECK(read(file) == "keep me");
  }

  // A directory of the user's: refused with and without --overwrite, left as it was.
  const std::string mine = tmp.file("mine");
  fs::create_directory(mine);
  tmp.write("mine/data.csv", "1,2,3");
  Run r = convert(mine);
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("not empty") != std::string::npos);
  CHECK(r.out.find("data.csv") != std::string::npos);
  r = convert(mine, "--overwrite");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("not the output of a tandem convert") != std::string::npos);
  CHECK(read(tmp.file("mine/data.csv")) == "1,2,3");
  CHECK(std::distance(fs::directory_iterator(mine), fs::directory_iterator()) == 1);

  // An empty directory is written into; a second convert needs --overwrite, which replaces it.
  const std::string out = tmp.file("out");
  fs::create_directory(out);
  r = convert(out);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(fs::exists(fs::path(out) / "model.safetensors"));
  CHECK(fs::exists(fs::path(out) / ".tandem-convert.json"));
  r = convert(out);
  CHECK(r.status == 1);
  CHECK(r.out.find("--overwrite") != std::string::npos);
  r = convert(out, "--overwrite --dtype bf16");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(tandem::model::load_hf(out)->named().size() > 0);

  // A file added to a previous output is not the converter's to delete.
  tmp.write("out/README.md", "my notes");
  r = convert(out, "--overwrite");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("README.md") != std::string::npos);
  CHECK(read(tmp.file("out/README.md")) == "my notes");
  CHECK(fs::exists(fs::path(out) / "model.safetensors"));
}

TEST_CASE("tandem convert --overwrite deletes only files of its names and recorded sizes",
          "[e2e]") {
  const std::string src = (kRepo / "tests" / "golden" / "tiny-qwen2").string();
  const tandem::test::TempDir tmp("cli-convert-marker");
  auto convert = [&](const std::string& out) {
    return run("convert --model " + src + " --out " + out + " --overwrite");
  };
  auto read = [](const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  // A marker someone else wrote, listing the user's file (as names, and as names with sizes).
  for (const std::string marker :
       {R"({"files": ["notes.txt", ".tandem-convert.json"]})", R"({"files": {"notes.txt": 7}})"}) {
    INFO(marker);
    const fs::path dir = tmp.file("forged");
    fs::create_directory(dir);
    tmp.write("forged/notes.txt", "keep me");
    tmp.write("forged/.tandem-convert.json", marker);
    const Run r = convert(dir.string());
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(read(dir / "notes.txt") == "keep me");
    CHECK(!fs::exists(dir / "model.safetensors"));
  }
  // A previous output whose config.json the user rewrote: convert's name, not its size.
  const fs::path out = tmp.file("out");
  Run r = run("convert --model " + src + " --out " + out.string());
  INFO(r.out);
  REQUIRE(r.status == 0);
  const auto marker = nlohmann::json::parse(read(out / ".tandem-convert.json"));
  CHECK(marker["files"]["model.safetensors"] == fs::file_size(out / "model.safetensors"));
  const std::string mine = read(out / "config.json") + "\n// my edits\n";
  tmp.write("out/config.json", mine);
  r = convert(out.string());
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("holds 'config.json', which tandem convert did not write") != std::string::npos);
  CHECK(read(out / "config.json") == mine);
}

TEST_CASE("tandem score refuses a line longer than the model's context naming file and line",
          "[e2e]") {
  const std::string model = (kRepo / "tests" / "golden" / "tiny-qwen2").string();
  const tandem::test::TempDir tmp("cli-score-context");
  // tiny-qwen2's max_position_embeddings is 512: 2 + 510 tokens fit, 2 + 511 do not.
  auto line = [](size_t completion_tokens) {
    nlohmann::json j = {{"prompt_ids", {5, 6}},
                        {"completion_ids", std::vector<int>(completion_tokens, 7)}};
    return j.dump() + "\n";
  };
  const std::string in = tmp.write("in.jsonl", line(510) + line(511));
  const Run r = run("score --model " + model + " --input " + in);
  INFO(r.out.substr(r.out.size() > 2000 ? r.out.size() - 2000 : 0));
  CHECK(r.status == 1);
  CHECK(r.out.find(in + ":2: 513 tokens") != std::string::npos);
  CHECK(r.out.find("max_position_embeddings") != std::string::npos);
  CHECK(r.out.find("\"line\":1") != std::string::npos);  // the line that fits was scored
}

// About 20 s on 2 cores (AVX2 or AVX-512); the training forward's plan would ask for 3 GB.
TEST_CASE("tandem score of a 2000-token input with SmolLM2 runs in memory linear in its length",
          "[slow]") {
  REQUIRE(fs::exists(kSmol));
  const tandem::test::TempDir tmp("cli-score-long");
  // 1500 prompt and 500 completion tokens: the training forward would keep 1.5 MB of
  // activations a token (3 GB); score's plan is about 40 KB a token and one chunk of logits.
  std::vector<int> prompt, completion;
  for (int i = 0; i < 1500; ++i) prompt.push_back(1000 + (i * 7919) % 40000);
  for (int i = 0; i < 500; ++i) completion.push_back(1000 + (i * 104729) % 40000);
  const nlohmann::json line = {{"prompt_ids", prompt}, {"completion_ids", completion}};
  const std::string in = tmp.write("long.jsonl", line.dump() + "\n");
  const std::string out = tmp.file("out.jsonl");
  const Measured m =
      run_measured("timeout -k 5 1200 " + std::string(TANDEM_BIN_DIR) + "/tandem score --model " +
                   kSmol + " --input " + in + " > " + out + " 2> " + tmp.file("err.txt"));
  const std::string text = tandem::test::read_text(out);
  INFO(text.substr(0, 2000));
  INFO("peak resident memory " << m.peak_mib << " MiB");
  REQUIRE(m.status == 0);
  const auto j = nlohmann::json::parse(text);
  REQUIRE(j["logprobs"].size() == completion.size());
  for (const auto& v : j["logprobs"]) CHECK(std::isfinite(v.get<double>()));
  // The f32 weights (540 MB) and tokenizer, 77 MB of activations, 51 MB of a chunk's logits.
  CHECK(m.peak_mib < 1536);
}
