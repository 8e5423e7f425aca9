// CPU SwiGLU: silu(g) = g / (1 + exp(-g)) in f32 (exp(-g) = silu_exp_neg, kernels/exp.h), one
// row per task; the row loops are built for each vector width (clones.h).
#include "kernels/cpu/swiglu.h"

#include <algorithm>

#include "core/parallel.h"
#include "kernels/cpu/clones.h"
#include "kernels/exp.h"

namespace tandem::ops::cpu {
namespace {

int64_t rows_per_thread(int64_t F) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(F, 1)); }

TANDEM_CPU_CLONES void swiglu_row(const float* gate, const float* up, float* out, int64_t F) {
  for (int64_t f = 0; f < F; ++f) {
    const float g = gate[f];
    out[f] = g / (1.0f + silu_exp_neg(g)) * up[f];
  }
}

TANDEM_CPU_CLONES void swiglu_backward_row(const float* g_out, const float* gate, const float* up,
                                           float* dgate, float* dup, int64_t F) {
  for (int64_t f = 0; f < F; ++f) {
    const float g = gate[f];
    const float denom = 1.0f + silu_exp_neg(g);
    const float sig = 1.0f / denom;
    // d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
    dgate[f] = g_out[f] * up[f] * (sig * (1.0f + g * (1.0f - sig)));
    dup[f] = g_out[f] * (g / denom);
  }
}

}  // namespace

void swiglu(const Tensor& gate_up, const Tensor& out) {
  const int64_t T = out.size(0), F = out.size(1);
  const float* gu = gate_up.data_as<float>();  // (T, 2F)
  float* o = out.data_as<float>();             // (T, F)
  parallel_for(
      T,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* gate = gu + t * 2 * F;
          swiglu_row(gate, gate + F, o + t * F, F);
        }
      },
      rows_per_thread(F));
}

void swiglu_backward(const Tensor& dout, const Tensor& gate_up, const Tensor& dgate_up) {
  const int64_t T = dout.size(0), F = dout.size(1);
  const float* dy = dout.data_as<float>();     // (T, F)
  const float* gu = gate_up.data_as<float>();  // (T, 2F)
  float* d = dgate_up.data_as<float>();        // (T, 2F)
  parallel_for(
      T,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* gate = gu + t * 2 * F;
          float* dgate = d + t * 2 * F;
          swiglu_backward_row(dy + t * F, gate, gate + F, dgate, dgate + F, F);
        }
      },
      rows_per_thread(F));
}

}  // namespace tandem::ops::cpu
