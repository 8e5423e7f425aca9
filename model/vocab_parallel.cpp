#include "model/vocab_parallel.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::model {

void vocab_parallel_logprob(Communicator& tp, const Tensor& logits, const Tensor& targets,
                            int64_t vocab_begin, int64_t vocab_size, const Tensor& logprob,
                            const Tensor& lse, const Tensor& entropy, float temperature) {
  TANDEM_CHECK(logits.ndim() == 2, "vocab_parallel_logprob: logits must be (T, Vs), got {}",
               logits.shape());
  const int64_t T = logits.size(0), Vs = logits.size(1);
  TANDEM_CHECK(vocab_begin >= 0 && vocab_begin + Vs <= vocab_size,
               "vocab_parallel_logprob: columns [{}, {}) are not in a vocabulary of {}",
               vocab_begin, vocab_begin + Vs, vocab_size);
  const int32_t* tg = targets.data_as<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    TANDEM_CHECK(tg[t] >= 0 && tg[t] < vocab_size,
                 "vocab_parallel_logprob: row {} has target id {}, outside the vocabulary [0, {})",
                 t, tg[t], vocab_size);

  Tensor stats = Tensor::empty({T, 4}, DType::f32);
  ops::logprob_shard_stats(logits, targets, vocab_begin, stats, temperature);
  const float* st = stats.data_as<float>();
  Tensor max = Tensor::empty({T}, DType::f32);
  float* m = max.data_as<float>();
  for (int64_t t = 0; t < T; ++t) m[t] = st[t * 4];
  tp.all_reduce(max, ReduceOp::max);

  // Each rank's sums rescaled to the global max: sum e^(z - M) = f s and
  // sum e^(z - M) (z - M) = f (ey + (m_r - M) s) with f = e^(m_r - M); the target's z, and
  // whether this rank holds the target (the sum over the ranks must be 1).
  Tensor sums = Tensor::empty({T, 4}, DType::f32);
  float* u = sums.data_as<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* o = st + t * 4;
    const float shift = o[0] - m[t];  // <= 0; -inf - -inf (a row of -inf everywhere) is NaN
    const float f = shift == shift ? std::exp(shift) : 0.0f;
    const int64_t local = tg[t] - vocab_begin;
    u[t * 4 + 0] = f * o[1];
    u[t * 4 + 1] = f > 0.0f ? f * (o[2] + shift * o[1]) : 0.0f;
    u[t * 4 + 2] = o[3];
    u[t * 4 + 3] = local >= 0 && local < Vs ? 1.0f : 0.0f;
  }
  tp.all_reduce(sums);

  float* lp = logprob.data_as<float>();
  float* ls = lse.data_as<float>();
  float* ent = entropy.defined() ? entropy.data_as<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const float* g = u + t * 4;
    TANDEM_CHECK(g[3] == 1.0f,
                 "vocab_parallel_logprob: row {}'s target id {} is held by {} ranks' columns, not "
                 "one: the ranks' vocabulary ranges must split [0, {}) exactly",
                 t, tg[t], g[3], vocab_size);
    const float log_sum = std::log(g[0]);
    ls[t] = m[t] + log_sum;
    lp[t] = g[2] - ls[t];
    if (ent) ent[t] = log_sum - g[1] / g[0];
  }
}

}  // namespace tandem::model
