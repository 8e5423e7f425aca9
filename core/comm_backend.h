// The interface between Communicator and its two backends (comm_gloo.cpp, comm_nccl.cpp): raw
// buffers, element counts and dtypes, one group; private to core/comm*.cpp.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/comm.h"

namespace gloo::rendezvous {
class Store;
}

namespace tandem::comm_detail {

// The group a backend serves, for its store keys and its messages.
struct Group {
  std::string name;          // "world", "world/replica#1"
  std::string store_prefix;  // its keys in the store: the name and the world ranks
  int rank = 0, size = 1;
  std::vector<int> world_ranks;
  std::chrono::milliseconds timeout{};

  // "rank 2" or, in a sub-group, "rank 2 (world rank 5)".
  std::string peer(int r) const;
  // "all_reduce on group 'world' (rank 0 of 2, 4096 bytes)".
  std::string call(const char* what, size_t bytes) const;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual void all_reduce(void* data, size_t count, DType dtype, ReduceOp op) = 0;
  // in: group.size * count elements; out: count elements.
  virtual void reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                              ReduceOp op) = 0;
  virtual void all_gather_v(const void* in, void* out, std::span<const size_t> counts,
                            DType dtype) = 0;
  virtual void broadcast(void* data, size_t count, DType dtype, int root) = 0;
  virtual void send_recv(std::span<const P2POp> ops) = 0;
  virtual void barrier() = 0;
  // Communicator::set_cuda_inputs_ready (NCCL only).
  virtual void set_inputs_ready(bool) {}
};

// Gloo over TCP for CPU buffers. `device` holds the process's gloo TCP device (created on first use
// with `hostname`, the address other ranks reach this one at).
std::unique_ptr<Backend> make_gloo_backend(const Group& group, gloo::rendezvous::Store& store,
                                           std::shared_ptr<void>& device,
                                           const std::string& hostname);
// NCCL for buffers on CUDA device `device_index`; throws when the build has no NCCL.
std::unique_ptr<Backend> make_nccl_backend(const Group& group, gloo::rendezvous::Store& store,
                                           int device_index);

}  // namespace tandem::comm_detail
