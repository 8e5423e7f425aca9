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

void detail::check_sampling_tensors(const char* op, const SamplingTensors& s, int64_t B) {
  check_f32(op, "temperature", s.temperature, {B});
  check_tensor(op, "top_k", s.top_k, DType::i32, {B});
  check_f32(op, "top_p", s.top_p, {B});
  check_f32(op, "min_p", s.min_p, {B});
  check_tensor(op, "seed", s.seed, DType::i64, {B});
  check_tensor(op, "offset", s.offset, DType::i64, {B});
}

void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob, const Stream& stream) {
  constexpr const char* op = "sample";
  const auto [B, V] = check_logits(op, logits);
  TANDEM_CHECK(V <= (int64_t{1} << 31) - 1, "{}: logits {} has more than 2^31 - 1 tokens", op,
               logits.shape().str());
  check_sampling_tensors(op, settings, B);
  check_tensor(op, "token", token, DType::i32, {B});
  check_f32(op, "logprob", logprob, {B});
  check_device(op, logits.device(),
               {&logits, &settings.temperature, &settings.top_k, &settings.top_p, &settings.min_p,
                &settings.seed, &settings.offset, &token, &logprob});
  check_stream(op, logits.device(), stream);
  const SamplingTensors& s = settings;
  TANDEM_ON_CUDA(logits.device(), sample, logits.data_as<float>(), B, V,
                 s.temperature.data_as<float>(), s.top_k.data_as<int32_t>(),
                 s.top_p.data_as<float>(), s.min_p.data_as<float>(), s.seed.data_as<int64_t>(),
                 s.offset.data_as<int64_t>(), token.data_as<int32_t>(), logprob.data_as<float>(),
                 stream.handle);
  cpu::sample(logits, settings, token, logprob);
}

}  // namespace tandem::ops
