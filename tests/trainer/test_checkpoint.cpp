// Tests of trainer/checkpoint: bit-exact resume of weights, moments, counters and trainer state,
// keeping the last K, atomic saves, errors for missing, truncated, malformed and foreign
// checkpoints that leave the destination untouched, and the clean-up after interrupted saves.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/checkpoint.h"
#include "trainer/lr_schedule.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;
using model::ModelConfig;
using model::NamedTensor;
using model::Weights;

// A tiny Qwen3 (q/k norms, untied lm_head) or Qwen2 (biases, tied).
ModelConfig tiny_config(bool qwen3 = true) {
  ModelConfig c = test::micro_model_config(qwen3);
  c.eos_token_ids = {2};
  return c;
}

bool same_weights(const Weights& a, const Weights& b) {
  for (size_t i = 0; i < a.storage().size(); ++i) {
    if (!test::bitwise_equal(a.storage()[i].tensor, b.storage()[i].tensor)) return false;
  }
  return true;
}

// A policy, its optimizer and synthetic gradients that depend only on the step.
struct Job {
  Weights policy;
  AdamW opt;
  Weights grads;
  LrSchedule schedule;
  explicit Job(const ModelConfig& c, uint64_t seed = 1)
      : policy(c, DType::f32),
        opt(policy, options()),
        grads(c, DType::f32, Device::cpu(), ArenaClass::gradients),
        schedule(lr()) {
    test::fill_uniform(policy, seed);
  }
  static AdamWConfig options() {
    AdamWConfig o;
    o.max_grad_norm = 2.0f;  // some steps clipped
    return o;
  }
  static LrScheduleConfig lr() {
    LrScheduleConfig s;
    s.kind = LrScheduleKind::cosine;
    s.lr = 1e-2f;
    s.warmup_steps = 1;
    s.total_steps = 6;
    return s;
  }
  void step(int64_t n) {
    test::fill_uniform(grads, 500 + static_cast<uint64_t>(n) * 97);
    opt.step(grads, schedule.lr_at(n));
  }
};

TrainerState sample_state(int64_t step) {
  TrainerState s;
  s.step = step;
  s.weight_version = step + 1;
  s.data_epoch = 1;
  s.data_position = 40 + step;
  s.rng_states = {{"sampler", {{"seed", "18446744073709551557"}, {"offset", 12345}}},
                  {"shuffle", {{"seed", "7"}}}};
  s.config = "[model]\npath = \"x\"  # a \"quoted\" comment\n";
  s.extra = {{"reward_mean", 0.25}, {"note", "ünïcode"}};
  return s;
}

TEST_CASE("Resume from a checkpoint continues bit-exactly", "[unit]") {
  const ModelConfig c = tiny_config();
  test::TempDir dir("ckpt_resume");

  Job straight(c);
  for (int64_t n = 0; n < 4; ++n) straight.step(n);

  Job first(c);
  for (int64_t n = 0; n < 2; ++n) first.step(n);
  const std::string saved =
      save_checkpoint(dir.path.string(), 2, first.policy, first.opt, sample_state(2),
                      {.keep_last = 0, .extra_files = {{"tokenizer.json", "{}"}}, .on_stage = {}});
  CHECK(saved == checkpoint_dir(dir.path.string(), 2));
  CHECK(fs::is_regular_file(fs::path(saved) / "policy" / "tokenizer.json"));
  CHECK(latest_checkpoint(dir.path.string()) == saved);

  Job resumed(c, /*seed=*/99);  // fresh objects, other weights
  TrainerState state;
  load_checkpoint(saved, resumed.policy, resumed.opt, state);
  CHECK(state == sample_state(2));
  CHECK(resumed.opt.counters().step == 2);
  CHECK(same_weights(resumed.policy, first.policy));
  for (int64_t n = state.step; n < 4; ++n) resumed.step(n);

  CHECK(resumed.opt.step_count() == 4);
  CHECK(same_weights(resumed.policy, straight.policy));
  CHECK(same_weights(resumed.opt.m(), straight.opt.m()));
  CHECK(same_weights(resumed.opt.v(), straight.opt.v()));
}

