// CPU cast, scale, add, random_uniform and sum_squares.
#include "kernels/cpu/elementwise.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "core/philox.h"
#include "kernels/cpu/clones.h"

namespace tandem::ops::cpu {

// Lane j sums the squares of x[i], i = j (mod 16), in increasing i; the lanes then combine in
// the fixed tree (8, 4, 2, 1).
TANDEM_CPU_CLONES double chunk_sum_squares(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const double v = x[i + j];
      lane[j] = lane[j] + v * v;
    }
  for (int j = 0; i + j < n; ++j) {
    const double v = x[i + j];
    lane[j] = lane[j] + v * v;
  }
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] = lane[j] + lane[j + w];
  return lane[0];
}

namespace {

// Elements per chunk of a reduction: fixed, so the sum does not depend on the thread count.
constexpr int64_t kReduceChunk = 4096;

template <class S, class D>
void cast_typed(const Tensor& src, const Tensor& dst) {
  const S* s = static_cast<const S*>(src.data());
  D* d = static_cast<D*>(dst.data());
  parallel_for(
      src.numel(),
      [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const float f = static_cast<float>(s[i]);
          if constexpr (std::is_same_v<D, float>) {
            d[i] = f;
          } else {
            d[i] = D(f);
          }
        }
      },
      1 << 14);
}

template <class S>
void cast_from(const Tensor& src, const Tensor& dst) {
  switch (dst.dtype()) {
    case DType::f32:
      return cast_typed<S, float>(src, dst);
    case DType::bf16:
      return cast_typed<S, bf16>(src, dst);
    case DType::f16:
      return cast_typed<S, f16>(src, dst);
    default:
      TANDEM_FAIL("cast: unsupported dst dtype {}", dst.dtype());
  }
}

}  // namespace

void cast(const Tensor& src, const Tensor& dst) {
  switch (src.dtype()) {
    case DType::f32:
      return cast_from<float>(src, dst);
    case DType::bf16:
      return cast_from<bf16>(src, dst);
    case DType::f16:
      return cast_from<f16>(src, dst);
    default:
      TANDEM_FAIL("cast: unsupported src dtype {}", src.dtype());
  }
}

void scale(const Tensor& x, float s) {
  float* p = x.data_as<float>();
  parallel_for(
      x.numel(),
      [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) p[i] *= s;
      },
      1 << 14);
}

void add(const Tensor& x, const Tensor& out) {
  const float* a = x.data_as<float>();
  float* p = out.data_as<float>();
  parallel_for(
      x.numel(),
      [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) p[i] += a[i];
      },
      1 << 14);
}

void random_uniform(const Tensor& out, uint64_t seed, uint64_t stream_id) {
  float* p = out.data_as<float>();
  const int64_t n = out.numel();
  parallel_for((n + 3) / 4,
               [&](int64_t b, int64_t e) {
                 for (int64_t g = b; g < e; ++g) {
                   const Philox4x32 r = philox_random(seed, stream_id, static_cast<uint64_t>(g));
                   for (int64_t j = 0; j < 4 && 4 * g + j < n; ++j)
                     p[4 * g + j] = uniform_from_bits(r.v[j]);
                 }
               },
               1 << 12);
}

void sum_squares(const Tensor& x, const Tensor& out, bool accumulate) {
  const float* p = x.data_as<float>();
  const int64_t n = x.numel();
  const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  std::vector<double> partial(static_cast<size_t>(chunks));
  parallel_for(chunks, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c)
      partial[static_cast<size_t>(c)] =
          chunk_sum_squares(p + c * kReduceChunk, std::min(kReduceChunk, n - c * kReduceChunk));
  });
  double total = 0;
  for (double s : partial) total += s;
  float* o = out.data_as<float>();
  o[0] = static_cast<float>(accumulate ? o[0] + total : total);
}

}  // namespace tandem::ops::cpu
