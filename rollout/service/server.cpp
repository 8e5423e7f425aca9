// RolloutServer: a TThreadedServer whose handlers hand requests to the engine thread and wait.
#include "rollout/service/server.h"

#include <arpa/inet.h>
#include <spdlog/spdlog.h>
#include <thrift/TApplicationException.h>
#include <thrift/TProcessor.h>
#include <thrift/Thrift.h>
#include <thrift/server/TThreadedServer.h>
#include <thrift/transport/TServerSocket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/build_info.h"
#include "core/error.h"
#include "core/utf8.h"
#include "rollout/service/client.h"
#include "rollout/service/rpc/RolloutService.h"
#include "rollout/service/rpc/rollout_constants.h"
#include "rollout/service/weight_receiver.h"
#include "rpc/bounded_thrift.h"

namespace tandem::rollout {
namespace {

namespace at = apache::thrift;
using Clock = std::chrono::steady_clock;

[[noreturn]] void invalid(std::string message) {
  rpc::InvalidRequest e;
  e.message = std::move(message);
  throw e;
}

[[noreturn]] void internal(std::string message) {
  rpc::Internal e;
  e.message = std::move(message);
  throw e;
}

rpc::FinishReason::type to_rpc(FinishReason r) {
  switch (r) {
    case FinishReason::stop:
      return rpc::FinishReason::STOP;
    case FinishReason::length:
      return rpc::FinishReason::LENGTH;
    case FinishReason::abort:
      return rpc::FinishReason::ABORT;
  }
  return rpc::FinishReason::ABORT;
}

// Counts the calls being processed (from the read of a message to the write of its answer), so
// that drain() knows when every answer has left.
class ActiveCalls : public at::TProcessorEventHandler {
 public:
  explicit ActiveCalls(std::atomic<int64_t>& count) : count_(count) {}
  void* getContext(const char*, void*) override {
    ++count_;
    return nullptr;
  }
  void freeContext(void*, const char*) override { --count_; }

 private:
  std::atomic<int64_t>& count_;
};

// Tells the constructor that the server listens.
}  // namespace

bool is_loopback_host(const std::string& host) {
  // An address, not a name that merely starts like one ("127.0.0.1.example.com").
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return host == "localhost";
}

int64_t max_bucket_bytes(const ServerOptions& options) {
  return std::max(options.max_message_bytes - 4096, options.max_message_bytes / 2);
}

void check_server_options(const ServerOptions& o) {
  auto in_range = [](const char* key, int64_t v, int64_t lo, int64_t hi) {
    TANDEM_CHECK(v >= lo && v <= hi, "rollout server: {} is {}, expected {}..{}", key, v, lo, hi);
  };
  in_range("port", o.port, 0, 65535);
  in_range("max_in_flight", o.max_in_flight, 1, 1 << 20);
  in_range("max_prompt_tokens", o.max_prompt_tokens, 1, 1 << 24);
  in_range("max_new_tokens", o.max_new_tokens, 1, 1 << 24);
  in_range("max_n", o.max_n, 1, 1 << 16);
  in_range("max_stop", o.max_stop, 0, 1 << 10);
  in_range("max_message_bytes", o.max_message_bytes, 1024, (1ll << 31) - 1);
  in_range("max_connections", o.max_connections, 1, 1 << 16);
  in_range("idle_timeout_ms", o.idle_timeout_ms, 1, (1ll << 31) - 1);
  in_range("log_interval_s", o.log_interval_s, 1, 1 << 24);
  TANDEM_CHECK(o.weight_update_timeout_s > 0 && o.weight_update_timeout_s <= 86400,
               "rollout server: weight_update_timeout_s is {}, expected above 0 and at most 86400",
               o.weight_update_timeout_s);
  TANDEM_CHECK(!o.host.empty(), "rollout server: the host is empty; use 127.0.0.1");
  TANDEM_CHECK(is_loopback_host(o.host) || !o.token.empty(),
               "rollout server: host '{}' is not a loopback address, and no token is set: a "
               "worker reachable from other machines requires a token (set server.token_env to "
               "an environment variable holding it), or bind 127.0.0.1",
               o.host);
}

struct RolloutServer::Impl {
  // One generate call, from its admission to its answer.
  struct Call {
    Request request;        // request.id: unique in the engine ("<serial>:<client id>")
    std::string client_id;  // what the client named it
    uint64_t min_version = 0;
    std::promise<void> done;
    RequestOutput out;
    bool stale = false;  // refused: the weights are older than min_version
    uint64_t version = 0;
    std::string engine_error;  // the engine thread failed (Internal)
  };

  ServerOptions options;
  model::PromptFormat format;
  std::string model_path;
  std::unique_ptr<model::Tokenizer> tokenizer;
  std::vector<int32_t> eos_ids;
  int64_t vocab_size = 0;
  std::shared_ptr<model::Weights> weights;  // the engine's; replaced by commit_weight_update
  // A commit without partial rollouts: the weights the started samples finish under, kept until
  // the engine's pending swap (Engine::Swap::after_started) happened.
  std::shared_ptr<model::Weights> old_weights;
  DType dtype = DType::f32;        // of the weights, for the checkpoints to load
  std::unique_ptr<Engine> engine;  // touched by the engine thread only, once started

