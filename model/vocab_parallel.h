// Logprobs and entropies under a head whose vocabulary is split over a tensor-parallel group
// (Megatron's vocab-parallel cross-entropy): each rank holds the logits of its vocabulary columns
// only, and two all-reduces of per-row statistics (T floats, then 4T) combine them; the logits are
// never gathered. The backward needs no communication: ops::logprob_shard_backward with the lse
// and entropy computed here gives each rank its columns of the gradient.
#pragma once

#include <cstdint>

#include "core/comm.h"
#include "core/tensor.h"

namespace tandem::model {

// logits (T, Vs) f32 on the CPU: columns [vocab_begin, vocab_begin + Vs) of a vocabulary of
// vocab_size ids, the ranks of `tp` together holding each column once; targets (T) i32 ids of the
// whole vocabulary. Writes on every rank logprob (T), lse (T) and, when defined, entropy (T) of
// z = logits / temperature over the whole vocabulary: the values ops::logprob_gather gives on the
// gathered logits, but for f32 rounding (the sums are split by rank). Throws naming the row when a
// target lies outside the vocabulary or the ranks' columns do not hold it exactly once.
void vocab_parallel_logprob(Communicator& tp, const Tensor& logits, const Tensor& targets,
                            int64_t vocab_begin, int64_t vocab_size, const Tensor& logprob,
                            const Tensor& lse, const Tensor& entropy, float temperature = 1.0f);

}  // namespace tandem::model
