// sample: checks and dispatch.
#include "kernels/cpu/sample.h"
#include "core/error.h"
#include "kernels/check.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/sample.h"
#endif

namespace tandem::ops {

using namespace detail;

void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob, const Stream& stream) {
  constexpr const char* op = "sample";
  check_dtype(op, "logits", logits, {DType::f32});
  check_ndim(op, "logits", logits, 2);
  const int64_t B = logits.size(0), V = logits.size(1);
  TANDEM_CHECK(V > 0, "{}: logits {} has an empty vocabulary", op, logits.shape().str());
  TANDEM_CHECK(V <= (int64_t{1} << 31) - 1, "{}: logits {} has more than 2^31 - 1 tokens", op,
               logits.shape().str());
  const SamplingTensors& s = settings;
  check_dtype(op, "temperature", s.temperature, {DType::f32});
  check_shape(op, "temperature", s.temperature, {B});
  check_dtype(op, "top_k", s.top_k, {DType::i32});
  check_shape(op, "top_k", s.top_k, {B});
  check_dtype(op, "top_p", s.top_p, {DType::f32});
  check_shape(op, "top_p", s.top_p, {B});
  check_dtype(op, "min_p", s.min_p, {DType::f32});
  check_shape(op, "min_p", s.min_p, {B});
  check_dtype(op, "seed", s.seed, {DType::i64});
  check_shape(op, "seed", s.seed, {B});
  check_dtype(op, "offset", s.offset, {DType::i64});
  check_shape(op, "offset", s.offset, {B});
  check_dtype(op, "token", token, {DType::i32});
  check_shape(op, "token", token, {B});
  check_dtype(op, "logprob", logprob, {DType::f32});
  check_shape(op, "logprob", logprob, {B});
  check_device(op, logits.device(),
               {&logits, &s.temperature, &s.top_k, &s.top_p, &s.min_p, &s.seed, &s.offset, &token,
                &logprob});
  check_stream(op, logits.device(), stream);
  TANDEM_ON_CUDA(logits.device(), sample, logits.data_as<float>(), B, V,
                 s.temperature.data_as<float>(), s.top_k.data_as<int32_t>(),
                 s.top_p.data_as<float>(), s.min_p.data_as<float>(), s.seed.data_as<int64_t>(),
                 s.offset.data_as<int64_t>(), token.data_as<int32_t>(), logprob.data_as<float>(),
                 stream.handle);
  cpu::sample(logits, settings, token, logprob);
}

}  // namespace tandem::ops
