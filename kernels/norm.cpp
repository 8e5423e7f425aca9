// rmsnorm, add_rmsnorm and rmsnorm_backward: checks and dispatch.
#include "kernels/cpu/norm.h"
#include "core/error.h"
#include "kernels/check.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/norm.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

// x (T, C) f32, weight (C) f32/bf16 and rstd (T) f32; returns {T, C}.
Shape check_rows_and_weight(const char* op, const char* x_name, const Tensor& x,
                            const Tensor& weight, const Tensor& rstd) {
  check_dtype(op, x_name, x, {DType::f32});
  check_ndim(op, x_name, x, 2);
  check_dtype(op, "weight", weight, {DType::f32, DType::bf16});
  check_shape(op, "weight", weight, {x.size(1)});
  check_f32(op, "rstd", rstd, {x.size(0)});
  return x.shape();
}

}  // namespace

void rmsnorm(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
             float eps, const Stream& stream) {
  const OpTimer timer("rmsnorm");
  constexpr const char* op = "rmsnorm";
  const Shape tc = check_rows_and_weight(op, "x", x, weight, rstd);
  check_f32(op, "out", out, tc);
  check_placement(op, x.device(), {&x, &weight, &out, &rstd}, stream);
  TANDEM_ON_CUDA(x.device(), rmsnorm, x.data_as<float>(), weight.data(), weight.dtype(),
                 out.data_as<float>(), rstd.data_as<float>(), tc[0], tc[1], eps, stream.handle);
  cpu::rmsnorm(x, weight, out, rstd, eps);
}

void add_rmsnorm(const Tensor& residual, const Tensor& delta, const Tensor& weight,
                 const Tensor& residual_out, const Tensor& out, const Tensor& rstd, float eps,
                 const Stream& stream) {
  const OpTimer timer("add_rmsnorm");
  constexpr const char* op = "add_rmsnorm";
  const Shape tc = check_rows_and_weight(op, "residual", residual, weight, rstd);
  check_f32(op, "delta", delta, tc);
  check_f32(op, "residual_out", residual_out, tc);
  check_f32(op, "out", out, tc);
  check_placement(op, residual.device(), {&residual, &delta, &weight, &residual_out, &out, &rstd},
                  stream);
  TANDEM_ON_CUDA(residual.device(), add_rmsnorm, residual.data_as<float>(), delta.data_as<float>(),
                 weight.data(), weight.dtype(), residual_out.data_as<float>(), out.data_as<float>(),
                 rstd.data_as<float>(), tc[0], tc[1], eps, stream.handle);
  cpu::add_rmsnorm(residual, delta, weight, residual_out, out, rstd, eps);
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dweight, bool accumulate_dx,
                      bool accumulate_dweight, const Stream& stream) {
  const OpTimer timer("rmsnorm_backward");
  constexpr const char* op = "rmsnorm_backward";
  const Shape tc = check_rows_and_weight(op, "x", x, weight, rstd);
  check_f32(op, "dout", dout, tc);
  check_f32(op, "dx", dx, tc);
  check_f32(op, "dweight", dweight, {tc[1]});
  check_placement(op, x.device(), {&dout, &x, &weight, &rstd, &dx, &dweight}, stream);
  TANDEM_ON_CUDA(x.device(), rmsnorm_backward, dout.data_as<float>(), x.data_as<float>(),
                 weight.data(), weight.dtype(), rstd.data_as<float>(), dx.data_as<float>(),
                 dweight.data_as<float>(), tc[0], tc[1], accumulate_dx, accumulate_dweight,
                 stream.handle);
  cpu::rmsnorm_backward(dout, x, weight, rstd, dx, dweight, accumulate_dx, accumulate_dweight);
}

}  // namespace tandem::ops