  // The engine thread's inbox.
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::function<void()>> tasks;
  bool stopping = false;
  std::thread engine_thread;

  // Engine-thread state.
  std::unordered_map<std::string, std::shared_ptr<Call>> calls;  // by engine id
  bool user_paused = false, updating = false;
  int64_t update_version = 0;           // of the update begun (updating)
  Clock::time_point update_deadline{};  // when that update is ended if no commit came
  uint64_t serial = 0;

  // Published by the engine thread for any thread to read.
  std::atomic<uint64_t> version{0};
  std::atomic<int64_t> waiting{0}, running{0}, free_blocks{0}, total_blocks{0};
  std::atomic<double> tokens_per_s{0};
  std::atomic<bool> paused{false};

  // Counted by the RPC threads.
  std::atomic<int64_t> in_flight{0}, accepted{0}, generated{0}, overloaded{0}, refused{0};
  std::atomic<int64_t> active_calls{0};
  std::atomic<bool> draining{false};

  // Weight updates that ended without new weights, and why the last one did (stats()).
  std::atomic<int64_t> updates_abandoned{0};
  std::mutex update_error_mutex;
  std::string last_update_error;

  // Weights over the wire (begin_weight_push .. commit_weight_push, and the data channel):
  // received into a staging copy while the engine generates on; the commit swaps it in on the
  // engine thread between two steps.
  std::unique_ptr<WeightReceiver> receiver;

  std::shared_ptr<at::transport::TServerSocket> socket;
  std::shared_ptr<at::server::TThreadedServer> server;
  std::thread serve_thread;

