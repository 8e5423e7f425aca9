// RewardServer: a TThreadedServer answering RewardService calls with a RewardFunction.
#include "rewards/remote_server.h"

#include <spdlog/spdlog.h>
#include <thrift/server/TThreadedServer.h>
#include <thrift/transport/TServerSocket.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <thread>

#include "core/build_info.h"
#include "core/error.h"
#include "rewards/rpc/RewardService.h"
#include "rewards/rpc/reward_constants.h"
#include "rpc/bounded_thrift.h"

namespace tandem::rewards {
namespace {

namespace at = apache::thrift;

class Handler : public rpc::RewardServiceIf {
 public:
  Handler(std::shared_ptr<RewardFunction> function, const RewardServer::Options& options)
      : function_(std::move(function)), options_(options) {}

  void score(rpc::ScoreResponse& out, const rpc::ScoreRequest& request) override {
    if (!options_.token.empty() && !same_token(request.token, options_.token)) {
      rpc::Unauthorized e;
      e.message = request.token.empty() ? "this server requires a token" : "wrong token";
      throw e;
    }
    const size_t n = request.samples.size();
    if (n > static_cast<size_t>(options_.max_batch_size))
      invalid(fmt::format("{} samples in one request, at most {}", n, options_.max_batch_size));
    std::vector<RewardSample> samples(n);
    for (size_t i = 0; i < n; ++i) {
      const rpc::Sample& s = request.samples[i];
      RewardSample& r = samples[i];
      r.prompt = s.prompt;
      r.completion = s.completion;
      r.answer = s.answer;
      r.completion_tokens = s.completion_tokens;
      r.truncated = s.truncated;
      r.extra = nlohmann::json::parse(s.extra_json.empty() ? "{}" : s.extra_json, nullptr,
                                      /*allow_exceptions=*/false);
      if (!r.extra.is_object())
        invalid(
            fmt::format("samples[{}].extra_json is not a JSON object: {:.80}", i, s.extra_json));
    }
    // Admitted calls wait for the function one after another; past the bound the client is told
    // to come back later rather than left waiting behind every other connection.
    if (in_flight_.fetch_add(1) >= options_.max_in_flight) {
      --in_flight_;
      ++overloaded_;
      rpc::Overloaded e;
      e.message =
          fmt::format("busy: already {} score calls in flight (max_in_flight); retry after a pause",
                      options_.max_in_flight);
      throw e;
    }
    struct Leave {
      std::atomic<int64_t>& count;
      ~Leave() { --count; }
    } leave{in_flight_};
    out.request_id = request.request_id;
    out.scores.resize(n);
    std::vector<RewardResult> results;
    std::string error;
    try {
      std::lock_guard lock(function_mutex_);
      results = function_->score(samples);
      if (results.size() != n)
        error = fmt::format("the function returned {} results for {} samples", results.size(), n);
    } catch (const std::exception& e) {
      error = fmt::format("the function threw: {}", e.what());
    }
    if (!error.empty())
      spdlog::warn("reward server '{}': request '{}': {}", options_.name, request.request_id,
                   error);
    for (size_t i = 0; i < n; ++i) {
      rpc::Score& s = out.scores[i];
      s.ok = error.empty() && results[i].ok;
      s.value = s.ok ? results[i].value : 0.0;
      s.error = !error.empty() ? error : results[i].error;
    }
    ++scored_;
  }

  RewardServer::Stats stats() const { return {scored_.load(), overloaded_.load(), 0}; }

  bool health() override { return true; }

  void info(rpc::ServerInfo& out) override {
    out.name = options_.name;
    out.version = version_string();
    out.protocol_version = rpc::g_reward_constants.PROTOCOL_VERSION;
    out.max_batch_size = static_cast<int32_t>(options_.max_batch_size);
  }

 private:
  [[noreturn]] static void invalid(std::string message) {
    rpc::InvalidRequest e;
    e.message = std::move(message);
    throw e;
  }