TEST_CASE("Checkpoints keep the last K and leave no temporaries", "[unit]") {
  const ModelConfig c = tiny_config(false);
  test::TempDir dir("ckpt_keep");
  Job job(c);
  CHECK_FALSE(latest_checkpoint(dir.path.string()).has_value());
  CHECK_FALSE(latest_checkpoint(dir.file("absent")).has_value());
  for (int64_t n = 1; n <= 5; ++n) {
    job.step(n);
    save_checkpoint(dir.path.string(), n * 10, job.policy, job.opt, sample_state(n),
                    {.keep_last = 2, .extra_files = {}, .on_stage = {}});
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-40", "step-50"});
  CHECK(latest_checkpoint(dir.path.string()) == checkpoint_dir(dir.path.string(), 50));
  // step-100 sorts after step-50 by number, not by name.
  save_checkpoint(dir.path.string(), 100, job.policy, job.opt, sample_state(10));
  CHECK(latest_checkpoint(dir.path.string()) == checkpoint_dir(dir.path.string(), 100));
}

TEST_CASE("A failure mid-save leaves the previous checkpoints intact", "[unit]") {
  const ModelConfig c = tiny_config();
  test::TempDir dir("ckpt_atomic");
  Job job(c);
  job.step(0);
  const std::string one =
      save_checkpoint(dir.path.string(), 1, job.policy, job.opt, sample_state(1));
  Weights saved_policy(c, DType::f32);
  saved_policy.copy_from(job.policy);
  job.step(1);

  for (const char* stage : {"policy", "optimizer", "trainer_state", "committed"}) {
    INFO(stage);
    CheckpointOptions o;
    o.keep_last = 1;  // would delete step-1 if step-2 completed
    o.on_stage = [&](const std::string& s) {
      if (s == stage) throw std::runtime_error("simulated crash");
    };
    CHECK_THROWS_WITH(
        save_checkpoint(dir.path.string(), 2, job.policy, job.opt, sample_state(2), o),
        "simulated crash");
    // Replacing step-1 itself fails the same way and keeps the old step-1.
    CHECK_THROWS(save_checkpoint(dir.path.string(), 1, job.policy, job.opt, sample_state(2), o));
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename());
    CHECK(names == std::vector<std::string>{"step-1"});
    CHECK(latest_checkpoint(dir.path.string()) == one);
  }
  Job fresh(c, 7);
  TrainerState state;
  load_checkpoint(one, fresh.policy, fresh.opt, state);
  CHECK(state == sample_state(1));
  CHECK(same_weights(fresh.policy, saved_policy));
  CHECK(fresh.opt.step_count() == 1);
}

