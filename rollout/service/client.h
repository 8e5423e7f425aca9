// RolloutClient: a C++ client of a rollout worker (rollout/service/rollout.thrift) with a
// deadline per call, retries with backoff, and a pool of connections shared by threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "rollout/service/rpc/RolloutService.h"
#include "rpc/thrift_client.h"

namespace tandem::rollout {

struct ClientOptions {
  std::string address{};       // host:port of the worker
  int64_t timeout_ms = 60000;  // the deadline of one call, all its tries together
  int64_t connect_timeout_ms = 2000;
  int64_t retries = 2;       // further tries after a transport error or Overloaded
  int64_t backoff_ms = 100;  // pause before the first retry; doubled each time, at most 5 s
  std::string token{};       // put in every call
};

// Why a call failed, for callers that act on it (a pool sends overloaded and transport failures
// to another worker, waits on stale_weights, and gives up on the others).
enum class CallFailure {
  invalid,          // InvalidRequest: retrying will not help
  overloaded,       // Overloaded after every retry
  stale_weights,    // StaleWeights: the worker's weights are older than the request wants
  unauthorized,     // Unauthorized: the token is wrong or missing
  weights_refused,  // WeightPushRefused: the worker refused a push of weights (what is wrong)
  internal,         // Internal, or the worker's own Thrift exception
  transport,        // cannot connect, connection lost, or the deadline passed
  protocol,         // the peer does not speak framed binary RolloutService
};
const char* call_failure_name(CallFailure f);

// A failed call: what() names the worker, the call and the cause.
class CallError : public Error {
 public:
  CallError(CallFailure failure, const std::string& what) : Error(what), failure_(failure) {}
  CallFailure failure() const { return failure_; }

 private:
  CallFailure failure_;
};

class RolloutClient {
 public:
  // Checks the options (tandem::Error naming the option); connects lazily, at the first call.
  explicit RolloutClient(ClientOptions options);
  ~RolloutClient();
  RolloutClient(const RolloutClient&) = delete;
  RolloutClient& operator=(const RolloutClient&) = delete;

  // Every call throws CallError when it fails; each may be called from any thread.
  // The request's token is set from the options.
  rpc::GenerateResponse generate(rpc::GenerateRequest request);
  int32_t abort(const std::string& request_id = "");  // "": every request in flight
  void pause();
  void resume();
  void begin_weight_update(int64_t version);
  int64_t commit_weight_update(int64_t version, const std::string& checkpoint_path);
  // Weights over the wire: the control calls of a push (rollout/service/weight_push.h sends a
  // whole version, its buckets over the worker's data channel). A bucket is idempotent by its
  // index, so transport errors are retried like any call.
  rpc::WeightPushReady begin_weight_push(int64_t version);
  void push_weight_bucket(rpc::WeightBucket& bucket);  // sets bucket.token
  int64_t commit_weight_push(int64_t version, int32_t buckets, bool partial = true);
  int64_t weight_version();
  bool health();
  rpc::Stats stats();
  rpc::ServerInfo info();

  const ClientOptions& options() const { return options_; }

 private:
  template <typename Call>
  auto with_retries(const char* what, Call&& call);

  ClientOptions options_;
  ThriftClient<rpc::RolloutServiceClient> link_;  // connected, between calls
};

}  // namespace tandem::rollout
