// CPU AdamW: torch.optim.AdamW's update, element by element, in f32.
#include "kernels/cpu/adamw.h"

#include <cmath>
#include <type_traits>

#include "core/half.h"
#include "core/parallel.h"

namespace tandem::ops::cpu {
namespace {

// The update of one element, in the order torch.optim.AdamW applies it (single-tensor path):
// decay the parameter, update the moments, then p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps).
template <class Copy>
void update(float* p, const float* g, float* m, float* v, Copy* copy, int64_t begin, int64_t end,
            const AdamWCoefficients& c) {
  for (int64_t i = begin; i < end; ++i) {
    const float grad = g[i] * c.grad_scale;
    const float mi = c.beta1 * m[i] + c.one_minus_beta1 * grad;
    const float vi = c.beta2 * v[i] + c.one_minus_beta2 * (grad * grad);
    const float denom = std::sqrt(vi) / c.bias2_sqrt + c.eps;
    const float pi = p[i] * c.decay - c.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if constexpr (std::is_same_v<Copy, float>) {
      copy[i] = pi;
    } else if constexpr (std::is_same_v<Copy, bf16>) {
      copy[i] = bf16(pi);
    }
  }
}

constexpr int64_t kChunk = 1 << 14;

}  // namespace

void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWCoefficients& c, const Tensor& param_copy) {
  float* p = param.data_as<float>();
  const float* g = grad.data_as<float>();
  float* mm = m.data_as<float>();
  float* vv = v.data_as<float>();
  const int64_t n = param.numel();
  parallel_for(
      n,
      [&](int64_t b, int64_t e) {
        if (!param_copy.defined()) {
          update<void>(p, g, mm, vv, nullptr, b, e, c);
        } else if (param_copy.dtype() == DType::bf16) {
          update(p, g, mm, vv, param_copy.data_as<bf16>(), b, e, c);
        } else {
          update(p, g, mm, vv, param_copy.data_as<float>(), b, e, c);
        }
      },
      kChunk);
}

}  // namespace tandem::ops::cpu
