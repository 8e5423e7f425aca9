// CPU rotary position embedding: one token per task, its cos/sin computed once for all heads.
#include "kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/parallel.h"

namespace tandem::ops::cpu {

void rope_inv_freq(int64_t D, const RopeParams& p, float* inv_freq) {
  const int64_t half = D / 2;
  const double low_freq_wavelen = static_cast<double>(p.original_max_position) / p.low_freq_factor;
  const double high_freq_wavelen =
      static_cast<double>(p.original_max_position) / p.high_freq_factor;
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(static_cast<double>(p.theta),
                              static_cast<double>(2 * i) / static_cast<double>(D));
    if (p.factor != 0.0f) {
      // Long wavelengths are slowed down by `factor`, short ones kept, the band between
      // interpolated smoothly.
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f = f / p.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth =
            (static_cast<double>(p.original_max_position) / wavelen - p.low_freq_factor) /
            (static_cast<double>(p.high_freq_factor) - p.low_freq_factor);
        f = (1.0 - smooth) * f / p.factor + smooth * f;
      }
    }
    inv_freq[i] = static_cast<float>(f);
  }
}

void rope(const Tensor& x, const Tensor& positions, const Tensor& out, const float* inv_freq,
          bool inverse) {
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2), half = D / 2;
  const float* src = x.data_as<float>();              // (T, N, D)
  const int32_t* pos = positions.data_as<int32_t>();  // (T)
  float* dst = out.data_as<float>();                  // (T, N, D), may be src
  parallel_for(
      T,
      [&](int64_t begin, int64_t end) {
        float cs[kRopeMaxHeadDim / 2], sn[kRopeMaxHeadDim / 2];
        for (int64_t t = begin; t < end; ++t) {
          const float p = static_cast<float>(pos[t]);
          for (int64_t i = 0; i < half; ++i) {
            const float angle = p * inv_freq[i];
            cs[i] = std::cos(angle);
            sn[i] = inverse ? -std::sin(angle) : std::sin(angle);
          }
          for (int64_t n = 0; n < N; ++n) {
            const float* a = src + (t * N + n) * D;
            float* o = dst + (t * N + n) * D;
            for (int64_t i = 0; i < half; ++i) {
              const float x1 = a[i], x2 = a[i + half];
              o[i] = x1 * cs[i] - x2 * sn[i];
              o[i + half] = x2 * cs[i] + x1 * sn[i];
            }
          }
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(N * D, 1)));
}

}  // namespace tandem::ops::cpu
