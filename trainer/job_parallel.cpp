// What the ranks of a colocated job share: each rank's share of a round's groups to generate, the
// exchange of their rewards and scores (and, for a grid trainer, of their tokens), and whether any
// rank asks to stop.
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "trainer/job_runner.h"

namespace tandem::trainer::job_detail {

namespace {

// Part i of n of `count` items: [count i / n, count (i + 1) / n).
std::pair<size_t, size_t> part_of(size_t count, int i, int n) {
  const auto k = static_cast<size_t>(n), j = static_cast<size_t>(i);
  return {count * j / k, count * (j + 1) / k};
}

}  // namespace

std::pair<size_t, size_t> Job::share(size_t count, int rank) const {
  return part_of(count, rank, world_);
}

bool Job::any_rank(bool mine) {
  if (comm_ == nullptr) return mine;
  const double flag = mine ? 1 : 0;
  for (const double f : gather_doubles(*comm_, std::span<const double>(&flag, 1)))
    if (f != 0) return true;
  return false;
}

// Each sample travels as its reward, its reward functions' total, truncation, length and weight
// version, then each function's value and whether it failed: 5 + 2F doubles, all-gathered in rank
// order.
std::vector<Group> Job::exchange(Communicator& comm, std::vector<Group> mine,
                                 std::vector<Prompt>& prompts,
                                 rewards::RewardBreakdown& breakdown) {
  const size_t F = job_.rewards.size(), K = 5 + 2 * F, G = static_cast<size_t>(job_.rollout.n);
  std::vector<double> out;
  size_t i = 0;
  for (const Group& g : mine) {
    TANDEM_CHECK(g.samples.size() == G, "rollout of prompt '{}' gave {} samples, not {}",
                 g.prompt.example.id, g.samples.size(), G);
    for (const Sample& x : g.samples) {
      out.insert(out.end(),
                 {static_cast<double>(x.reward), breakdown.total[i], x.truncated ? 1.0 : 0.0,
                  static_cast<double>(x.length), static_cast<double>(x.version)});
      for (size_t f = 0; f < F; ++f) out.push_back(breakdown.values[f][i]);
      for (size_t f = 0; f < F; ++f) out.push_back(breakdown.failed[f][i]);
      ++i;
    }
  }
  std::vector<int64_t> counts;
  for (int r = 0; r < world_; ++r) {
    const auto [a, b] = share(prompts.size(), r);
    counts.push_back(static_cast<int64_t>((b - a) * G * K));
  }
  std::vector<double> all(prompts.size() * G * K);
  comm.all_gather_v(Tensor::wrap(out.data(), {static_cast<int64_t>(out.size())}, DType::i64),
                    Tensor::wrap(all.data(), {static_cast<int64_t>(all.size())}, DType::i64),
                    counts);

  rewards::RewardBreakdown round;
  for (const RewardSpec& r : job_.rewards) round.names.push_back(r.name);
  round.values.resize(F);
  round.failed.resize(F);
  round.call_errors = breakdown.call_errors;
  round.call_errors.resize(F);
  const auto [first, last] = share(prompts.size(), rank_);
  std::vector<Group> groups;
  for (size_t p = 0; p < prompts.size(); ++p) {
    if (p >= first && p < last) {
      groups.push_back(std::move(mine[p - first]));
    } else {
      Group g;
      g.prompt = prompts[p];
      g.local = false;
      groups.push_back(std::move(g));
    }
    for (size_t k = 0; k < G; ++k) {
      const double* x = all.data() + (p * G + k) * K;
      if (!groups.back().local) {
        Sample sample;
        sample.reward = static_cast<float>(x[0]);
        sample.truncated = x[2] != 0;
        sample.length = static_cast<int64_t>(x[3]);
        sample.version = static_cast<int64_t>(x[4]);
        groups.back().samples.push_back(std::move(sample));
      }
      round.total.push_back(x[1]);
      for (size_t f = 0; f < F; ++f) {
        round.values[f].push_back(x[5 + f]);
        round.failed[f].push_back(static_cast<uint8_t>(x[5 + F + f]));
      }
    }
  }
  breakdown = std::move(round);
  return groups;
}

// Every rank generates its share of the groups, but a data-parallel replica of a grid trainer is
// several ranks (its tensor-parallel ranks and pipeline stages), each of which runs every sample
// of the replica's share: the tokens and the engine's logprobs of every sample travel to every
// rank (2 doubles a token, all-gathered in rank order; the lengths came with the rewards).
void Job::share_samples(Communicator& comm, std::vector<Group>& groups) {
  const size_t count = groups.size();
  const auto [first, last] = share(count, rank_);
  std::vector<double> out;
  for (size_t p = first; p < last; ++p)
    for (const Sample& x : groups[p].samples)
      for (size_t i = 0; i < x.tokens.size(); ++i)
        out.insert(out.end(), {static_cast<double>(x.tokens[i]), x.logprobs[i]});
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (int r = 0; r < world_; ++r) {
    const auto [a, b] = share(count, r);
    int64_t n = 0;
    for (size_t p = a; p < b; ++p)
      for (const Sample& x : groups[p].samples) n += 2 * x.length;
    counts.push_back(n);
    total += n;
  }
  std::vector<double> all(static_cast<size_t>(total));
  comm.all_gather_v(Tensor::wrap(out.data(), {static_cast<int64_t>(out.size())}, DType::i64),
                    Tensor::wrap(all.data(), {total}, DType::i64), counts);
  const auto [mine_first, mine_last] = part_of(count, grid_->at().dp, grid_->dp_size());
  size_t at = 0;
  for (size_t p = 0; p < count; ++p) {
    Group& g = groups[p];
    for (Sample& x : g.samples) {
      const auto n = static_cast<size_t>(x.length);
      if (!g.local) {
        x.tokens.resize(n);
        x.logprobs.resize(n);
        for (size_t i = 0; i < n; ++i) {
          x.tokens[i] = static_cast<int32_t>(all[at + 2 * i]);
          x.logprobs[i] = static_cast<float>(all[at + 2 * i + 1]);
        }
      }
      at += 2 * n;
    }
    g.local = p >= mine_first && p < mine_last;
  }
}

}  // namespace tandem::trainer::job_detail
