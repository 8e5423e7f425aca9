// CUDA embedding: one block per token for the gather; the backward gives each thread one column
// of one slice of the vocabulary and walks the tokens in order (deterministic, no atomics).
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.h"

namespace tandem::ops::cuda {
namespace {

constexpr int kThreads = 128;
// Vocabulary slices of the backward (grid.y): more slices, more parallel threads per column.
constexpr int64_t kMaxSlices = 512;
constexpr unsigned long long kNoBadId = ULLONG_MAX;

__device__ __forceinline__ void flag_bad(unsigned long long* first_bad, int64_t t) {
  atomicMin(first_bad, static_cast<unsigned long long>(t));
}

template <class W>
__global__ void embedding_kernel(const int32_t* ids, const W* table, float* out, int64_t V,
                                 int64_t C, unsigned long long* first_bad) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  float* o = out + t * C;  // (C)
  if (id < 0 || id >= V) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = 0.0f;
    if (threadIdx.x == 0) flag_bad(first_bad, t);
    return;
  }
  const W* row = table + id * C;  // (C)
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = to_f32(row[c]);
}

__global__ void find_bad_ids_kernel(const int32_t* ids, int64_t T, int64_t V,
                                    unsigned long long* first_bad) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < T;
       t += int64_t{gridDim.x} * blockDim.x)
    if (ids[t] < 0 || ids[t] >= V) flag_bad(first_bad, t);
}

// Thread (c, slice) owns column c of the rows [slice * rows, (slice + 1) * rows): it alone
// writes those elements, adding the tokens' rows in token order.
__global__ void embedding_backward_kernel(const int32_t* ids, const float* dout, float* dtable,
                                          int64_t T, int64_t V, int64_t C, int64_t rows_per_slice) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int64_t v0 = blockIdx.y * rows_per_slice;
  const int64_t v1 = v0 + rows_per_slice < V ? v0 + rows_per_slice : V;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = ids[t];
    if (id < v0 || id >= v1) continue;
    dtable[id * C + c] += dout[t * C + c];
  }
}

// A device flag holding the first bad position (kNoBadId when none).
unsigned long long* new_flag(cudaStream_t s) {
  unsigned long long* flag = nullptr;
  CUDA_CHECK(cudaMallocAsync(&flag, sizeof(unsigned long long), s));
  CUDA_CHECK(cudaMemsetAsync(flag, 0xff, sizeof(unsigned long long), s));
  return flag;
}

// Copies the flag back, waits for the stream and frees the flag.
int64_t read_flag(unsigned long long* flag, cudaStream_t s) {
  unsigned long long host = kNoBadId;
  CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof host, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaFreeAsync(flag, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return host == kNoBadId ? -1 : static_cast<int64_t>(host);
}

}  // namespace

int64_t embedding(const int32_t* ids, const void* table, DType table_type, float* out, int64_t T,
                  int64_t V, int64_t C, void* stream) {
  if (T == 0) return -1;
  const cudaStream_t s = native(stream);
  unsigned long long* flag = new_flag(s);
  if (table_type == DType::bf16) {
    embedding_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(
        ids, static_cast<const bf16*>(table), out, V, C, flag);
  } else {
    embedding_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(
        ids, static_cast<const float*>(table), out, V, C, flag);
  }
  CUDA_CHECK_LAUNCH();
  return read_flag(flag, s);
}

int64_t embedding_backward(const int32_t* ids, const float* dout, float* dtable, int64_t T,
                           int64_t V, int64_t C, bool accumulate, void* stream) {
  const cudaStream_t s = native(stream);
  if (!accumulate && V * C > 0)
    CUDA_CHECK(cudaMemsetAsync(dtable, 0, static_cast<size_t>(V * C) * sizeof(float), s));
  if (T == 0 || V == 0 || C == 0) return -1;
  unsigned long long* flag = new_flag(s);
  find_bad_ids_kernel<<<blocks_for(T, 256), 256, 0, s>>>(ids, T, V, flag);
  CUDA_CHECK_LAUNCH();
  const int64_t slices = V < kMaxSlices ? V : kMaxSlices;
  const int64_t rows_per_slice = (V + slices - 1) / slices;
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads),
                  static_cast<unsigned>((V + rows_per_slice - 1) / rows_per_slice));
  embedding_backward_kernel<<<grid, kThreads, 0, s>>>(ids, dout, dtable, T, V, C, rows_per_slice);
  CUDA_CHECK_LAUNCH();
  return read_flag(flag, s);
}

}  // namespace tandem::ops::cuda
