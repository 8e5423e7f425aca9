// Arena: one allocation per class of memory, handed out by a bump pointer, emptied per phase.
#pragma once

#include <cstddef>

#include "core/tensor.h"

namespace tandem {

// The classes of memory a job holds; each phase of a step owns some of them.
enum class ArenaClass : uint8_t { parameters, gradients, optimizer_states, activations, kv_blocks };
const char* arena_class_name(ArenaClass c);

// Addresses stay fixed from reserve() to release(), so CUDA graphs may capture them. Tensors
// from alloc() borrow the arena's memory and are invalid after reset() or release(). While
// reserved, the capacity counts in the process's core/memory_ledger.h by class; a reserve (the
// constructor's too) that would take the ledger past its cap throws, holding nothing.
class Arena {
 public:
  static constexpr size_t kAlignment = 256;

  Arena(ArenaClass cls, Device device, size_t capacity_bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Tensor alloc(const Shape& shape, DType dtype);
  // Forget every allocation; the memory stays reserved.
  void reset() { used_ = 0; }
  // Give the memory back to the device (e.g. the KV cache during training).
  void release();
  // Take the memory again after release(); capacity is unchanged.
  void reserve();

  ArenaClass cls() const { return cls_; }
  Device device() const { return device_; }
  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }
  bool reserved() const { return base_ != nullptr; }

 private:
  ArenaClass cls_;
  Device device_;
  size_t capacity_;
  size_t used_ = 0;
  char* base_ = nullptr;
};

}  // namespace tandem
