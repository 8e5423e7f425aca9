// CPU sampling (arguments already checked; the settings are checked row by row here).
#pragma once

#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::ops::cpu {

void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob);

}  // namespace tandem::ops::cpu
