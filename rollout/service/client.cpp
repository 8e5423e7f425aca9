// RolloutClient: calls to a RolloutService over framed binary Thrift, each within its deadline,
// retried after transport errors and Overloaded.
#include "rollout/service/client.h"

#include <spdlog/spdlog.h>
#include <thrift/Thrift.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TSocket.h>
#include <thrift/transport/TTransportException.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "rewards/bounded_thrift.h"

namespace tandem::rollout {
namespace {

namespace at = apache::thrift;
using Clock = std::chrono::steady_clock;

int64_t ms_left(Clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
}

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
    case CallFailure::internal:
      return "internal";
    case CallFailure::transport:
      return "transport";
    case CallFailure::protocol:
      return "protocol";
  }
  return "?";
}

void route_thrift_output_to_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    at::GlobalOutput.setOutputFunction([](const char* msg) { spdlog::debug("thrift: {}", msg); });
  });
}

struct RolloutClient::Connection {
  std::shared_ptr<at::transport::TSocket> socket;
  std::shared_ptr<at::transport::TTransport> transport;
  std::unique_ptr<rpc::RolloutServiceClient> client;
};

RolloutClient::RolloutClient(ClientOptions options) : options_(std::move(options)) {
  route_thrift_output_to_log();
  const std::string& a = options_.address;
  const size_t colon = a.rfind(':');
  const bool port_ok = colon != std::string::npos && colon + 1 < a.size() &&
                       a.size() - colon <= 6 &&
                       a.find_first_not_of("0123456789", colon + 1) == std::string::npos;
  TANDEM_CHECK(port_ok && colon > 0,
               "rollout client: address '{}' is not host:port (e.g. 127.0.0.1:9100)", a);
  host_ = a.substr(0, colon);
  if (host_.size() > 2 && host_.front() == '[' && host_.back() == ']')
    host_ = host_.substr(1, host_.size() - 2);
  port_ = std::stoi(a.substr(colon + 1));
  TANDEM_CHECK(port_ >= 1 && port_ <= 65535, "rollout client: port {} of '{}' is not 1..65535",
               port_, a);
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

std::unique_ptr<RolloutClient::Connection> RolloutClient::take_connection(bool& reused,
                                                                          int64_t timeout_ms) {
  const int ms = static_cast<int>(std::clamp<int64_t>(timeout_ms, 1, 1 << 30));
  {
    auto c = idle_.take();
    reused = c != nullptr;
    if (reused) {
      c->socket->setRecvTimeout(ms);
      c->socket->setSendTimeout(ms);
      return c;
    }
  }
  // Answers are bounded like requests: a worker cannot make the client allocate without limit.
  const ThriftLimits limits{.max_container_elements = 1 << 24};
  BoundedClientSocket link = open_bounded_client(
      host_, port_,
      static_cast<int>(std::min<int64_t>(options_.connect_timeout_ms, std::max(timeout_ms, 1l))),
      ms, limits);
  auto c = std::make_unique<Connection>();
  c->socket = std::move(link.socket);
  c->transport = std::move(link.transport);
  c->client = std::make_unique<rpc::RolloutServiceClient>(std::move(link.protocol));
  return c;
}

// Transport errors and Overloaded are retried after a pause that doubles, while the deadline
// allows; the connection of a transport error is dropped (a late answer could still arrive on
// it). The worker's typed refusals are final and keep their kind.
template <typename Call>
auto RolloutClient::with_retries(const char* what, Call&& call) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  const std::string where = fmt::format("rollout worker {}: {}", options_.address, what);
  std::string last;
  CallFailure last_kind = CallFailure::transport;
  bool stale_retried = false;
  for (int64_t attempt = 0;;) {
    std::unique_ptr<Connection> c;
    bool reused = false;
    try {
      const int64_t left = ms_left(deadline);
      if (left <= 0) {
        last = fmt::format("the deadline of {} ms passed", options_.timeout_ms);
        last_kind = CallFailure::transport;
        break;
      }
      c = take_connection(reused, left);
      auto result = call(*c->client);
      idle_.give_back(std::move(c));
      return result;
    } catch (const at::transport::TTransportException& e) {
      last = fmt::format("transport error: {}", e.what());
      last_kind = CallFailure::transport;
      idle_.drop_all();
      // A pooled connection is dead after the worker restarted: try a fresh one at once, once.
      if (reused && !stale_retried &&
          e.getType() != at::transport::TTransportException::TIMED_OUT) {
        stale_retried = true;
        continue;
      }
    } catch (const rpc::Overloaded& e) {
      last = fmt::format("overloaded: {}", e.message);
      last_kind = CallFailure::overloaded;
      idle_.give_back(std::move(c));
    } catch (const rpc::StaleWeights& e) {
      idle_.give_back(std::move(c));
      throw CallError(CallFailure::stale_weights, fmt::format("{}: {}", where, e.message));
    } catch (const rpc::Unauthorized& e) {
      idle_.give_back(std::move(c));
      throw CallError(CallFailure::unauthorized,
                      fmt::format("{}: the worker refused the token ({}): set the client's token "
                                  "to the worker's",
                                  where, e.message));
    } catch (const rpc::InvalidRequest& e) {
      idle_.give_back(std::move(c));
      throw CallError(CallFailure::invalid,
                      fmt::format("{}: the worker refused the request: {}", where, e.message));
    } catch (const rpc::Internal& e) {
      idle_.give_back(std::move(c));
      throw CallError(CallFailure::internal,
                      fmt::format("{}: the worker failed: {}", where, e.message));
    } catch (const at::protocol::TProtocolException& e) {
      throw CallError(CallFailure::protocol,
                      fmt::format("{}: protocol error (is it a RolloutService, framed binary "
                                  "protocol?): {}",
                                  where, e.what()));
    } catch (const at::TApplicationException& e) {
      throw CallError(CallFailure::internal,
                      fmt::format("{}: the worker failed: {}", where, e.what()));
    }
    if (attempt == options_.retries) break;
    const int64_t pause = std::min<int64_t>(
        {options_.backoff_ms << std::min<int64_t>(attempt, 16), 5000, ms_left(deadline)});
    if (pause < 0) break;
    spdlog::debug("{}: {}; retry {} of {} in {} ms", where, last, attempt + 1, options_.retries,
                  pause);
    std::this_thread::sleep_for(std::chrono::milliseconds(pause));
    ++attempt;
  }
  throw CallError(last_kind, fmt::format("{} failed: {}", where, last));
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
