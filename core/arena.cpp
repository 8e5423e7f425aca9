// Bump-pointer arenas over one device allocation each.
#include "core/arena.h"

#include "core/memory_ledger.h"

namespace tandem {

const char* arena_class_name(ArenaClass c) {
  switch (c) {
    case ArenaClass::parameters:
      return "parameters";
    case ArenaClass::gradients:
      return "gradients";
    case ArenaClass::optimizer_states:
      return "optimizer_states";
    case ArenaClass::activations:
      return "activations";
    case ArenaClass::kv_blocks:
      return "kv_blocks";
  }
  return "?";
}

Arena::Arena(ArenaClass cls, Device device, size_t capacity_bytes)
    : cls_(cls), device_(device), capacity_(capacity_bytes) {
  reserve();
}

Arena::~Arena() { release(); }

Tensor Arena::alloc(const Shape& shape, DType dtype) {
  TANDEM_CHECK(reserved(), "{} arena on {} was released: reserve() it before allocating",
               arena_class_name(cls_), device_);
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  const size_t start = (used_ + kAlignment - 1) / kAlignment * kAlignment;
  TANDEM_CHECK(start + bytes <= capacity_,
               "{} arena on {} is full: {} bytes used of {}, {} more asked for {} {}; raise its "
               "size",
               arena_class_name(cls_), device_, used_, capacity_, bytes, dtype, shape.str());
  used_ = start + bytes;
  return Tensor::wrap(base_ + start, shape, dtype, device_);
}

void Arena::release() {
  if (base_ != nullptr) memory_ledger::release(cls_, capacity_);
  device_free(device_, base_);
  base_ = nullptr;
  used_ = 0;
}

void Arena::reserve() {
  if (base_ != nullptr) return;
  memory_ledger::reserve(cls_, capacity_);  // throws past the process's cap, holding nothing
  try {
    base_ = static_cast<char*>(device_alloc(device_, capacity_));
  } catch (...) {
    memory_ledger::release(cls_, capacity_);
    throw;
  }
}

}  // namespace tandem
