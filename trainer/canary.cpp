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

// Rank 0 sends the probe to every worker that holds the weights last pushed; on several ranks
// its answers are broadcast to every rank (rows of the workers in placement.workers order: 1
// answered, 0 not asked, then the token count, n tokens and n logprobs), which all score them in
// the same call.
std::pair<std::vector<std::string>, std::vector<rollout::SampleOutput>> Canary::worker_probes(
    RemoteRollout& workers, const rollout::Request& request) const {
  const std::vector<std::string>& addresses = job_.placement.workers;
  const auto n = static_cast<size_t>(job_.weight_sync.canary_tokens);
  const size_t width = 2 + 2 * n;
  std::vector<double> rows(addresses.size() * width, 0.0);
  std::string failure;
  if (world_ == nullptr || world_->rank() == 0) {
    try {
      for (const auto& [address, answer] : workers.generate_on_each(request)) {
        TANDEM_CHECK(answer.status == rollout::RequestStatus::done && answer.samples.size() == 1 &&
                         answer.samples[0].tokens.size() <= n &&
                         answer.samples[0].logprobs.size() == answer.samples[0].tokens.size(),
                     "weight_sync canary: rollout worker {} did not generate the probe: {}",
                     address, answer.error);
        const auto at = static_cast<size_t>(std::find(addresses.begin(), addresses.end(), address) -
                                            addresses.begin());
        TANDEM_CHECK(at < addresses.size(), "weight_sync canary: an answer of unknown worker {}",
                     address);
        double* row = rows.data() + at * width;
        const rollout::SampleOutput& s = answer.samples[0];
        row[0] = 1;
        row[1] = static_cast<double>(s.tokens.size());
        for (size_t i = 0; i < s.tokens.size(); ++i) {
          row[2 + i] = s.tokens[i];
          row[2 + n + i] = s.logprobs[i];
        }
      }
    } catch (const std::exception& e) {
      if (world_ == nullptr) throw;
      failure = e.what();
      rows.assign(rows.size(), 0.0);
      rows[0] = -1;  // the others stop too
    }
  }
  if (world_ != nullptr) {
    static_assert(sizeof(double) == sizeof(int64_t));  // sent as i64 bits, as gather_doubles does
    world_->broadcast(Tensor::wrap(rows.data(), {static_cast<int64_t>(rows.size())}, DType::i64),
                      0);
    if (!failure.empty()) TANDEM_FAIL("{}", failure);
    TANDEM_CHECK(rows.empty() || rows[0] >= 0,
                 "weight_sync canary: rank 0 could not probe the rollout workers (its error says "
                 "why)");
  }
  std::vector<std::string> names;
  std::vector<rollout::SampleOutput> answers;
  for (size_t w = 0; w < addresses.size(); ++w) {
    const double* row = rows.data() + w * width;
    if (row[0] != 1) continue;
    names.push_back(fmt::format("rollout worker {}", addresses[w]));
    rollout::SampleOutput& s = answers.emplace_back();
    for (size_t i = 0; i < static_cast<size_t>(row[1]); ++i) {
      s.tokens.push_back(static_cast<int32_t>(row[2 + i]));
      s.logprobs.push_back(static_cast<float>(row[2 + n + i]));
    }
  }
  return {std::move(names), std::move(answers)};
}

