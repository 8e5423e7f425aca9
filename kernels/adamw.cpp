// adamw: checks, the step's coefficients, and dispatch.
#include <cmath>

#include "core/error.h"
#include "kernels/check.h"
#include "kernels/cpu/adamw.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/adamw.h"
#endif

namespace tandem::ops {

using namespace detail;

void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWParams& p, const Tensor& param_copy, const Stream& stream) {
  const OpTimer timer("adamw");
  constexpr const char* op = "adamw";
  check_dtype(op, "param", param, {DType::f32});
  check_ndim(op, "param", param, 1);
  const int64_t n = param.numel();
  for (const auto& [name, t] : {std::pair{"grad", &grad}, std::pair{"m", &m}, std::pair{"v", &v}}) {
    check_dtype(op, name, *t, {DType::f32});
    check_shape(op, name, *t, {n});
  }
  if (param_copy.defined()) {
    check_dtype(op, "param_copy", param_copy, {DType::bf16, DType::f32});
    check_shape(op, "param_copy", param_copy, {n});
  }
  TANDEM_CHECK(p.step >= 1, "adamw: step {} must be 1 or more (it counts from 1)", p.step);
  TANDEM_CHECK(p.beta1 >= 0.0f && p.beta1 < 1.0f && p.beta2 >= 0.0f && p.beta2 < 1.0f,
               "adamw: betas ({}, {}) must lie in [0, 1)", p.beta1, p.beta2);
  TANDEM_CHECK(std::isfinite(p.lr) && std::isfinite(p.grad_scale) && p.eps > 0.0f,
               "adamw: lr {}, grad_scale {} and eps {} must be finite, eps positive", p.lr,
               p.grad_scale, p.eps);
  check_device(op, param.device(), {&param, &grad, &m, &v, &param_copy});
  check_stream(op, param.device(), stream);

  const double b1 = p.beta1, b2 = p.beta2;
  AdamWCoefficients c{};
  c.decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  c.beta1 = p.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - b1);
  c.beta2 = p.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - b2);
  const double step = static_cast<double>(p.step);
  c.step_size = static_cast<float>(p.lr / (1.0 - std::pow(b1, step)));
  c.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, step)));
  c.eps = p.eps;
  c.grad_scale = p.grad_scale;

  TANDEM_ON_CUDA(param.device(), adamw, param.data_as<float>(), grad.data_as<float>(),
                 m.data_as<float>(), v.data_as<float>(), n, c,
                 param_copy.defined() ? param_copy.data() : nullptr,
                 param_copy.defined() ? param_copy.dtype() : DType::f32, stream.handle);
  cpu::adamw(param, grad, m, v, c, param_copy);
}

}  // namespace tandem::ops
