// CPU embedding gather (rows in parallel) and backward (columns in parallel, tokens in order).
#include "kernels/cpu/embedding.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/parallel.h"

namespace tandem::ops::cpu {
namespace {

// Columns per task of the backward: 64 floats, so no two threads share a cache line of dtable.
constexpr int64_t kColumnBlock = 64;
// Elements per thread at least, so that tiny calls stay on one thread.
constexpr int64_t kMinElementsPerThread = 1 << 14;

template <class W>
int64_t gather(const int32_t* ids, const W* table, float* out, int64_t T, int64_t V, int64_t C) {
  std::atomic<int64_t> first_bad{T};
  parallel_for(
      T,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t id = ids[t];
          float* o = out + t * C;  // (C)
          if (id < 0 || id >= V) {
            std::fill(o, o + C, 0.0f);
            int64_t seen = first_bad.load();
            while (t < seen && !first_bad.compare_exchange_weak(seen, t)) {
            }
            continue;
          }
          const W* row = table + id * C;  // (C)
          for (int64_t c = 0; c < C; ++c) o[c] = static_cast<float>(row[c]);
        }
      },
      std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(C, 1)));
  const int64_t bad = first_bad.load();
  return bad < T ? bad : -1;
}

}  // namespace

int64_t first_bad_id(const Tensor& ids, int64_t V) {
  const int32_t* p = ids.data_as<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    if (p[t] < 0 || p[t] >= V) return t;
  return -1;
}

int64_t embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  const int64_t T = ids.numel(), V = table.size(0), C = table.size(1);
  const int32_t* id = ids.data_as<int32_t>();
  float* o = out.data_as<float>();
  if (table.dtype() == DType::bf16) return gather(id, table.data_as<bf16>(), o, T, V, C);
  return gather(id, table.data_as<float>(), o, T, V, C);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable,
                        bool accumulate) {
  const int64_t T = ids.numel(), V = dtable.size(0), C = dtable.size(1);
  const int32_t* id = ids.data_as<int32_t>();
  const float* g = dout.data_as<float>();  // (T, C)
  float* d = dtable.data_as<float>();      // (V, C)
  if (!accumulate) {
    parallel_for(
        V,
        [&](int64_t begin, int64_t end) {
          std::memset(d + begin * C, 0, static_cast<size_t>((end - begin) * C) * sizeof(float));
        },
        std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(C, 1)));
  }
  // Each task owns a block of columns of every row and walks the tokens in order, so every
  // element of dtable receives its contributions in token order whatever the thread count.
  const int64_t blocks = (C + kColumnBlock - 1) / kColumnBlock;
  parallel_for(blocks, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kColumnBlock, c1 = std::min(C, end * kColumnBlock);
    for (int64_t t = 0; t < T; ++t) {
      float* row = d + static_cast<int64_t>(id[t]) * C;
      const float* src = g + t * C;
      for (int64_t c = c0; c < c1; ++c) row[c] += src[c];
    }
  });
}

}  // namespace tandem::ops::cpu
