// The single-rank path of weight_sync: a trainer and a rollout engine in one process (the
// colocated job). After each optimizer step the engine must read the new parameters. Where the
// engine's tensor is the trainer's own (same storage), nothing moves; where only the place
// differs, one copy; where the dtype differs (f32 master weights, bf16 rollout weights), one
// cast-copy pass per tensor. The multi-rank reshard path (Layout, ReshardPlan, buckets over
// NCCL/Gloo) builds on the same per-tensor rule.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::weight_sync {

// One parameter as the two sides name it (HF names; storage tensors, e.g. a fused qkv).
struct Param {
  std::string name;
  Tensor tensor;
};

// What publishing does to each tensor.
enum class Transfer { shared, copy, cast };

struct PublishStats {
  uint64_t version = 0;
  int64_t shared = 0, copied = 0, cast = 0;  // tensors
  int64_t bytes_written = 0;                 // into the destination
  double seconds = 0;
};

class LocalPublisher {
 public:
  // src: the trainer's parameters; dst: the engine's, the same names in the same order with the
  // same shapes (possibly the very same tensors). Throws tandem::Error naming the first tensor
  // that does not match. Both must outlive the publisher.
  LocalPublisher(std::span<const Param> src, std::span<const Param> dst);

  // Makes dst hold src's values and stamps the version. Stream-ordered on a device.
  PublishStats publish(uint64_t version, const Stream& stream = {}) const;

  // Whether every destination tensor is the source's own storage (publishing moves no bytes).
  bool zero_copy() const { return moved_ == 0; }
  Transfer transfer(size_t i) const { return transfers_[i]; }
  size_t size() const { return transfers_.size(); }

 private:
  std::span<const Param> src_, dst_;
  std::vector<Transfer> transfers_;
  int64_t moved_ = 0;
};

}  // namespace tandem::weight_sync
