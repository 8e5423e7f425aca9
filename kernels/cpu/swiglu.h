// CPU SwiGLU and its backward (arguments already checked).
#pragma once

#include "core/tensor.h"

namespace tandem::ops::cpu {

// out (T, F) = silu(gate_up[:, :F]) * gate_up[:, F:].
void swiglu(const Tensor& gate_up, const Tensor& out);
// dgate_up (T, 2F) from dout (T, F) and gate_up (T, 2F).
void swiglu_backward(const Tensor& dout, const Tensor& gate_up, const Tensor& dgate_up);

}  // namespace tandem::ops::cpu
