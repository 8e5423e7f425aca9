// Checkpoints of several data-parallel ranks (ranks as threads): the read plan of a rank's pieces
// over the saved ranges, saves at one (shard level, world size) loaded at another bitwise and
// stepping on as an uninterrupted run, the commit marker (a failing rank, a missing marker, a
// missing or truncated shard) and checkpoints from before markers or of one range per rank.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/safetensors.h"
#include "model/shard_layout.h"
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
using model::ShardLayout;
using model::Weights;
using test::on_ranks;

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

// A rank's local buffer (ShardLayout's) as the flat parameters: its pieces in place, NaN elsewhere.
std::vector<float> unpack(const ShardLayout& layout, int rank, const Tensor& local) {
  std::vector<float> out(static_cast<size_t>(layout.total()), std::nanf(""));
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const FlatRange r = layout.range(u, rank);
    std::memcpy(out.data() + r.begin, local.data_as<float>() + layout.units()[u].local,
                static_cast<size_t>(r.size()) * sizeof(float));
  }
  return out;
}

// Whether a rank's local buffer holds `whole`'s elements of its pieces bitwise, and zeros past
// them.
bool holds(const ShardLayout& layout, int rank, const Tensor& local,
           const std::vector<float>& whole) {
  if (local.numel() != layout.local_size()) return false;
  std::vector<float> want(static_cast<size_t>(layout.local_size()), 0.0f);
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const FlatRange r = layout.range(u, rank);
    std::copy(whole.begin() + r.begin, whole.begin() + r.end,
              want.begin() + layout.units()[u].local);
  }
  return std::memcmp(want.data(), local.data(), want.size() * sizeof(float)) == 0;
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

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The weights of `world` ranks (threads): the same (seed 1) on each.
struct ShardedRun {
  std::vector<std::unique_ptr<Weights>> params;  // each rank's weights
  ShardedRun(const model::ModelConfig& c, int world, uint64_t seed = 1) {
    for (int r = 0; r < world; ++r) {
      params.push_back(std::make_unique<Weights>(c, DType::f32));
      test::fill_uniform(*params.back(), seed);
    }
  }
};

ShardOptions at_level(ShardLevel level) {
  ShardOptions o;
  o.level = level;
  o.deterministic = true;
  return o;
}

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

TEST_CASE("plan_shard_reads reads several wanted ranges one after the other", "[unit]") {
  const std::vector<FlatRange> saved = {{0, 10}, {10, 10}, {10, 20}, {20, 25}};
  const std::vector<FlatRange> want = {{2, 4}, {8, 12}, {24, 25}, {12, 12}};
  CHECK(plan_shard_reads(saved, want) ==
        std::vector<ShardRead>{{0, 2, 0, 2}, {0, 8, 2, 2}, {2, 0, 4, 2}, {3, 4, 6, 1}});
  const std::vector<FlatRange> beyond = {{0, 5}, {20, 30}};
  CHECK_THROWS_WITH(plan_shard_reads(saved, beyond),
                    Catch::Contains("do not hold elements [25, 30)"));
}

// Saves at one (shard level, world size) and loads at another: the moments and the f32 weights
// of every rank's pieces equal the saved ones bitwise, and one more step equals the step of an
// uninterrupted run bitwise (deterministic: the gradients summed in fixed point).
struct Resharding {
  model::ModelConfig c = test::tiny_model_config(test::TinyKind::qwen3);
  AdamWConfig cfg;
  const test::TempDir tmp{"ckpt-reshard"};
  std::vector<int64_t> grads;     // the fixed-point gradients of every step
  std::vector<float> w1, m1, v1;  // after one step
  std::vector<float> w2, m2, v2;  // after two
  int runs = 0;

