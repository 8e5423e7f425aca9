// CPU logprob_gather and its backward, and the row softmax statistics that sample shares.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/cpu/clones.h"
#include "kernels/cuda/logprob.h"  // the arithmetic CPU and CUDA share (free of CUDA itself)

namespace tandem::ops::cpu {

// Row reductions run over 16 lanes: lane j sums the elements v = j (mod 16) in increasing v,
// then the lanes combine in a fixed tree (8, 4, 2, 1). The order depends on V alone.
inline constexpr int kSoftmaxLanes = 16;

// Max, sum of exp and log-sum-exp of x (V) / temperature, and the entropy when asked.
// logprob_gather and sample call this one function, so their logprobs agree bit for bit.
RowSoftmax row_softmax(const float* x, int64_t V, float temperature, bool with_entropy);

// Checks that every target lies in [0, V); throws naming the op, the row and the id.
void check_targets(const char* op, const int32_t* targets, int64_t T, int64_t V);

void logprob_gather(const Tensor& logits, const Tensor& targets, const Tensor& logprob,
                    const Tensor& lse, const Tensor& entropy, float temperature);
void logprob_gather_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                             const Tensor& targets, const Tensor& lse, const Tensor& dlogits,
                             float temperature, bool accumulate);
void logprob_shard_maxima(const Tensor& logits, const Tensor& maxima);
void logprob_shard_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                         const Tensor& all_maxima, const Tensor& stats, float temperature);
void logprob_shard_combine(const Tensor& all_maxima, const Tensor& all_stats, const Tensor& logprob,
                           const Tensor& lse, const Tensor& entropy, float temperature);
void logprob_shard_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_begin, const Tensor& lse,
                            const Tensor& entropy, const Tensor& dlogits, float temperature,
                            bool accumulate);

}  // namespace tandem::ops::cpu
