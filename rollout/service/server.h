// RolloutServer: the rollout engine served over Thrift (rollout/service/rollout.thrift). One
// thread owns and steps the engine; RPC threads hand it requests and wait, so the requests of
// every client are batched together by the engine's continuous batching.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "model/loader.h"
#include "model/prompt.h"
#include "rollout/engine.h"

namespace tandem::rollout {

struct ServerOptions {
  std::string host = "127.0.0.1";  // any other address requires a token
  int port = 0;                    // 0: a free port (port() says which)
  std::string token{};             // when not empty, every call must carry it
  std::string name = "tandem";     // info().name and the log lines
  int64_t max_in_flight = 64;      // generate calls admitted at once; one more is Overloaded
  int64_t max_prompt_tokens = 2048;
  int64_t max_new_tokens = 2048;         // params.max_tokens at most
  int64_t max_n = 64;                    // params.n at most
  int64_t max_stop = 16;                 // stop strings and stop ids, each list at most
  int64_t max_message_bytes = 16 << 20;  // a bigger request frame closes the connection
  int64_t max_connections = 64;          // further clients wait to be accepted
  int64_t idle_timeout_ms = 600'000;     // a connection silent this long is closed
  int64_t log_interval_s = 60;           // one log line per interval that saw work
  // A weight update whose commit does not come within this many seconds of its begin is
  // abandoned: the worker serves the weights it has again.
  double weight_update_timeout_s = 300;
};

// An IPv4 address in 127.0.0.0/8, ::1 or "localhost".
bool is_loopback_host(const std::string& host);

// The most one weight bucket of a push over the wire may carry: its data and its pieces, each
// piece counted as its name's bytes + 32 (rollout.thrift, begin_weight_push). The rest of the
// frame of max_message_bytes is left to the call's other fields.
int64_t max_bucket_bytes(const ServerOptions& options);
constexpr int64_t kWeightPieceBytes = 32;  // a piece's wire bytes besides its name, at most

// Throws tandem::Error naming the option when one is out of range, or when a non-loopback
// host has no token.
void check_server_options(const ServerOptions& options);

// Every size read from the wire is checked before it is allocated (rpc/bounded_thrift.h): a
// malformed or oversize frame closes that connection only (stats().refused, and a warning), and
// the server serves the others on. Requests over a bound, with bad parameters or a wrong token
// are answered with InvalidRequest or Unauthorized; more than max_in_flight generate calls with
// Overloaded (never an unbounded queue); a request for a newer weight version than the worker's
// with StaleWeights; a failure of the engine with Internal. A weight update whose commit fails,
// or does not come within weight_update_timeout_s of its begin, or that resume() ends, leaves the
// worker generating under the weights it had (stats().weight_updates_abandoned, a warning).
class RolloutServer {
 public:
  struct Stats {
    int64_t accepted = 0;                  // generate calls admitted to the engine
    int64_t generated = 0;                 // generate calls answered with samples
    int64_t overloaded = 0;                // generate calls refused with Overloaded
    int64_t refused = 0;                   // connections closed for a malformed or oversize frame
    int64_t in_flight = 0;                 // generate calls admitted and not yet answered
    int64_t weight_updates_abandoned = 0;  // ended without new weights (failed, timed out)
  };

  // Loads nothing: serves `model` (its tokenizer is required) with prompts in `format`. Listens
  // when it returns; throws tandem::Error naming the address when it cannot bind.
  RolloutServer(model::LoadedModel model, model::PromptFormat format, EngineOptions engine,
                ServerOptions options);
  ~RolloutServer();  // stop()
  RolloutServer(const RolloutServer&) = delete;
  RolloutServer& operator=(const RolloutServer&) = delete;

  int port() const;
  Stats stats() const;
  // Refuses new generate calls (Overloaded: the worker is shutting down), waits until every
  // admitted call has been answered (generation goes on, resumed if it was paused), then stops.
  void drain();
  // Stops accepting, ends the requests in flight (abort) and the engine thread, closes the
  // connections.
  void stop();

  struct Impl;  // the engine thread, the Thrift server and their shared state (server.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::rollout
