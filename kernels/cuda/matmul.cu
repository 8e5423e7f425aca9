// CUDA matmul and its backward products: cuBLASLt GEMMs with f32 accumulation and f32 output,
// bf16 operands whenever one operand is bf16 (the other is rounded to bf16 first), plain f32
// (no TF32) when both are f32. Algorithms are pinned per shape so that results are
// deterministic and, for the forward product, independent of the number of rows.
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matmul.h"

namespace tandem::ops::cuda {
namespace {

// Row-major vs column-major. cuBLASLt works on column-major matrices; a row-major (R, C)
// matrix with leading dimension C is the column-major (C, R) matrix, i.e. its transpose. So:
//   y (M, N) = x (M, K) · w (N, K)^T     <=>  y^T (N x M) = w (N x K) · x^T (K x M):
//     A = w seen column-major is (K x N), used transposed; B = x seen column-major is (K x M),
//     used as is; C = y seen column-major is (N x M), ldc = N.          [op "TN"]
//   dx (M, K) = dy (M, N) · w (N, K)      <=>  dx^T (K x M) = w^T (K x N) · dy^T (N x M):
//     A = w column-major (K x N) as is; B = dy column-major (N x M) as is. [op "NN"]
//   dw (N, K) = dy^T (N, M) · x (M, K)    <=>  dw^T (K x N) = x^T (K x M) · dy (M x N):
//     A = x column-major (K x M) as is; B = dy column-major (N x M), transposed. [op "NT"]

// Workspace of one device's handle; enough for the Hopper kernels the heuristic picks.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// The forward product's algorithm is chosen for this many rows, whatever the call's M, so
// that every M runs the same kernel (tiles along M never change a row's arithmetic).
constexpr int64_t kPinnedRows = 2048;

// C (m x n, ldc) [+]= op(A) (m x k) · op(B) (k x n), column-major. A, B: `ab` (f32 or bf16).
struct GemmShape {
  cublasOperation_t ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  cudaDataType_t ab;
};

struct AlgoKey {
  int ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  int ab;
  uint32_t align_a, align_b, align_c;
  bool operator<(const AlgoKey& o) const {
    return std::tie(ta, tb, m, n, k, lda, ldb, ldc, ab, align_a, align_b, align_c) <
           std::tie(o.ta, o.tb, o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.ab, o.align_a, o.align_b,
                    o.align_c);
  }
};

// One cuBLASLt handle, workspace, algorithm cache and bf16 conversion buffers per device,
// created on first use and kept for the process. The conversion buffers only grow (to the
// largest operand seen), so steady-state calls allocate nothing; calls on one device must not
// overlap on different streams while they use them (the trainer and engine use one stream).
struct DeviceState {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  // nullopt: cuBLASLt offers no deterministic algorithm for the shape; the fallback kernel runs.
  std::map<AlgoKey, std::optional<cublasLtMatmulAlgo_t>> algos;
  void* scratch[2] = {nullptr, nullptr};
  size_t scratch_bytes[2] = {0, 0};
};

DeviceState& device_state() {
  static std::mutex mu;
  static DeviceState* states[64] = {};
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (states[dev] == nullptr) {
    auto* s = new DeviceState;
    CUBLAS_CHECK(cublasLtCreate(&s->handle));
    CUDA_CHECK(cudaMalloc(&s->workspace, kWorkspaceBytes));
    states[dev] = s;
  }
  return *states[dev];
}

void* grow_scratch(DeviceState& s, int slot, size_t bytes) {
  if (s.scratch_bytes[slot] < bytes) {
    if (s.scratch[slot] != nullptr) CUDA_CHECK(cudaFree(s.scratch[slot]));  // synchronises
    CUDA_CHECK(cudaMalloc(&s.scratch[slot], bytes));
    s.scratch_bytes[slot] = bytes;
  }
  return s.scratch[slot];
}

__global__ void f32_to_bf16_kernel(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = from_f32<bf16>(src[i]);
}

// The operand as bf16: itself, or a rounded copy in the device's scratch slot.
const void* as_bf16(DeviceState& s, int slot, const void* p, DType t, int64_t n,
                    cudaStream_t stream) {
  if (t == DType::bf16 || n == 0) return p;
  bf16* d = static_cast<bf16*>(grow_scratch(s, slot, static_cast<size_t>(n) * sizeof(bf16)));
  constexpr int kThreads = 256;
  f32_to_bf16_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(static_cast<const float*>(p),
                                                                       d, n);
  CUDA_CHECK_LAUNCH();
  return d;
}

// The alignment the heuristic may assume, at most 16 bytes (what the Hopper kernels need): rows
// of one tensor start at different multiples of 16, and asking for more would let the
// algorithm, and so the result, depend on where a batch starts.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 16;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

struct Layouts {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Layouts(const GemmShape& g) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof g.ta));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof g.tb));
    const bool ta = g.ta == CUBLAS_OP_T, tb = g.tb == CUBLAS_OP_T;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, g.ab, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, g.ab, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, g.m, g.n, g.ldc));
  }
  ~Layouts() {
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(op);
  }
};