  Resharding() {
    Weights probe(c, DType::f32);
    const int64_t total = static_cast<int64_t>(flat(probe).size());
    std::mt19937_64 rng(5);
    for (int64_t i = 0; i < total; ++i)
      grads.push_back(static_cast<int64_t>(rng() % (int64_t{1} << 31)) - (int64_t{1} << 30));
    // The uninterrupted run: one rank, two steps.
    Weights p(c, DType::f32);
    test::fill_uniform(p, 1);
    ShardedAdamW alone(p, nullptr, cfg, at_level(ShardLevel::optimizer));
    alone.step_fixed(grads, 1e-2f);
    w1 = flat(alone.params());
    m1 = unpack(alone.layout(), 0, alone.m());
    v1 = unpack(alone.layout(), 0, alone.v());
    alone.step_fixed(grads, 1e-2f);
    w2 = flat(alone.params());
    m2 = unpack(alone.layout(), 0, alone.m());
    v2 = unpack(alone.layout(), 0, alone.v());
  }

  // Runs fn(rank, optimizer) on `world` ranks at `level`, from the weights of `seed` (1: the
  // uninterrupted run's start).
  template <class Fn>
  void on(int world, ShardLevel level, Fn fn, uint64_t seed = 77) {
    ShardedRun run(c, world, seed);
    on_ranks(world, tmp.file("store" + std::to_string(runs++)), [&](int r, Communicator& comm) {
      ShardedAdamW opt(*run.params[static_cast<size_t>(r)], world == 1 ? nullptr : &comm, cfg,
                       at_level(level));
      fn(r, opt);
      comm.barrier();  // no rank leaves while another still connects
    });
  }

  // The checkpoint after one step, saved at (optimizer, world).
  std::string first(int world) {
    const std::string root = tmp.file(fmt::format("first-{}", world));
    on(
        world, ShardLevel::optimizer,
        [&](int r, ShardedAdamW& opt) {
          std::vector<int64_t> mine(grads.size(), 0);
          if (r == 0) mine = grads;  // the sum over the ranks is grads
          opt.step_fixed(mine, 1e-2f);
          save_checkpoint(root, 1, opt, state_at(1));
        },
        1);
    return checkpoint_dir(root, 1);
  }

  // Loads `from` at (level, world), checks every rank's pieces, saves again there.
  std::string reshard(const std::string& from, ShardLevel level, int world) {
    INFO("loaded at " << shard_level_name(level) << " on " << world << " ranks from " << from);
    const std::string root = tmp.file(fmt::format("{}-{}", shard_level_name(level), world));
    on(world, level, [&](int r, ShardedAdamW& opt) {
      TrainerState state;
      load_checkpoint(from, opt, state);
      CHECK(state == state_at(1));
      CHECK(opt.step_count() == 1);
      CHECK(holds(opt.layout(), r, opt.m(), m1));
      CHECK(holds(opt.layout(), r, opt.v(), v1));
      if (level == ShardLevel::parameters) {
        CHECK(holds(opt.layout(), r, opt.local_params(), w1));
      } else {
        CHECK(flat(opt.params()) == w1);
      }
      save_checkpoint(root, 1, opt, state_at(1));
    });
    const nlohmann::json marker = read_json(fs::path(checkpoint_dir(root, 1)) / "COMMITTED");
    CHECK(marker["world_size"] == world);
    CHECK(marker["shard_level"] == shard_level_name(level));
    return checkpoint_dir(root, 1);
  }

  // Loads `from` at (optimizer, world) and takes the second step: the uninterrupted run's.
  void step_on(const std::string& from, int world) {
    INFO("stepped on " << world << " ranks from " << from);
    on(world, ShardLevel::optimizer, [&](int r, ShardedAdamW& opt) {
      TrainerState state;
      load_checkpoint(from, opt, state);
      std::vector<int64_t> mine(grads.size(), 0);
      if (r == world - 1) mine = grads;
      opt.step_fixed(mine, 1e-2f);
      CHECK(opt.step_count() == 2);
      CHECK(flat(opt.params()) == w2);
      CHECK(holds(opt.layout(), r, opt.m(), m2));
      CHECK(holds(opt.layout(), r, opt.v(), v2));
    });
  }
};

