// CUDA sampling over vocabulary shards: each phase of kernels/sample_shard_rows.h as a kernel with
// one thread per row, the CPU op's arithmetic in the CPU op's order (the same bits). Simple, not
// fast: a row's scans run in one thread.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/sample.h"

namespace tandem::ops::cuda {
namespace {

using shards::ShardArgs;

constexpr int kThreads = 64;

// Calls row(b) for every row b < B, one thread each.
template <class Row>
__global__ void rows_kernel(int64_t B, Row row) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < B) row(b);
}

template <class Row>
void each_row(int64_t B, void* stream, Row row) {
  if (B == 0) return;
  rows_kernel<<<blocks_for(B, kThreads), kThreads, 0, native(stream)>>>(B, row);
  CUDA_CHECK_LAUNCH();
}

// The rows' phases as device functors (a lambda would need nvcc's --extended-lambda).
struct MaximaRow {
  ShardArgs a;
  float* maxima;
  uint8_t* kinds;
  __device__ void operator()(int64_t b) const { shards::maxima_row(a, b, maxima, kinds); }
};
struct StatsRow {
  ShardArgs a;
  float *z, *e, *stats;
  __device__ void operator()(int64_t b) const { shards::stats_row(a, b, z, e, stats); }
};
struct ChainRow {
  ShardArgs a;
  int hop;
  float* chain;
  __device__ void operator()(int64_t b) const { shards::chain_row(a, b, hop, chain); }
};
struct CountsRow {
  ShardArgs a;
  float *counts, *bounds;
  __device__ void operator()(int64_t b) const { shards::counts_row(a, b, counts, bounds); }
};
struct CandidatesRow {
  ShardArgs a;
  float* cands;
  __device__ void operator()(int64_t b) const { shards::candidates_row(a, b, cands); }
};
struct DecideRow {
  ShardArgs a;
  int32_t* token;
  float *logprob, *draws;
  __device__ void operator()(int64_t b) const { shards::decide_row(a, b, token, logprob, draws); }
};
struct DrawsRow {
  const uint8_t* kinds;
  const float* all_draws;
  int32_t* token;
  float* logprob;
  __device__ void operator()(int64_t b) const {
    shards::draws_row(kinds, all_draws, b, token, logprob);
  }
};

}  // namespace

void sample_shard_maxima(const ShardArgs& a, float* maxima, uint8_t* kinds, void* stream) {
  each_row(a.B, stream, MaximaRow{a, maxima, kinds});
}

void sample_shard_stats(const ShardArgs& a, float* z, float* e, float* stats, void* stream) {
  each_row(a.B, stream, StatsRow{a, z, e, stats});
}

void sample_shard_chain(const ShardArgs& a, int hop, float* chain, void* stream) {
  each_row(a.B, stream, ChainRow{a, hop, chain});
}

void sample_shard_counts(const ShardArgs& a, float* counts, float* bounds, void* stream) {
  each_row(a.B, stream, CountsRow{a, counts, bounds});
}

void sample_shard_candidates(const ShardArgs& a, float* cands, void* stream) {
  each_row(a.B, stream, CandidatesRow{a, cands});
}

void sample_shard_decide(const ShardArgs& a, int32_t* token, float* logprob, float* draws,
                         void* stream) {
  each_row(a.B, stream, DecideRow{a, token, logprob, draws});
}

void sample_shard_draws(const uint8_t* kinds, const float* all_draws, int64_t B, int32_t* token,
                        float* logprob, void* stream) {
  each_row(B, stream, DrawsRow{kinds, all_draws, token, logprob});
}

}  // namespace tandem::ops::cuda