  // Queues a task for the engine thread; false when it has stopped (the task is dropped).
  bool post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex);
      if (stopping) return false;
      tasks.push_back(std::move(task));
    }
    wake.notify_one();
    return true;
  }

  // Runs `fn` on the engine thread and returns its result (or rethrows what it threw).
  template <typename Fn>
  auto on_engine(Fn fn) -> decltype(fn()) {
    using R = decltype(fn());
    auto promise = std::make_shared<std::promise<R>>();
    std::future<R> result = promise->get_future();
    const bool posted = post([promise, fn = std::move(fn)]() mutable {
      try {
        if constexpr (std::is_void_v<R>) {
          fn();
          promise->set_value();
        } else {
          promise->set_value(fn());
        }
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
    if (!posted) internal("the worker is stopping");
    return result.get();
  }

  // --- the engine thread ---------------------------------------------------------------------

  void submit(const std::shared_ptr<Call>& call) {
    // A swap pending (a commit without partial rollouts): the engine starts the call on the
    // committed weights once the started samples are done.
    const uint64_t have = engine->committed_version();
    if (call->min_version > have) {
      call->stale = true;
      call->version = have;
      call->done.set_value();
      return;
    }
    call->request.id = fmt::format("{}:{}", serial++, call->client_id);
    calls.emplace(call->request.id, call);
    engine->submit(call->request);
  }

  void deliver(std::vector<RequestOutput> outs) {
    for (RequestOutput& o : outs) {
      auto it = calls.find(o.id);
      if (it == calls.end()) continue;
      std::shared_ptr<Call> call = std::move(it->second);
      calls.erase(it);
      call->out = std::move(o);
      call->done.set_value();
    }
  }

  int abort_calls(const std::string& client_id) {
    std::vector<std::string> ids;
    for (const auto& [id, call] : calls)
      if (client_id.empty() || call->client_id == client_id) ids.push_back(id);
    int n = 0;
    for (const std::string& id : ids) n += engine->abort(id) ? 1 : 0;
    return n;
  }

  // A failed step leaves the engine in an unknown state: every call in flight is answered with
  // Internal and the requests are ended.
  void fail_all(const std::string& why) {
    for (auto& [id, call] : calls) {
      engine->abort(id);
      call->engine_error = why;
      call->done.set_value();
    }
    calls.clear();
    engine->poll();
  }

  // Ends weight update `version` without new weights (begun or not): generation goes on under
  // the weights the worker has. Said in stats() and the log.
  void abandon_update(int64_t version, const std::string& why) {
    updating = false;
    note_abandoned(version, why);
    publish();
  }

  // Counts an update to `version` that ended without new weights, and logs why (any thread).
  void note_abandoned(int64_t to, const std::string& why) {
    ++updates_abandoned;
    {
      std::lock_guard lock(update_error_mutex);
      last_update_error = fmt::format("weight update to v{}: {}", to, why);
    }
    spdlog::warn("rollout server '{}': weight update to v{} abandoned: {}; serving v{}",
                 options.name, to, why, version.load());
  }

  void publish() {
    if (old_weights && !engine->swap_pending()) old_weights.reset();
    // The committed version, which requests asking for it wait for while a swap is pending.
    version = engine->committed_version();
    waiting = engine->num_waiting();
    running = engine->num_running();
    free_blocks = engine->blocks().num_free_blocks();
    total_blocks = engine->blocks().num_blocks();
    paused = user_paused || updating;
  }

  void engine_loop() {
    const Clock::time_point start = Clock::now();
    Clock::time_point rate_mark = start, log_mark = start;
    int64_t rate_tokens = 0, log_tokens = 0, log_generated = 0;
    auto tokens_done = [&] {
      const EngineStats& s = engine->stats();
      return s.prefill_tokens + s.decode_tokens;
    };
    publish();
    for (;;) {
      std::deque<std::function<void()>> pending;
      {
        std::unique_lock lock(mutex);
        // An update begun is ended at its deadline, not up to a second later.
        const Clock::duration wait =
            updating ? std::clamp<Clock::duration>(update_deadline - Clock::now(),
                                                   Clock::duration::zero(), std::chrono::seconds(1))
                     : Clock::duration(std::chrono::seconds(1));
        wake.wait_for(lock, wait, [&] {
          return stopping || !tasks.empty() || (!(user_paused || updating) && engine->has_work());
        });
        if (stopping) break;
        pending.swap(tasks);
      }
      for (auto& task : pending) task();
      receiver->expire();
      if (updating && Clock::now() >= update_deadline)
        abandon_update(update_version,
                       fmt::format("no commit_weight_update within {} s of begin_weight_update "
                                   "(limits.weight_update_timeout_s)",
                                   options.weight_update_timeout_s));
      try {
        if (!(user_paused || updating) && engine->has_work()) engine->step();
        deliver(engine->poll());
      } catch (const std::exception& e) {
        spdlog::error("rollout server '{}': the engine failed: {}", options.name, e.what());
        fail_all(fmt::format("the engine failed: {}", e.what()));
      }
      publish();

      const Clock::time_point now = Clock::now();
      const double since_rate = std::chrono::duration<double>(now - rate_mark).count();
      if (since_rate >= 2.0) {
        const int64_t t = tokens_done();
        tokens_per_s = static_cast<double>(t - rate_tokens) / since_rate;
        rate_tokens = t;
        rate_mark = now;
      }
      const double since_log = std::chrono::duration<double>(now - log_mark).count();
      if (since_log >= static_cast<double>(options.log_interval_s)) {
        const int64_t t = tokens_done(), g = generated.load();
        if (t > log_tokens || g > log_generated)
          spdlog::info(
              "rollout server '{}': {:.0f} tokens/s over {:.0f} s, {} calls answered, {} in "
              "flight, {} waiting, {} running, {} of {} KV blocks free, {} overloaded, weights "
              "v{}",
              options.name, static_cast<double>(t - log_tokens) / since_log, since_log,
              g - log_generated, in_flight.load(), waiting.load(), running.load(),
              free_blocks.load(), total_blocks.load(), overloaded.load(), version.load());
        log_tokens = t;
        log_generated = g;
        log_mark = now;
      }
    }
    // Stopped: the tasks queued before run (their callers wait for them), then whoever still
    // waits is answered with what it has (aborted).
    std::deque<std::function<void()>> left;
    {
      std::lock_guard lock(mutex);
      left.swap(tasks);
    }
    for (auto& task : left) task();
    for (auto& [id, call] : calls) engine->abort(id);
    deliver(engine->poll());
    for (auto& [id, call] : calls) {
      call->engine_error = "the worker stopped";
      call->done.set_value();
    }
    calls.clear();
  }
};

namespace {

using Impl = RolloutServer::Impl;

class RolloutHandler : public rpc::RolloutServiceIf {
 public:
  explicit RolloutHandler(Impl& m) : m_(m) {}

  // Every failure reaches the client as a typed exception: what is not one already is Internal.
  void generate(rpc::GenerateResponse& out, const rpc::GenerateRequest& request) override {
    try {
      answer(out, request);
    } catch (const apache::thrift::TException&) {
      throw;
    } catch (const std::exception& e) {
      spdlog::error("rollout server '{}': request '{}': {}", m_.options.name, request.request_id,
                    e.what());
      internal(fmt::format("request '{}': {}", request.request_id, e.what()));
    }
  }

  void answer(rpc::GenerateResponse& out, const rpc::GenerateRequest& request) {
    authorize(request.token);
    if (m_.draining) {
      ++m_.overloaded;
      rpc::Overloaded e;
      e.message = "the worker is shutting down; send the request to another worker";
      throw e;
    }
    auto call = std::make_shared<Impl::Call>();
    render(*call, request);
    if (request.min_weight_version < 0)
      invalid(fmt::format("min_weight_version is {}, expected >= 0", request.min_weight_version));
    call->min_version = static_cast<uint64_t>(request.min_weight_version);
    if (call->min_version > m_.version) stale(m_.version, call->min_version);
    // Admitted calls wait for the engine; past the bound the client is told to come back later
    // (or go to another worker) rather than join an ever longer queue.
    if (m_.in_flight.fetch_add(1) >= m_.options.max_in_flight) {
      --m_.in_flight;
      ++m_.overloaded;
      rpc::Overloaded e;
      e.message = fmt::format("busy: already {} generate calls in flight (max_in_flight)",
                              m_.options.max_in_flight);
      throw e;
    }
    struct Leave {
      std::atomic<int64_t>& count;
      ~Leave() { --count; }
    } leave{m_.in_flight};
    ++m_.accepted;
    std::future<void> done = call->done.get_future();
    if (!m_.post([&m = m_, call] { m.submit(call); })) internal("the worker is stopping");
    done.wait();

    if (call->stale) stale(call->version, call->min_version);
    if (!call->engine_error.empty()) internal(call->engine_error);
    RequestOutput& o = call->out;
    if (o.status == RequestStatus::error) {
      // The engine's message names its own id; the client knows its request by its own.
      const std::string why = o.error.substr(std::min(o.error.find(": "), o.error.size()) + 2);
      if (o.refusal == Refusal::queue_full) {
        ++m_.overloaded;
        rpc::Overloaded e;
        e.message = fmt::format("busy: {}", why);
        throw e;
      }
      if (o.refusal == Refusal::invalid)
        invalid(fmt::format("request '{}': {}", call->client_id, why));
      internal(fmt::format("request '{}': {}", call->client_id, why));
    }
    out.request_id = call->client_id;
    out.prompt_tokens = std::move(o.prompt);
    // Thrift strings are UTF-8 (a Python client decodes them as such); a completion cut inside a
    // character is not.
    out.prompt_text = to_valid_utf8(prompt_text_);
    out.aborted = o.status == RequestStatus::aborted;
    out.cached_prompt_tokens = o.num_cached_prompt_tokens;
    out.samples.resize(o.samples.size());
    for (size_t i = 0; i < o.samples.size(); ++i) {
      SampleOutput& s = o.samples[i];
      rpc::Sample& r = out.samples[i];
      r.tokens = std::move(s.tokens);
      r.text = to_valid_utf8(s.text);
      r.logprobs.assign(s.logprobs.begin(), s.logprobs.end());
      r.finish_reason = to_rpc(s.finish_reason);
      r.stop_string = to_valid_utf8(s.stop_string);
      r.weight_version = static_cast<int64_t>(s.weight_version);
      r.first_weight_version = static_cast<int64_t>(s.first_weight_version);
      r.token_versions.assign(s.token_versions.begin(), s.token_versions.end());
    }
    ++m_.generated;
  }

  int32_t abort(const rpc::AbortRequest& request) override {
    authorize(request.token);
    return m_.on_engine([&m = m_, id = request.request_id] { return m.abort_calls(id); });
  }

  void pause(const std::string& token) override {
    authorize(token);
    m_.on_engine([&m = m_] {
      m.user_paused = true;
      m.publish();
    });
  }

  void resume(const std::string& token) override {
    authorize(token);
    m_.on_engine([&m = m_] {
      m.user_paused = false;
      if (m.updating) m.abandon_update(m.update_version, "resume() ended it before a commit");
      m.publish();
    });
  }

  void begin_weight_update(const rpc::WeightUpdate& update) override {
    authorize(update.token);
    m_.on_engine([&m = m_, version = update.version] {
      m.updating = true;
      m.update_version = version;
      m.update_deadline =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(m.options.weight_update_timeout_s));
      m.publish();
    });
    spdlog::info(
        "rollout server '{}': weight update to v{} begun; generation paused until its commit, "
        "for at most {} s",
        m_.options.name, update.version, m_.options.weight_update_timeout_s);
  }

  // A commit that fails ends the update: the worker serves the weights it has.
  int64_t commit_weight_update(const rpc::WeightUpdate& update) override {
    authorize(update.token);
    try {
      return commit(update);
    } catch (const rpc::InvalidRequest& e) {
      try {
        m_.on_engine([&m = m_, &update, &e] { m.abandon_update(update.version, e.message); });
      } catch (const rpc::Internal&) {  // the worker is stopping: nothing left to resume
      }
      throw;
    }
  }

  int64_t commit(const rpc::WeightUpdate& update) {
    // The commit came: the update's bound stops running (loading takes what it takes).
    m_.on_engine([&m = m_] {
      if (m.updating) m.update_deadline = Clock::time_point::max();
    });
    if (update.version <= static_cast<int64_t>(m_.version.load()))
      invalid(fmt::format("weight version {} is not newer than the worker's {}", update.version,
                          m_.version.load()));
    if (update.checkpoint_path.empty())
      invalid("checkpoint_path is empty: a CPU worker loads the new weights from a checkpoint");
    // The checkpoint is read here, off the engine thread, which generates meanwhile unless
    // begin_weight_update paused it.
    std::shared_ptr<model::Weights> next;
    try {
      next = std::move(model::load_model(update.checkpoint_path, m_.dtype).weights);
    } catch (const std::exception& e) {
      invalid(fmt::format("cannot load '{}': {}", update.checkpoint_path, e.what()));
    }
    const auto version = static_cast<uint64_t>(update.version);
    try {
      m_.on_engine([&m = m_, &next, version] {
        TANDEM_CHECK(version > m.engine->committed_version(),
                     "weight version {} is not newer than the worker's {}", version,
                     m.engine->committed_version());
        m.engine->set_weights(*next, version);
        std::swap(m.weights, next);  // the old weights go once the engine no longer reads them
        m.updating = false;
        m.publish();
      });
    } catch (const std::exception& e) {
      invalid(fmt::format("cannot take the weights of '{}': {}", update.checkpoint_path, e.what()));
    }
    spdlog::info("rollout server '{}': weights v{} from {}", m_.options.name, version,
                 update.checkpoint_path);
    return update.version;
  }

  // --- weights over the wire ----------------------------------------------------------------

  void begin_weight_push(rpc::WeightPushReady& out, const rpc::WeightPushBegin& begin) override {
    out = m_.receiver->begin(begin);
  }

  void push_weight_bucket(const rpc::WeightBucket& b) override {
    m_.receiver->take(
        {b.version, b.index, static_cast<int32_t>(b.dtype), b.pieces, b.data, b.xxh3, b.token});
  }

  int64_t commit_weight_push(const rpc::WeightPushCommit& c) override {
    int64_t bytes = 0;
    std::shared_ptr<model::Weights> next = m_.receiver->complete(c, bytes);
    if (!next) return c.version;  // sent again: in use already
    const auto version = static_cast<uint64_t>(c.version);
    const bool partial = c.partial;
    std::string refused;
    m_.on_engine([&m = m_, &next, &refused, version, partial] {
      const uint64_t have = m.engine->committed_version();
      if (version <= have) {
        refused = fmt::format("weight version {} is not newer than the worker's {}", version, have);
        return;
      }
      m.engine->set_weights(*next, version,
                            partial ? Engine::Swap::partial : Engine::Swap::after_started);
      std::swap(m.weights, next);  // the old weights go once the engine no longer reads them
      // Started samples finish under the weights in use (else next was pending, unused).
      if (m.engine->swap_pending() && !m.old_weights) m.old_weights = std::move(next);
      m.publish();
    });
    m_.receiver->keep_spare(std::move(next));
    if (!refused.empty()) {
      rpc::WeightPushRefused e;
      e.message = refused;
      e.fault = rpc::WeightPushFault::VERSION;
      e.worker_version = static_cast<int64_t>(m_.version.load());
      throw e;
    }
    spdlog::info("rollout server '{}': weights v{} over the wire ({} bytes)", m_.options.name,
                 version, bytes);
    return c.version;
  }

  int64_t weight_version(const std::string& token) override {
    authorize(token);
    return static_cast<int64_t>(m_.version.load());
  }

  bool health(const std::string& token) override {
    authorize(token);
    if (m_.paused || m_.draining) return false;
    auto call = std::make_shared<Impl::Call>();
    call->client_id = "health";
    call->request.prompt = {m_.tokenizer->bos_id() >= 0 ? m_.tokenizer->bos_id() : 0};
    call->request.params.temperature = 0.0f;
    call->request.params.max_tokens = 1;
    std::future<void> done = call->done.get_future();
    if (!m_.post([&m = m_, call] { m.submit(call); })) return false;
    if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) return false;
    return call->engine_error.empty() && call->out.status == RequestStatus::done &&
           call->out.samples.size() == 1 && call->out.samples[0].tokens.size() == 1;
  }

  void stats(rpc::Stats& out, const std::string& token) override {
    authorize(token);
    out.queue_depth = m_.waiting;
    out.running_sequences = m_.running;
    out.free_kv_blocks = m_.free_blocks;
    out.total_kv_blocks = m_.total_blocks;
    out.tokens_per_s = m_.tokens_per_s;
    out.in_flight = m_.in_flight;
    out.generated = m_.generated;
    out.overloaded = m_.overloaded;
    out.weight_version = static_cast<int64_t>(m_.version.load());
    out.paused = m_.paused;
    out.__set_weight_updates_abandoned(m_.updates_abandoned);
    std::lock_guard lock(m_.update_error_mutex);
    out.__set_last_weight_update_error(m_.last_update_error);
  }

  void info(rpc::ServerInfo& out, const std::string& token) override {
    authorize(token);
    const ServerOptions& o = m_.options;
    out.name = o.name;
    out.version = version_string();
    out.protocol_version = rpc::g_rollout_constants.PROTOCOL_VERSION;
    out.model = m_.model_path;
    out.tp_size = 1;
    out.vocab_size = static_cast<int32_t>(m_.vocab_size);
    out.eos_token_ids = m_.eos_ids;
    out.max_in_flight = static_cast<int32_t>(o.max_in_flight);
    out.max_prompt_tokens = static_cast<int32_t>(o.max_prompt_tokens);
    out.max_new_tokens = static_cast<int32_t>(o.max_new_tokens);
    out.max_n = static_cast<int32_t>(o.max_n);
    out.max_message_bytes = o.max_message_bytes;
  }

 private:
  void authorize(const std::string& token) const { rollout::authorize(token, m_.options.token); }

  [[noreturn]] static void stale(uint64_t have, uint64_t want) {
    rpc::StaleWeights e;
    e.message = fmt::format(
        "the worker's weights are version {}, the request wants at least {}; retry after the "
        "worker's next weight update, or on another worker",
        have, want);
    e.have_version = static_cast<int64_t>(have);
    e.want_version = static_cast<int64_t>(want);
    throw e;
  }

  // The request's prompt and sampling parameters into call.request, within the bounds.
  void render(Impl::Call& call, const rpc::GenerateRequest& r) {
    const ServerOptions& o = m_.options;
    call.client_id = r.request_id;
    const int forms = !r.prompt_tokens.empty() + !r.prompt_text.empty() + !r.messages.empty();
    if (forms != 1)
      invalid(fmt::format(
          "request '{}': give the prompt as exactly one of prompt_tokens, prompt_text and "
          "messages ({} given)",
          r.request_id, forms));
    const rpc::SamplingParams& p = r.params;
    if (p.n < 1 || p.n > o.max_n)
      invalid(
          fmt::format("request '{}': n is {}, expected 1..{} (max_n)", r.request_id, p.n, o.max_n));
    if (p.max_tokens < 1 || p.max_tokens > o.max_new_tokens)
      invalid(fmt::format("request '{}': max_tokens is {}, expected 1..{} (max_new_tokens)",
                          r.request_id, p.max_tokens, o.max_new_tokens));
    if (static_cast<int64_t>(p.stop.size()) > o.max_stop ||
        static_cast<int64_t>(p.stop_token_ids.size()) > o.max_stop)
      invalid(fmt::format("request '{}': {} stop strings and {} stop ids, at most {} each",
                          r.request_id, p.stop.size(), p.stop_token_ids.size(), o.max_stop));
    for (const std::string& s : p.stop)
      if (s.size() > 1024)
        invalid(fmt::format("request '{}': a stop string of {} bytes, at most 1024", r.request_id,
                            s.size()));
    // Text longer than this many bytes per allowed token cannot fit; refused before tokenizing.
    const int64_t max_text_bytes = o.max_prompt_tokens * 64;
    std::vector<int32_t> tokens;
    prompt_text_.clear();
    if (!r.prompt_tokens.empty()) {
      tokens = r.prompt_tokens;
    } else {
      int64_t bytes = static_cast<int64_t>(r.prompt_text.size());
      std::vector<model::ChatMessage> messages;
      for (const rpc::Message& msg : r.messages) {
        bytes += static_cast<int64_t>(msg.role.size() + msg.content.size());
        messages.push_back({msg.role, msg.content});
      }
      if (bytes > max_text_bytes)
        invalid(
            fmt::format("request '{}': the prompt has {} bytes, more than max_prompt_tokens "
                        "({}) can hold",
                        r.request_id, bytes, o.max_prompt_tokens));
      model::PromptFormat format = m_.format;
      if (!r.prompt_text.empty()) {
        format.chat = false;
        format.system_prompt.clear();
      }
      model::RenderedPrompt rendered;
      try {
        rendered = model::render_prompt(*m_.tokenizer, r.prompt_text, messages, format);
      } catch (const std::exception& e) {
        invalid(fmt::format("request '{}': cannot render the prompt: {}", r.request_id, e.what()));
      }
      tokens = std::move(rendered.tokens);
      prompt_text_ = std::move(rendered.text);
    }
    if (static_cast<int64_t>(tokens.size()) > o.max_prompt_tokens)
      invalid(fmt::format("request '{}': the prompt has {} tokens, at most {} (max_prompt_tokens)",
                          r.request_id, tokens.size(), o.max_prompt_tokens));
    SamplingParams& s = call.request.params;
    s.n = p.n;
    s.temperature = static_cast<float>(p.temperature);
    s.top_p = static_cast<float>(p.top_p);
    s.min_p = static_cast<float>(p.min_p);
    s.top_k = p.top_k;
    s.max_tokens = p.max_tokens;
    s.stop_token_ids = p.stop_token_ids;
    if (p.stop_at_eos)
      for (int32_t id : m_.eos_ids)
        if (std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), id) ==
            s.stop_token_ids.end())
          s.stop_token_ids.push_back(id);
    s.stop = p.stop;
    s.seed = static_cast<uint64_t>(p.seed);
    s.logprobs = p.logprobs;
    call.request.prompt = std::move(tokens);
  }

  Impl& m_;
  std::string prompt_text_;  // the rendered prompt of the call in progress on this connection
};

