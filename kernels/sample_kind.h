// A sampling row's kind from its settings: which filters apply, the same test on the CPU and on
// CUDA (free of fmt, so .cu files include it).
#pragma once

#include <cstdint>

#include "core/half.h"

namespace tandem::ops {

// What ops::sample does with a row (kernels/ops.h): greedy (temperature 0), top_k (0 < top_k <
// V), nucleus (top_p < 1 with top-k off), plain (neither: every token, min-p aside), or invalid
// (temperature < 0 or not finite, top_k < 0, top_p outside (0, 1], min_p outside [0, 1]).
enum class SampleRowKind : uint8_t { greedy, top_k, nucleus, plain, invalid };

TANDEM_HD bool sampling_settings_valid(float temperature, int32_t top_k, float top_p, float min_p) {
  // t - t is 0 exactly when t is finite (inf - inf and NaN - NaN are NaN).
  return temperature >= 0.0f && temperature - temperature == 0.0f && top_k >= 0 && top_p > 0.0f &&
         top_p <= 1.0f && min_p >= 0.0f && min_p <= 1.0f;
}

TANDEM_HD SampleRowKind sample_row_kind(float temperature, int32_t top_k, float top_p, float min_p,
                                        int64_t V) {
  if (!sampling_settings_valid(temperature, top_k, top_p, min_p)) return SampleRowKind::invalid;
  if (temperature == 0.0f) return SampleRowKind::greedy;
  if (top_k > 0 && top_k < V) return SampleRowKind::top_k;
  if (top_p < 1.0f) return SampleRowKind::nucleus;
  return SampleRowKind::plain;
}

}  // namespace tandem::ops
