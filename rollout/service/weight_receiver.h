// WeightReceiver: a rollout worker's side of weights over the wire: the push in progress, its
// staging copy of the weights, every bucket checked and checksummed into it (from a Thrift call's
// frame, or read from the data channel's socket straight into place), and the commit's handover.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "model/weights.h"
#include "rollout/service/rpc/RolloutService.h"

namespace tandem::rollout {

// Every call of a worker's (the Thrift calls, the data channel's hello): throws rpc::Unauthorized
// unless `expected` is empty or `given` is it (compared in a time that does not depend on where
// they first differ).
void authorize(const std::string& given, const std::string& expected);

// A weight bucket as a Thrift call carried it: its data where it was read (the call's frame).
struct BucketView {
  int64_t version = 0;
  int32_t index = 0;
  int32_t dtype = 0;  // rpc::WeightDType, as sent
  const std::vector<rpc::WeightPiece>& pieces;
  std::string_view data;
  int64_t xxh3 = 0;
  const std::string& token;
};

// Errors are typed for the client: rpc::WeightPushRefused (with its fault) and rpc::Unauthorized.
// A bucket's pieces are checked against the model, the push and the buckets taken or in flight
// before any byte is written; the data is checksummed a chunk at a time right after it lands
// (one pass); a bucket refused, or cut off mid-way, marks nothing received, so nothing it wrote
// counts until a good bucket rewrites it. The data channel (rollout/service/weight_channel.h)
// listens on the worker's host beside Thrift; its connections are bound to one push by their
// hello (the token and the push's version) and read with the worker's idle timeout.
class WeightReceiver {
 public:
  struct Options {
    std::string name;              // of the worker, for the log
    std::string host;              // the data channel's, as Thrift's
    std::string token;             // every call and every data connection must carry it
    int64_t max_bucket_bytes = 0;  // data + pieces, as rollout.thrift counts them
    int64_t max_connections = 64;  // data connections at once; more are closed
    int64_t idle_timeout_ms = 600'000;
    double update_timeout_s = 300;  // a push without a call for this long is ended
  };
  using Clock = std::chrono::steady_clock;

  // Receives pushes into copies of `served` (its config, dtype and tensor names); `version` is the
  // worker's weight version, `note_abandoned(version, why)` counts and logs a push that ended
  // without committing. Listens on the data channel when it returns (tandem::Error if it cannot).
  WeightReceiver(const model::Weights& served, Options options,
                 const std::atomic<uint64_t>& version,
                 std::function<void(int64_t, const std::string&)> note_abandoned);
  ~WeightReceiver();  // stop()
  WeightReceiver(const WeightReceiver&) = delete;
  WeightReceiver& operator=(const WeightReceiver&) = delete;

  void authorize(const std::string& token) const;  // rpc::Unauthorized unless it is the token

  // begin_weight_push: ends a push in progress and begins one of `version` (> the worker's).
  rpc::WeightPushReady begin(const rpc::WeightPushBegin& begin);
  // push_weight_bucket: a bucket from memory.
  void take(const BucketView& b);
  // commit_weight_push: the staging weights of the whole push of `version` (nullptr where that
  // version is in use already: a commit sent again), ending the push; `bytes` of data it took.
  std::shared_ptr<model::Weights> complete(const rpc::WeightPushCommit& c, int64_t& bytes);
  // The weights the commit swapped out, kept for the next push to receive into.
  void keep_spare(std::shared_ptr<model::Weights> old);
  // Ends the push in progress when no call of it came within update_timeout_s.
  void expire();
  // Stops listening and closes every data connection.
  void stop();

  int data_port() const { return data_port_; }

 private:
  struct Push {
    int64_t version = 0;
    std::shared_ptr<model::Weights> staging;  // held too by each bucket being written
    // Per tensor of Weights::named() (by index): the runs received, first element -> end, and
    // the runs of buckets being written.
    std::vector<std::map<int64_t, int64_t>> received, writing;
    std::unordered_map<int32_t, uint64_t> buckets;  // index -> XXH3-64 of its data
    int64_t bytes = 0;
    Clock::time_point deadline{};
  };
  struct Target {
    size_t tensor = 0;  // index in Weights::named()
    int64_t offset = 0, elements = 0;
  };
  class Bucket;  // a bucket between its checks and its end (weight_receiver.cpp)

  // The checks before any data is read; the bucket's ranges marked as being written.
  std::unique_ptr<Bucket> open(int64_t version, int32_t index, int32_t dtype,
                               const std::vector<rpc::WeightPiece>& pieces, int64_t data_bytes);
  // Reads the bucket's data with read(dst, n) (exactly n bytes) into place; its XXH3-64.
  uint64_t fill(Bucket& b, const std::function<void(char*, size_t)>& read);
  // Marks the bucket received where `hash` is the one sent.
  void finish(Bucket& b, uint64_t hash, uint64_t sent_hash);
  rpc::WeightPushRefused refusal(rpc::WeightPushFault::type fault, std::string message,
                                 std::string tensor = "") const;
  [[noreturn]] void refuse(rpc::WeightPushFault::type fault, std::string message,
                           std::string tensor = "") const;
  void note_closed(const std::string& why);  // a data connection closed for bad input, logged
  void check_push(int64_t version, const std::string& which) const;  // mutex_ held
  Clock::time_point deadline() const;

  void accept_loop();
  void serve_connection(int fd);

  const Options options_;
  const model::ModelConfig config_;
  const DType dtype_;
  std::unordered_map<std::string, size_t> named_;  // HF name -> index in Weights::named()
  const std::atomic<uint64_t>& version_;
  const std::function<void(int64_t, const std::string&)> note_abandoned_;

  std::mutex mutex_;  // guards push_ and spare_
  std::optional<Push> push_;
  std::shared_ptr<model::Weights> spare_;

  int listener_ = -1, data_port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> closed_{0};  // data connections closed for bad input
  std::thread accept_thread_;
  struct Connection {
    int fd = -1;  // -1 once its thread closed it (connections_mutex_)
    std::thread thread;
  };
  std::mutex connections_mutex_;
  std::list<Connection> connections_;  // stable addresses: a thread clears its own fd
};

}  // namespace tandem::rollout