// The generated processor, but a weight bucket is read by read_bucket below: its data is taken
// where the framed transport read it (the connection's frame buffer, kept until the next
// message) instead of copied into a string of its own, a fresh allocation of many MiB per bucket
// whose page faults cost more than the copy.
class Processor : public rpc::RolloutServiceProcessor {
 public:
  Processor(std::shared_ptr<RolloutHandler> handler, Impl& m)
      : RolloutServiceProcessor(std::move(handler)), m_(m) {}

 protected:
  bool dispatchCall(at::protocol::TProtocol* in, at::protocol::TProtocol* out,
                    const std::string& name, int32_t seqid, void* call_context) override {
    if (name != "push_weight_bucket")
      return RolloutServiceProcessor::dispatchCall(in, out, name, seqid, call_context);
    const char* const what = "RolloutService.push_weight_bucket";
    void* ctx = eventHandler_ ? eventHandler_->getContext(what, call_context) : nullptr;
    at::TProcessorContextFreer freer(eventHandler_.get(), ctx, what);
    read_args(in);
    in->readMessageEnd();
    in->getTransport()->readEnd();
    auto answer = [&](at::protocol::TMessageType type, const auto& body) {
      out->writeMessageBegin("push_weight_bucket", type, seqid);
      body.write(out);
      out->writeMessageEnd();
      out->getTransport()->writeEnd();
      out->getTransport()->flush();
    };
    rpc::RolloutService_push_weight_bucket_result result;
    try {
      m_.receiver->take({version_, index_, dtype_, pieces_, data_, xxh3_, token_});
    } catch (rpc::WeightPushRefused& e) {
      result.refused = std::move(e);
      result.__isset.refused = true;
    } catch (rpc::Unauthorized& e) {
      result.unauthorized = std::move(e);
      result.__isset.unauthorized = true;
    } catch (const std::exception& e) {
      answer(at::protocol::T_EXCEPTION, at::TApplicationException(e.what()));
      return true;
    }
    answer(at::protocol::T_REPLY, result);
    return true;
  }

