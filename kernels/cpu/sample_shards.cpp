// CPU sampling over vocabulary shards: each phase of kernels/sample_shard_rows.h over the rows, a
// range of rows per task. Built for the baseline x86-64 only: GCC 12's AVX2 copy of the row code
// (target_clones, kernels/cpu/clones.h) dropped terms of the masses.
#include <cstdint>

#include "core/parallel.h"
#include "kernels/cpu/sample.h"

namespace tandem::ops::cpu {
namespace {

using shards::ShardArgs;

template <class Row>
void each_row(int64_t B, const Row& row) {
  parallel_for(B, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) row(b);
  });
}

}  // namespace

void sample_shard_maxima(const ShardArgs& a, float* maxima, uint8_t* kinds) {
  each_row(a.B, [&](int64_t b) { shards::maxima_row(a, b, maxima, kinds); });
}

void sample_shard_stats(const ShardArgs& a, float* z, float* e, float* stats) {
  each_row(a.B, [&](int64_t b) { shards::stats_row(a, b, z, e, stats); });
}

void sample_shard_chain(const ShardArgs& a, int hop, float* chain) {
  each_row(a.B, [&](int64_t b) { shards::chain_row(a, b, hop, chain); });
}

void sample_shard_counts(const ShardArgs& a, float* counts, float* bounds) {
  each_row(a.B, [&](int64_t b) { shards::counts_row(a, b, counts, bounds); });
}

void sample_shard_candidates(const ShardArgs& a, float* cands) {
  each_row(a.B, [&](int64_t b) { shards::candidates_row(a, b, cands); });
}

void sample_shard_decide(const ShardArgs& a, int32_t* token, float* logprob, float* draws) {
  each_row(a.B, [&](int64_t b) { shards::decide_row(a, b, token, logprob, draws); });
}

void sample_shard_draws(const uint8_t* kinds, const float* all_draws, int64_t B, int32_t* token,
                        float* logprob) {
  for (int64_t b = 0; b < B; ++b) shards::draws_row(kinds, all_draws, b, token, logprob);
}

}  // namespace tandem::ops::cpu
