// CUDA cast, scale, add, random_uniform and sum_squares.
#include "core/philox.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"

namespace tandem::ops::cuda {
namespace {

constexpr int kThreads = 256;
// Elements per block of the first reduction pass; the pass order is fixed, so the sum is too.
constexpr int64_t kReduceChunk = 4096;

template <class S, class D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = from_f32<D>(to_f32(src[i]));
}

template <class S, class D>
void launch_cast(const void* src, void* dst, int64_t n, cudaStream_t s) {
  cast_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(static_cast<const S*>(src),
                                                           static_cast<D*>(dst), n);
  CUDA_CHECK_LAUNCH();
}

template <class S>
void cast_from(const void* src, void* dst, DType dst_type, int64_t n, cudaStream_t s) {
  if (dst_type == DType::f32) return launch_cast<S, float>(src, dst, n, s);
  if (dst_type == DType::bf16) return launch_cast<S, bf16>(src, dst, n, s);
  return launch_cast<S, f16>(src, dst, n, s);  // the caller checked the dtypes
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    x[i] *= s;
}

__global__ void add_kernel(const float* x, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] += x[i];
}

__global__ void random_uniform_kernel(float* out, int64_t n, uint64_t seed, uint64_t stream_id) {
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; 4 * g < n;
       g += int64_t{gridDim.x} * blockDim.x) {
    const Philox4x32 r = philox_random(seed, stream_id, static_cast<uint64_t>(g));
    for (int64_t j = 0; j < 4 && 4 * g + j < n; ++j) out[4 * g + j] = uniform_from_bits(r.v[j]);
  }
}

// One block per chunk: a fixed tree over the chunk's squares, in double.
__global__ void sum_squares_partial(const float* x, int64_t n, double* partial) {
  __shared__ double acc[kThreads];
  const int64_t base = blockIdx.x * kReduceChunk;
  double s = 0;
  for (int64_t i = base + threadIdx.x; i < base + kReduceChunk && i < n; i += kThreads)
    s += static_cast<double>(x[i]) * x[i];
  acc[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) acc[threadIdx.x] += acc[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = acc[0];
}

__global__ void sum_squares_final(const double* partial, int64_t chunks, float* out,
                                  bool accumulate) {
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  out[0] = static_cast<float>(accumulate ? out[0] + total : total);
}

}  // namespace

void cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n, void* stream) {
  if (n == 0) return;
  if (src_type == DType::f32) return cast_from<float>(src, dst, dst_type, n, native(stream));
  if (src_type == DType::bf16) return cast_from<bf16>(src, dst, dst_type, n, native(stream));
  return cast_from<f16>(src, dst, dst_type, n, native(stream));
}

void scale(float* x, float s, int64_t n, void* stream) {
  if (n == 0) return;
  scale_kernel<<<blocks_for(n, kThreads), kThreads, 0, native(stream)>>>(x, s, n);
  CUDA_CHECK_LAUNCH();
}

void add(const float* x, float* out, int64_t n, void* stream) {
  if (n == 0) return;
  add_kernel<<<blocks_for(n, kThreads), kThreads, 0, native(stream)>>>(x, out, n);
  CUDA_CHECK_LAUNCH();
}

void random_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream_id, void* stream) {
  if (n == 0) return;
  random_uniform_kernel<<<blocks_for((n + 3) / 4, kThreads), kThreads, 0, native(stream)>>>(
      out, n, seed, stream_id);
  CUDA_CHECK_LAUNCH();
}

void sum_squares(const float* x, int64_t n, float* out, bool accumulate, void* stream) {
  const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  if (chunks == 0) {
    if (!accumulate) CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), native(stream)));
    return;
  }
  double* partial = nullptr;
  CUDA_CHECK(
      cudaMallocAsync(&partial, static_cast<size_t>(chunks) * sizeof(double), native(stream)));
  sum_squares_partial<<<static_cast<unsigned>(chunks), kThreads, 0, native(stream)>>>(x, n,
                                                                                      partial);
  CUDA_CHECK_LAUNCH();
  sum_squares_final<<<1, 1, 0, native(stream)>>>(partial, chunks, out, accumulate);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaFreeAsync(partial, native(stream)));
}

}  // namespace tandem::ops::cuda
