// Logprobs and entropies under a head whose vocabulary is split over a tensor-parallel group
// (Megatron's vocab-parallel cross-entropy): each rank holds the logits of its vocabulary columns
// only, and two all-gathers of per-row statistics (tp T floats, then 4 tp T) combine them; the
// logits are never gathered. The row's max and lse are those of sampling over shards
// (kernels/vocab_shards.h; model/tp_sample.h): for the same logits a tensor-parallel rollout's
// logprob of a token and this one are the same bits. The backward needs no communication:
// ops::logprob_shard_backward with the lse and entropy computed here gives each rank its columns
// of the gradient.
#pragma once

#include <cstdint>

#include "core/comm.h"
#include "core/tensor.h"

namespace tandem::model {

// logits (T, Vs) f32 on the CPU: columns [vocab_begin, vocab_begin + Vs) of a vocabulary of
// vocab_size ids, the ranks of `tp` together holding each column once; targets (T) i32 ids of the
// whole vocabulary. Writes on every rank logprob (T), lse (T) and, when defined, entropy (T) of
// z = logits / temperature over the whole vocabulary: the values ops::logprob_gather gives on the
// gathered logits, but for f32 rounding (the sums are split by rank, then added in rank order).
// The same bits on every rank, whatever the order in which the group's library reduces. Throws
// naming the row when a target lies outside the vocabulary or the ranks' columns do not hold it
// exactly once.
void vocab_parallel_logprob(Communicator& tp_group, const Tensor& logits, const Tensor& targets,
                            int64_t vocab_begin, int64_t vocab_size, const Tensor& logprob,
                            const Tensor& lse, const Tensor& entropy, float temperature = 1.0f);

}  // namespace tandem::model
