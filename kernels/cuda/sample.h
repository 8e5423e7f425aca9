// CUDA sampling on raw pointers: over the whole vocabulary one block per row, thresholds by
// binary search, no sort; over vocabulary shards the phases of kernels/sample_shard_rows.h, one
// thread per row.
#pragma once

#include <cstdint>

#include "kernels/sample_shard_rows.h"

namespace tandem::ops::cuda {

// logits (B, V); settings (B) each; token (B) i32, logprob (B) f32. A row with bad settings gets
// token -1 and a NaN logprob (the CPU op throws instead; the device is not synchronised).
void sample(const float* logits, int64_t B, int64_t V, const float* temperature,
            const int32_t* top_k, const float* top_p, const float* min_p, const int64_t* seed,
            const int64_t* offset, int32_t* token, float* logprob, void* stream);

// ops::sample_shard_*: every pointer of `a` and the outputs on the device. A row with bad settings
// gets kind invalid (the CPU op throws instead).
void sample_shard_maxima(const shards::ShardArgs& a, float* maxima, uint8_t* kinds, void* stream);
void sample_shard_stats(const shards::ShardArgs& a, float* z, float* e, float* stats, void* stream);
void sample_shard_chain(const shards::ShardArgs& a, int hop, float* chain, void* stream);
void sample_shard_counts(const shards::ShardArgs& a, float* counts, float* bounds, void* stream);
void sample_shard_candidates(const shards::ShardArgs& a, float* cands, void* stream);
void sample_shard_decide(const shards::ShardArgs& a, int32_t* token, float* logprob, float* draws,
                         void* stream);
void sample_shard_draws(const uint8_t* kinds, const float* all_draws, int64_t B, int32_t* token,
                        float* logprob, void* stream);

}  // namespace tandem::ops::cuda