// The algorithm for a shape: the heuristic's best that is deterministic. Split-K is allowed only
// with an out-of-place reduction (a fixed number of splits summed by a separate kernel); the
// in-place scheme adds the splits in the order they finish. `query` is the shape the heuristic
// sees (the forward product's with kPinnedRows rows).
std::optional<cublasLtMatmulAlgo_t> pick_algo(DeviceState& s, const GemmShape& query, const AlgoKey& key) {
  const auto found = s.algos.find(key);
  if (found != s.algos.end()) return found->second;
  const Layouts l(query);
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws));
  // Split-K only with a deterministic (out-of-place) reduction.
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                           CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
  const uint32_t aligns[3] = {key.align_a, key.align_b, key.align_c};
  const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i < 3 ? i : 2],
                                                      sizeof(uint32_t)));
  constexpr int kWanted = 16;
  cublasLtMatmulHeuristicResult_t results[kWanted] = {};
  int returned = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(s.handle, l.op, l.a, l.b, l.c, l.c, pref,
                                                           kWanted, results, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  CUBLAS_CHECK(st);
  for (int i = 0; i < returned; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    int32_t splits = 1;
    size_t written = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(
        &results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits, &written));
    if (splits > 1) {
      uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_INPLACE;
      CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo,
                                                        CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                        &scheme, sizeof scheme, &written));
      if (scheme == CUBLASLT_REDUCTION_SCHEME_INPLACE || scheme == CUBLASLT_REDUCTION_SCHEME_NONE)
        continue;
    }
    s.algos.emplace(key, results[i].algo);
    return results[i].algo;
  }
  s.algos.emplace(key, std::nullopt);
  return std::nullopt;
}

// The same product when cuBLASLt has no deterministic algorithm (odd leading dimensions of bf16
// operands, say): 16x16 output tiles, each element summed over k in increasing order.
template <class T>
__global__ void fallback_gemm_kernel(bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                                     const T* A, int64_t lda, const T* B, int64_t ldb, float* C,
                                     int64_t ldc, bool accumulate) {
  __shared__ float as[16][17], bs[16][17];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t i = blockIdx.x * int64_t{16} + tx, j = blockIdx.y * int64_t{16} + ty;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t ak = k0 + ty, bk = k0 + tx;
    as[tx][ty] = i < m && ak < k ? to_f32(A[ta ? ak + i * lda : i + ak * lda]) : 0.0f;
    const int64_t bj = blockIdx.y * int64_t{16} + ty;
    bs[tx][ty] = bk < k && bj < n ? to_f32(B[tb ? bj + bk * ldb : bk + bj * ldb]) : 0.0f;
    __syncthreads();
    for (int kk = 0; kk < 16; ++kk) acc = fmaf(as[tx][kk], bs[kk][ty], acc);
    __syncthreads();
  }
  if (i < m && j < n) {
    float* c = C + i + j * ldc;
    *c = accumulate ? *c + acc : acc;
  }
}