TEST_CASE("A checkpoint saved with parameters sharded on 2 ranks resumes on 1 rank bitwise",
          "[unit]") {
  Resharding t;
  const std::string one = t.first(1);
  const std::string two = t.reshard(one, ShardLevel::parameters, 2);
  // The policy gathered unit by unit is the file the whole weights give.
  for (const char* f : {"policy/model.safetensors", "policy/config.json"})
    CHECK(read_bytes(fs::path(two) / f) == read_bytes(fs::path(one) / f));
  const nlohmann::json marker = read_json(fs::path(two) / "COMMITTED");
  REQUIRE(marker["optimizer"].size() == 2);
  CHECK(marker["optimizer"][1]["file"] == "optimizer/rank-00001-of-00002.safetensors");
  CHECK(marker["optimizer"][0]["ranges"][0]["m"] == "m.model.embed_tokens");
  for (const auto& [name, f] : marker["files"].items()) {
    INFO(name);
    CHECK(f["bytes"] == fs::file_size(fs::path(two) / name));
  }
  t.reshard(two, ShardLevel::optimizer, 1);
  t.step_on(two, 1);
}

TEST_CASE(
    "A checkpoint saved with gradients sharded on 4 ranks resumes with parameters sharded "
    "on 3 bitwise",
    "[unit]") {
  Resharding t;
  const std::string four = t.reshard(t.first(2), ShardLevel::gradients, 4);
  const std::string three = t.reshard(four, ShardLevel::parameters, 3);
  t.step_on(three, 3);
  t.step_on(four, 2);
}

TEST_CASE("A checkpoint of one rank resumes with parameters sharded on 2 and on 1 rank bitwise",
          "[unit]") {
  Resharding t;
  const std::string one = t.first(1);
  const std::string two = t.reshard(one, ShardLevel::parameters, 2);
  const std::string alone = t.reshard(two, ShardLevel::parameters, 1);
  CHECK(fs::exists(fs::path(alone) / "optimizer.safetensors"));
  t.step_on(alone, 2);
}

TEST_CASE("A checkpoint of one range per rank file still loads at every level", "[unit]") {
  // Written as before units: rank r's file holds tensors m and v of one range [begin, end).
  Resharding t;
  const fs::path dir = t.first(1);
  const int64_t total = static_cast<int64_t>(t.m1.size()), cut = total / 3;
  nlohmann::json marker = read_json(dir / "COMMITTED");
  marker["world_size"] = 2;
  marker["optimizer"] = nlohmann::json::array();
  fs::create_directories(dir / "optimizer");
  for (int r = 0; r < 2; ++r) {
    const int64_t b = r == 0 ? 0 : cut, e = r == 0 ? cut : total;
    const std::string name = fmt::format("optimizer/rank-{:05d}-of-00002.safetensors", r);
    std::vector<float> m(t.m1.begin() + b, t.m1.begin() + e), v(t.v1.begin() + b, t.v1.begin() + e);
    const NamedTensor tensors[] = {{"m", Tensor::wrap(m.data(), {e - b}, DType::f32)},
                                   {"v", Tensor::wrap(v.data(), {e - b}, DType::f32)}};
    model::write_safetensors((dir / name).string(), tensors,
                             {{"format", "tandem-checkpoint"},
                              {"step", "1"},
                              {"skipped_total", "0"},
                              {"consecutive_skips", "0"},
                              {"begin", std::to_string(b)},
                              {"end", std::to_string(e)}});
    marker["optimizer"].push_back({{"file", name}, {"begin", b}, {"end", e}});
    marker["files"][name] = {{"bytes", fs::file_size(dir / name)}, {"crc32c", 0}};
  }
  fs::remove(dir / "optimizer.safetensors");
  marker["files"].erase("optimizer.safetensors");
  std::ofstream(dir / "COMMITTED") << marker.dump(2);
  t.reshard(dir.string(), ShardLevel::parameters, 3);
  t.reshard(dir.string(), ShardLevel::optimizer, 2);
  t.step_on(dir.string(), 1);
}

