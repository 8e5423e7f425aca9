// logprob_gather and logprob_gather_backward: checks and dispatch.
#include <cmath>

#include "core/error.h"
#include "kernels/check.h"
#include "kernels/cpu/logprob.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/logprob.h"
#include "kernels/op_timing.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

void check_temperature(const char* op, float temperature) {
  TANDEM_CHECK(temperature > 0.0f && std::isfinite(temperature),
               "{}: temperature {} must be positive and finite", op, temperature);
}

}  // namespace

void logprob_gather(const Tensor& logits, const Tensor& targets, const Tensor& logprob,
                    const Tensor& lse, const Tensor& entropy, float temperature,
                    const Stream& stream) {
  const OpTimer timer("logprob_gather");
  constexpr const char* op = "logprob_gather";
  check_dtype(op, "logits", logits, {DType::f32});
  check_ndim(op, "logits", logits, 2);
  const int64_t T = logits.size(0), V = logits.size(1);
  TANDEM_CHECK(V > 0, "{}: logits {} has an empty vocabulary", op, logits.shape().str());
  check_dtype(op, "targets", targets, {DType::i32});
  check_shape(op, "targets", targets, {T});
  check_dtype(op, "logprob", logprob, {DType::f32});
  check_shape(op, "logprob", logprob, {T});
  check_dtype(op, "lse", lse, {DType::f32});
  check_shape(op, "lse", lse, {T});
  if (entropy.defined()) {
    check_dtype(op, "entropy", entropy, {DType::f32});
    check_shape(op, "entropy", entropy, {T});
  }
  check_temperature(op, temperature);
  check_device(op, logits.device(), {&logits, &targets, &logprob, &lse, &entropy});
  check_stream(op, logits.device(), stream);
  TANDEM_ON_CUDA(logits.device(), logprob_gather, logits.data_as<float>(),
                 targets.data_as<int32_t>(), logprob.data_as<float>(), lse.data_as<float>(),
                 entropy.defined() ? entropy.data_as<float>() : nullptr, T, V, temperature,
                 stream.handle);
  cpu::logprob_gather(logits, targets, logprob, lse, entropy, temperature);
}

void logprob_gather_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                             const Tensor& targets, const Tensor& lse, const Tensor& dlogits,
                             float temperature, bool accumulate, const Stream& stream) {
  const OpTimer timer("logprob_gather_backward");
  constexpr const char* op = "logprob_gather_backward";
  check_dtype(op, "logits", logits, {DType::f32});
  check_ndim(op, "logits", logits, 2);
  const int64_t T = logits.size(0), V = logits.size(1);
  TANDEM_CHECK(V > 0, "{}: logits {} has an empty vocabulary", op, logits.shape().str());
  check_dtype(op, "dlogprob", dlogprob, {DType::f32});
  check_shape(op, "dlogprob", dlogprob, {T});
  if (dentropy.defined()) {
    check_dtype(op, "dentropy", dentropy, {DType::f32});
    check_shape(op, "dentropy", dentropy, {T});
  }
  check_dtype(op, "targets", targets, {DType::i32});
  check_shape(op, "targets", targets, {T});
  check_dtype(op, "lse", lse, {DType::f32});
  check_shape(op, "lse", lse, {T});
  check_dtype(op, "dlogits", dlogits, {DType::f32});
  check_shape(op, "dlogits", dlogits, {T, V});
  check_temperature(op, temperature);
  check_device(op, logits.device(), {&dlogprob, &dentropy, &logits, &targets, &lse, &dlogits});
  check_stream(op, logits.device(), stream);
  TANDEM_ON_CUDA(logits.device(), logprob_gather_backward, dlogprob.data_as<float>(),
                 dentropy.defined() ? dentropy.data_as<float>() : nullptr, logits.data_as<float>(),
                 targets.data_as<int32_t>(), lse.data_as<float>(), dlogits.data_as<float>(), T, V,
                 temperature, accumulate, stream.handle);
  cpu::logprob_gather_backward(dlogprob, dentropy, logits, targets, lse, dlogits, temperature,
                               accumulate);
}

}  // namespace tandem::ops
