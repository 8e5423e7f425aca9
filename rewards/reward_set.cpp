// RewardSet: weighted combination, deadlines, fallbacks, failure counting.
#include "rewards/reward_set.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"

namespace tandem::rewards {

// One call running on its own thread; shared by the caller and that thread, so either may go
// first.
struct RewardSet::InFlight {
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  std::vector<RewardResult> results;
  std::string error;         // what the function threw
  std::exception_ptr fatal;  // a FatalRewardError it threw
};

namespace {

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

RewardSet::RewardSet(std::vector<Entry> entries, RewardSetOptions options)
    : entries_(std::move(entries)), options_(options) {
  TANDEM_CHECK(!entries_.empty(), "a reward set needs at least one reward function");
  TANDEM_CHECK(std::isfinite(options_.fallback),
               "rewards fallback: expected a finite value, got {}", options_.fallback);
  TANDEM_CHECK(options_.max_consecutive_failures >= 0,
               "rewards max_consecutive_failures: expected >= 0, got {}",
               options_.max_consecutive_failures);
  std::set<std::string> names;
  for (const Entry& e : entries_) {
    TANDEM_CHECK(e.function != nullptr, "a reward set entry has no function");
    const std::string& name = e.function->name();
    TANDEM_CHECK(names.insert(name).second, "two reward functions are named '{}'", name);
    TANDEM_CHECK(std::isfinite(e.weight), "reward '{}' weight: expected a finite value, got {}",
                 name, e.weight);
    TANDEM_CHECK(!e.fallback || std::isfinite(*e.fallback),
                 "reward '{}' fallback: expected a finite value, got {}", name, *e.fallback);
    TANDEM_CHECK(!e.max_consecutive_failures || *e.max_consecutive_failures >= 0,
                 "reward '{}' max_consecutive_failures: expected >= 0, got {}", name,
                 *e.max_consecutive_failures);
    RewardFunctionStats st;
    st.name = name;
    st.weight = e.weight;
    stats_.push_back(st);
  }
  abandoned_.resize(entries_.size());
}

RewardBreakdown RewardSet::score(std::span<const RewardSample> samples) {
  const size_t n = samples.size();
  RewardBreakdown out;
  out.total.assign(n, 0.0);
  if (n == 0) return out;
  // The functions with a deadline read this copy, which outlives an abandoned call.
  std::shared_ptr<const std::vector<RewardSample>> shared;
  if (options_.timeout_s > 0)
    shared = std::make_shared<const std::vector<RewardSample>>(samples.begin(), samples.end());

  for (size_t f = 0; f < entries_.size(); ++f) {
    const Entry& entry = entries_[f];
    RewardFunctionStats& st = stats_[f];
    const double fallback = entry.fallback.value_or(options_.fallback);
    std::vector<RewardResult> results;
    std::string call_error;
    ++st.calls;
    st.samples += static_cast<int64_t>(n);

    if (abandoned_[f] != nullptr) {
      bool done = false;
      {
        std::lock_guard lock(abandoned_[f]->mutex);
        done = abandoned_[f]->done;
      }
      if (done) abandoned_[f].reset();
    }
    if (abandoned_[f] != nullptr) {
      ++st.timed_out;
      call_error = "a call abandoned at its deadline is still running";
    } else if (options_.timeout_s <= 0) {
      try {
        results = entry.function->score(samples);
      } catch (const FatalRewardError&) {
        throw;
      } catch (...) {
        ++st.thrown;
        call_error = "threw: " + describe(std::current_exception());
      }
    } else {
      auto call = std::make_shared<InFlight>();
      std::thread([function = entry.function, call, shared] {
        std::vector<RewardResult> r;
        std::string error;
        std::exception_ptr fatal;
        try {
          r = function->score(*shared);
        } catch (const FatalRewardError&) {
          fatal = std::current_exception();
        } catch (...) {
          error = "threw: " + describe(std::current_exception());
        }
        std::lock_guard lock(call->mutex);
        call->results = std::move(r);
        call->error = std::move(error);
        call->fatal = fatal;
        call->done = true;
        call->finished.notify_all();
      }).detach();
      std::unique_lock lock(call->mutex);
      const auto budget = std::chrono::duration<double>(options_.timeout_s);
      if (!call->finished.wait_for(lock, budget, [&] { return call->done; })) {
        ++st.timed_out;
        call_error = fmt::format("did not return within {} s (abandoned)", options_.timeout_s);
        abandoned_[f] = call;
      } else if (call->fatal) {
        std::rethrow_exception(call->fatal);
      } else if (!call->error.empty()) {
        ++st.thrown;
        call_error = call->error;
      } else {
        results = std::move(call->results);
      }
    }
    if (call_error.empty() && results.size() != n) {
      ++st.errors;
      call_error = fmt::format("returned {} results for {} samples", results.size(), n);
    }

    std::vector<double> values(n, fallback);
    std::vector<uint8_t> failed(n, 1);
    size_t n_failed = n;
    std::string first_error = call_error;
    if (call_error.empty()) {
      n_failed = 0;
      for (size_t i = 0; i < n; ++i) {
        const RewardResult& r = results[i];
        if (!r.ok) {
          ++st.errors;
          st.last_error = r.error;
        } else if (!std::isfinite(r.value)) {
          ++st.non_finite;
          st.last_error = fmt::format("returned {} for sample {}", r.value, i);
        } else {
          values[i] = r.value;
          failed[i] = 0;
          st.value_sum += r.value;
          continue;
        }
        if (n_failed++ == 0) first_error = fmt::format("sample {}: {}", i, st.last_error);
      }
    } else {
      st.last_error = call_error;
    }
    st.failed_samples += static_cast<int64_t>(n_failed);
    if (n_failed == n) {
      ++st.failed_calls;
      ++st.consecutive_failed_calls;
    } else {
      st.consecutive_failed_calls = 0;
    }
    for (size_t i = 0; i < n; ++i) out.total[i] += entry.weight * values[i];
    out.names.push_back(st.name);
    out.values.push_back(std::move(values));
    out.failed.push_back(std::move(failed));
    out.call_errors.push_back(call_error);
    if (n_failed > 0)
      spdlog::warn("reward '{}': {} of {} samples got the fallback {}; first error: {}", st.name,
                   n_failed, n, fallback, first_error);

    const int limit = entry.max_consecutive_failures.value_or(options_.max_consecutive_failures);
    TANDEM_CHECK(limit == 0 || st.consecutive_failed_calls < limit,
                 "reward function '{}' failed {} calls in a row (last error: {}); stopping the "
                 "run: fix the function or remove it from the rewards section of the config",
                 st.name, st.consecutive_failed_calls, st.last_error);
  }
  return out;
}

nlohmann::json RewardBreakdown::metrics() const {
  nlohmann::json m = nlohmann::json::object();
  const auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  };
  m["reward/mean"] = mean(total);
  for (size_t f = 0; f < names.size(); ++f) {
    m[fmt::format("reward/{}/mean", names[f])] = mean(values[f]);
    int64_t n_failed = 0;
    for (uint8_t x : failed[f]) n_failed += x;
    m[fmt::format("reward/{}/failed", names[f])] = n_failed;
    m[fmt::format("reward/{}/fallback_fraction", names[f])] =
        failed[f].empty() ? 0.0
                          : static_cast<double>(n_failed) / static_cast<double>(failed[f].size());
  }
  return m;
}

nlohmann::json RewardSet::stats_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const RewardFunctionStats& s : stats_) {
    const int64_t ok = s.samples - s.failed_samples;
    j[s.name] = {{"weight", s.weight},
                 {"calls", s.calls},
                 {"failed_calls", s.failed_calls},
                 {"samples", s.samples},
                 {"failed_samples", s.failed_samples},
                 {"thrown", s.thrown},
                 {"timed_out", s.timed_out},
                 {"errors", s.errors},
                 {"non_finite", s.non_finite},
                 {"mean", ok > 0 ? s.value_sum / static_cast<double>(ok) : 0.0},
                 {"last_error", s.last_error}};
  }
  return j;
}

}  // namespace tandem::rewards
