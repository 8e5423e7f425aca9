// Checkpoints of several data-parallel ranks (ranks as threads): the read plan of a rank's range
// over the saved ranges, a 2-rank save loaded on 1, 2 and 3 ranks bitwise (and a 1-rank save on
// 2), the commit marker (a failing rank, a missing marker, a missing or truncated shard) and
// checkpoints from before markers.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "trainer/checkpoint.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;
using model::NamedTensor;
using model::Weights;
using test::on_ranks;

void fill_random(Weights& w, uint64_t seed) {
  for (const NamedTensor& s : w.storage()) {
    Tensor t = s.tensor;
    t.copy_from(test::random_tensor(t.shape(), t.dtype(), ++seed, -1.0, 1.0));
  }
}

bool same_weights(const Weights& a, const Weights& b) {
  for (size_t i = 0; i < a.storage().size(); ++i)
    if (!test::bitwise_equal(a.storage()[i].tensor, b.storage()[i].tensor)) return false;
  return true;
}

// A model's storage tensors flattened one after the other (FlatRange's numbering).
std::vector<float> flat(const Weights& w) {
  std::vector<float> out;
  for (const NamedTensor& s : w.storage())
    out.insert(out.end(), s.tensor.data_as<float>(), s.tensor.data_as<float>() + s.tensor.numel());
  return out;
}

std::vector<float> range_of(const ShardedAdamW& o, const Tensor& t) {
  const float* p = t.data_as<float>();
  return {p, p + (o.end() - o.begin())};
}

TrainerState state_at(int64_t step) {
  TrainerState s;
  s.step = step;
  s.weight_version = step;
  s.data_position = 8 * step;
  s.config = "[trainer]\nsteps = 9\n";
  s.extra = {{"stream", {{"index", 8 * step}}}};
  return s;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// The weights of `world` ranks (threads): the same (seed 1) on each.
struct ShardedRun {
  std::vector<std::unique_ptr<Weights>> params;  // each rank's weights
  ShardedRun(const model::ModelConfig& c, int world) {
    for (int r = 0; r < world; ++r) {
      params.push_back(std::make_unique<Weights>(c, DType::f32));
      fill_random(*params.back(), 1);
    }
  }
};

TEST_CASE("plan_shard_reads reads a range from the pieces of the saved ranges it overlaps",
          "[unit]") {
  const std::vector<FlatRange> saved = {{0, 10}, {10, 20}, {20, 25}};
  CHECK(plan_shard_reads(saved, {5, 22}) ==
        std::vector<ShardRead>{{0, 5, 0, 5}, {1, 0, 5, 10}, {2, 0, 15, 2}});
  CHECK(plan_shard_reads(saved, {10, 20}) == std::vector<ShardRead>{{1, 0, 0, 10}});
  CHECK(plan_shard_reads(saved, {0, 25}) ==
        std::vector<ShardRead>{{0, 0, 0, 10}, {1, 0, 10, 10}, {2, 0, 20, 5}});
  CHECK(plan_shard_reads(saved, {25, 25}).empty());
  CHECK(plan_shard_reads(saved, {3, 3}).empty());
  CHECK(describe(plan_shard_reads(saved, {5, 22})) ==
        "range 0 [5, 10) -> [0, 5)\nrange 1 [0, 10) -> [5, 15)\nrange 2 [0, 2) -> [15, 17)\n");
  // Empty saved ranges (a rank past the end of a small model) are passed over.
  const std::vector<FlatRange> with_empty = {{0, 8}, {8, 8}, {8, 12}, {12, 12}};
  CHECK(plan_shard_reads(with_empty, {0, 12}) ==
        std::vector<ShardRead>{{0, 0, 0, 8}, {2, 0, 8, 4}});
  CHECK_THROWS_WITH(plan_shard_reads(saved, {15, 30}),
                    Catch::Contains("do not hold elements [25, 30)"));
  const std::vector<FlatRange> gap = {{0, 10}, {12, 20}};
  CHECK_THROWS_WITH(plan_shard_reads(gap, {0, 20}),
                    Catch::Contains("saved range 1 [12, 20) does not follow range 0 [0, 10)"));
  const std::vector<FlatRange> overlap = {{0, 10}, {8, 20}};
  CHECK_THROWS_WITH(plan_shard_reads(overlap, {0, 20}), Catch::Contains("does not follow"));

  // Any split into saved ranges, read back by any other split, gives every element once, in
  // place.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t total = std::uniform_int_distribution<int64_t>(0, 60)(rng);
    auto split = [&](int parts) {
      std::vector<int64_t> cuts = {0, total};
      for (int i = 1; i < parts; ++i)
        cuts.push_back(std::uniform_int_distribution<int64_t>(0, total)(rng));
      std::sort(cuts.begin(), cuts.end());
      std::vector<FlatRange> out;
      for (size_t i = 0; i + 1 < cuts.size(); ++i) out.push_back({cuts[i], cuts[i + 1]});
      return out;
    };
    const std::vector<FlatRange> old_ranges = split(std::uniform_int_distribution<int>(1, 6)(rng));
    for (const FlatRange& want : split(std::uniform_int_distribution<int>(1, 6)(rng))) {
      std::vector<int64_t> got(static_cast<size_t>(want.end - want.begin), -1);
      for (const ShardRead& r : plan_shard_reads(old_ranges, want))
        for (int64_t i = 0; i < r.count; ++i)
          got[static_cast<size_t>(r.offset + i)] = old_ranges[r.source].begin + r.source_offset + i;
      for (int64_t i = 0; i < want.end - want.begin; ++i)
        REQUIRE(got[static_cast<size_t>(i)] == want.begin + i);
    }
  }
}