// Each engine's largest |engine - trainer| logprob of its probe (NaN: infinite), the probes scored
// in one call; -1 each on a pipeline stage that computes no logprobs.
std::vector<double> Canary::differences(std::span<const rollout::SampleOutput> outs,
                                        PolicyTrainer& trainer,
                                        const model::Weights& policy) const {
  std::vector<TrainSample> samples(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    samples[i].prompt = probe_;
    samples[i].completion = outs[i].tokens;
    samples[i].rollout_logp = outs[i].logprobs;
  }
  size_t tokens = 0;
  for (const rollout::SampleOutput& o : outs) tokens += o.logprobs.size();
  const std::vector<float> scored = trainer.logprobs(policy, samples);
  if (job_.placement.release_memory) trainer.release_activations();
  TANDEM_CHECK(scored.size() == tokens,
               "weight_sync canary: the trainer gave {} logprobs for the probes' {} tokens",
               scored.size(), tokens);
  std::vector<double> worst(outs.size(), trainer.computes_logprobs() ? 0.0 : -1.0);
  size_t at = 0;
  for (size_t i = 0; i < outs.size(); ++i)
    for (const float engine : outs[i].logprobs) {
      const double d = std::abs(static_cast<double>(scored[at++]) - engine);
      if (worst[i] < 0) continue;
      worst[i] = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(worst[i], d);
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
  const int64_t n = job_.weight_sync.canary_tokens;
  request.params.max_tokens = static_cast<int>(n);
  const std::vector<rollout::RequestOutput> out = engine.generate({request});
  // A rank whose engine did not finish the probe (an error) sends none: its replica fails below.
  const rollout::SampleOutput none;
  const rollout::SampleOutput& mine =
      out.size() == 1 && out[0].status == rollout::RequestStatus::done &&
              out[0].samples.size() == 1 &&
              out[0].samples[0].logprobs.size() == out[0].samples[0].tokens.size() &&
              static_cast<int64_t>(out[0].samples[0].tokens.size()) <= n
          ? out[0].samples[0]
          : none;

  // Every replica's probe on every rank (its first rank's: a replica's ranks generate the same),
  // scored by every rank in the same call, so that a trainer split over ranks (tensor-parallel
  // ranks, pipeline stages, data-parallel replicas in step) makes the same collectives: per rank
  // the token count, then n tokens and n logprobs.
  std::vector<double> row(static_cast<size_t>(1 + 2 * n), 0.0);
  row[0] = static_cast<double>(mine.tokens.size());
  for (size_t i = 0; i < mine.tokens.size(); ++i) {
    row[1 + i] = mine.tokens[i];
    row[static_cast<size_t>(1 + n) + i] = mine.logprobs[i];
  }
  const std::vector<double> all = world_ != nullptr ? gather_doubles(*world_, row) : row;
  const size_t ranks = all.size() / row.size(), replicas = ranks / static_cast<size_t>(tp_);
  std::vector<rollout::SampleOutput> probes(replicas);
  std::vector<bool> generated(replicas);
  for (size_t r = 0; r < replicas; ++r) {
    const double* at = all.data() + r * static_cast<size_t>(tp_) * row.size();
    const auto count = static_cast<size_t>(at[0]);
    generated[r] = count > 0;
    for (size_t i = 0; i < count; ++i) {
      probes[r].tokens.push_back(static_cast<int32_t>(at[1 + i]));
      probes[r].logprobs.push_back(static_cast<float>(at[static_cast<size_t>(1 + n) + i]));
    }
  }
  const double tolerance = job_.weight_sync.canary_tolerance;
  std::string failed;
  auto ranks_of = [&](size_t replica) {
    const size_t first = replica * static_cast<size_t>(tp_);
    return tp_ == 1 ? fmt::format("rank {}", first)
                    : fmt::format("ranks {}-{}", first, first + tp_ - 1);
  };
  auto fail = [&](const std::string& what) { failed += (failed.empty() ? "" : ", ") + what; };
  for (size_t i = 0; i < replicas; ++i)
    if (!generated[i]) fail(fmt::format("replica {} ({}) generated no probe", i, ranks_of(i)));
  TANDEM_CHECK(failed.empty(),
               "weight_sync canary: after the publish of step {} (weight version "
               "{}) {}: the job stops before training on that engine's samples",
               step, version, failed);
  std::vector<double> worst = differences(probes, trainer, policy);
  // The ranks that computed the logprobs (every one but the first pipeline stages) give them.
  if (world_ != nullptr) {
    const std::vector<double> every = gather_doubles(*world_, worst);
    for (size_t k = 0; k < every.size(); ++k)
      worst[k % replicas] = std::max(worst[k % replicas], every[k]);
  }

  CanaryResult r;
  for (size_t i = 0; i < replicas; ++i) {
    r.max_abs = std::max(r.max_abs, worst[i]);
    if (worst[i] > tolerance)
      fail(fmt::format("replica {} ({}) by up to {:.3g}", i, ranks_of(i), worst[i]));
  }
  // Disaggregated: each worker's engine too.
  if (workers != nullptr) {
    const auto [names, answers] = worker_probes(*workers, request);
    std::vector<double> d = differences(answers, trainer, policy);
    if (world_ != nullptr) {
      const std::vector<double> every = gather_doubles(*world_, d);
      for (size_t k = 0; k < every.size(); ++k)
        d[k % d.size()] = std::max(d[k % d.size()], every[k]);
    }
    for (size_t i = 0; i < d.size(); ++i) {
      r.max_abs = std::max(r.max_abs, d[i]);
      if (d[i] > tolerance) fail(fmt::format("{} by up to {:.3g}", names[i], d[i]));
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
