// CPU sampling (arguments already checked; the settings are checked row by row here), over the
// whole vocabulary and over vocabulary shards.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/ops.h"
#include "kernels/sample_shard_rows.h"

namespace tandem::ops::cpu {

// Throws naming the first row whose settings are outside their ranges (ops::sample).
void check_sampling_settings(const SamplingTensors& settings);

void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob);
// ops::count_at_least, count_greater and mass_at_least (kernels/sample_shard_rows.h) built per
// vector width for sample's searches.
int64_t count_at_least(const float* z, int64_t n, float t);
int64_t count_greater(const float* z, int64_t n, float t);
float mass_at_least(const float* z, const float* e, int64_t n, float t);

// The phases of ops::sample_shard_* (kernels/sample_shard_rows.h), a row per task; the settings
// were checked by sample_shard_maxima.
void sample_shard_maxima(const shards::ShardArgs& a, float* maxima, uint8_t* kinds);
void sample_shard_stats(const shards::ShardArgs& a, float* z, float* e, float* stats);
void sample_shard_chain(const shards::ShardArgs& a, int hop, float* chain);
void sample_shard_counts(const shards::ShardArgs& a, float* counts, float* bounds);
void sample_shard_candidates(const shards::ShardArgs& a, float* cands);
void sample_shard_decide(const shards::ShardArgs& a, int32_t* token, float* logprob, float* draws);
void sample_shard_draws(const uint8_t* kinds, const float* all_draws, int64_t B, int32_t* token,
                        float* logprob);

}  // namespace tandem::ops::cpu
