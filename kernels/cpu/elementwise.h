// CPU implementations of cast, scale, random_uniform and sum_squares (arguments already checked).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace tandem::ops::cpu {

void cast(const Tensor& src, const Tensor& dst);
void scale(const Tensor& x, float s);
void random_uniform(const Tensor& out, uint64_t seed, uint64_t stream_id);
void sum_squares(const Tensor& x, const Tensor& out, bool accumulate);

}  // namespace tandem::ops::cpu