  std::shared_ptr<RewardFunction> function_;
  const RewardServer::Options& options_;
  std::mutex function_mutex_;
  std::atomic<int64_t> in_flight_{0};  // score calls admitted and not yet answered
  std::atomic<int64_t> scored_{0}, overloaded_{0};
};

// Tells the constructor that the server listens.
}  // namespace

struct RewardServer::Impl {
  Options options;
  std::shared_ptr<at::transport::TServerSocket> socket;
  std::shared_ptr<Handler> handler;
  std::atomic<int64_t> refused{0};
  std::shared_ptr<at::server::TThreadedServer> server;
  std::thread thread;
};

RewardServer::RewardServer(std::shared_ptr<RewardFunction> function, Options options)
    : impl_(std::make_unique<Impl>()) {
  TANDEM_CHECK(function != nullptr, "reward server: no function to serve");
  route_thrift_output_to_log();
  TANDEM_CHECK(options.port >= 0 && options.port <= 65535, "reward server: port {} is not 0..65535",
               options.port);
  TANDEM_CHECK(options.max_batch_size >= 1 && options.max_batch_size <= (1 << 30) &&
                   options.max_message_bytes >= 1024 &&
                   options.max_message_bytes <= (1ll << 31) - 1 && options.max_connections >= 1 &&
                   options.max_in_flight >= 1 && options.idle_timeout_ms >= 1 &&
                   options.idle_timeout_ms <= (1ll << 31) - 1,
               "reward server: a bound is out of range (max_batch_size {}, max_message_bytes {}, "
               "max_connections {}, max_in_flight {}, idle_timeout_ms {})",
               options.max_batch_size, options.max_message_bytes, options.max_connections,
               options.max_in_flight, options.idle_timeout_ms);
  Impl& m = *impl_;
  m.options = std::move(options);
  // A list longer than max_batch_size is still read, to be refused with InvalidRequest.
  const ThriftLimits limits{.max_message_bytes = static_cast<int32_t>(m.options.max_message_bytes),
                            .max_string_bytes = static_cast<int32_t>(m.options.max_message_bytes),
                            .max_container_elements = static_cast<int32_t>(
                                std::max<int64_t>(m.options.max_batch_size, 1 << 16)),
                            .max_depth = 16};
  check_thrift_limits(limits, fmt::format("reward server '{}'", m.options.name));
  m.socket = std::make_shared<at::transport::TServerSocket>(m.options.host, m.options.port);
  m.socket->setRecvTimeout(static_cast<int>(m.options.idle_timeout_ms));
  m.socket->setSendTimeout(static_cast<int>(m.options.idle_timeout_ms));
  m.handler = std::make_shared<Handler>(std::move(function), m.options);
  m.server = std::make_shared<at::server::TThreadedServer>(
      report_refused_requests(std::make_shared<rpc::RewardServiceProcessor>(m.handler),
                              [&m](const std::string& peer, const std::string& why) {
                                const int64_t n = ++m.refused;
                                spdlog::warn(
                                    "reward server '{}': closed the connection of {}: {} ({} "
                                    "so far)",
                                    m.options.name, peer, why, n);
                              }),
      m.socket, bounded_framed_transport_factory(limits), bounded_binary_protocol_factory(limits));
  m.server->setConcurrentClientLimit(m.options.max_connections);
  try {
    m.thread = serve_when_listening(m.server, fmt::format("reward server '{}'", m.options.name));
  } catch (const std::exception& e) {
    TANDEM_FAIL("reward server: cannot listen on {}:{}: {}", m.options.host, m.options.port,
                e.what());
  }
  port_ = m.socket->getPort();
}

RewardServer::~RewardServer() { stop(); }

RewardServer::Stats RewardServer::stats() const {
  Stats s = impl_->handler->stats();
  s.refused = impl_->refused.load();
  return s;
}

void RewardServer::stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  impl_->server->stop();
  impl_->thread.join();
}

}  // namespace tandem::rewards
