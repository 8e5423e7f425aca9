// CPU rmsnorm, add_rmsnorm and rmsnorm_backward (arguments already checked).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace tandem::ops::cpu {

// Rows of the backward's dweight partial sums: dweight is the sum, in chunk order, of the sums
// over fixed chunks of this many rows (each in row order), whatever the thread count.
inline constexpr int64_t kNormRowChunk = 64;

void rmsnorm(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
             float eps);
void add_rmsnorm(const Tensor& residual, const Tensor& delta, const Tensor& weight,
                 const Tensor& residual_out, const Tensor& out, const Tensor& rstd, float eps);
void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dweight, bool accumulate_dx,
                      bool accumulate_dweight);

}  // namespace tandem::ops::cpu
