// CPU implementations of cast, scale, add, random_uniform and sum_squares (arguments already
// checked).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace tandem::ops::cpu {

void cast(const Tensor& src, const Tensor& dst);
void scale(const Tensor& x, float s);
void add(const Tensor& x, const Tensor& out);
void random_uniform(const Tensor& out, uint64_t seed, uint64_t stream_id);
void sum_squares(const Tensor& x, const Tensor& out, bool accumulate);
// The sum of squares of x[0, n) in f64, in an order that depends on n alone: what sum_squares adds
// per chunk of 4096 elements and the optimizers' gradient norm per block.
double chunk_sum_squares(const float* x, int64_t n);

}  // namespace tandem::ops::cpu
