// `tandem bench train --ranks N`: one GRPO update (forward, backward, the sharded AdamW step) on N
// data-parallel ranks, threads of this process with a communicator each, at every sharding level
// (trainer.shard), with the communication overlapped and not (trainer.overlap_comm), over Gloo on
// loopback and over an emulated link (a bandwidth and latency the Communicator sleeps out, without
// spending CPU). Each row: the step time, the same level's without overlap beside it, the
// communication's total and exposed time, and the training state one rank held at most against
// the one-rank AdamW's (16 bytes a parameter).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "bench/bench.h"
#include "bench/peers.h"
#include "core/comm.h"
#include "core/parallel.h"
#include "model/loader.h"
#include "trainer/train_step.h"

namespace tandem::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One group of G samples per rank: a prompt of P tokens, completions of C tokens, advantages of
// both signs. Tokens are spread over the vocabulary.
std::vector<trainer::TrainSample> rank_group(int rank, int G, int P, int C, int64_t V) {
  std::vector<trainer::TrainSample> out;
  std::vector<int32_t> prompt;
  for (int t = 0; t < P; ++t)
    prompt.push_back(static_cast<int32_t>((rank * 7919 + t * 104729 + 13) % V));
  for (int i = 0; i < G; ++i) {
    trainer::TrainSample s;
    s.prompt = prompt;
    for (int t = 0; t < C; ++t)
      s.completion.push_back(static_cast<int32_t>((rank * 31 + i * 7907 + t * 9973 + 5) % V));
    s.rollout_logp.assign(static_cast<size_t>(C), -3.0f);
    s.advantage = (i % 2 == 0 ? 1.0f : -1.0f) * (0.5f + 0.1f * static_cast<float>(i));
    s.group = rank;
    out.push_back(std::move(s));
  }
  return out;
}

struct Run {
  double step_s = 0, comm_s = 0, exposed_s = 0;
  int64_t state_bytes = 0;  // rank 0's training state at most
};

// `steps` updates on `ranks` ranks at `level`; the medians over the steps after the first.
Run run(const model::Weights& loaded, trainer::ShardLevel level, bool overlap,
        const EmulatedLink& link, int ranks, int steps, int G, int P, int C) {
  std::vector<std::unique_ptr<Communicator>> comms = loopback_communicators(ranks, 600, "bench");
  std::vector<std::vector<double>> step_s(static_cast<size_t>(ranks)), comm_s(step_s.size()),
      exposed_s(step_s.size());
  int64_t state = 0;
  on_rank_threads(
      ranks,
      [&](int r) {
        Communicator& comm = *comms[static_cast<size_t>(r)];
        comm.set_link(link);
        auto w = std::make_unique<model::Weights>(loaded.config(), DType::f32);
        w->copy_from(loaded);
        trainer::ShardOptions so;
        so.level = level;
        so.overlap = overlap;
        trainer::ShardedAdamW opt(*w, &comm, trainer::AdamWConfig{}, so);
        if (level == trainer::ShardLevel::parameters) w.reset();  // the job frees them too
        const trainer::LrSchedule lr(trainer::LrScheduleConfig{.lr = 1e-6f});
        trainer::TrainStepConfig tc;
        tc.micro_batch_tokens = 4096;
        trainer::PolicyTrainer trainer(opt, nullptr, lr, tc);
        const int64_t V = loaded.config().vocab_size;
        std::vector<trainer::TrainSample> all;
        for (int q = 0; q < ranks; ++q) {
          auto g = rank_group(q, G, P, C, V);
          all.insert(all.end(), g.begin(), g.end());
        }
        trainer::BatchShard shard;
        for (size_t i = 0; i < all.size(); ++i) {
          shard.lengths.push_back(C);
          if (all[i].group == r) shard.positions.push_back(i);
        }
        const auto mine = rank_group(r, G, P, C, V);
        for (int s = 0; s <= steps; ++s) {
          comm.barrier();
          const auto t0 = Clock::now();
          const trainer::TrainStepMetrics m = trainer.step(mine, &shard);
          const double t = std::chrono::duration<double>(Clock::now() - t0).count();
          if (s == 0) {
            opt.memory(true);
            continue;
          }
          step_s[static_cast<size_t>(r)].push_back(t);
          comm_s[static_cast<size_t>(r)].push_back(m.comm_s);
          exposed_s[static_cast<size_t>(r)].push_back(m.comm_exposed_s);
        }
        if (r == 0) state = opt.memory().total();
      },
      "bench train --ranks");
  Run out;
  out.step_s = median(step_s[0]);
  out.comm_s = median(comm_s[0]);
  out.exposed_s = median(exposed_s[0]);
  out.state_bytes = state;
  return out;
}

}  // namespace

