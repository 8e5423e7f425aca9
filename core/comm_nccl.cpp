// The NCCL backend for CUDA buffers: a non-blocking communicator (ncclCommInitRankConfig with
// blocking = 0) on its own stream; every call polls the stream and ncclCommGetAsyncError until it
// completes, and aborts the communicator (ncclCommAbort) at the deadline, so nothing hangs. The
// stream is a non-blocking one: a call waits (through an event) for the work queued on the
// device's default stream before it, where the callers compute its inputs, but work queued there
// after the call does not wait for the collective, so compute on other threads overlaps it. A
// caller that orders the inputs itself (set_cuda_inputs_ready) skips the first wait.
#include <fmt/format.h>
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "core/comm_backend.h"
#include "core/cuda_check.h"
#include "core/error.h"

namespace tandem::comm_detail {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclMax; }

class NcclBackend : public Backend {
 public:
  NcclBackend(const Group& group, gloo::rendezvous::Store& store, int device_index)
      : group_(group), device_(device_index) {
    CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id;
    const std::string key = group.store_prefix + "/nccl_unique_id";
    if (group.rank == 0) {
      NCCL_CHECK(ncclGetUniqueId(&id));
      store.set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      const auto bytes = store.get(key);
      TANDEM_CHECK(bytes.size() == sizeof(id.internal), "group '{}': a malformed NCCL id",
                   group.name);
      std::memcpy(id.internal, bytes.data(), bytes.size());
    }
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const auto deadline = Clock::now() + group.timeout;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, group.size, id, group.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress)
      TANDEM_FAIL("creating the NCCL communicator of group '{}' (rank {} of {}): {}", group.name,
                  group.rank, group.size, ncclGetErrorString(r));
    settle("ncclCommInitRankConfig", 0, deadline);
  }

  ~NcclBackend() override {
    if (comm_ != nullptr) {
      if (aborted_)
        ncclCommAbort(comm_);
      else
        ncclCommDestroy(comm_);
    }
    if (barrier_buf_ != nullptr) cudaFree(barrier_buf_);
    if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op) override {
    run("all_reduce", count * dtype_size(dtype), [&] {
      return ncclAllReduce(data, data, count, nccl_type(dtype), nccl_op(op), comm_, stream_);
    });
  }

  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    run("reduce_scatter", count * dtype_size(dtype) * static_cast<size_t>(group_.size), [&] {
      return ncclReduceScatter(in, out, count, nccl_type(dtype), nccl_op(op), comm_, stream_);
    });
  }

  void all_gather_v(const void* in, void* out, std::span<const size_t> counts,
                    DType dtype) override {
    const size_t esize = dtype_size(dtype);
    size_t total = 0;
    for (size_t c : counts) total += c;
    run("all_gather", total * esize, [&] {
      // One broadcast per rank's piece, grouped: NCCL's all-gather of unequal pieces.
      ncclResult_t r = ncclGroupStart();
      size_t offset = 0;
      for (int root = 0; root < group_.size && (r == ncclSuccess || r == ncclInProgress); ++root) {
        const size_t n = counts[static_cast<size_t>(root)];
        char* dst = static_cast<char*>(out) + offset * esize;
        if (n > 0)
          r = ncclBroadcast(root == group_.rank ? in : dst, dst, n, nccl_type(dtype), root, comm_,
                            stream_);
        offset += n;
      }
      const ncclResult_t end = ncclGroupEnd();
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
  }

  void broadcast(void* data, size_t count, DType dtype, int root) override {
    run("broadcast", count * dtype_size(dtype),
        [&] { return ncclBroadcast(data, data, count, nccl_type(dtype), root, comm_, stream_); });
  }

  void send_recv(std::span<const P2POp> ops) override {
    size_t bytes = 0;
    for (const auto& op : ops) bytes += op.tensor.nbytes();
    run("send_recv", bytes, [&] {
      ncclResult_t r = ncclGroupStart();
      for (const auto& op : ops) {
        if (r != ncclSuccess && r != ncclInProgress) break;
        const size_t n = static_cast<size_t>(op.tensor.numel());
        if (op.kind == P2POp::Kind::send)
          r = ncclSend(op.tensor.data(), n, nccl_type(op.tensor.dtype()), op.peer, comm_, stream_);
        else
          r = ncclRecv(op.tensor.data(), n, nccl_type(op.tensor.dtype()), op.peer, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
  }

  void set_inputs_ready(bool ready) override { caller_orders_inputs_ = ready; }

  void barrier() override {
    if (barrier_buf_ == nullptr) CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    run("barrier", 0, [&] {
      return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
  }

 private:
  template <class Issue>
  void run(const char* what, size_t bytes, Issue&& issue) {
    CUDA_CHECK(cudaSetDevice(device_));
    const auto deadline = Clock::now() + group_.timeout;
    if (!caller_orders_inputs_) {
      // The inputs: what the default (legacy) stream computed before this call.
      CUDA_CHECK(cudaEventRecord(inputs_ready_, nullptr));
      CUDA_CHECK(cudaStreamWaitEvent(stream_, inputs_ready_, 0));
    }
    const ncclResult_t r = issue();
    if (r != ncclSuccess && r != ncclInProgress) fail(what, bytes, ncclGetErrorString(r));
    settle(what, bytes, deadline);
    // The work is queued; wait for the stream, watching for errors and the deadline.
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) fail(what, bytes, cudaGetErrorString(q));
      check_async(what, bytes, deadline);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Waits until the communicator has no operation in progress (non-blocking mode).
  void settle(const char* what, size_t bytes, Clock::time_point deadline) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_, &st);
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) fail(what, bytes, ncclGetErrorString(st));
      check_deadline(what, bytes, deadline);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void check_async(const char* what, size_t bytes, Clock::time_point deadline) {
    ncclResult_t st = ncclSuccess;
    ncclCommGetAsyncError(comm_, &st);
    if (st != ncclSuccess && st != ncclInProgress) fail(what, bytes, ncclGetErrorString(st));
    check_deadline(what, bytes, deadline);
  }

  void check_deadline(const char* what, size_t bytes, Clock::time_point deadline) {
    if (Clock::now() < deadline) return;
    fail(what, bytes,
         fmt::format("not done within {} s (distributed.timeout_s): a peer of the group is dead, "
                     "stuck or in another collective; the NCCL communicator was aborted",
                     std::chrono::duration<double>(group_.timeout).count()));
  }

  [[noreturn]] void fail(const char* what, size_t bytes, const std::string& why) {
    if (!aborted_ && comm_ != nullptr) {
      aborted_ = true;
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    TANDEM_FAIL("{} (NCCL on cuda:{}): {}", group_.call(what, bytes), device_, why);
  }

  Group group_;
  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr;
  bool caller_orders_inputs_ = false;  // Communicator::set_cuda_inputs_ready
  void* barrier_buf_ = nullptr;
  bool aborted_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_nccl_backend(const Group& group, gloo::rendezvous::Store& store,
                                           int device_index) {
  return std::make_unique<NcclBackend>(group, store, device_index);
}

}  // namespace tandem::comm_detail
