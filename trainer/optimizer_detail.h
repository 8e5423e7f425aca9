// The pieces AdamW (trainer/optimizer.cpp) and ShardedAdamW (trainer/sharded_adamw.cpp) share:
// what the gradient norm decides, the kernel's parameters, and the global norm's blocks.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"
#include "trainer/optimizer.h"

namespace tandem::trainer::optimizer_detail {

// What the global gradient norm decides, the same for AdamW and ShardedAdamW: a non-finite norm
// skips the step (counted; the max_consecutive_skips-th skip in a row throws), a norm above
// max_grad_norm scales the gradients by max_norm / (norm + 1e-6) (torch's clip_grad_norm_).
StepResult decide_step(float norm, float lr, const AdamWConfig& config, AdamWCounters& counters);

// The kernel's parameters of an update that decide_step let through (weight decay is per tensor).
ops::AdamWParams update_params(const AdamWConfig& config, const AdamWCounters& counters,
                               const StepResult& r);

// The global norm on the CPU, AdamW's and ShardedAdamW's alike: the gradients flattened in storage
// order, cut into blocks of kNormBlock; a block's sum of squares in f64
// (ops::sum_squares_f64), the blocks' sums added in block order, the square root rounded to
// f32. A rank holds whole blocks, so the norm of the same gradients has the same bits on any number
// of ranks.
constexpr int64_t kNormBlock = ShardedAdamW::kNormBlock;

// The sums of the blocks of x[0, n), one per block of `blocks` (those past n are 0).
std::vector<double> block_sums(const float* x, int64_t n, int64_t blocks);
float norm_of_sums(std::span<const double> sums);

// ops::adamw works on flat (N) tensors.
inline Tensor flat(const Tensor& t) { return t.view({t.numel()}); }

}  // namespace tandem::trainer::optimizer_detail
