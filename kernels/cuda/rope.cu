// CUDA rotary position embedding: one block per token; its cos/sin (cosf/sinf, not the fast
// intrinsics) computed once into shared memory for all heads.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.h"

namespace tandem::ops::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void rope_kernel(const float* x, const int32_t* positions, float* out, int64_t N,
                            int64_t D, RopeFreqs freqs, bool inverse) {
  __shared__ float cs[kRopeMaxPairs], sn[kRopeMaxPairs];
  const int64_t t = blockIdx.x;
  const int64_t half = D / 2;
  const float p = static_cast<float>(positions[t]);
  for (int64_t i = threadIdx.x; i < half; i += kThreads) {
    const float angle = p * freqs.inv_freq[i];
    cs[i] = cosf(angle);
    sn[i] = inverse ? -sinf(angle) : sinf(angle);
  }
  __syncthreads();
  const float* a = x + t * N * D;  // (N, D)
  float* o = out + t * N * D;      // (N, D), may be a
  for (int64_t q = threadIdx.x; q < N * half; q += kThreads) {
    const int64_t n = q / half, i = q % half;
    const float x1 = a[n * D + i], x2 = a[n * D + i + half];
    o[n * D + i] = x1 * cs[i] - x2 * sn[i];
    o[n * D + i + half] = x2 * cs[i] + x1 * sn[i];
  }
}

}  // namespace

void rope(const float* x, const int32_t* positions, float* out, int64_t T, int64_t N, int64_t D,
          const RopeFreqs& freqs, bool inverse, void* stream) {
  if (T == 0 || N * D == 0) return;
  rope_kernel<<<static_cast<unsigned>(T), kThreads, 0, native(stream)>>>(x, positions, out, N, D,
                                                                         freqs, inverse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::ops::cuda
