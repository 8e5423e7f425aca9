// Shared CUDA helpers: native streams, launch sizes, conversions of any float dtype. No fmt here.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "core/cuda_check.h"
#include "core/half.h"

namespace tandem::ops::cuda {

inline cudaStream_t native(void* stream) { return static_cast<cudaStream_t>(stream); }

inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 32 ? b : 65535 * 32);
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return bf16_bits_to_f32(x.bits); }
__device__ __forceinline__ float to_f32(f16 x) { return f16_bits_to_f32(x.bits); }

template <class T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T::from_bits(std::is_same_v<T, bf16> ? f32_to_bf16_bits(x) : f32_to_f16_bits(x));
  }
}

}  // namespace tandem::ops::cuda
