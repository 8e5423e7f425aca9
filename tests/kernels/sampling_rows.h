// Per-row sampling settings for the tests of ops::sample and of the sampling over vocabulary
// shards: a row's temperature, top-k, top-p, min-p, seed and offset, and their tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::test {

struct RowSpec {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  int64_t seed = 0;
  int64_t offset = 0;
};

inline ops::SamplingTensors make_settings(const std::vector<RowSpec>& rows) {
  const int64_t B = static_cast<int64_t>(rows.size());
  ops::SamplingTensors s{Tensor::empty({B}, DType::f32), Tensor::empty({B}, DType::i32),
                         Tensor::empty({B}, DType::f32), Tensor::empty({B}, DType::f32),
                         Tensor::empty({B}, DType::i64), Tensor::empty({B}, DType::i64)};
  for (int64_t b = 0; b < B; ++b) {
    const RowSpec& r = rows[static_cast<size_t>(b)];
    s.temperature.data_as<float>()[b] = r.temperature;
    s.top_k.data_as<int32_t>()[b] = r.top_k;
    s.top_p.data_as<float>()[b] = r.top_p;
    s.min_p.data_as<float>()[b] = r.min_p;
    s.seed.data_as<int64_t>()[b] = r.seed;
    s.offset.data_as<int64_t>()[b] = r.offset;
  }
  return s;
}

}  // namespace tandem::test
