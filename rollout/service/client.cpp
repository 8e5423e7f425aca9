// RolloutClient: calls to a RolloutService over framed binary Thrift, each within its deadline,
// retried after transport errors and Overloaded.
#include "rollout/service/client.h"

#include <thrift/Thrift.h>

#include <thrift/protocol/TProtocolException.h>
#include <algorithm>

namespace tandem::rollout {
namespace {

namespace at = apache::thrift;

}  // namespace

const char* call_failure_name(CallFailure f) {
  switch (f) {
    case CallFailure::invalid:
      return "invalid";
    case CallFailure::overloaded:
      return "overloaded";
    case CallFailure::stale_weights:
      return "stale_weights";
    case CallFailure::unauthorized:
      return "unauthorized";
    case CallFailure::weights_refused:
      return "weights_refused";
    case CallFailure::internal:
      return "internal";
    case CallFailure::transport:
      return "transport";
    case CallFailure::protocol:
      return "protocol";
  }
  return "?";
}

RolloutClient::RolloutClient(ClientOptions options)
    : options_(std::move(options)),
      // Answers are bounded like requests: a worker cannot make the client allocate without
      // limit.
      link_(parse_endpoint(options_.address, "rollout client", 9100),
            ThriftLimits{.max_container_elements = 1 << 24}) {
  route_thrift_output_to_log();
  const std::string& a = options_.address;
  auto check_range = [&](const char* key, int64_t v, int64_t lo, int64_t hi) {
    TANDEM_CHECK(v >= lo && v <= hi, "rollout client {}: option '{}' is {}, expected {}..{}", a,
                 key, v, lo, hi);
  };
  check_range("timeout_ms", options_.timeout_ms, 1, 24 * 3'600'000ll);
  check_range("connect_timeout_ms", options_.connect_timeout_ms, 1, 3'600'000);
  check_range("retries", options_.retries, 0, 100);
  check_range("backoff_ms", options_.backoff_ms, 0, 60'000);
}

RolloutClient::~RolloutClient() = default;

// Transport errors and Overloaded are retried after a pause that doubles, while the deadline
// allows (rpc/thrift_client.h). The worker's typed refusals are final and keep their kind.
template <typename Call>
auto RolloutClient::with_retries(const char* what, Call&& call) {
  const std::string where = fmt::format("rollout worker {}: {}", options_.address, what);
  const CallTries tries{.what = where,
                        .retries = options_.retries,
                        .backoff_ms = options_.backoff_ms,
                        .connect_timeout_ms = options_.connect_timeout_ms,
                        .timeout_ms = options_.timeout_ms,
                        .deadline = true};
  auto judge = [&]() -> std::string {
    try {
      throw;
    } catch (const rpc::Overloaded& e) {
      return fmt::format("overloaded: {}", e.message);
    } catch (const rpc::StaleWeights& e) {
      throw CallError(CallFailure::stale_weights, fmt::format("{}: {}", where, e.message));
    } catch (const rpc::Unauthorized& e) {
      throw CallError(CallFailure::unauthorized,
                      fmt::format("{}: the worker refused the token ({}): set the client's token "
                                  "to the worker's",
                                  where, e.message));
    } catch (const rpc::InvalidRequest& e) {
      throw CallError(CallFailure::invalid,
                      fmt::format("{}: the worker refused the request: {}", where, e.message));
    } catch (const rpc::WeightPushRefused& e) {
      throw CallError(CallFailure::weights_refused,
                      fmt::format("{}: the worker refused the weights ({}, it serves v{}): {}",
                                  where, rpc::to_string(e.fault), e.worker_version, e.message));
    } catch (const rpc::Internal& e) {
      throw CallError(CallFailure::internal,
                      fmt::format("{}: the worker failed: {}", where, e.message));
    } catch (const at::protocol::TProtocolException& e) {
      throw CallError(CallFailure::protocol,
                      fmt::format("{}: protocol error (is it a RolloutService, framed binary "
                                  "protocol?): {}",
                                  where, e.what()));
    } catch (const at::TException& e) {
      throw CallError(CallFailure::internal,
                      fmt::format("{}: the worker failed: {}", where, e.what()));
    }
  };
  auto give_up = [&](const CallExhausted& last) {
    return CallError(last.busy ? CallFailure::overloaded : CallFailure::transport,
                     fmt::format("{} failed: {}", where, last.why));
  };
  return link_.call(tries, std::forward<Call>(call), judge, give_up);
}

rpc::GenerateResponse RolloutClient::generate(rpc::GenerateRequest request) {
  request.token = options_.token;
  return with_retries("generate", [&](rpc::RolloutServiceClient& c) {
    rpc::GenerateResponse out;
    c.generate(out, request);
    return out;
  });
}

int32_t RolloutClient::abort(const std::string& request_id) {
  rpc::AbortRequest r;
  r.request_id = request_id;
  r.token = options_.token;
  return with_retries("abort", [&](rpc::RolloutServiceClient& c) { return c.abort(r); });
}

void RolloutClient::pause() {
  with_retries("pause", [&](rpc::RolloutServiceClient& c) {
    c.pause(options_.token);
    return 0;
  });
}

void RolloutClient::resume() {
  with_retries("resume", [&](rpc::RolloutServiceClient& c) {
    c.resume(options_.token);
    return 0;
  });
}

void RolloutClient::begin_weight_update(int64_t version) {
  rpc::WeightUpdate u;
  u.version = version;
  u.token = options_.token;
  with_retries("begin_weight_update", [&](rpc::RolloutServiceClient& c) {
    c.begin_weight_update(u);
    return 0;
  });
}

int64_t RolloutClient::commit_weight_update(int64_t version, const std::string& checkpoint_path) {
  rpc::WeightUpdate u;
  u.version = version;
  u.checkpoint_path = checkpoint_path;
  u.token = options_.token;
  return with_retries("commit_weight_update",
                      [&](rpc::RolloutServiceClient& c) { return c.commit_weight_update(u); });
}

rpc::WeightPushReady RolloutClient::begin_weight_push(int64_t version) {
  rpc::WeightPushBegin b;
  b.version = version;
  b.token = options_.token;
  return with_retries("begin_weight_push", [&](rpc::RolloutServiceClient& c) {
    rpc::WeightPushReady ready;
    c.begin_weight_push(ready, b);
    return ready;
  });
}

void RolloutClient::push_weight_bucket(rpc::WeightBucket& bucket) {
  bucket.token = options_.token;
  with_retries("push_weight_bucket", [&](rpc::RolloutServiceClient& c) {
    c.push_weight_bucket(bucket);
    return 0;
  });
}

int64_t RolloutClient::commit_weight_push(int64_t version, int32_t buckets, bool partial) {
  rpc::WeightPushCommit commit;
  commit.version = version;
  commit.buckets = buckets;
  commit.partial = partial;
  commit.token = options_.token;
  return with_retries("commit_weight_push",
                      [&](rpc::RolloutServiceClient& c) { return c.commit_weight_push(commit); });
}

int64_t RolloutClient::weight_version() {
  return with_retries("weight_version", [&](rpc::RolloutServiceClient& c) {
    return c.weight_version(options_.token);
  });
}

bool RolloutClient::health() {
  return with_retries("health",
                      [&](rpc::RolloutServiceClient& c) { return c.health(options_.token); });
}

rpc::Stats RolloutClient::stats() {
  return with_retries("stats", [&](rpc::RolloutServiceClient& c) {
    rpc::Stats s;
    c.stats(s, options_.token);
    return s;
  });
}

rpc::ServerInfo RolloutClient::info() {
  return with_retries("info", [&](rpc::RolloutServiceClient& c) {
    rpc::ServerInfo i;
    c.info(i, options_.token);
    return i;
  });
}

}  // namespace tandem::rollout