 private:
  // Reads a struct, handing each field to read(id, type), which returns false for one it does not
  // take (skipped, as generated code skips unknown fields).
  template <class Read>
  static void read_struct(at::protocol::TProtocol* in, Read&& read) {
    std::string name;
    at::protocol::TType type;
    int16_t id = 0;
    in->readStructBegin(name);
    for (;;) {
      in->readFieldBegin(name, type, id);
      if (type == at::protocol::T_STOP) break;
      if (!read(id, type)) in->skip(type);
      in->readFieldEnd();
    }
    in->readStructEnd();
  }

  // The call's arguments: a struct whose field 1 is the bucket.
  void read_args(at::protocol::TProtocol* in) {
    version_ = xxh3_ = 0;
    index_ = dtype_ = 0;
    pieces_.clear();
    data_ = {};
    token_.clear();
    read_struct(in, [&](int16_t id, at::protocol::TType type) {
      if (id != 1 || type != at::protocol::T_STRUCT) return false;
      read_struct(in,
                  [&](int16_t field, at::protocol::TType t) { return read_bucket(in, field, t); });
      return true;
    });
  }

  // A field of rpc::WeightBucket, as its generated read takes it, but `data` borrowed from the
  // frame (its size checked against the frame by the transport: borrow fails unless the frame
  // holds all of it).
  bool read_bucket(at::protocol::TProtocol* in, int16_t id, at::protocol::TType type) {
    namespace tp = at::protocol;
    if (id == 1 && type == tp::T_I64) {
      in->readI64(version_);
    } else if (id == 2 && type == tp::T_I32) {
      in->readI32(index_);
    } else if (id == 3 && type == tp::T_I32) {
      in->readI32(dtype_);
    } else if (id == 4 && type == tp::T_LIST) {
      tp::TType element;
      uint32_t size = 0;
      in->readListBegin(element, size);  // bounded by the protocol's limits
      if (element != tp::T_STRUCT)
        throw tp::TProtocolException(tp::TProtocolException::INVALID_DATA,
                                     "weight bucket: pieces of another type");
      pieces_.resize(size);
      for (rpc::WeightPiece& p : pieces_) p.read(in);
      in->readListEnd();
    } else if (id == 5 && type == tp::T_STRING) {
      int32_t size = 0;
      in->readI32(size);
      uint32_t len = static_cast<uint32_t>(size);
      const uint8_t* at = size < 0 ? nullptr : in->getTransport()->borrow(nullptr, &len);
      if (at == nullptr)
        throw tp::TProtocolException(
            tp::TProtocolException::SIZE_LIMIT,
            fmt::format("weight bucket: data of {} bytes, more than its frame holds", size));
      data_ = {reinterpret_cast<const char*>(at), static_cast<size_t>(size)};
      in->getTransport()->consume(static_cast<uint32_t>(size));
    } else if (id == 7 && type == tp::T_STRING) {
      in->readString(token_);
    } else if (id == 8 && type == tp::T_I64) {
      in->readI64(xxh3_);
    } else {
      return false;
    }
    return true;
  }