TEST_CASE("Bad checkpoints give errors naming the file and field and change nothing", "[unit]") {
  const ModelConfig c = tiny_config();
  test::TempDir dir("ckpt_bad");
  Job job(c);
  job.step(0);
  const fs::path good = save_checkpoint(dir.path.string(), 1, job.policy, job.opt, sample_state(1));

  Job target(c, 55);
  target.step(3);
  Weights policy_before(c, DType::f32), m_before(c, DType::f32);
  policy_before.copy_from(target.policy);
  m_before.copy_from(target.opt.m());
  TrainerState state = sample_state(9);

  auto broken = [&](const std::string& name) {
    const fs::path p = dir.path / name;
    fs::copy(good, p, fs::copy_options::recursive);
    return p;
  };
  auto fails = [&](const fs::path& p, const std::vector<std::string>& words) {
    try {
      load_checkpoint(p.string(), target.policy, target.opt, state);
      FAIL("no error for " << p);
    } catch (const Error& e) {
      INFO(e.what());
      for (const std::string& w : words) CHECK(std::string(e.what()).find(w) != std::string::npos);
    }
    CHECK(same_weights(target.policy, policy_before));
    CHECK(same_weights(target.opt.m(), m_before));
    CHECK(target.opt.step_count() == 1);
    CHECK(state == sample_state(9));
  };

  const fs::path missing = broken("missing");
  fs::remove(missing / "trainer_state.json");
  fails(missing, {"trainer_state.json", "missing"});

  const fs::path no_opt = broken("no_opt");
  fs::remove(no_opt / "optimizer.safetensors");
  fails(no_opt, {"optimizer.safetensors"});

  const fs::path truncated = broken("truncated");
  fs::resize_file(truncated / "optimizer.safetensors",
                  fs::file_size(truncated / "optimizer.safetensors") / 2);
  fails(truncated, {"optimizer.safetensors"});

  const fs::path truncated_policy = broken("truncated_policy");
  fs::resize_file(truncated_policy / "policy" / "model.safetensors",
                  fs::file_size(truncated_policy / "policy" / "model.safetensors") - 100);
  fails(truncated_policy, {"model.safetensors"});

  const fs::path cut_json = broken("cut_json");
  fs::resize_file(cut_json / "trainer_state.json", 40);
  fails(cut_json, {"trainer_state.json", "JSON"});

  const fs::path bad_field = broken("bad_field");
  {
    std::ifstream in(bad_field / "trainer_state.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["data_position"] = "forty";
    std::ofstream(bad_field / "trainer_state.json") << j.dump();
  }
  fails(bad_field, {"trainer_state.json", "'data_position'", "integer"});

  // A checkpoint of another model: the differing config field is named.
  ModelConfig other = c;
  other.intermediate_size = 32;
  Job foreign(other);
  const fs::path foreign_dir = save_checkpoint((dir.path / "foreign").string(), 1, foreign.policy,
                                               foreign.opt, sample_state(1));
  fails(foreign_dir, {"config.json", "intermediate_size", "another model"});

  fails(dir.path / "nowhere", {"nowhere", "does not exist"});

  // The good one still loads.
  load_checkpoint(good.string(), target.policy, target.opt, state);
  CHECK(same_weights(target.policy, job.policy));
}

TEST_CASE("A negative or inconsistent step in trainer_state.json is refused naming the file",
          "[unit]") {
  const ModelConfig c = tiny_config();
  test::TempDir dir("ckpt_step");
  Job job(c);
  const fs::path good = save_checkpoint(dir.path.string(), 2, job.policy, job.opt, sample_state(2));
  auto with_step = [&](const std::string& name, int64_t step) {
    const fs::path p = dir.path / name;
    fs::copy(good, p, fs::copy_options::recursive);
    std::ifstream in(p / "trainer_state.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["step"] = step;
    std::ofstream(p / "trainer_state.json") << j.dump();
    // The marker vouches for the step too: a checkpoint moved to another step is remade whole.
    std::ifstream marker_in(p / "COMMITTED");
    nlohmann::json marker = nlohmann::json::parse(marker_in);
    marker["step"] = step;
    std::ofstream(p / "COMMITTED") << marker.dump();
    return p;
  };
  Job target(c, 9);
  TrainerState state;
  auto fails = [&](const fs::path& p, const std::vector<std::string>& words) {
    try {
      load_checkpoint(p.string(), target.policy, target.opt, state);
      FAIL("no error for " << p);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find((p / "trainer_state.json").string()) != std::string::npos);
      for (const std::string& w : words) CHECK(std::string(e.what()).find(w) != std::string::npos);
    }
    CHECK(state == TrainerState{});
  };
  fails(with_step("negative", -3), {"'step' -3", "0 or more"});
  fails(with_step("step-5", 4), {"'step' is 4", "step-5"});
  load_checkpoint(with_step("step-7", 7).string(), target.policy, target.opt, state);
  CHECK(state.step == 7);
}

TEST_CASE("Leftovers of interrupted saves are removed or restored", "[unit]") {
  const ModelConfig c = tiny_config();
  test::TempDir dir("ckpt_leftovers");
  Job job(c);
  const std::string root = dir.path.string();
  save_checkpoint(root, 1, job.policy, job.opt, sample_state(1));
  save_checkpoint(root, 2, job.policy, job.opt, sample_state(2));
  // A save of step 3 killed while writing; one of step 2 killed after moving the old step-2 aside
  // and renaming the new one in; one of step 1 killed between its two renames (step-1 is only in
  // the .old directory).
  fs::create_directories(dir.path / ".tmp-step-3-999999991" / "policy");
  std::ofstream(dir.path / ".tmp-step-3-999999991" / "policy" / "model.safetensors") << "half";
  fs::copy(dir.path / "step-2", dir.path / ".old-step-2-999999992", fs::copy_options::recursive);
  fs::rename(dir.path / "step-1", dir.path / ".old-step-1-999999993");
  std::ofstream(dir.path / "notes.txt") << "mine";
  fs::create_directory(dir.path / ".tmp-other");

  const std::vector<std::string> done = recover_interrupted_saves(root);
  REQUIRE(done.size() == 3);
  CHECK(done[0].find("restored " + (dir.path / "step-1").string()) == 0);
  CHECK(done[1].find("removed " + (dir.path / ".old-step-2-999999992").string()) == 0);
  CHECK(done[2].find("removed " + (dir.path / ".tmp-step-3-999999991").string()) == 0);
  for (const std::string& d : done) CHECK(d.find("no longer running") != std::string::npos);
  CHECK(!fs::exists(dir.path / ".tmp-step-3-999999991"));
  CHECK(!fs::exists(dir.path / ".old-step-2-999999992"));
  CHECK(!fs::exists(dir.path / ".old-step-1-999999993"));
  CHECK(latest_checkpoint(root) == (dir.path / "step-2").string());
  Job target(c, 5);
  TrainerState state;
  load_checkpoint((dir.path / "step-1").string(), target.policy, target.opt, state);
  CHECK(state == sample_state(1));
  CHECK(fs::exists(dir.path / "notes.txt"));
  CHECK(fs::exists(dir.path / ".tmp-other"));
  CHECK(recover_interrupted_saves(root).empty());
}

}  // namespace
}  // namespace tandem::trainer