int run_sharded_train_bench(const Options& opt, const std::string& model_path) {
  namespace fs = std::filesystem;
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const int N = opt.ranks;
  TANDEM_CHECK(N >= 2, "bench train --ranks: {} ranks; use 2 or more", N);
  const int steps = opt.quick ? 1 : 3;
  const int G = 4, P = opt.quick ? 8 : 32, C = opt.quick ? 8 : 32;
  model::LoadedModel m = model::load_model(path, DType::f32);
  const int64_t params = m.weights->num_parameters();
  // Each rank computes on its share of the cores, as N processes of a job would.
  const int threads = num_threads();
  set_num_threads(std::max(1, threads / N));
  std::vector<std::pair<std::string, EmulatedLink>> links = {{"loopback", EmulatedLink{}}};
  if (opt.link_gbps > 0)
    links.push_back(
        {fmt::format("emulated {:g} Gbit/s {:g} us", opt.link_gbps, opt.link_latency_us),
         EmulatedLink{opt.link_gbps, opt.link_latency_us}});
  for (const auto& [link_name, link] : links) {
    double optimizer_step = 0;
    for (const trainer::ShardLevel level :
         {trainer::ShardLevel::optimizer, trainer::ShardLevel::gradients,
          trainer::ShardLevel::parameters}) {
      const std::string case_name =
          fmt::format("{} {} ranks shard={} {}", fs::path(path).stem().string(), N,
                      trainer::shard_level_name(level), link_name);
      if (!opt.filter.empty() && case_name.find(opt.filter) == std::string::npos) continue;
      const Run on = run(*m.weights, level, true, link, N, steps, G, P, C);
      const Run off = run(*m.weights, level, false, link, N, steps, G, P, C);
      if (level == trainer::ShardLevel::optimizer) optimizer_step = on.step_s;
      nlohmann::ordered_json j{
          {"bench", "train"},
          {"case", case_name},
          {"metric", "step_s"},
          {"unit", "s"},
          {"value", on.step_s},
          {"peer", "the same level without overlap (trainer.overlap_comm=false)"},
          {"peer_value", off.step_s},
          {"ratio", off.step_s / on.step_s},
          {"comm_s", on.comm_s},
          {"comm_exposed_s", on.exposed_s},
          {"comm_hidden_fraction", on.comm_s > 0 ? 1.0 - on.exposed_s / on.comm_s : 0.0},
          {"no_overlap_comm_s", off.comm_s},
          {"tokens_per_rank", G * (P + C)},
          {"rank_threads", num_threads()}};
      if (optimizer_step > 0) j["vs_shard_optimizer"] = on.step_s / optimizer_step;
      j["state_mib"] = static_cast<double>(on.state_bytes) / (1 << 20);
      // One rank's AdamW: f32 weights, gradients and two moments.
      j["state_vs_one_rank"] =
          static_cast<double>(on.state_bytes) / (16.0 * static_cast<double>(params));
      add_machine(opt, j);
      print_line(opt, j);
    }
  }
  set_num_threads(threads);
  return 0;
}

}  // namespace tandem::bench
