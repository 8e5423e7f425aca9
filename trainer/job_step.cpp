// A GRPO step's phase work that needs no job state: generating and scoring groups, selecting the
// batch.
#include "trainer/job_step.h"

#include <fmt/format.h>

#include <utility>

#include "core/error.h"
#include "trainer/shaping.h"

namespace tandem::trainer::job_detail {
namespace {

rollout::SamplingParams sampling(const JobConfig& job, const model::LoadedModel& m, int n,
                                 double temperature, uint64_t seed) {
  rollout::SamplingParams sp;
  sp.n = n;
  sp.temperature = static_cast<float>(temperature);
  sp.top_p = static_cast<float>(job.rollout.top_p);
  sp.top_k = static_cast<int>(job.rollout.top_k);
  sp.min_p = static_cast<float>(job.rollout.min_p);
  sp.max_tokens = static_cast<int>(job.rollout.max_new_tokens);
  sp.seed = seed;
  sp.stop_token_ids = m.stop_ids();
  return sp;
}

}  // namespace

void append(rewards::RewardBreakdown& b, const rewards::RewardBreakdown& more) {
  if (b.names.empty()) {
    b = more;
    return;
  }
  b.total.insert(b.total.end(), more.total.begin(), more.total.end());
  for (size_t f = 0; f < b.names.size(); ++f) {
    b.values[f].insert(b.values[f].end(), more.values[f].begin(), more.values[f].end());
    b.failed[f].insert(b.failed[f].end(), more.failed[f].begin(), more.failed[f].end());
    if (b.call_errors[f].empty()) b.call_errors[f] = more.call_errors[f];
  }
}

std::vector<Group> generate(Rollout& rollout, const model::LoadedModel& m,
                            std::vector<Prompt> prompts, const JobConfig& job, int n,
                            double temperature, uint64_t seed, size_t first) {
  std::vector<rollout::Request> requests;
  for (size_t i = 0; i < prompts.size(); ++i)
    requests.push_back({fmt::format("{}", i), prompts[i].rendered.tokens,
                        sampling(job, m, n, temperature, seed + 7919 * (first + i))});
  std::vector<rollout::RequestOutput> outputs = rollout.generate(std::move(requests));
  std::vector<Group> groups(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    rollout::RequestOutput& o = outputs[i];
    TANDEM_CHECK(o.status == rollout::RequestStatus::done, "rollout of prompt '{}' failed: {}",
                 prompts[i].example.id, o.error);
    groups[i].prompt = std::move(prompts[i]);
    for (rollout::SampleOutput& s : o.samples) {
      const auto length = static_cast<int64_t>(s.tokens.size());
      groups[i].samples.push_back({std::move(s.tokens), std::move(s.logprobs), std::move(s.text),
                                   s.finish_reason == rollout::FinishReason::length, 0, length,
                                   static_cast<int64_t>(s.first_weight_version)});
    }
  }
  return groups;
}

rewards::RewardBreakdown score(std::span<Group> groups, rewards::RewardSet& reward_set,
                               const JobConfig& job) {
  std::vector<rewards::RewardSample> inputs;
  for (const Group& g : groups)
    for (const Sample& s : g.samples)
      inputs.push_back({g.prompt.rendered.text, s.text, g.prompt.example.answer,
                        g.prompt.example.extra, static_cast<int64_t>(s.tokens.size()),
                        s.truncated});
  rewards::RewardBreakdown breakdown = reward_set.score(inputs);
  const ShapingSection& shaping = job.trainer.shaping;
  size_t i = 0;
  for (Group& g : groups) {
    for (Sample& s : g.samples) {
      s.reward = static_cast<float>(breakdown.total[i++]);
      if (shaping.overlong_factor > 0)
        s.reward +=
            overlong_penalty(static_cast<int64_t>(s.tokens.size()), job.rollout.max_new_tokens,
                             shaping.overlong_buffer, static_cast<float>(shaping.overlong_factor));
    }
  }
  return breakdown;
}

std::vector<float> rewards_of(const Group& g) {
  std::vector<float> r;
  for (const Sample& s : g.samples) r.push_back(s.reward);
  return r;
}

Selected select(Collected& c, const JobConfig& job) {
  std::vector<float> all_rewards, kept_rewards;
  std::vector<int32_t> all_sizes, kept_sizes;
  const int64_t down = job.trainer.shaping.downsample;
  std::vector<std::vector<size_t>> trained(c.groups.size());  // of each kept group
  Selected s;
  for (size_t gi = 0; gi < c.groups.size(); ++gi) {
    const Group& g = c.groups[gi];
    const std::vector<float> r = rewards_of(g);
    all_rewards.insert(all_rewards.end(), r.begin(), r.end());
    all_sizes.push_back(static_cast<int32_t>(r.size()));
    if (!g.kept) continue;
    trained[gi] = max_variance_subset(r, down > 0 ? static_cast<size_t>(down) : r.size());
    for (const size_t i : trained[gi]) kept_rewards.push_back(r[i]);
    kept_sizes.push_back(static_cast<int32_t>(trained[gi].size()));
    s.downsampled += static_cast<int64_t>(r.size() - trained[gi].size());
  }
  s.rewards = reward_stats(all_rewards, all_sizes);
  const Advantages adv = compute_advantages(kept_rewards, kept_sizes, job.trainer.grpo.advantage);
  s.advantages = adv.stats;
  // The batch is every rank's kept samples in group order; this rank trains the local ones.
  size_t a = 0;
  for (size_t gi = 0; gi < c.groups.size(); ++gi) {
    Group& g = c.groups[gi];
    const auto group = static_cast<int64_t>(gi);
    if (!g.kept) continue;
    for (const size_t i : trained[gi]) {
      Sample& x = g.samples[i];
      const float advantage = adv.values[a++];
      if (!enters_loss(x.truncated, job.trainer.shaping.mask_truncated)) {
        ++s.masked_truncated;
        continue;
      }
      if (g.local) {
        s.shard.positions.push_back(s.shard.lengths.size());
        s.train.push_back({g.prompt.rendered.tokens, x.tokens, x.logprobs, advantage, group});
        s.versions.push_back(x.version);
      }
      s.shard.lengths.push_back(x.length);
    }
  }
  const size_t minibatches = static_cast<size_t>(job.trainer.step.minibatches);
  s.dropped_remainder = static_cast<int64_t>(s.shard.lengths.size() % minibatches);
  s.shard.lengths.resize(s.shard.lengths.size() - static_cast<size_t>(s.dropped_remainder));
  while (!s.shard.positions.empty() && s.shard.positions.back() >= s.shard.lengths.size()) {
    s.shard.positions.pop_back();
    s.train.pop_back();
    s.versions.pop_back();
  }
  return s;
}

}  // namespace tandem::trainer::job_detail
