// How ShardedAdamW's communication thread orders its work against the compute on the optimizer's
// device: on the CPU there is nothing to order (copies run at once); on CUDA a mark (an event on
// the compute stream) that the thread waits for before it reads what the compute wrote, and a
// stream of its own for its copies and sums, each waited for before the thread goes on.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "core/device.h"
#include "core/tensor.h"

namespace tandem::trainer {

class ShardDevice {
 public:
  // The compute queued on the device's compute stream (its default stream, where the decoder and
  // the update run) up to the moment mark() was called; null on the CPU.
  using Mark = std::shared_ptr<void>;

  explicit ShardDevice(Device device);
  ~ShardDevice();
  ShardDevice(const ShardDevice&) = delete;
  ShardDevice& operator=(const ShardDevice&) = delete;

  Device device() const { return device_; }
  bool is_cpu() const { return device_.is_cpu(); }

  // Records a mark on the compute stream (CUDA; counted in marks()).
  Mark mark();
  // Blocks the calling thread until the mark's work ran; a null mark returns at once.
  static void wait(const Mark& m);
  // Whether the mark's work ran (a null mark: true).
  static bool done(const Mark& m);

  // On this device, on the side stream (CUDA: a non-blocking stream, so it never waits for the
  // compute stream by itself), done when they return: dst = src, dst = 0, out += x (f32).
  void copy(void* dst, const void* src, int64_t bytes) const;
  void zero(void* dst, int64_t bytes) const;
  void add(const Tensor& x, const Tensor& out) const;

  int64_t marks() const { return marks_.load(); }  // marks recorded so far

 private:
  Device device_;
  void* side_ = nullptr;  // cudaStream_t on CUDA
  std::atomic<int64_t> marks_{0};
};

}  // namespace tandem::trainer
