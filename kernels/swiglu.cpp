// swiglu and swiglu_backward: checks and dispatch.
#include "kernels/cpu/swiglu.h"
#include "core/error.h"
#include "kernels/check.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/swiglu.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

// gate_up (T, 2F) f32; returns F.
int64_t check_gate_up(const char* op, const Tensor& gate_up) {
  check_dtype(op, "gate_up", gate_up, {DType::f32});
  check_ndim(op, "gate_up", gate_up, 2);
  TANDEM_CHECK(gate_up.size(1) % 2 == 0, "{}: gate_up {} has an odd width: expected (T, 2F)", op,
               gate_up.shape().str());
  return gate_up.size(1) / 2;
}

}  // namespace

void swiglu(const Tensor& gate_up, const Tensor& out, const Stream& stream) {
  const OpTimer timer("swiglu");
  constexpr const char* op = "swiglu";
  const int64_t F = check_gate_up(op, gate_up), T = gate_up.size(0);
  check_dtype(op, "out", out, {DType::f32});
  check_shape(op, "out", out, {T, F});
  check_device(op, gate_up.device(), {&gate_up, &out});
  check_stream(op, gate_up.device(), stream);
  TANDEM_ON_CUDA(gate_up.device(), swiglu, gate_up.data_as<float>(), out.data_as<float>(), T, F,
                 stream.handle);
  cpu::swiglu(gate_up, out);
}

void swiglu_backward(const Tensor& dout, const Tensor& gate_up, const Tensor& dgate_up,
                     const Stream& stream) {
  const OpTimer timer("swiglu_backward");
  constexpr const char* op = "swiglu_backward";
  const int64_t F = check_gate_up(op, gate_up), T = gate_up.size(0);
  check_dtype(op, "dout", dout, {DType::f32});
  check_shape(op, "dout", dout, {T, F});
  check_dtype(op, "dgate_up", dgate_up, {DType::f32});
  check_shape(op, "dgate_up", dgate_up, gate_up.shape());
  check_device(op, gate_up.device(), {&dout, &gate_up, &dgate_up});
  check_stream(op, gate_up.device(), stream);
  TANDEM_ON_CUDA(gate_up.device(), swiglu_backward, dout.data_as<float>(), gate_up.data_as<float>(),
                 dgate_up.data_as<float>(), T, F, stream.handle);
  cpu::swiglu_backward(dout, gate_up, dgate_up);
}

}  // namespace tandem::ops
