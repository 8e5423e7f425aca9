// logprob_gather and logprob_gather_backward: checks and dispatch.
#include <cmath>

#include "core/error.h"
#include "kernels/check.h"
#include "kernels/cpu/logprob.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/logprob.h"
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
  const auto [T, V] = check_logits(op, logits);
  check_tensor(op, "targets", targets, DType::i32, {T});
  check_f32(op, "logprob", logprob, {T});
  check_f32(op, "lse", lse, {T});
  if (entropy.defined()) check_f32(op, "entropy", entropy, {T});
  check_temperature(op, temperature);
  check_placement(op, logits.device(), {&logits, &targets, &logprob, &lse, &entropy}, stream);
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
  const auto [T, V] = check_logits(op, logits);
  check_f32(op, "dlogprob", dlogprob, {T});
  if (dentropy.defined()) check_f32(op, "dentropy", dentropy, {T});
  check_tensor(op, "targets", targets, DType::i32, {T});
  check_f32(op, "lse", lse, {T});
  check_f32(op, "dlogits", dlogits, {T, V});
  check_temperature(op, temperature);
  check_placement(op, logits.device(), {&dlogprob, &dentropy, &logits, &targets, &lse, &dlogits},
                  stream);
  TANDEM_ON_CUDA(logits.device(), logprob_gather_backward, dlogprob.data_as<float>(),
                 dentropy.defined() ? dentropy.data_as<float>() : nullptr, logits.data_as<float>(),
                 targets.data_as<int32_t>(), lse.data_as<float>(), dlogits.data_as<float>(), T, V,
                 temperature, accumulate, stream.handle);
  cpu::logprob_gather_backward(dlogprob, dentropy, logits, targets, lse, dlogits, temperature,
                               accumulate);
}

void logprob_shard_maxima(const Tensor& logits, const Tensor& maxima, const Stream& stream) {
  const OpTimer timer("logprob_shard_maxima");
  constexpr const char* op = "logprob_shard_maxima";
  const auto [T, V] = check_logits(op, logits);
  check_f32(op, "maxima", maxima, {T});
  check_placement(op, logits.device(), {&logits, &maxima}, stream);
  TANDEM_CHECK(logits.device().is_cpu(), "{}: a vocabulary-parallel head runs on the CPU only", op);
  cpu::logprob_shard_maxima(logits, maxima);
}

void logprob_shard_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                         const Tensor& all_maxima, const Tensor& stats, float temperature,
                         const Stream& stream) {
  const OpTimer timer("logprob_shard_stats");
  constexpr const char* op = "logprob_shard_stats";
  const auto [T, V] = check_logits(op, logits);
  check_tensor(op, "targets", targets, DType::i32, {T});
  TANDEM_CHECK(all_maxima.ndim() == 2 && all_maxima.size(0) >= 1 && all_maxima.size(1) == T,
               "{}: all_maxima must be (tp, T = {}), got {}", op, T, all_maxima.shape().str());
  check_f32(op, "all_maxima", all_maxima, {all_maxima.size(0), T});
  check_f32(op, "stats", stats, {T, 4});
  check_temperature(op, temperature);
  TANDEM_CHECK(vocab_begin >= 0, "{}: vocab_begin {} is negative", op, vocab_begin);
  check_placement(op, logits.device(), {&logits, &targets, &all_maxima, &stats}, stream);
  TANDEM_CHECK(logits.device().is_cpu(), "{}: a vocabulary-parallel head runs on the CPU only", op);
  cpu::logprob_shard_stats(logits, targets, vocab_begin, all_maxima, stats, temperature);
}

void logprob_shard_combine(const Tensor& all_maxima, const Tensor& all_stats, const Tensor& logprob,
                           const Tensor& lse, const Tensor& entropy, float temperature,
                           const Stream& stream) {
  const OpTimer timer("logprob_shard_combine");
  constexpr const char* op = "logprob_shard_combine";
  TANDEM_CHECK(all_maxima.ndim() == 2 && all_maxima.size(0) >= 1,
               "{}: all_maxima must be (tp, T), got {}", op, all_maxima.shape().str());
  const int64_t tp = all_maxima.size(0), T = all_maxima.size(1);
  check_f32(op, "all_maxima", all_maxima, {tp, T});
  check_f32(op, "all_stats", all_stats, {tp, T, 4});
  check_f32(op, "logprob", logprob, {T});
  check_f32(op, "lse", lse, {T});
  if (entropy.defined()) check_f32(op, "entropy", entropy, {T});
  check_temperature(op, temperature);
  check_placement(op, all_maxima.device(), {&all_maxima, &all_stats, &logprob, &lse, &entropy},
                  stream);
  TANDEM_CHECK(all_maxima.device().is_cpu(), "{}: a vocabulary-parallel head runs on the CPU only",
               op);
  cpu::logprob_shard_combine(all_maxima, all_stats, logprob, lse, entropy, temperature);
}

void logprob_shard_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_begin, const Tensor& lse,
                            const Tensor& entropy, const Tensor& dlogits, float temperature,
                            bool accumulate, const Stream& stream) {
  const OpTimer timer("logprob_shard_backward");
  constexpr const char* op = "logprob_shard_backward";
  const auto [T, V] = check_logits(op, logits);
  check_f32(op, "dlogprob", dlogprob, {T});
  check_tensor(op, "targets", targets, DType::i32, {T});
  check_f32(op, "lse", lse, {T});
  if (dentropy.defined()) {
    check_f32(op, "dentropy", dentropy, {T});
    check_f32(op, "entropy", entropy, {T});
  }
  check_f32(op, "dlogits", dlogits, {T, V});
  check_temperature(op, temperature);
  TANDEM_CHECK(vocab_begin >= 0, "{}: vocab_begin {} is negative", op, vocab_begin);
  check_placement(op, logits.device(),
                  {&dlogprob, &dentropy, &logits, &targets, &lse, &entropy, &dlogits}, stream);
  TANDEM_CHECK(logits.device().is_cpu(), "{}: a vocabulary-parallel head runs on the CPU only", op);
  cpu::logprob_shard_backward(dlogprob, dentropy, logits, targets, vocab_begin, lse, entropy,
                              dlogits, temperature, accumulate);
}

}  // namespace tandem::ops