  Impl& m_;
  // The bucket being read: its data in the connection's frame, the rest kept between calls.
  int64_t version_ = 0, xxh3_ = 0;
  int32_t index_ = 0, dtype_ = 0;
  std::vector<rpc::WeightPiece> pieces_;
  std::string_view data_;
  std::string token_;
};

// One handler (and processor) per connection, so a connection's per-call state needs no lock.
class ProcessorFactory : public at::TProcessorFactory {
 public:
  explicit ProcessorFactory(Impl& m) : m_(m) {}
  std::shared_ptr<at::TProcessor> getProcessor(const at::TConnectionInfo&) override {
    return std::make_shared<Processor>(std::make_shared<RolloutHandler>(m_), m_);
  }

 private:
  Impl& m_;
};

}  // namespace

RolloutServer::RolloutServer(model::LoadedModel model, model::PromptFormat format,
                             EngineOptions engine, ServerOptions options)
    : impl_(std::make_unique<Impl>()) {
  route_thrift_output_to_log();
  check_server_options(options);
  TANDEM_CHECK(model.weights != nullptr, "rollout server: no model to serve");
  TANDEM_CHECK(model.tokenizer != nullptr,
               "rollout server: the model '{}' has no tokenizer (tokenizer.json); a worker needs "
               "one for text prompts, chat messages and completion text",
               model.path);
  Impl& m = *impl_;
  m.options = std::move(options);
  m.format = std::move(format);
  m.model_path = model.path;
  m.eos_ids = model.stop_ids();
  m.vocab_size = model.config().vocab_size;
  m.tokenizer = std::move(model.tokenizer);
  m.weights = std::move(model.weights);
  m.dtype = m.weights->dtype();
  m.receiver = std::make_unique<WeightReceiver>(
      *m.weights,
      WeightReceiver::Options{.name = m.options.name,
                              .host = m.options.host,
                              .token = m.options.token,
                              .max_bucket_bytes = max_bucket_bytes(m.options),
                              .max_connections = m.options.max_connections,
                              .idle_timeout_ms = m.options.idle_timeout_ms,
                              .update_timeout_s = m.options.weight_update_timeout_s},
      m.version, [&m](int64_t to, const std::string& why) { m.note_abandoned(to, why); });
  // Admitted calls never overflow the engine's queue: at most max_in_flight requests wait.
  engine.max_waiting = std::max(engine.max_waiting, m.options.max_in_flight + 1);
  m.engine = std::make_unique<Engine>(*m.weights, engine, m.tokenizer.get());

  const ThriftLimits limits{.max_message_bytes = static_cast<int32_t>(m.options.max_message_bytes),
                            .max_string_bytes = static_cast<int32_t>(m.options.max_message_bytes),
                            .max_container_elements = static_cast<int32_t>(
                                std::max<int64_t>(1 << 16, m.options.max_prompt_tokens)),
                            .max_depth = 16};
  check_thrift_limits(limits, fmt::format("rollout server '{}'", m.options.name));
  m.engine_thread = std::thread([&m] { m.engine_loop(); });

  m.socket = std::make_shared<at::transport::TServerSocket>(m.options.host, m.options.port);
  m.socket->setRecvTimeout(static_cast<int>(m.options.idle_timeout_ms));
  m.socket->setSendTimeout(static_cast<int>(m.options.idle_timeout_ms));
  auto processor = std::make_shared<ProcessorFactory>(m);
  // The factory's processors count the calls they process, for drain().
  class CountingFactory : public at::TProcessorFactory {
   public:
    CountingFactory(std::shared_ptr<at::TProcessorFactory> inner, Impl& m) : inner_(inner), m_(m) {}
    std::shared_ptr<at::TProcessor> getProcessor(const at::TConnectionInfo& info) override {
      std::shared_ptr<at::TProcessor> p = inner_->getProcessor(info);
      p->setEventHandler(std::make_shared<ActiveCalls>(m_.active_calls));
      return report_refused_requests(p, [&m = m_](const std::string& peer, const std::string& why) {
        // A flood of bad connections must not flood the log: the first ten, then every 1000th.
        const int64_t n = ++m.refused;
        if (n <= 10 || n % 1000 == 0)
          spdlog::warn("rollout server '{}': closed the connection of {}: {} ({} so far)",
                       m.options.name, peer, why, n);
      });
    }

   private:
    std::shared_ptr<at::TProcessorFactory> inner_;
    Impl& m_;
  };
  m.server = std::make_shared<at::server::TThreadedServer>(
      std::make_shared<CountingFactory>(processor, m), m.socket,
      bounded_framed_transport_factory(limits), bounded_binary_protocol_factory(limits));
  m.server->setConcurrentClientLimit(m.options.max_connections);
  try {
    m.serve_thread =
        serve_when_listening(m.server, fmt::format("rollout server '{}'", m.options.name));
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(m.mutex);
      m.stopping = true;
    }
    m.wake.notify_one();
    m.engine_thread.join();
    TANDEM_FAIL("rollout server: cannot listen on {}:{}: {}", m.options.host, m.options.port,
                e.what());
  }
}

RolloutServer::~RolloutServer() { stop(); }

int RolloutServer::port() const { return impl_->socket->getPort(); }

RolloutServer::Stats RolloutServer::stats() const {
  const Impl& m = *impl_;
  return {m.accepted.load(), m.generated.load(), m.overloaded.load(),
          m.refused.load(),  m.in_flight.load(), m.updates_abandoned.load()};
}

void RolloutServer::drain() {
  Impl& m = *impl_;
  if (!m.serve_thread.joinable()) return;
  m.draining = true;
  m.post([&m] {
    m.user_paused = false;
    m.updating = false;
  });
  // Every admitted call is answered, and every answer written, before the connections close.
  while (m.in_flight.load() > 0 || m.active_calls.load() > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  stop();
}

void RolloutServer::stop() {
  if (!impl_) return;
  Impl& m = *impl_;
  if (m.engine_thread.joinable()) {
    {
      std::lock_guard lock(m.mutex);
      m.stopping = true;
    }
    m.wake.notify_one();
    m.engine_thread.join();
  }
  if (m.serve_thread.joinable()) {
    m.server->stop();
    m.serve_thread.join();
  }
  if (m.receiver) m.receiver->stop();
}

}  // namespace tandem::rollout