TEST_CASE("A rank failing mid-save makes every rank throw and keeps the previous checkpoint",
          "[unit]") {
  const model::ModelConfig c = test::micro_model_config(true);
  const test::TempDir tmp("ckpt-shards-fail");
  const std::string root = tmp.file("ckpt");
  ShardedRun two(c, 2);
  on_ranks(2, tmp.file("store-ok"), [&](int r, Communicator& comm) {
    ShardedAdamW sharded(*two.params[static_cast<size_t>(r)], &comm);
    save_checkpoint(root, 1, sharded, state_at(1));
  });
  REQUIRE(latest_checkpoint(root) == checkpoint_dir(root, 1));
  for (const auto& [failing, stage, level] : {std::tuple{1, "optimizer", ShardLevel::optimizer},
                                              std::tuple{0, "policy", ShardLevel::optimizer},
                                              std::tuple{0, "policy", ShardLevel::parameters},
                                              std::tuple{1, "optimizer", ShardLevel::parameters},
                                              std::tuple{0, "trainer_state", ShardLevel::gradients},
                                              std::tuple{0, "committed", ShardLevel::optimizer}}) {
    INFO("rank " << failing << " fails after " << stage << " at " << shard_level_name(level));
    const std::vector<std::string> errors = on_ranks(
        2, tmp.file(fmt::format("store-{}-{}-{}", stage, failing, shard_level_name(level))),
        [&](int r, Communicator& comm) {
          ShardedRun fresh(c, 1);
          ShardedAdamW sharded(*fresh.params[0], &comm, {}, at_level(level));
          CheckpointOptions o;
          o.keep_last = 1;  // would delete step-1 if step-2 completed
          o.on_stage = [&](const std::string& s) {
            if (r == failing && s == stage) throw Error("simulated crash");
          };
          save_checkpoint(root, 2, sharded, state_at(2), o);
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
  const model::ModelConfig c =
      test::tiny_model_config(test::TinyKind::qwen3);  // both ranks own pieces
  const test::TempDir tmp("ckpt-shards-bad");
  const std::string root = tmp.file("ckpt");
  ShardedRun two(c, 2);
  on_ranks(2, tmp.file("store"), [&](int r, Communicator& comm) {
    ShardedAdamW sharded(*two.params[static_cast<size_t>(r)], &comm);
    save_checkpoint(root, 1, sharded, state_at(1));
    save_checkpoint(root, 2, sharded, state_at(2));
  });
  const fs::path step2 = checkpoint_dir(root, 2);
  const std::string shard1 = "optimizer/rank-00001-of-00002.safetensors";

  Weights target(c, DType::f32), before(c, DType::f32);
  test::fill_uniform(target, 3);
  before.copy_from(target);
  ShardedAdamW opt(target, nullptr);
  auto fails = [&](const fs::path& dir, const std::vector<std::string>& words) {
    TrainerState state;
    try {
      load_checkpoint(dir.string(), opt, state);
      FAIL("no error for " << dir);
    } catch (const Error& e) {
      INFO(e.what());
      for (const std::string& w : words) CHECK(std::string(e.what()).find(w) != std::string::npos);
    }
    CHECK(same_weights(opt.params(), before));
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
  test::fill_uniform(p, 1);
  test::fill_uniform(g, 2);
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
  load_checkpoint(dir.string(), sharded, state);
  CHECK(state == state_at(3));
  CHECK(same_weights(q, p));
  CHECK(holds(sharded.layout(), 0, sharded.m(), flat(adamw.m())));
  CHECK(sharded.step_count() == 1);
}

}  // namespace
}  // namespace tandem::trainer
