// What the CPU attention's forward and decode (attention.cpp) and its backward
// (attention_backward.cpp) share: the key block, per-thread scratch, the work-item loop, the
// packed batch's sequences with their shared prefixes, and the AVX-512 row transpose.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::ops::cpu::attention_detail {

constexpr int kBlk = static_cast<int>(kAttentionKeyBlock);
static_assert(kBlk == 16, "the row step keeps one key block in one 16-lane register");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread scratch that grows once to the largest shape seen; 64-byte aligned. Slots 0-3.
float* scratch_floats(int slot, size_t n);

// Multiply-adds below which a call runs on one thread: waking the pool costs more than it saves.
constexpr double kMinMacsPerThread = 1 << 20;

// Calls f(w, w + 1) for every work item w of [0, n), handing the items out one at a time from a
// shared counter, so that a thread that loses its core delays one item rather than half of the
// work. Every item is computed by one thread from its inputs alone: the results do not depend
// on which thread takes which item, nor on the thread count. macs: the call's work, roughly.
template <class F>
void parallel_items(int64_t n, double macs, F&& f) {
  const int64_t by_work = static_cast<int64_t>(macs / kMinMacsPerThread) + 1;
  const int64_t threads = std::min({n, by_work, static_cast<int64_t>(num_threads())});
  std::atomic<int64_t> next{0};
  parallel_for(threads, [&](int64_t, int64_t) {
    for (int64_t w = next.fetch_add(1); w < n; w = next.fetch_add(1)) f(w, w + 1);
  });
}

// ---------------------------------------------------------------------------------------------
// Sequences of a packed batch, with their shared prefixes.

// A sequence's rows [start, start + len) and its prefix's rows [ctx_start, ctx_start + ctx_len)
// (ctx_len 0: none). Its token i sits at position ctx_len + i; key position p is token row
// key_row(p).
struct SeqSpan {
  int64_t start, len, ctx_start, ctx_len;
  int64_t key_row(int64_t p) const { return p < ctx_len ? ctx_start + p : start + p - ctx_len; }
};

// The sequences, and for each one the sequences it prefixes (CSR: children[child_ptr[b] ..
// child_ptr[b + 1]), in increasing order).
struct Sequences {
  std::vector<SeqSpan> seqs;
  std::vector<int64_t> child_ptr, children;
};

// Reads and checks cu_seqlens and prefix (undefined: no prefixes); reuses the calling thread's
// buffers.
const Sequences& read_sequences(const char* op, const Tensor& cu_seqlens, const Tensor& prefix,
                                int64_t T);

// Work items of the packed kernels: (sequence, kv head, pair of query tiles). Tile p is paired
// with tile (tiles - 1 - p) so that every item costs about the same under the causal mask.
struct TileItem {
  int64_t seq;
  SeqSpan span;
  int64_t kvh, tile_a, tile_b;  // tile_b == tile_a: one tile only
};

// The items of a batch; reuses the calling thread's buffer.
const std::vector<TileItem>& tile_items(const Sequences& s, int64_t Hkv);

// Multiply-adds of the forward: 2 * (len^2 / 2 + len * ctx_len) * H * D per sequence.
double causal_macs(const Sequences& s, int64_t H, int64_t D);

// dst (D, 16) = the n rows (D floats each) transposed, lanes >= n zero; D a multiple of 16, in
// 16 x 16 register blocks (data movement only: the same floats).
__attribute__((target("avx512f"))) void transpose_rows_avx512(const float* const* rows, int n,
                                                              int64_t D, float* dst);

}  // namespace tandem::ops::cpu::attention_detail