TEST_CASE("A checkpoint saved by 2 ranks loads on 1 2 and 3 ranks bitwise and steps on as AdamW",
          "[unit]") {
  const model::ModelConfig c = test::micro_model_config(false);
  AdamWConfig cfg;
  Weights g(c, DType::f32), half(c, DType::f32), zero(c, DType::f32);
  fill_random(g, 7);
  half.copy_from(g);
  for (const NamedTensor& s : half.storage()) {
    float* x = s.tensor.data_as<float>();
    for (int64_t i = 0; i < s.tensor.numel(); ++i) x[i] *= 0.5f;  // exact: g = half + half
  }
  zero.zero();
  const test::TempDir tmp("ckpt-shards");
  const std::string root = tmp.file("ckpt");

  // Two ranks take a step and save.
  ShardedRun two(c, 2);
  std::vector<float> saved_m(flat(g).size()), saved_v(saved_m.size());
  on_ranks(2, tmp.file("store2"), [&](int r, Communicator& comm) {
    ShardedAdamW sharded(*two.params[static_cast<size_t>(r)], &comm, cfg);
    sharded.step(half, 1e-2f);
    const std::vector<float> m = range_of(sharded, sharded.m()), v = range_of(sharded, sharded.v());
    std::copy(m.begin(), m.end(), saved_m.begin() + sharded.begin());
    std::copy(v.begin(), v.end(), saved_v.begin() + sharded.begin());
    const std::string dir =
        save_checkpoint(root, 1, *two.params[static_cast<size_t>(r)], sharded, state_at(1));
    CHECK(dir == checkpoint_dir(root, 1));
  });
  const fs::path dir = checkpoint_dir(root, 1);
  CHECK(latest_checkpoint(root) == dir.string());
  CHECK(!fs::exists(dir / "optimizer.safetensors"));
  const nlohmann::json marker = read_json(dir / "COMMITTED");
  CHECK(marker["world_size"] == 2);
  CHECK(marker["step"] == 1);
  CHECK(marker["parameters"] == saved_m.size());
  REQUIRE(marker["optimizer"].size() == 2);
  CHECK(marker["optimizer"][0]["file"] == "optimizer/rank-00000-of-00002.safetensors");
  CHECK(marker["optimizer"][1]["end"] == saved_m.size());
  for (const char* f :
       {"optimizer/rank-00000-of-00002.safetensors", "optimizer/rank-00001-of-00002.safetensors",
        "trainer_state.json", "policy/config.json", "policy/model.safetensors"}) {
    INFO(f);
    REQUIRE(marker["files"].contains(f));
    CHECK(marker["files"][f]["bytes"] == fs::file_size(dir / f));
  }
  for (const auto& e : fs::directory_iterator(tmp.path / "ckpt"))
    CHECK(e.path().filename().string().rfind(".tmp", 0) != 0);

  // Loaded on 1 rank (AdamW, and the deterministic job's one-rank ShardedAdamW), on 2 and on 3:
  // each rank's range is the saved state's, bitwise.
  {
    Weights p(c, DType::f32);
    fill_random(p, 99);
    AdamW adamw(p, cfg);
    TrainerState state;
    load_checkpoint(dir.string(), p, adamw, state);
    CHECK(state == state_at(1));
    CHECK(same_weights(p, *two.params[0]));
    CHECK(flat(adamw.m()) == saved_m);
    CHECK(flat(adamw.v()) == saved_v);
    CHECK(adamw.step_count() == 1);
    // Saved again by one rank (one optimizer.safetensors), it loads on 2 ranks.
    save_checkpoint(tmp.file("one"), 1, p, adamw, state);
    CHECK(fs::exists(fs::path(tmp.file("one")) / "step-1" / "optimizer.safetensors"));
    CHECK(read_json(fs::path(tmp.file("one")) / "step-1" / "COMMITTED")["world_size"] == 1);
  }
  {
    Weights p(c, DType::f32);
    ShardedAdamW alone(p, nullptr, cfg);
    TrainerState state;
    load_checkpoint(dir.string(), p, alone, state);
    CHECK(range_of(alone, alone.m()) == saved_m);
    CHECK(range_of(alone, alone.v()) == saved_v);
  }
  for (const auto& [world, from] : {std::pair{2, dir.string()}, std::pair{3, dir.string()},
                                    std::pair{2, checkpoint_dir(tmp.file("one"), 1)}}) {
    INFO(world << " ranks from " << from);
    ShardedRun more(c, world);
    on_ranks(world, tmp.file("store-load" + std::to_string(world) + from.substr(from.size() - 8)),
             [&](int r, Communicator& comm) {
               Weights& p = *more.params[static_cast<size_t>(r)];
               fill_random(p, 50 + static_cast<uint64_t>(r));
               ShardedAdamW sharded(p, &comm, cfg);
               TrainerState state;
               load_checkpoint(from, p, sharded, state);
               CHECK(state == state_at(1));
               CHECK(sharded.step_count() == 1);
               CHECK(same_weights(p, *two.params[0]));
               const auto b = saved_m.begin() + sharded.begin(),
                          e = saved_m.begin() + sharded.end();
               CHECK(range_of(sharded, sharded.m()) == std::vector<float>(b, e));
               CHECK(range_of(sharded, sharded.v()) ==
                     std::vector<float>(saved_v.begin() + sharded.begin(),
                                        saved_v.begin() + sharded.end()));
               comm.barrier();  // no rank leaves while another still connects
             });
  }

  // Three ranks resumed from it step on as AdamW that took both steps.
  Weights ref(c, DType::f32);
  fill_random(ref, 1);
  AdamW adamw(ref, cfg);
  adamw.step(g, 1e-2f);
  adamw.step(g, 1e-2f);
  ShardedRun three(c, 3);
  on_ranks(3, tmp.file("store3"), [&](int r, Communicator& comm) {
    Weights& p = *three.params[static_cast<size_t>(r)];
    ShardedAdamW sharded(p, &comm, cfg);
    TrainerState state;
    load_checkpoint(dir.string(), p, sharded, state);
    sharded.step(r == 0 ? g : zero, 1e-2f);  // the sum is g
    CHECK(sharded.step_count() == 2);
  });
  for (int r = 0; r < 3; ++r)
    for (size_t t = 0; t < ref.storage().size(); ++t) {
      INFO(ref.storage()[t].name << " on rank " << r);
      CHECK(test::max_abs_diff(
                test::to_f64(three.params[static_cast<size_t>(r)]->storage()[t].tensor),
                test::to_f64(ref.storage()[t].tensor)) < 1e-6);
    }
}

