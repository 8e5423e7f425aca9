// A reward function served by another process over Thrift (rewards/reward.thrift): the client.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "rewards/reward.h"

namespace tandem::rewards {

// What the server says about itself (RewardService.info).
struct RemoteServerInfo {
  std::string name{};
  std::string version{};
  int32_t protocol_version = 0;
  int32_t max_batch_size = 0;  // 0: the server states no limit
};

class RemoteReward : public RewardFunction {
 public:
  struct Options {
    std::string address{};       // host:port of the server
    int64_t timeout_ms = 10000;  // send and receive timeout of one request
    int64_t connect_timeout_ms = 2000;
    int64_t retries = 2;       // further tries of a request after a transport error or Overloaded
    int64_t backoff_ms = 100;  // pause before the first retry; doubled each time, at most 5 s
    int64_t max_concurrency = 4;  // requests (connections) in flight at once
    int64_t batch_size = 64;      // samples per request at most; a bigger batch is split
    std::string token{};          // the shared token, when the server requires one
    // Ask the server for info() in the constructor, so a wrong address or an incompatible server
    // fails when the job starts rather than at its first step.
    bool check_on_start = true;
  };

  // Throws tandem::Error naming the reward and the option when an option is out of range, or
  // the reward, the address and the cause when check_on_start fails.
  RemoteReward(std::string name, Options options);
  ~RemoteReward() override;
  RemoteReward(const RemoteReward&) = delete;
  RemoteReward& operator=(const RemoteReward&) = delete;

  // Splits the batch into requests of at most batch_size samples and sends them over up to
  // max_concurrency connections at once. A sample the server could not judge comes back as
  // RewardResult::failure. Throws tandem::Error naming the reward and the address when a request
  // still fails after its retries, when the server refuses it (InvalidRequest, Unauthorized: not
  // retried), or when it answers with a number of scores other than the samples sent.
  std::vector<RewardResult> score(std::span<const RewardSample> samples) override;
  const std::string& name() const override { return name_; }

  RemoteServerInfo info();
  bool health();
  const Options& options() const { return options_; }

 private:
  struct Link;  // the connections to the server (rpc/thrift_client.h)
  // Runs `call` on a connection with the retry policy; `what` names the request in errors.
  template <typename Call>
  auto with_retries(const std::string& what, Call&& call);

  std::string name_;
  Options options_;
  std::unique_ptr<Link> link_;
  std::atomic<uint64_t> next_request_{0};
};

}  // namespace tandem::rewards
