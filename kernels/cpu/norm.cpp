// CPU RMSNorm: one row per task, f32 sums in a fixed order (16 lane partials, then a tree).
#include "kernels/cpu/norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"

namespace tandem::ops::cpu {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kMinElementsPerThread = 1 << 14;

int64_t rows_per_thread(int64_t C) {
  return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(C, 1));
}

// sum of term(i) for i < n in f32: lane j sums the terms i = j (mod 16) in order, then the
// lanes are added in a fixed tree. The loop over the lanes vectorises.
template <class F>
float fixed_order_sum(int64_t n, F term) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += term(i + j);
  for (int j = 0; i + j < n; ++j) acc[j] += term(i + j);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

// out = x * rstd * w for one row; x may be out.
template <class W>
void normalise_row(const float* x, const W* w, float* out, float* rstd, int64_t C, float eps) {
  const float ss = fixed_order_sum(C, [x](int64_t i) { return x[i] * x[i]; });
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
  *rstd = r;
  for (int64_t c = 0; c < C; ++c) out[c] = x[c] * r * static_cast<float>(w[c]);
}

template <class W>
void rmsnorm_typed(const Tensor& x, const W* w, const Tensor& out, const Tensor& rstd, float eps) {
  const int64_t T = x.size(0), C = x.size(1);
  const float* xp = x.data_as<float>();  // (T, C)
  float* o = out.data_as<float>();       // (T, C)
  float* r = rstd.data_as<float>();      // (T)
  parallel_for(
      T,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          normalise_row(xp + t * C, w, o + t * C, r + t, C, eps);
      },
      rows_per_thread(C));
}

template <class W>
void add_rmsnorm_typed(const Tensor& residual, const Tensor& delta, const W* w,
                       const Tensor& residual_out, const Tensor& out, const Tensor& rstd,
                       float eps) {
  const int64_t T = residual.size(0), C = residual.size(1);
  const float* a = residual.data_as<float>();  // (T, C)
  const float* b = delta.data_as<float>();     // (T, C)
  float* sum = residual_out.data_as<float>();  // (T, C), may be the residual
  float* o = out.data_as<float>();             // (T, C)
  float* r = rstd.data_as<float>();            // (T)
  parallel_for(
      T,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          float* s = sum + t * C;
          const float* ar = a + t * C;
          const float* br = b + t * C;
          for (int64_t c = 0; c < C; ++c) s[c] = ar[c] + br[c];
          // The very rmsnorm of the stored sum: add then rmsnorm gives the same bits.
          normalise_row(s, w, o + t * C, r + t, C, eps);
        }
      },
      rows_per_thread(C));
}

// dx = rstd * (dy * w) - x * (rstd^3 * sum(dy * w * x) / C) per row; dweight = sum over rows of
// dy * (x * rstd), by fixed chunks of kNormRowChunk rows.
template <class W>
void backward_typed(const Tensor& dout, const Tensor& x, const W* w, const Tensor& rstd,
                    const Tensor& dx, const Tensor& dweight, bool accumulate_dx,
                    bool accumulate_dweight) {
  const int64_t T = x.size(0), C = x.size(1);
  const float* dy = dout.data_as<float>();  // (T, C)
  const float* xp = x.data_as<float>();     // (T, C)
  const float* rs = rstd.data_as<float>();  // (T)
  float* dxp = dx.data_as<float>();         // (T, C)
  float* dw = dweight.data_as<float>();     // (C)
  const int64_t chunks = (T + kNormRowChunk - 1) / kNormRowChunk;
  // Per-chunk partial sums of dweight: (chunks, C). Grows once to the largest shape seen.
  static thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(chunks * C))
    scratch.resize(static_cast<size_t>(chunks * C));
  float* partial = scratch.data();
  parallel_for(chunks, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      float* p = partial + ch * C;
      std::fill(p, p + C, 0.0f);
      for (int64_t t = ch * kNormRowChunk; t < std::min(T, (ch + 1) * kNormRowChunk); ++t) {
        const float* g = dy + t * C;
        const float* xr = xp + t * C;
        float* d = dxp + t * C;
        const float r = rs[t];
        const float dot =
            fixed_order_sum(C, [&](int64_t i) { return g[i] * static_cast<float>(w[i]) * xr[i]; });
        const float k = r * r * r * (dot / static_cast<float>(C));
        for (int64_t c = 0; c < C; ++c) {
          const float v = r * (g[c] * static_cast<float>(w[c])) - xr[c] * k;
          d[c] = accumulate_dx ? d[c] + v : v;
          p[c] += g[c] * (xr[c] * r);
        }
      }
    }
  });
  parallel_for(
      C,
      [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          float s = 0.0f;
          for (int64_t ch = 0; ch < chunks; ++ch) s += partial[ch * C + c];
          dw[c] = accumulate_dweight ? dw[c] + s : s;
        }
      },
      1024);
}

}  // namespace

void rmsnorm(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
             float eps) {
  if (weight.dtype() == DType::bf16)
    return rmsnorm_typed(x, weight.data_as<bf16>(), out, rstd, eps);
  rmsnorm_typed(x, weight.data_as<float>(), out, rstd, eps);
}

void add_rmsnorm(const Tensor& residual, const Tensor& delta, const Tensor& weight,
                 const Tensor& residual_out, const Tensor& out, const Tensor& rstd, float eps) {
  if (weight.dtype() == DType::bf16)
    return add_rmsnorm_typed(residual, delta, weight.data_as<bf16>(), residual_out, out, rstd, eps);
  add_rmsnorm_typed(residual, delta, weight.data_as<float>(), residual_out, out, rstd, eps);
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dweight, bool accumulate_dx,
                      bool accumulate_dweight) {
  if (weight.dtype() == DType::bf16)
    return backward_typed(dout, x, weight.data_as<bf16>(), rstd, dx, dweight, accumulate_dx,
                          accumulate_dweight);
  backward_typed(dout, x, weight.data_as<float>(), rstd, dx, dweight, accumulate_dx,
                 accumulate_dweight);
}

}  // namespace tandem::ops::cpu
