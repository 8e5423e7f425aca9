// `tandem bench overlap`: whether a colocated job would gain by generating the next batch while it
// updates on this one (rollout.max_staleness above 0 on the trainer's own cores; docs/train.md,
// "Asynchronous rollouts"). A rollout (the engine generating B prompts x G samples of T new tokens
// from its own copy of the weights, as an engine generating during AdamW must) and an update
// (forward, backward of the mean completion-token logprob and AdamW over the B x G samples, packed
// as the trainer packs them): one after the other on every core, as the job runs them today,
// against the two at once on two threads, the cores split between them (ScopedThreadCount) or each
// on every core (the OpenMP teams time-share the cores). ratio = one after the other / at once:
// above 1 the overlap pays.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <thread>

#include "bench/bench.h"
#include "bench/peers.h"
#include "bench/update_step.h"
#include "core/parallel.h"
#include "model/decoder.h"
#include "model/loader.h"
#include "rollout/engine.h"

namespace tandem::bench {
namespace {

// fa and fb at once on two threads, fa's ops on threads_a threads and fb's on threads_b (0: every
// core each); seconds until both are done.
double at_once(const std::function<void()>& fa, const std::function<void()>& fb, int threads_a,
               int threads_b) {
  auto on = [](const std::function<void()>& f, int threads) {
    return [&f, threads] {
      if (threads > 0) {
        const ScopedThreadCount scoped(threads);
        f();
      } else {
        f();
      }
    };
  };
  return seconds_of([&] {
    std::thread a(on(fa, threads_a));
    on(fb, threads_b)();
    a.join();
  });
}

}  // namespace

int run_overlap_bench(const Options& opt, const std::string& model_path) {
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const std::string model_name = std::filesystem::path(path).stem().string();
  const int64_t B = 4, G = 8, P = 48, T = opt.quick ? 8 : 32;
  const int reps = opt.quick ? 1 : 3;
  model::LoadedModel m = model::load_model(path, DType::f32);
  const model::ModelConfig& c = m.config();

  // The rollout: B distinct prompts of P tokens, G samples each, exactly T new tokens (no stop
  // tokens).
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < B; ++b) {
    std::string text;
    std::vector<int32_t> ids;
    for (int i = 0; static_cast<int64_t>(ids.size()) < P; ++i) {
      text += fmt::format("Problem {}-{}: what is {} plus {}? ", b, i, 17 + 3 * b + i, 29 + b);
      ids = m.tok().encode(text, false);
    }
    ids.resize(static_cast<size_t>(P));
    prompts.push_back(std::move(ids));
  }
  model::Weights engine_weights(c, DType::f32);
  engine_weights.copy_from(*m.weights);
  rollout::EngineOptions eo;
  eo.max_context = P + T + 1;
  eo.max_seqs = B * G;
  eo.num_blocks = B * G * ((eo.max_context + eo.block_size - 1) / eo.block_size + 1) + 16;
  rollout::Engine engine(engine_weights, eo);
  uint64_t seed = 0;
  std::vector<std::vector<int32_t>> completions;  // of the first rollout, for the update
  auto rollout_once = [&] {
    std::vector<rollout::Request> rs;
    for (size_t b = 0; b < prompts.size(); ++b) {
      rollout::SamplingParams sp;
      sp.n = static_cast<int>(G);
      sp.temperature = 1.0f;
      sp.max_tokens = static_cast<int>(T);
      sp.seed = seed++;
      rs.push_back({fmt::format("r{}", seed), prompts[b], sp});
    }
    const std::vector<rollout::RequestOutput> outs = engine.generate(std::move(rs));
    if (!completions.empty()) return;
    for (const rollout::RequestOutput& o : outs)
      for (const rollout::SampleOutput& s : o.samples) completions.push_back(s.tokens);
  };
  rollout_once();  // warms the engine up, and gives the update its sequences

  // The update: the B x G samples the rollout made, packed as the trainer packs them (each
  // group's prompt once, trainer.share_prompts; the head on the completions' rows), the policy's
  // forward and backward of their mean token logprob, then AdamW.
  std::vector<model::PackedBatch::PromptCompletion> pairs;
  for (size_t i = 0; i < completions.size(); ++i)
    pairs.push_back({prompts[i / static_cast<size_t>(G)], completions[i]});
  const model::PackedBatch batch = model::PackedBatch::from_prompts(pairs, true);
  const int64_t tokens = batch.num_tokens();
  UpdateStep update(*m.weights, batch);
  auto update_once = [&] { update.run(1e-7f); };
  update_once();  // warm-up

  const int cores = num_threads();
  const int rollout_cores = std::max(1, cores / 2), update_cores = std::max(1, cores - cores / 2);
  double rollout_s = 1e30, update_s = 1e30, sequential = 1e30, split = 1e30, shared = 1e30;
  double split_rollout_s = 1e30, split_update_s = 1e30;
  // Interleaved, so that a busy moment of the machine hits every way alike; best of reps.
  for (int r = 0; r < reps; ++r) {
    const double a = seconds_of(rollout_once), b = seconds_of(update_once);
    rollout_s = std::min(rollout_s, a);
    update_s = std::min(update_s, b);
    sequential = std::min(sequential, a + b);
    double ra = 0, ub = 0;
    split = std::min(split,
                     at_once([&] { ra = seconds_of(rollout_once); },
                             [&] { ub = seconds_of(update_once); }, rollout_cores, update_cores));
    split_rollout_s = std::min(split_rollout_s, ra);
    split_update_s = std::min(split_update_s, ub);
    shared = std::min(shared, at_once(rollout_once, update_once, 0, 0));
  }
  const std::string shape = fmt::format(
      "{} f32, rollout {} x {} samples of {} + {} tokens, update "
      "of its {} tokens, {} cores",
      model_name, B, G, P, T, tokens, cores);
  const std::string peer = "one after the other on every core (the colocated step today)";
  print_line(opt, {{"bench", "step"},
                   {"case", shape + ": one after the other"},
                   {"metric", "seconds"},
                   {"unit", "s"},
                   {"value", sequential},
                   {"rollout_s", rollout_s},
                   {"update_s", update_s}});
  print_line(opt, {{"bench", "step"},
                   {"case", fmt::format("{}: at once, {} cores for the rollout and {} for the "
                                        "update",
                                        shape, rollout_cores, update_cores)},
                   {"metric", "seconds"},
                   {"unit", "s"},
                   {"value", split},
                   {"rollout_s", split_rollout_s},
                   {"update_s", split_update_s},
                   {"peer", peer},
                   {"peer_value", sequential},
                   {"ratio", sequential / split}});
  print_line(opt, {{"bench", "step"},
                   {"case", shape + ": at once, each on every core"},
                   {"metric", "seconds"},
                   {"unit", "s"},
                   {"value", shared},
                   {"peer", peer},
                   {"peer_value", sequential},
                   {"ratio", sequential / shared}});
  return 0;
}

}  // namespace tandem::bench