void fallback_gemm(const GemmShape& g, const void* A, const void* B, float* C, bool accumulate,
                   cudaStream_t stream) {
  const dim3 block(16, 16);
  const dim3 grid(static_cast<unsigned>((g.m + 15) / 16), static_cast<unsigned>((g.n + 15) / 16));
  const bool ta = g.ta == CUBLAS_OP_T, tb = g.tb == CUBLAS_OP_T;
  if (g.ab == CUDA_R_16BF) {
    fallback_gemm_kernel<<<grid, block, 0, stream>>>(ta, tb, g.m, g.n, g.k,
                                                     static_cast<const bf16*>(A), g.lda,
                                                     static_cast<const bf16*>(B), g.ldb, C, g.ldc,
                                                     accumulate);
  } else {
    fallback_gemm_kernel<<<grid, block, 0, stream>>>(ta, tb, g.m, g.n, g.k,
                                                     static_cast<const float*>(A), g.lda,
                                                     static_cast<const float*>(B), g.ldb, C,
                                                     g.ldc, accumulate);
  }
  CUDA_CHECK_LAUNCH();
}

void gemm(const GemmShape& g, const GemmShape& query, const void* A, const void* B, float* C,
          bool accumulate, cudaStream_t stream, DeviceState& s) {
  if (g.m == 0 || g.n == 0) return;
  const AlgoKey key{g.ta,
                    g.tb,
                    query.m,
                    query.n,
                    query.k,
                    query.lda,
                    query.ldb,
                    query.ldc,
                    static_cast<int>(g.ab),
                    alignment_of(A),
                    alignment_of(B),
                    alignment_of(C)};
  const std::optional<cublasLtMatmulAlgo_t> algo = pick_algo(s, query, key);
  if (!algo) return fallback_gemm(g, A, B, C, accumulate, stream);
  const Layouts l(g);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(s.handle, l.op, &alpha, A, l.a, B, l.b, &beta, C, l.c, C, l.c,
                              &*algo, s.workspace, kWorkspaceBytes, stream));
}

// An empty sum (the inner dimension is 0): out = 0, or unchanged when accumulating.
void zero_unless(bool accumulate, float* out, int64_t n, cudaStream_t stream) {
  if (!accumulate && n > 0)
    CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(n) * sizeof(float), stream));
}

cudaDataType_t compute_type(DType a, DType b) {
  return a == DType::f32 && b == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
}

}  // namespace

void matmul(const void* x, DType x_type, const void* w, DType w_type, float* y, int64_t M,
            int64_t N, int64_t K, bool accumulate, void* stream) {
  if (M == 0 || N == 0) return;
  const cudaStream_t st = native(stream);
  DeviceState& s = device_state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (K == 0) return zero_unless(accumulate, y, M * N, st);
  const cudaDataType_t ab = compute_type(x_type, w_type);
  if (ab == CUDA_R_16BF) {
    x = as_bf16(s, 0, x, x_type, M * K, st);
    w = as_bf16(s, 1, w, w_type, N * K, st);
  }
  const GemmShape g{CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, K, K, N, ab};
  GemmShape query = g;
  query.n = kPinnedRows;
  gemm(g, query, w, x, y, accumulate, st, s);
}

void matmul_backward_input(const float* dy, const void* w, DType w_type, float* dx, int64_t M,
                           int64_t N, int64_t K, bool accumulate, void* stream) {
  if (M == 0 || K == 0) return;
  const cudaStream_t st = native(stream);
  DeviceState& s = device_state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (N == 0) return zero_unless(accumulate, dx, M * K, st);
  const cudaDataType_t ab = compute_type(DType::f32, w_type);
  const void* b = ab == CUDA_R_16BF ? as_bf16(s, 0, dy, DType::f32, M * N, st) : dy;
  const GemmShape g{CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, K, N, K, ab};
  gemm(g, g, w, b, dx, accumulate, st, s);
}

void matmul_backward_weight(const float* dy, const void* x, DType x_type, float* dw, int64_t M,
                            int64_t N, int64_t K, bool accumulate, void* stream) {
  if (N == 0 || K == 0) return;
  const cudaStream_t st = native(stream);
  DeviceState& s = device_state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (M == 0) return zero_unless(accumulate, dw, N * K, st);
  const cudaDataType_t ab = compute_type(DType::f32, x_type);
  const void* b = ab == CUDA_R_16BF ? as_bf16(s, 0, dy, DType::f32, M * N, st) : dy;
  const GemmShape g{CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, K, N, K, ab};
  gemm(g, g, x, b, dw, accumulate, st, s);
}

}  // namespace tandem::ops::cuda
