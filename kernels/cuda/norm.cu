// CUDA RMSNorm: one block per row with a fixed-order tree reduction; dweight by fixed chunks of
// rows summed in chunk order.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/norm.h"

namespace tandem::ops::cuda {
namespace {

constexpr int kThreads = 256;
// Rows per dweight partial sum (the CPU's kNormRowChunk).
constexpr int64_t kRowChunk = 64;

// The sum of every thread's v over the block, in a fixed tree; all threads get it.
__device__ float block_sum(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
    __syncthreads();
  }
  const float total = shared[0];
  __syncthreads();
  return total;
}

template <class W>
__device__ void normalise_row(const float* x, const W* w, float* out, float* rstd, int64_t C,
                              float eps, float* shared) {
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) ss += x[c] * x[c];
  ss = block_sum(ss, shared);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
  for (int64_t c = threadIdx.x; c < C; c += kThreads) out[c] = x[c] * r * to_f32(w[c]);
  if (threadIdx.x == 0) *rstd = r;
}

template <class W>
__global__ void rmsnorm_kernel(const float* x, const W* w, float* out, float* rstd, int64_t C,
                               float eps) {
  __shared__ float shared[kThreads];
  const int64_t t = blockIdx.x;
  normalise_row(x + t * C, w, out + t * C, rstd + t, C, eps, shared);
}

template <class W>
__global__ void add_rmsnorm_kernel(const float* residual, const float* delta, const W* w,
                                   float* residual_out, float* out, float* rstd, int64_t C,
                                   float eps) {
  __shared__ float shared[kThreads];
  const int64_t t = blockIdx.x;
  float* s = residual_out + t * C;
  // Each thread re-reads only the elements it wrote itself.
  for (int64_t c = threadIdx.x; c < C; c += kThreads) s[c] = residual[t * C + c] + delta[t * C + c];
  normalise_row(s, w, out + t * C, rstd + t, C, eps, shared);
}

template <class W>
__global__ void rmsnorm_dx_kernel(const float* dout, const float* x, const W* w, const float* rstd,
                                  float* dx, int64_t C, bool accumulate) {
  __shared__ float shared[kThreads];
  const int64_t t = blockIdx.x;
  const float* g = dout + t * C;
  const float* xr = x + t * C;
  float* d = dx + t * C;
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) dot += g[c] * to_f32(w[c]) * xr[c];
  dot = block_sum(dot, shared);
  const float r = rstd[t];
  const float k = r * r * r * (dot / static_cast<float>(C));
  for (int64_t c = threadIdx.x; c < C; c += kThreads) {
    const float v = r * (g[c] * to_f32(w[c])) - xr[c] * k;
    d[c] = accumulate ? d[c] + v : v;
  }
}

// partial (chunks, C): thread (c, chunk) sums dout * x * rstd over the chunk's rows in order.
__global__ void rmsnorm_dweight_partial(const float* dout, const float* x, const float* rstd,
                                        float* partial, int64_t T, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int64_t chunk = blockIdx.y;
  const int64_t end = (chunk + 1) * kRowChunk < T ? (chunk + 1) * kRowChunk : T;
  float s = 0.0f;
  for (int64_t t = chunk * kRowChunk; t < end; ++t) s += dout[t * C + c] * (x[t * C + c] * rstd[t]);
  partial[chunk * C + c] = s;
}

__global__ void rmsnorm_dweight_final(const float* partial, float* dweight, int64_t chunks,
                                      int64_t C, bool accumulate) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int64_t ch = 0; ch < chunks; ++ch) s += partial[ch * C + c];
  dweight[c] = accumulate ? dweight[c] + s : s;
}

template <class W>
void backward_typed(const float* dout, const float* x, const W* w, const float* rstd, float* dx,
                    float* dweight, int64_t T, int64_t C, bool accumulate_dx,
                    bool accumulate_dweight, cudaStream_t s) {
  const int64_t chunks = (T + kRowChunk - 1) / kRowChunk;
  const unsigned column_blocks = static_cast<unsigned>((C + kThreads - 1) / kThreads);
  if (T > 0) {
    rmsnorm_dx_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(dout, x, w, rstd, dx, C,
                                                                    accumulate_dx);
    CUDA_CHECK_LAUNCH();
  }
  float* partial = nullptr;
  if (chunks > 0) {
    CUDA_CHECK(cudaMallocAsync(&partial, static_cast<size_t>(chunks * C) * sizeof(float), s));
    rmsnorm_dweight_partial<<<dim3(column_blocks, static_cast<unsigned>(chunks)), kThreads, 0, s>>>(
        dout, x, rstd, partial, T, C);
    CUDA_CHECK_LAUNCH();
  }
  rmsnorm_dweight_final<<<column_blocks, kThreads, 0, s>>>(partial, dweight, chunks, C,
                                                           accumulate_dweight);
  CUDA_CHECK_LAUNCH();
  if (partial != nullptr) CUDA_CHECK(cudaFreeAsync(partial, s));
}

}  // namespace

void rmsnorm(const float* x, const void* weight, DType weight_type, float* out, float* rstd,
             int64_t T, int64_t C, float eps, void* stream) {
  if (T == 0) return;
  const cudaStream_t s = native(stream);
  if (weight_type == DType::bf16) {
    rmsnorm_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(
        x, static_cast<const bf16*>(weight), out, rstd, C, eps);
  } else {
    rmsnorm_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(
        x, static_cast<const float*>(weight), out, rstd, C, eps);
  }
  CUDA_CHECK_LAUNCH();
}

void add_rmsnorm(const float* residual, const float* delta, const void* weight, DType weight_type,
                 float* residual_out, float* out, float* rstd, int64_t T, int64_t C, float eps,
                 void* stream) {
  if (T == 0) return;
  const cudaStream_t s = native(stream);
  if (weight_type == DType::bf16) {
    add_rmsnorm_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(
        residual, delta, static_cast<const bf16*>(weight), residual_out, out, rstd, C, eps);
  } else {
    add_rmsnorm_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(
        residual, delta, static_cast<const float*>(weight), residual_out, out, rstd, C, eps);
  }
  CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(const float* dout, const float* x, const void* weight, DType weight_type,
                      const float* rstd, float* dx, float* dweight, int64_t T, int64_t C,
                      bool accumulate_dx, bool accumulate_dweight, void* stream) {
  if (C == 0) return;
  if (weight_type == DType::bf16) {
    backward_typed(dout, x, static_cast<const bf16*>(weight), rstd, dx, dweight, T, C,
                   accumulate_dx, accumulate_dweight, native(stream));
  } else {
    backward_typed(dout, x, static_cast<const float*>(weight), rstd, dx, dweight, T, C,
                   accumulate_dx, accumulate_dweight, native(stream));
  }
}

}  // namespace tandem::ops::cuda
