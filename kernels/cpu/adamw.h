// CPU AdamW update (arguments already checked).
#pragma once

#include "core/tensor.h"
#include "kernels/cuda/adamw.h"  // AdamWCoefficients (free of CUDA itself)

namespace tandem::ops::cpu {

void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWCoefficients& c, const Tensor& param_copy);

}  // namespace tandem::ops::cpu
