// cast, scale, add, random_uniform, sum_squares, global_norm: checks and dispatch.
#include <cmath>

#include "core/error.h"
#include "kernels/check.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/elementwise.h"
#endif

namespace tandem::ops {

using namespace detail;

void cast(const Tensor& src, const Tensor& dst, const Stream& stream) {
  check_dtype("cast", "src", src, {DType::f32, DType::bf16, DType::f16});
  check_dtype("cast", "dst", dst, {DType::f32, DType::bf16, DType::f16});
  TANDEM_CHECK(src.numel() == dst.numel(), "cast: src {} and dst {} differ in size", src.str(),
               dst.str());
  check_device("cast", src.device(), {&src, &dst});
  TANDEM_ON_CUDA(src.device(), cast, src.data(), src.dtype(), dst.data(), dst.dtype(), src.numel(),
                 stream.handle);
  cpu::cast(src, dst);
}

void scale(const Tensor& x, float s, const Stream& stream) {
  check_dtype("scale", "x", x, {DType::f32});
  TANDEM_ON_CUDA(x.device(), scale, x.data_as<float>(), s, x.numel(), stream.handle);
  cpu::scale(x, s);
}

void add(const Tensor& x, const Tensor& out, const Stream& stream) {
  check_dtype("add", "x", x, {DType::f32});
  check_dtype("add", "out", out, {DType::f32});
  TANDEM_CHECK(x.numel() == out.numel(), "add: x {} and out {} differ in size", x.str(), out.str());
  check_device("add", x.device(), {&x, &out});
  TANDEM_ON_CUDA(x.device(), add, x.data_as<float>(), out.data_as<float>(), x.numel(),
                 stream.handle);
  cpu::add(x, out);
}

void random_uniform(const Tensor& out, uint64_t seed, uint64_t stream_id, const Stream& stream) {
  check_dtype("random_uniform", "out", out, {DType::f32});
  TANDEM_ON_CUDA(out.device(), random_uniform, out.data_as<float>(), out.numel(), seed, stream_id,
                 stream.handle);
  cpu::random_uniform(out, seed, stream_id);
}

void sum_squares(const Tensor& x, const Tensor& out, bool accumulate, const Stream& stream) {
  const OpTimer timer("sum_squares");
  check_dtype("sum_squares", "x", x, {DType::f32});
  check_dtype("sum_squares", "out", out, {DType::f32});
  check_shape("sum_squares", "out", out, {1});
  check_device("sum_squares", x.device(), {&x, &out});
  TANDEM_ON_CUDA(x.device(), sum_squares, x.data_as<float>(), x.numel(), out.data_as<float>(),
                 accumulate, stream.handle);
  cpu::sum_squares(x, out, accumulate);
}

float global_norm(std::span<const Tensor> tensors, const Stream& stream) {
  const OpTimer timer("global_norm");
  if (tensors.empty()) return 0.0f;
  Tensor acc = Tensor::zeros({1}, DType::f32, tensors[0].device());
  for (const Tensor& t : tensors) sum_squares(t, acc, /*accumulate=*/true, stream);
  stream.synchronize();
  const Tensor host = acc.to(Device::cpu());
  return std::sqrt(host.data_as<float>()[0]);
}

double sum_squares_f64(const Tensor& x) {
  check_dtype("sum_squares_f64", "x", x, {DType::f32});
  TANDEM_CHECK(x.device().is_cpu(), "sum_squares_f64: x {} must be on the CPU", x.str());
  return cpu::chunk_sum_squares(x.data_as<float>(), x.numel());
}

}  // namespace tandem::ops
