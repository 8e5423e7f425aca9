#include "model/vocab_parallel.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::model {

void vocab_parallel_logprob(Communicator& tp_group, const Tensor& logits, const Tensor& targets,
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

  // Two all-gathers of the rows' statistics, combined in rank order on every rank: the maxima,
  // (tp, T) f32, then each rank's sums against the whole row's max, (tp, T, 4) f32. The row's
  // max z, sum and lse are kernels/vocab_shards.h's (through ops::logprob_shard_*), as sampling
  // over shards has them (model/tp_sample.h): the logprob a tensor-parallel rollout reports for a
  // token is this one's bits. (An all-reduce would leave the order of the ranks' sums to the
  // library.)
  const int tp = tp_group.size();
  Tensor maxima = Tensor::empty({T}, DType::f32), all_maxima = Tensor::empty({tp, T}, DType::f32);
  ops::logprob_shard_maxima(logits, maxima);
  tp_group.all_gather(maxima, all_maxima.view({tp * T}));
  Tensor stats = Tensor::empty({T, 4}, DType::f32),
         all_stats = Tensor::empty({tp, T, 4}, DType::f32);
  ops::logprob_shard_stats(logits, targets, vocab_begin, all_maxima, stats, temperature);
  tp_group.all_gather(stats.view({T * 4}), all_stats.view({tp * T * 4}));

  const float* g = all_stats.data_as<float>();
  for (int64_t t = 0; t < T; ++t) {
    int holders = 0;
    for (int r = 0; r < tp; ++r) holders += g[(r * T + t) * 4 + 3] != 0.0f ? 1 : 0;
    TANDEM_CHECK(holders == 1,
                 "vocab_parallel_logprob: row {}'s target id {} is held by {} ranks' columns, not "
                 "one: the ranks' vocabulary ranges must split [0, {}) exactly",
                 t, tg[t], holders, vocab_size);
  }
  ops::logprob_shard_combine(all_maxima, all_stats, logprob, lse, entropy, temperature);
}

}  // namespace tandem::model
