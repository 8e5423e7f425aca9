// The record phase of a job's step: every rank's memory peaks gathered, then on rank 0 the
// metrics line (metrics.jsonl and TensorBoard), the report, the progress line and a sample.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "core/memory_ledger.h"
#include "trainer/job_runner.h"
#include "trainer/report.h"

namespace tandem::trainer::job_detail {
namespace {

namespace fs = std::filesystem;

// The process's peak resident memory so far (Linux reports ru_maxrss in KiB).
double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// A rank's memory figures, in this order: the peak of each ledger class since the previous
// step, of the arenas together, and the process's peak RSS, MiB.
constexpr size_t kMemoryFigures = memory_ledger::kClasses + 2;

// Every rank's memory figures in rank order (every rank takes part); the ledger's peaks start
// again from what each rank holds now.
std::vector<double> memory_by_rank(Communicator* comm) {
  const memory_ledger::Snapshot s = memory_ledger::reset_peaks();
  std::vector<double> mine;
  for (const ArenaClass c : memory_ledger::kAllClasses) mine.push_back(mib(s[c].peak));
  mine.push_back(mib(s.total.peak));
  mine.push_back(peak_rss_mib());
  return comm != nullptr ? gather_doubles(*comm, mine) : mine;
}

// memory/<class>_peak_mib, memory/arena_peak_mib and memory/peak_rss_mib of rank 0, and with
// several ranks each rank's as memory/rank<r>/...
void add_memory_metrics(nlohmann::ordered_json& j, std::span<const double> all) {
  const auto add = [&](const std::string& prefix, std::span<const double> f) {
    for (size_t k = 0; k < memory_ledger::kClasses; ++k)
      j[fmt::format("{}{}_peak_mib", prefix,
                    memory_ledger::class_label(memory_ledger::kAllClasses[k]))] = f[k];
    j[prefix + "arena_peak_mib"] = f[memory_ledger::kClasses];
    j[prefix + "peak_rss_mib"] = f[memory_ledger::kClasses + 1];
  };
  add("memory/", all.first(kMemoryFigures));
  const size_t ranks = all.size() / kMemoryFigures;
  if (ranks > 1)
    for (size_t r = 0; r < ranks; ++r)
      add(fmt::format("memory/rank{}/", r), all.subspan(r * kMemoryFigures, kMemoryFigures));
}

std::string format_eta(double seconds) {
  if (seconds < 60) return fmt::format("{:.0f}s", seconds);
  if (seconds < 3600)
    return fmt::format("{:.0f}m{:02.0f}s", std::floor(seconds / 60), std::fmod(seconds, 60));
  return fmt::format("{:.1f}h", seconds / 3600);
}

}  // namespace

// One line of metrics.jsonl, and its numbers as TensorBoard scalars.
void Job::write_metrics(const nlohmann::ordered_json& line) {
  metrics_out_->write_line(line.dump());
  if (tensorboard_)
    tensorboard_->write(
        line,
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
}

// The record phase: the step's metrics line, the report, the progress line and a sample.
void Job::record(const Collected& c, const Selected& s, const Updated& u, double step_s,
                 Role role) {
  const std::vector<double> memory = memory_by_rank(comm_);
  if (role != Role::writer) return;
  const TrainStepMetrics& tm = u.train;
  int64_t samples = 0, tokens = 0, max_len = 0, truncated = 0;
  for (const Group& g : c.groups) {
    for (const Sample& x : g.samples) {
      const auto len = x.length;
      ++samples;
      tokens += len;
      max_len = std::max(max_len, len);
      truncated += x.truncated ? 1 : 0;
    }
  }
  const double n_samples = std::max<double>(static_cast<double>(samples), 1.0);
  nlohmann::ordered_json j;
  j["step"] = state_.step;
  j["loss"] = tm.loss;
  j["reward/mean"] = s.rewards.mean;
  j["reward/std"] = s.rewards.std;
  const nlohmann::json reward_metrics = c.breakdown.metrics();
  for (auto it = reward_metrics.begin(); it != reward_metrics.end(); ++it) j[it.key()] = *it;
  j["advantage/mean"] = s.advantages.advantage_mean;
  j["advantage/std"] = s.advantages.advantage_std;
  j["advantage/min"] = s.advantages.advantage_min;
  j["advantage/max"] = s.advantages.advantage_max;
  j["zero_variance_group_fraction"] = s.rewards.zero_variance_fraction;
  j["pg_clipfrac_low"] = tm.policy.pg_clipfrac_low();
  j["pg_clipfrac_high"] = tm.policy.pg_clipfrac_high();
  j["kl_old"] = tm.policy.approx_kl_old();
  j["kl_ref"] = tm.policy.kl_ref_mean();
  j["entropy"] = tm.policy.entropy_mean();
  j["grad_norm"] = tm.grad_norm;
  j["lr"] = tm.lr;
  j["skipped_steps"] = tm.skipped_steps;
  j["response_length/mean"] = static_cast<double>(tokens) / n_samples;
  j["response_length/max"] = max_len;
  j["response_tokens"] = tokens;
  j["truncation_rate"] = static_cast<double>(truncated) / n_samples;
  j["old_logp_recomputed"] = tm.old_recomputed ? 1 : 0;
  if (tm.old_recomputed) {  // otherwise the old logprobs are the rollout's: nothing to compare
    j["rollout_trainer_logp/max_abs"] = tm.rollout_vs_trainer_max_abs;
    j["rollout_trainer_logp/mean_abs"] = tm.rollout_vs_trainer_mean_abs;
    j["token_mult_prob_error"] = tm.policy.token_mult_prob_error();
  } else if (job_.rollout.max_staleness > 0 && s.batch() > 0) {
    // The old logprobs are the behaviour's: the loss's own ratio policy / behaviour measures the
    // mismatch (before the update, with one epoch and one minibatch), staleness included.
    j["rollout_trainer_logp/max_abs"] = tm.policy.current_rollout_abs_max;
    j["rollout_trainer_logp/mean_abs"] = tm.policy.current_rollout_abs_mean();
    j["rollout_trainer_logp/kl_k3"] = tm.policy.approx_kl_old();
    j["rollout_trainer_logp/ratio_min"] = tm.policy.ratio_min;
    j["rollout_trainer_logp/ratio_max"] = tm.policy.ratio_max;
  }
  // How far the samples trained lag the weights the update started from, in weight versions
  // (each sample's first token's version): at most rollout.max_staleness.
  j["async/max_staleness"] = job_.rollout.max_staleness;
  j["async/weight_version"] = u.version;
  if (!s.versions.empty()) {
    int64_t lo = s.versions[0], hi = s.versions[0];
    double sum = 0;
    for (const int64_t v : s.versions) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      sum += static_cast<double>(v);
    }
    j["async/oldest_version"] = lo;
    j["async/staleness_min"] = u.version - hi;
    j["async/staleness_mean"] =
        static_cast<double>(u.version) - sum / static_cast<double>(s.versions.size());
    j["async/staleness_max"] = u.version - lo;
  }
  j["samples_trained"] = s.batch();
  j["samples_masked_truncated"] = s.masked_truncated;
  j["samples_downsampled"] = s.downsampled;
  j["samples_dropped_remainder"] = s.dropped_remainder;
  j["data/prompts_skipped_too_long"] = c.prompts_skipped;
  j["packed_tokens"] = tm.packed_tokens;
  j["update_skipped"] = s.batch() == 0 ? 1 : 0;
  j["dynamic_sampling/groups_generated"] = c.groups.size();
  j["dynamic_sampling/groups_kept"] = c.groups_kept;
  j["dynamic_sampling/refill_rounds"] = c.refill_rounds;
  add_memory_metrics(j, memory);
  j["memory/optimizer_state_mib"] =
      static_cast<double>(optimizer_->state_bytes()) / (1024.0 * 1024.0);
  j["distributed/ranks"] = world_;
  j["distributed/rollout_tp"] = rollout_->tp();
  j["distributed/trainer_tp"] = job_.trainer.tp;
  j["distributed/trainer_pp"] = job_.trainer.pp;
  j["tokens_per_s"] = static_cast<double>(tokens) / std::max(step_s, 1e-9);
  j["time/rollout_s"] = c.rollout_s;
  j["time/reward_s"] = c.reward_s;
  j["time/train_s"] = u.train_s;
  j["time/old_logp_s"] = tm.seconds_old;
  j["time/ref_logp_s"] = tm.seconds_ref;
  j["time/update_s"] = tm.seconds_update;
  // The sharded optimizer's collectives: all of their time, and the part the update waited for.
  j["time/comm_s"] = tm.comm_s;
  j["time/comm_exposed_s"] = tm.comm_exposed_s;
  j["distributed/shard"] =
      sharded_ != nullptr ? shard_level_name(sharded_->options().level) : "none";
  j["weight_sync/bytes"] = u.published.bytes_written;
  j["weight_sync/cast_tensors"] = u.published.cast;
  j["weight_sync/copied_tensors"] = u.published.copied;
  j["weight_sync/shared_tensors"] = u.published.shared;
  j["time/publish_s"] = u.publish_s;
  if (u.canary) {
    j["weight_sync/canary_max_abs"] = u.canary->max_abs;
    j["time/canary_s"] = u.canary->seconds;
  }
  j["time/step_s"] = step_s;
  if (c.trainer_idle_s >= 0) {  // a disaggregated job
    j["time/trainer_idle_s"] = c.trainer_idle_s;
    j["time/rollout_idle_s"] = c.rollout_idle_s;
  }
  if (remote_) remote_->add_metrics(j);
  write_metrics(j);
  if (hooks_.on_step) hooks_.on_step(j);
  write_report((fs::path(job_.logging.dir) / "metrics.jsonl").string(),
               (fs::path(job_.logging.dir) / "report.html").string(),
               fmt::format("tandem: {}", job_.source));

  if (s.batch() == 0)
    std::fprintf(stderr,
                 "tandem: step %lld: no sample to train on (%lld groups generated, none with "
                 "reward variance after %lld refill rounds): update skipped\n",
                 static_cast<long long>(state_.step), static_cast<long long>(c.groups.size()),
                 static_cast<long long>(c.refill_rounds));
  if (s.dropped_remainder > 0)
    std::fprintf(stderr,
                 "tandem: step %lld: %lld samples left out so that trainer.minibatches = %lld "
                 "divides the %lld that enter the loss\n",
                 static_cast<long long>(state_.step), static_cast<long long>(s.dropped_remainder),
                 static_cast<long long>(job_.trainer.step.minibatches),
                 static_cast<long long>(s.batch() + static_cast<size_t>(s.dropped_remainder)));
  const double per_step = seconds_since(start_) / static_cast<double>(state_.step - first_step_);
  const std::string groups = job_.trainer.shaping.dynamic_sampling
                                 ? fmt::format(" | groups {}/{} ({} refills)", c.groups_kept,
                                               c.groups.size(), c.refill_rounds)
                                 : "";
  std::fprintf(
      stderr,
      "step %lld/%lld | reward %.3f%s | kl %.4f | entropy %.3f | len %.1f | %.0f tok/s | "
      "%.1fs (rollout %.1f, train %.1f) | eta %s\n",
      static_cast<long long>(state_.step), static_cast<long long>(job_.trainer.steps),
      s.rewards.mean, groups.c_str(), tm.policy.kl_ref_mean(), tm.policy.entropy_mean(),
      j["response_length/mean"].get<double>(), j["tokens_per_s"].get<double>(), step_s, c.rollout_s,
      u.train_s,
      format_eta(per_step * static_cast<double>(job_.trainer.steps - state_.step)).c_str());
  if (job_.logging.samples_every > 0 && state_.step % job_.logging.samples_every == 0 &&
      !c.groups.empty() && !c.groups[0].samples.empty()) {
    const Group& g = c.groups[0];
    // Every prompt whose group the step trained, by its example id: which prompts each step
    // used, across restarts too.
    nlohmann::json trained = nlohmann::json::array();
    for (const Group& kept : c.groups)
      if (kept.kept) trained.push_back(kept.prompt.example.id);
    samples_out_->write_line(nlohmann::json{{"step", state_.step},
                                            {"trained_prompts", std::move(trained)},
                                            {"prompt", g.prompt.rendered.text},
                                            {"completion", g.samples[0].text},
                                            {"answer", g.prompt.example.answer},
                                            {"reward", g.samples[0].reward}}
                                 // A completion may end inside a UTF-8 character: U+FFFD there.
                                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
}

}  // namespace tandem::trainer::job_detail