TEST_CASE("A rank failing mid-save makes every rank throw and keeps the previous checkpoint",
          "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  const test::TempDir tmp("ckpt-shards-fail");
  const std::string root = tmp.file("ckpt");
  ShardedRun two(c, 2);
  on_ranks(2, tmp.file("store-ok"), [&](int r, Communicator& comm) {
    ShardedAdamW sharded(*two.params[static_cast<size_t>(r)], &comm);
    save_checkpoint(root, 1, *two.params[static_cast<size_t>(r)], sharded, state_at(1));
  });
  REQUIRE(latest_checkpoint(root) == checkpoint_dir(root, 1));
  for (const auto& [failing, stage] : {std::pair{1, "optimizer"}, std::pair{0, "policy"},
                                       std::pair{0, "trainer_state"}, std::pair{0, "committed"}}) {
    INFO("rank " << failing << " fails after " << stage);
    const std::vector<std::string> errors = on_ranks(
        2, tmp.file(std::string("store-") + stage + std::to_string(failing)),
        [&](int r, Communicator& comm) {
          ShardedAdamW sharded(*two.params[static_cast<size_t>(r)], &comm);
          CheckpointOptions o;
          o.keep_last = 1;  // would delete step-1 if step-2 completed
          o.on_stage = [&](const std::string& s) {
            if (r == failing && s == stage) throw Error("simulated crash");
          };
          save_checkpoint(root, 2, *two.params[static_cast<size_t>(r)], sharded, state_at(2), o);
        },
        /*expect_errors=*/true);
    CHECK(errors[static_cast<size_t>(failing)] == "simulated crash");
    CHECK_THAT(errors[static_cast<size_t>(1 - failing)],
               Catch::Contains(fmt::format("rank {} of 2 failed", failing)) &&
                   Catch::Contains("previous checkpoints are as they were"));
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename());
    CHECK(names == std::vector<std::string>{"step-1"});
  }
  CHECK(latest_checkpoint(root) == checkpoint_dir(root, 1));
}

