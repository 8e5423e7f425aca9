// RemoteReward: batches of samples to a RewardService over framed binary Thrift, with timeouts,
// retries and bounded concurrency.
#include "rewards/remote.h"

#include <spdlog/spdlog.h>
#include <thrift/Thrift.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TSocket.h>
#include <thrift/transport/TTransportException.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "core/utf8.h"
#include "rewards/rpc/RewardService.h"
#include "rewards/rpc/reward_constants.h"
#include "rpc/thrift_client.h"

namespace tandem::rewards {
namespace {

namespace at = apache::thrift;

// Thrift strings are UTF-8, and a server in Python decodes them as such.
rpc::Sample to_rpc(const RewardSample& s) {
  rpc::Sample r;
  r.prompt = to_valid_utf8(s.prompt);
  r.completion = to_valid_utf8(s.completion);
  r.answer = to_valid_utf8(s.answer);
  r.extra_json = s.extra.is_null()
                     ? "{}"
                     : s.extra.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  r.completion_tokens = s.completion_tokens;
  r.truncated = s.truncated;
  return r;
}

// A failure that retrying will not cure: the server refused the request, or broke the contract.
struct Refused : Error {
  using Error::Error;
};

}  // namespace

struct RemoteReward::Link : ThriftClient<rpc::RewardServiceClient> {
  using ThriftClient::ThriftClient;
};

RemoteReward::RemoteReward(std::string name, Options options)
    : name_(std::move(name)), options_(std::move(options)) {
  route_thrift_output_to_log();
  const std::string& a = options_.address;
  const Endpoint peer = parse_endpoint(a, fmt::format("reward '{}' (remote)", name_), 9090);
  auto check_range = [&](const char* key, int64_t v, int64_t lo, int64_t hi) {
    TANDEM_CHECK(v >= lo && v <= hi, "reward '{}' (remote): option '{}' is {}, expected {}..{}",
                 name_, key, v, lo, hi);
  };
  // Thrift takes its socket timeouts as int milliseconds.
  check_range("timeout_ms", options_.timeout_ms, 1, 3'600'000);
  check_range("connect_timeout_ms", options_.connect_timeout_ms, 1, 3'600'000);
  check_range("retries", options_.retries, 0, 100);
  check_range("backoff_ms", options_.backoff_ms, 0, 60'000);
  check_range("max_concurrency", options_.max_concurrency, 1, 1024);
  check_range("batch_size", options_.batch_size, 1, 1'000'000);
  // An answer holds one score per sample sent, so a longer list is never read.
  link_ = std::make_unique<Link>(
      peer, ThriftLimits{.max_container_elements = static_cast<int32_t>(options_.batch_size)});
  if (!options_.check_on_start) return;
  const RemoteServerInfo i = info();
  const int32_t expected = rpc::g_reward_constants.PROTOCOL_VERSION;
  TANDEM_CHECK(i.protocol_version == expected,
               "reward '{}' (remote {}): the server '{}' speaks protocol version {}, this client "
               "{}: update the server to the rewards/reward.thrift of this tandem",
               name_, a, i.name, i.protocol_version, expected);
  if (i.max_batch_size > 0 && i.max_batch_size < options_.batch_size) {
    spdlog::info("reward '{}': server '{}' at {} takes {} samples per request; batch_size {} -> {}",
                 name_, i.name, a, i.max_batch_size, options_.batch_size, i.max_batch_size);
    options_.batch_size = i.max_batch_size;
  }
}

RemoteReward::~RemoteReward() = default;

// Transport errors (refused, reset, timed out) and Overloaded are retried after a pause that
// doubles (rpc/thrift_client.h). A refusal (InvalidRequest, Unauthorized), a protocol error or the
// server's own exception are final.
template <typename Call>
auto RemoteReward::with_retries(const std::string& what, Call&& call) {
  const std::string where = fmt::format("reward '{}' (remote {})", name_, options_.address);
  const CallTries tries{.what = fmt::format("{}: {}", where, what),
                        .retries = options_.retries,
                        .backoff_ms = options_.backoff_ms,
                        .connect_timeout_ms = options_.connect_timeout_ms,
                        .timeout_ms = options_.timeout_ms,
                        .retry_log_level = spdlog::level::warn};
  auto judge = [&]() -> std::string {
    try {
      throw;
    } catch (const rpc::Overloaded& e) {
      return fmt::format("server overloaded: {}", e.message);
    } catch (const rpc::Unauthorized& e) {
      throw FatalRewardError(
          fmt::format("{}: {}: the server refused the token ({}): the token is wrong or missing; "
                      "set the reward's token (token_env in the job config) to the server's",
                      where, what, e.message));
    } catch (const rpc::InvalidRequest& e) {
      throw Refused(
          fmt::format("{}: {}: the server refused the request: {}", where, what, e.message));
    } catch (const at::protocol::TProtocolException& e) {
      throw Refused(
          fmt::format("{}: {}: protocol error (is it a RewardService, framed binary "
                      "protocol?): {}",
                      where, what, e.what()));
    } catch (const at::TException& e) {
      throw Refused(fmt::format("{}: {}: the server failed: {}", where, what, e.what()));
    }
  };
  auto give_up = [&](const CallExhausted& last) {
    return Error(fmt::format("{}: {} failed after {} tries: {}", where, what, options_.retries + 1,
                             last.why));
  };
  return link_->call(tries, std::forward<Call>(call), judge, give_up);
}

RemoteServerInfo RemoteReward::info() {
  const rpc::ServerInfo i = with_retries("info()", [](rpc::RewardServiceClient& c) {
    rpc::ServerInfo r;
    c.info(r);
    return r;
  });
  return {i.name, i.version, i.protocol_version, i.max_batch_size};
}

bool RemoteReward::health() {
  return with_retries("health()", [](rpc::RewardServiceClient& c) { return c.health(); });
}

std::vector<RewardResult> RemoteReward::score(std::span<const RewardSample> samples) {
  std::vector<RewardResult> results(samples.size());
  if (samples.empty()) return results;
  const size_t per = static_cast<size_t>(options_.batch_size);
  const size_t requests = (samples.size() + per - 1) / per;
  const uint64_t call = next_request_++;

  // Workers take the next request until none is left or one has failed; the first failure is
  // the call's error.
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto work = [&] {
    for (size_t r = next++; r < requests && !failed; r = next++) {
      const size_t begin = r * per;
      const size_t end = std::min(samples.size(), begin + per);
      try {
        rpc::ScoreRequest req;
        req.request_id = fmt::format("{}-{}-{}", name_, call, r);
        req.token = options_.token;
        req.samples.reserve(end - begin);
        for (size_t i = begin; i < end; ++i) req.samples.push_back(to_rpc(samples[i]));
        const std::string what = fmt::format("request {} (samples {}..{} of {})", req.request_id,
                                             begin, end - 1, samples.size());
        const rpc::ScoreResponse resp = with_retries(what, [&](rpc::RewardServiceClient& c) {
          rpc::ScoreResponse out;
          c.score(out, req);
          return out;
        });
        if (resp.scores.size() != end - begin)
          throw Refused(
              fmt::format("reward '{}' (remote {}): {}: the server returned {} scores "
                          "for {} samples",
                          name_, options_.address, what, resp.scores.size(), end - begin));
        for (size_t i = begin; i < end; ++i) {
          const rpc::Score& s = resp.scores[i - begin];
          results[i] = s.ok ? RewardResult::success(s.value)
                            : RewardResult::failure(
                                  s.error.empty() ? "the server could not score it" : s.error);
        }
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  const size_t workers = std::min(requests, static_cast<size_t>(options_.max_concurrency));
  std::vector<std::jthread> threads;
  for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  threads.clear();  // joins
  if (error) std::rethrow_exception(error);
  return results;
}

}  // namespace tandem::rewards
