// CUDA rotary position embedding on raw pointers; stream is a cudaStream_t.
#pragma once

#include <cstdint>

namespace tandem::ops::cuda {

// The inverse frequencies, passed by value as a kernel argument (no device copy): head sizes
// up to 2 * kRopeMaxPairs.
inline constexpr int kRopeMaxPairs = 256;
struct RopeFreqs {
  float inv_freq[kRopeMaxPairs];
};

// out (T, N, D) = x (T, N, D) with each pair (i, i + D/2) rotated by the angle
// float(positions[t]) * inv_freq[i] (its negative when inverse); out may be x.
void rope(const float* x, const int32_t* positions, float* out, int64_t T, int64_t N, int64_t D,
          const RopeFreqs& freqs, bool inverse, void* stream);

}  // namespace tandem::ops::cuda
