// Communicator: the collectives and point-to-point transfers of a group of ranks on tensors, over
// Gloo (CPU tensors, TCP) and NCCL (CUDA tensors), every call bounded by distributed.timeout_s.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/rendezvous.h"
#include "core/tensor.h"

namespace tandem {

enum class ReduceOp { sum, max };
const char* reduce_op_name(ReduceOp op);

// A network that a Communicator emulates on top of its real transport (docs/distributed.md, "The
// emulated link"): after each call it sleeps until the time a link of this bandwidth and latency
// would have needed for the bytes this rank sends under a ring algorithm, counted from the call's
// start. Off at 0 gbps.
struct EmulatedLink {
  double gbps = 0;        // bandwidth, 10^9 bits per second each way; 0: off
  double latency_us = 0;  // added once per ring step
  bool on() const { return gbps > 0; }
  // Seconds to send `bytes` in `steps` ring steps; 0 when off.
  double seconds(double bytes, int steps) const;
};

struct CommOptions {
  // Bound of every collective, of the rendezvous and of the store: a dead or stuck peer becomes a
  // tandem::Error after this long instead of a hang (distributed.timeout_s).
  double timeout_s = 300;
  std::string store = "tcp";  // "tcp" or "file:/shared/dir" (distributed.store)
  std::string master;         // "HOST:PORT" of the coordinator, over the launcher's variables
  // CUDA: an NCCL communicator on this device carries the CUDA tensors (CPU ones still go over
  // Gloo). Needs a build with NCCL.
  Device device = Device::cpu();
  // Off unless link.gbps > 0 (distributed.emulated_link_gbps,
  // distributed.emulated_link_latency_us).
  EmulatedLink link;
};

// One transfer of a grouped send_recv: `tensor` goes to, or is filled from, group rank `peer`.
struct P2POp {
  enum class Kind { send, recv } kind;
  int peer;
  Tensor tensor;
};
inline P2POp send_to(int peer, const Tensor& t) { return {P2POp::Kind::send, peer, t}; }
inline P2POp recv_from(int peer, const Tensor& t) { return {P2POp::Kind::recv, peer, t}; }

// What a communicator's calls did while counted (Communicator::set_call_stats), by call:
// "all_reduce", "reduce_scatter", "all_gather" (all_gather_v too), "broadcast", "send_recv",
// "barrier". Bytes are the payload: the tensor of all_reduce and broadcast, reduce_scatter's input,
// all_gather's output, send_recv's sent plus received. Seconds run from entry to return: the wait
// for slower peers and an emulated link's hold included. A bench's measure of a group's share of
// a step; a failed call is not counted.
struct CallStats {
  struct Tally {
    int64_t calls = 0;
    int64_t bytes = 0;
    double seconds = 0;
  };
  std::map<std::string, Tally> by_call;
  Tally total() const;
};

namespace comm_detail {
class Backend;
}

// A group of ranks. Every member calls the same collectives in the same order with matching
// shapes; each call returns when this rank's part is done (results are in place on return, CUDA
// work included). Errors name the collective, the group, the bytes and the peer that failed; after
// one, the communicator refuses further calls. One thread at a time uses a communicator; sub-groups
// are separate communicators and may run on separate threads.
class Communicator {
 public:
  // The world of the job: rank and size from the launcher (rendezvous::detect_rank_info), the
  // ranks meet in the store of options.store.
  static std::unique_ptr<Communicator> create(const rendezvous::RankInfo& info,
                                              const CommOptions& options);
  static std::unique_ptr<Communicator> from_environment(const CommOptions& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }  // "world", "world/replica0"
  // This group's rank r as a rank of the world.
  int world_rank(int r) const { return world_ranks_[static_cast<size_t>(r)]; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // The emulated link of this group's calls, from CommOptions.link; set_link changes it from the
  // next call on (a bench compares links in one run). A split group starts with its parent's link
  // at the time of the split. Throws on a negative bandwidth or latency.
  const EmulatedLink& link() const { return options_.link; }
  void set_link(const EmulatedLink& link);
  // A CUDA call first waits for the work queued on the device's default stream before it (where
  // tandem computes the inputs). A caller that waits for its inputs' work itself before every call
  // (an event, as the sharded optimizer's communication thread does) sets this: its calls then
  // start at once and overlap the compute queued after the inputs. Not inherited by splits.
  void set_cuda_inputs_ready(bool ready);
  // Adds every later successful call of this group to *stats (null: stops counting). The caller
  // keeps stats alive while set; off by default (a pointer test a call); not inherited by splits.
  void set_call_stats(CallStats* stats) { call_stats_ = stats; }

  // t = op over the ranks' t, in place.
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum);
  // out = rank r's slice of op over the ranks' `in`: in holds size() * out.numel() elements,
  // slice r being elements [r * out.numel(), (r + 1) * out.numel()).
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op = ReduceOp::sum);
  // out = every rank's `in`, concatenated in rank order; out.numel() = size() * in.numel().
  void all_gather(const Tensor& in, const Tensor& out);
  // The same with rank r contributing counts[r] elements (counts known to every rank; in.numel()
  // = counts[rank()], out.numel() = their sum).
  void all_gather_v(const Tensor& in, const Tensor& out, std::span<const int64_t> counts);
  // t = root's t on every rank.
  void broadcast(const Tensor& t, int root);
  // Every send and receive of `ops` in flight together (no ordering deadlock between peers); the
  // peers post the matching ops, in the same order for one pair of ranks.
  void send_recv(std::span<const P2POp> ops);
  void barrier();

  // A sub-group of this group's ranks (e.g. one rollout replica): called by exactly the members,
  // each with the same name and ranks (this group's numbering, ascending); the new group's rank i
  // is ranks[i]. The same name may be split again (each call is a new group).
  std::unique_ptr<Communicator> split(const std::string& name, const std::vector<int>& ranks);

 private:
  Communicator() = default;
  void check_usable(const char* what) const;
  comm_detail::Backend& backend_for(const Tensor& t, const char* what);
  template <class Fn>
  void guarded(const char* what, Fn&& fn);
  // With an emulated link in a group of more than one rank: sleeps until `start` plus the link's
  // time for `bytes` sent in `steps` ring steps.
  void hold_for_link(std::chrono::steady_clock::time_point start, double bytes, int steps) const;
  // With call stats set: adds one call of `what` carrying `bytes`, begun at `start`.
  void count_call(const char* what, std::chrono::steady_clock::time_point start,
                  int64_t bytes) const;

  int rank_ = 0, size_ = 1;
  std::string name_;
  std::vector<int> world_ranks_;
  std::chrono::milliseconds timeout_{};
  CommOptions options_;
  std::shared_ptr<rendezvous::Store> store_;
  std::shared_ptr<void> gloo_device_;  // the TCP device every group of this process shares
  std::unique_ptr<comm_detail::Backend> gloo_;
  std::unique_ptr<comm_detail::Backend> nccl_;  // null unless options.device is CUDA
  std::map<std::string, int> splits_;           // name -> times split, for unique store keys
  std::string broken_;                          // the first failure, once one happened
  CallStats* call_stats_ = nullptr;             // set_call_stats; null: not counted
};

// Checks that every rank runs the same config (`text`, e.g. the resolved TOML): all-gathers a
// hash, and on a mismatch gathers the texts and throws a tandem::Error naming the ranks and the
// keys (or lines) whose values differ. Collective: every rank calls it.
void verify_same_config(Communicator& comm, const std::string& text);

}  // namespace tandem
