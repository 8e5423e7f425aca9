// rope and rope_backward: checks, the inverse frequencies, and dispatch.
#include "kernels/cpu/rope.h"
#include "core/error.h"
#include "kernels/check.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/rope.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

#if TANDEM_HAS_CUDA
static_assert(2 * cuda::kRopeMaxPairs == cpu::kRopeMaxHeadDim);
#endif

// The rotation by +angle (rope) or -angle (rope_backward) of src (T, N, D) into dst.
void rotate(const char* op, const char* src_name, const char* dst_name, const Tensor& src,
            const Tensor& positions, const Tensor& dst, const RopeParams& p, bool inverse,
            const Stream& stream) {
  check_dtype(op, src_name, src, {DType::f32});
  check_ndim(op, src_name, src, 3);
  const int64_t T = src.size(0), D = src.size(2);
  TANDEM_CHECK(D > 0 && D % 2 == 0 && D <= cpu::kRopeMaxHeadDim,
               "{}: {} {} has head size {}: it must be even and at most {}", op, src_name,
               src.shape().str(), D, cpu::kRopeMaxHeadDim);
  check_dtype(op, "positions", positions, {DType::i32});
  check_shape(op, "positions", positions, {T});
  check_dtype(op, dst_name, dst, {DType::f32});
  check_shape(op, dst_name, dst, src.shape());
  check_device(op, src.device(), {&src, &positions, &dst});
  check_stream(op, src.device(), stream);
  TANDEM_CHECK(p.theta > 0.0f, "{}: theta is {}, it must be positive", op, p.theta);
  if (p.factor != 0.0f) {
    TANDEM_CHECK(p.factor > 0.0f && p.low_freq_factor > 0.0f &&
                     p.high_freq_factor > p.low_freq_factor && p.original_max_position > 0,
                 "{}: Llama-3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                 "and original_max_position > 0; got factor {}, low_freq_factor {}, "
                 "high_freq_factor {}, original_max_position {}",
                 op, p.factor, p.low_freq_factor, p.high_freq_factor, p.original_max_position);
  }
#if TANDEM_HAS_CUDA
  if (src.device().is_cuda()) {
    cuda::RopeFreqs freqs{};
    cpu::rope_inv_freq(D, p, freqs.inv_freq);
    cuda::rope(src.data_as<float>(), positions.data_as<int32_t>(), dst.data_as<float>(), T,
               src.size(1), D, freqs, inverse, stream.handle);
    return;
  }
#else
  TANDEM_ON_CUDA(src.device(), rope);
#endif
  float inv_freq[cpu::kRopeMaxHeadDim / 2];
  cpu::rope_inv_freq(D, p, inv_freq);
  cpu::rope(src, positions, dst, inv_freq, inverse);
}

}  // namespace

void rope(const Tensor& x, const Tensor& positions, const Tensor& out, const RopeParams& p,
          const Stream& stream) {
  const OpTimer timer("rope");
  rotate("rope", "x", "out", x, positions, out, p, /*inverse=*/false, stream);
}

void rope_backward(const Tensor& dout, const Tensor& positions, const Tensor& dx,
                   const RopeParams& p, const Stream& stream) {
  const OpTimer timer("rope_backward");
  rotate("rope_backward", "dout", "dx", dout, positions, dx, p, /*inverse=*/true, stream);
}

}  // namespace tandem::ops
