// CPU sampling (arguments already checked; the settings are checked row by row here).
#pragma once

#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::ops::cpu {

void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob);

// The counts and masses over a row (or a shard of one) that sample's thresholds are searched
// on, shared with the sampling over vocabulary shards (model/tp_sample.cpp): the entries with
// z >= t, with z > t, and the sum of e over those with z >= t in row_softmax's lane order (16
// lanes, then a fixed tree).
int64_t count_at_least(const float* z, int64_t n, float t);
int64_t count_greater(const float* z, int64_t n, float t);
float mass_at_least(const float* z, const float* e, int64_t n, float t);

}  // namespace tandem::ops::cpu
