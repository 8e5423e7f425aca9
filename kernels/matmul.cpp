// matmul, matmul_backward_input and matmul_backward_weight: checks and dispatch.
#include "kernels/cpu/matmul.h"
#include "core/error.h"
#include "kernels/check.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/matmul.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

// Both operands 2-D with the same inner size; names both shapes when they do not fit.
void check_pair(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                const Tensor& b, int a_dim, int b_dim) {
  check_ndim(op, a_name, a, 2);
  check_ndim(op, b_name, b, 2);
  TANDEM_CHECK(a.size(a_dim) == b.size(b_dim),
               "{}: {} {} and {} {} do not fit (dimension {} of {} must equal dimension {} of {})",
               op, a_name, a.shape().str(), b_name, b.shape().str(), a_dim, a_name, b_dim, b_name);
}

}  // namespace

void matmul(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate,
            const Stream& stream) {
  constexpr const char* op = "matmul";
  check_dtype(op, "x", x, {DType::f32, DType::bf16});
  check_dtype(op, "w", w, {DType::f32, DType::bf16});
  check_dtype(op, "y", y, {DType::f32});
  check_pair(op, "x", x, "w", w, 1, 1);
  check_shape(op, "y", y, {x.size(0), w.size(0)});
  check_device(op, x.device(), {&x, &w, &y});
  check_stream(op, x.device(), stream);
  const OpTimer timer("matmul", x.size(0), w.size(0), x.size(1));
  TANDEM_ON_CUDA(x.device(), matmul, x.data(), x.dtype(), w.data(), w.dtype(), y.data_as<float>(),
                 x.size(0), w.size(0), x.size(1), accumulate, stream.handle);
  cpu::matmul(x, w, y, accumulate);
}

void matmul_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate,
                           const Stream& stream) {
  constexpr const char* op = "matmul_backward_input";
  check_dtype(op, "dy", dy, {DType::f32});
  check_dtype(op, "w", w, {DType::f32, DType::bf16});
  check_dtype(op, "dx", dx, {DType::f32});
  check_pair(op, "dy", dy, "w", w, 1, 0);
  check_shape(op, "dx", dx, {dy.size(0), w.size(1)});
  check_device(op, dy.device(), {&dy, &w, &dx});
  check_stream(op, dy.device(), stream);
  const OpTimer timer("matmul_backward_input", dy.size(0), w.size(0), w.size(1));
  TANDEM_ON_CUDA(dy.device(), matmul_backward_input, dy.data_as<float>(), w.data(), w.dtype(),
                 dx.data_as<float>(), dy.size(0), w.size(0), w.size(1), accumulate, stream.handle);
  cpu::matmul_backward_input(dy, w, dx, accumulate);
}

void matmul_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate,
                            const Stream& stream) {
  constexpr const char* op = "matmul_backward_weight";
  check_dtype(op, "dy", dy, {DType::f32});
  check_dtype(op, "x", x, {DType::f32, DType::bf16});
  check_dtype(op, "dw", dw, {DType::f32});
  check_pair(op, "dy", dy, "x", x, 0, 0);
  check_shape(op, "dw", dw, {dy.size(1), x.size(1)});
  check_device(op, dy.device(), {&dy, &x, &dw});
  check_stream(op, dy.device(), stream);
  const OpTimer timer("matmul_backward_weight", dy.size(0), dy.size(1), x.size(1));
  TANDEM_ON_CUDA(dy.device(), matmul_backward_weight, dy.data_as<float>(), x.data(), x.dtype(),
                 dw.data_as<float>(), dy.size(0), dy.size(1), x.size(1), accumulate, stream.handle);
  cpu::matmul_backward_weight(dy, x, dw, accumulate);
}

}  // namespace tandem::ops
