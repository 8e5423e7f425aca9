// Canary: one greedy probe per publish through the rollout engine and through the trainer's
// logprob forward, their largest difference gathered over the ranks and bounded.
#include "trainer/canary.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <utility>

#include "core/error.h"
#include "trainer/disaggregated.h"
#include "trainer/job_config.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {

Canary::Canary(const JobConfig& job, std::vector<int32_t> probe, Communicator* world, int tp)
    : job_(job), probe_(std::move(probe)), world_(world), tp_(tp) {
  TANDEM_CHECK(!probe_.empty(), "weight_sync.canary: the probe prompt has no tokens ({})",
               job.where("weight_sync.canary"));
  if (static_cast<int64_t>(probe_.size()) > job.data.max_prompt_tokens)
    probe_.resize(static_cast<size_t>(job.data.max_prompt_tokens));
}

// The largest |engine - trainer| logprob of one engine's probe (NaN: infinite).
double Canary::difference(const rollout::RequestOutput& out, const std::string& engine,
                          PolicyTrainer& trainer, const model::Weights& policy) const {
  TANDEM_CHECK(out.status == rollout::RequestStatus::done && out.samples.size() == 1,
               "weight_sync canary: {} did not generate the probe: {}", engine, out.error);
  const rollout::SampleOutput& s = out.samples[0];
  TrainSample sample;
  sample.prompt = probe_;
  sample.completion = s.tokens;
  sample.rollout_logp = s.logprobs;
  const std::vector<float> scored = trainer.logprobs(policy, std::span(&sample, 1));
  if (job_.placement.release_memory) trainer.release_activations();
  TANDEM_CHECK(scored.size() == s.logprobs.size() && !scored.empty(),
               "weight_sync canary: {} gave {} logprobs for {} tokens, the trainer {}", engine,
               s.logprobs.size(), s.tokens.size(), scored.size());
  double worst = 0;
  for (size_t i = 0; i < scored.size(); ++i) {
    const double d = std::abs(static_cast<double>(scored[i]) - s.logprobs[i]);
    worst = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(worst, d);
  }
  return worst;
}

CanaryResult Canary::check(rollout::Engine& engine, PolicyTrainer& trainer,
                           const model::Weights& policy, int64_t step, uint64_t version,
                           RemoteRollout* workers) {
  const auto t0 = std::chrono::steady_clock::now();
  rollout::Request request;
  request.id = "weight_sync-canary";
  request.prompt = probe_;
  // top_k = 1 draws the top token; the temperature only sets the logprob's definition, the
  // trainer's (logits / rollout.temperature).
  request.params.n = 1;
  request.params.temperature = static_cast<float>(job_.rollout.temperature);
  request.params.top_k = 1;
  request.params.max_tokens = static_cast<int>(job_.weight_sync.canary_tokens);
  const std::vector<rollout::RequestOutput> out = engine.generate({request});
  TANDEM_CHECK(out.size() == 1, "weight_sync canary: the rollout engine gave {} outputs, not 1",
               out.size());
  const double mine = difference(out[0], "the rollout engine", trainer, policy);

  // world: one double from every rank.
  const std::vector<double> all = world_ != nullptr
                                      ? gather_doubles(*world_, std::span<const double>(&mine, 1))
                                      : std::vector<double>{mine};
  CanaryResult r;
  const double tolerance = job_.weight_sync.canary_tolerance;
  std::string failed;
  for (size_t first = 0; first < all.size(); first += static_cast<size_t>(tp_)) {
    const double worst = *std::max_element(all.begin() + static_cast<ptrdiff_t>(first),
                                           all.begin() + static_cast<ptrdiff_t>(first) + tp_);
    r.max_abs = std::max(r.max_abs, worst);
    if (worst <= tolerance) continue;
    const std::string ranks = tp_ == 1 ? fmt::format("rank {}", first)
                                       : fmt::format("ranks {}-{}", first, first + tp_ - 1);
    failed += fmt::format("{}replica {} ({}) by up to {:.3g}", failed.empty() ? "" : ", ",
                          first / static_cast<size_t>(tp_), ranks, worst);
  }
  // Disaggregated: each worker's engine too (the job is one rank).
  if (workers != nullptr) {
    for (const auto& [address, answer] : workers->generate_on_each(request)) {
      const std::string name = fmt::format("rollout worker {}", address);
      const double worst = difference(answer, name, trainer, policy);
      r.max_abs = std::max(r.max_abs, worst);
      if (worst > tolerance)
        failed += fmt::format("{}{} by up to {:.3g}", failed.empty() ? "" : ", ", name, worst);
    }
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  TANDEM_CHECK(failed.empty(),
               "weight_sync canary: after the publish of step {} (weight version {}) the rollout "
               "engine's logprobs of the probe's {} greedy tokens differ from the trainer's by "
               "more than weight_sync.canary_tolerance = {:g} ({}) on {}. Those engine weights "
               "are not the trainer's (a corrupted or misplaced shard); the job stops before "
               "training on their samples. weight_sync.checksums = true checks the bytes sent "
               "between ranks (docs/weight-sync.md)",
               step, version, job_.weight_sync.canary_tokens, tolerance,
               job_.where("weight_sync.canary_tolerance"), failed);
  return r;
}

}  // namespace tandem::trainer