TEST_CASE("A sharded checkpoint without its marker or with a missing or cut shard is refused",
          "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  const test::TempDir tmp("ckpt-shards-bad");
  const std::string root = tmp.file("ckpt");
  ShardedRun two(c, 2);
  on_ranks(2, tmp.file("store"), [&](int r, Communicator& comm) {
    Weights& p = *two.params[static_cast<size_t>(r)];
    ShardedAdamW sharded(p, &comm);
    save_checkpoint(root, 1, p, sharded, state_at(1));
    save_checkpoint(root, 2, p, sharded, state_at(2));
  });
  const fs::path step2 = checkpoint_dir(root, 2);
  const std::string shard1 = "optimizer/rank-00001-of-00002.safetensors";

  Weights target(c, DType::f32), before(c, DType::f32);
  fill_random(target, 3);
  before.copy_from(target);
  ShardedAdamW opt(target, nullptr);
  auto fails = [&](const fs::path& dir, const std::vector<std::string>& words) {
    TrainerState state;
    try {
      load_checkpoint(dir.string(), target, opt, state);
      FAIL("no error for " << dir);
    } catch (const Error& e) {
      INFO(e.what());
      for (const std::string& w : words) CHECK(std::string(e.what()).find(w) != std::string::npos);
    }
    CHECK(same_weights(target, before));
    CHECK(opt.step_count() == 0);
    CHECK(state == TrainerState{});
  };

  SECTION("no marker: passed over by latest_checkpoint, refused by load") {
    fs::remove(step2 / "COMMITTED");
    CHECK(latest_checkpoint(root) == checkpoint_dir(root, 1));
    fails(step2, {(step2 / "COMMITTED").string(), "did not complete"});
  }
  SECTION("a shard missing") {
    fs::remove(step2 / shard1);
    fails(step2, {(step2 / shard1).string(), "missing", "COMMITTED lists it"});
  }
  SECTION("a shard cut short") {
    fs::resize_file(step2 / shard1, fs::file_size(step2 / shard1) - 8);
    fails(step2, {(step2 / shard1).string(), "truncated"});
  }
  SECTION("a shard of another range") {
    fs::copy_file(step2 / "optimizer/rank-00000-of-00002.safetensors", step2 / shard1,
                  fs::copy_options::overwrite_existing);
    nlohmann::json marker = read_json(step2 / "COMMITTED");
    marker["files"][shard1] = marker["files"]["optimizer/rank-00000-of-00002.safetensors"];
    std::ofstream(step2 / "COMMITTED") << marker.dump();
    fails(step2, {(step2 / shard1).string()});
  }
  SECTION("a marker of another step") {
    fs::copy_file(fs::path(checkpoint_dir(root, 1)) / "COMMITTED", step2 / "COMMITTED",
                  fs::copy_options::overwrite_existing);
    fails(step2, {(step2 / "COMMITTED").string(), "'step' is 1"});
  }
}

TEST_CASE("A checkpoint from before commit markers still loads and counts as the latest",
          "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  const test::TempDir tmp("ckpt-unmarked");
  const std::string root = tmp.file("ckpt");
  Weights p(c, DType::f32), g(c, DType::f32);
  fill_random(p, 1);
  fill_random(g, 2);
  AdamW adamw(p);
  adamw.step(g, 1e-2f);
  save_checkpoint(root, 3, p, adamw, state_at(3));
  // Version 1: no COMMITTED, trainer_state.json of version 1.
  const fs::path dir = checkpoint_dir(root, 3);
  fs::remove(dir / "COMMITTED");
  nlohmann::json j = read_json(dir / "trainer_state.json");
  j["version"] = 1;
  std::ofstream(dir / "trainer_state.json") << j.dump(2);
  CHECK(latest_checkpoint(root) == dir.string());

  Weights q(c, DType::f32);
  ShardedAdamW sharded(q, nullptr);
  TrainerState state;
  load_checkpoint(dir.string(), q, sharded, state);
  CHECK(state == state_at(3));
  CHECK(same_weights(q, p));
  CHECK(range_of(sharded, sharded.m()) == flat(adamw.m()));
  CHECK(sharded.step_count() == 1);
}

}  // namespace
}  // namespace tandem::trainer
