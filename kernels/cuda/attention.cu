// CUDA attention: packed causal forward and backward over tiles of 16 queries and 16 keys in
// shared memory, kv_cache_write, and paged decode in key blocks of 16 with the online softmax.
#include <math_constants.h>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"
#include "kernels/exp.h"

namespace tandem::ops::cuda {
namespace {

constexpr int kTile = 16;  // queries per tile and keys per block (kAttentionKeyBlock)
constexpr int kThreads = 128;

// The sequence and query tile of a block: blockIdx.x counts the tiles of all sequences in
// order. Returns false for the spare blocks past the last tile.
__device__ bool find_tile(const int32_t* cu_seqlens, int64_t B, int64_t* start, int64_t* len,
                          int64_t* tile_start) {
  int64_t tile = blockIdx.x;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cu_seqlens[b + 1] - cu_seqlens[b];
    const int64_t tiles = (n + kTile - 1) / kTile;
    if (tile < tiles) {
      *start = cu_seqlens[b];
      *len = n;
      *tile_start = tile * kTile;
      return true;
    }
    tile -= tiles;
  }
  return false;
}

// Rows [first, first + rows) of a (T, heads, D) tensor at head h into a (16, D) tile; the rest 0.
__device__ void load_tile(float* dst, const float* src, int64_t first, int64_t rows, int64_t heads,
                          int64_t h, int64_t D) {
  for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    const int64_t r = i / D, d = i % D;
    dst[i] = r < rows ? src[((first + r) * heads + h) * D + d] : 0.0f;
  }
}

// The query tile of a block (find_tile) at head blockIdx.y: its sequence's start and length, its
// first query q0, its rows, the head and its key/value head.
struct QueryTile {
  int64_t start, len, q0, rows, h, kvh;
};
__device__ bool find_query_tile(const int32_t* cu_seqlens, int64_t B, int64_t H, int64_t Hkv,
                                QueryTile* t) {
  if (!find_tile(cu_seqlens, B, &t->start, &t->len, &t->q0)) return false;
  t->h = blockIdx.y;
  t->kvh = t->h / (H / Hkv);
  t->rows = min(static_cast<int64_t>(kTile), t->len - t->q0);
  return true;
}

// Lays arrays out one after the other from `at` (shared memory): carve(at, &a, n_a, &b, n_b, ...).
__device__ void carve(float*) {}
template <class... Rest>
__device__ void carve(float* at, float** array, int64_t n, Rest... rest) {
  *array = at;
  carve(at + n, rest...);
}

// The key block [k0, k0 + n) of a sequence starting at `first` into the tiles ks and vs, between
// two barriers (the previous block's readers are done; the next readers see it whole).
__device__ void load_key_block(float* ks, float* vs, const float* k, const float* v, int64_t first,
                               int64_t n, int64_t Hkv, int64_t kvh, int64_t D) {
  __syncthreads();
  load_tile(ks, k, first, n, Hkv, kvh, D);
  load_tile(vs, v, first, n, Hkv, kvh, D);
  __syncthreads();
}

// The log-sum-exp of the rows [first, first + rows) at head h into row_lse[16]; the rest 0.
__device__ void load_tile_lse(float* row_lse, const float* lse, int64_t first, int64_t rows,
                              int64_t H, int64_t h) {
  if (threadIdx.x < kTile)
    row_lse[threadIdx.x] = threadIdx.x < rows ? lse[(first + threadIdx.x) * H + h] : 0.0f;
}

__device__ float dot(const float* a, const float* b, int64_t D) {
  float s = 0.0f;
  for (int64_t d = 0; d < D; ++d) s = fmaf(a[d], b[d], s);
  return s;
}

// One block per (query tile, head). Shared: q, k, v, acc (16, D); scores (16, 16); m, l, alpha.
__global__ void attention_forward_kernel(const float* q, const float* k, const float* v,
                                         const int32_t* cu_seqlens, int64_t B, int64_t H,
                                         int64_t Hkv, int64_t D, float* out, float* lse,
                                         float scale) {
  QueryTile t;
  if (!find_query_tile(cu_seqlens, B, H, Hkv, &t)) return;
  const int64_t start = t.start, len = t.len, q0 = t.q0, rows = t.rows, h = t.h, kvh = t.kvh;
  extern __shared__ float smem[];
  float *qs, *ks, *vs, *acc, *s, *m, *l, *alpha;
  carve(smem, &qs, kTile * D, &ks, kTile * D, &vs, kTile * D, &acc, kTile * D, &s, kTile * kTile,
        &m, kTile, &l, kTile, &alpha, kTile);
  load_tile(qs, q, start + q0, rows, H, h, D);
  for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) acc[i] = 0.0f;
  if (threadIdx.x < kTile) {
    m[threadIdx.x] = -CUDART_INF_F;
    l[threadIdx.x] = 0.0f;
  }
  for (int64_t k0 = 0; k0 < q0 + rows; k0 += kTile) {
    const int64_t n = min(static_cast<int64_t>(kTile), len - k0);
    load_key_block(ks, vs, k, v, start + k0, n, Hkv, kvh, D);
    for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
      const int r = i / kTile, j = i % kTile;
      const bool visible = r < rows && j < n && k0 + j <= q0 + r;
      s[i] = visible ? dot(qs + r * D, ks + j * D, D) * scale : -CUDART_INF_F;
    }
    __syncthreads();
    if (threadIdx.x < rows) {
      const int r = threadIdx.x;
      float mb = -CUDART_INF_F;
      for (int j = 0; j < kTile; ++j) mb = fmaxf(mb, s[r * kTile + j]);
      const float m_new = fmaxf(m[r], mb);
      const float a = softmax_exp(m[r] - m_new);
      float sum = 0.0f;
      for (int j = 0; j < kTile; ++j) {
        const float p = j < n ? softmax_exp(s[r * kTile + j] - m_new) : 0.0f;
        s[r * kTile + j] = p;
        sum += p;
      }
      l[r] = l[r] * a + sum;
      m[r] = m_new;
      alpha[r] = a;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
      const int64_t r = i / D, d = i % D;
      if (r >= rows) continue;
      float a = acc[i] * alpha[r];
      for (int64_t j = 0; j < n; ++j) a = fmaf(s[r * kTile + j], vs[j * D + d], a);
      acc[i] = a;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int64_t r = i / D, d = i % D;
    out[((start + q0 + r) * H + h) * D + d] = acc[i] / l[r];
  }
  if (threadIdx.x < rows)
    lse[(start + q0 + threadIdx.x) * H + h] = m[threadIdx.x] + logf(l[threadIdx.x]);
}

// delta_r = rowsum(dout * out) for the rows of a tile, into delta[16].
__device__ void tile_delta(float* delta, const float* dout, const float* out, int64_t first,
                           int64_t rows, int64_t H, int64_t h, int64_t D) {
  if (threadIdx.x < kTile) {
    float s = 0.0f;
    if (threadIdx.x < rows) {
      const int64_t base = ((first + threadIdx.x) * H + h) * D;
      for (int64_t d = 0; d < D; ++d) s = fmaf(dout[base + d], out[base + d], s);
    }
    delta[threadIdx.x] = s;
  }
}

// dq: one block per (query tile, head), key blocks in order.
__global__ void attention_dq_kernel(const float* dout, const float* q, const float* k,
                                    const float* v, const float* out, const float* lse,
                                    const int32_t* cu_seqlens, int64_t B, int64_t H, int64_t Hkv,
                                    int64_t D, float* dq, float scale) {
  QueryTile t;
  if (!find_query_tile(cu_seqlens, B, H, Hkv, &t)) return;
  const int64_t start = t.start, len = t.len, q0 = t.q0, rows = t.rows, h = t.h, kvh = t.kvh;
  extern __shared__ float smem[];
  float *qs, *gs, *ks, *vs, *acc, *ds, *row_lse, *delta;
  carve(smem, &qs, kTile * D, &gs, kTile * D, &ks, kTile * D, &vs, kTile * D, &acc, kTile * D, &ds,
        kTile * kTile, &row_lse, kTile, &delta, kTile);
  load_tile(qs, q, start + q0, rows, H, h, D);
  load_tile(gs, dout, start + q0, rows, H, h, D);
  for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) acc[i] = 0.0f;
  tile_delta(delta, dout, out, start + q0, rows, H, h, D);
  load_tile_lse(row_lse, lse, start + q0, rows, H, h);
  for (int64_t k0 = 0; k0 < q0 + rows; k0 += kTile) {
    const int64_t n = min(static_cast<int64_t>(kTile), len - k0);
    load_key_block(ks, vs, k, v, start + k0, n, Hkv, kvh, D);
    for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
      const int r = i / kTile, j = i % kTile;
      float g = 0.0f;
      if (r < rows && j < n && k0 + j <= q0 + r) {
        const float p = softmax_exp(dot(qs + r * D, ks + j * D, D) * scale - row_lse[r]);
        g = p * (dot(gs + r * D, vs + j * D, D) - delta[r]);
      }
      ds[i] = g;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
      const int64_t r = i / D, d = i % D;
      float a = acc[i];
      for (int64_t j = 0; j < n; ++j) a = fmaf(ds[r * kTile + j], ks[j * D + d], a);
      acc[i] = a;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int64_t r = i / D, d = i % D;
    dq[((start + q0 + r) * H + h) * D + d] = acc[i] * scale;
  }
}

// dk, dv: one block per (key tile, kv head); the group's heads, then the query tiles, in order.
__global__ void attention_dkdv_kernel(const float* dout, const float* q, const float* k,
                                      const float* v, const float* out, const float* lse,
                                      const int32_t* cu_seqlens, int64_t B, int64_t H, int64_t Hkv,
                                      int64_t D, float* dk, float* dv, float scale) {
  int64_t start, len, k0;
  if (!find_tile(cu_seqlens, B, &start, &len, &k0)) return;
  const int64_t kvh = blockIdx.y, G = H / Hkv;
  const int64_t n = min(static_cast<int64_t>(kTile), len - k0);
  extern __shared__ float smem[];
  float *ks, *vs, *qs, *gs, *dk_acc, *dv_acc, *p, *ds, *row_lse, *delta;
  carve(smem, &ks, kTile * D, &vs, kTile * D, &qs, kTile * D, &gs, kTile * D, &dk_acc, kTile * D,
        &dv_acc, kTile * D, &p, kTile * kTile, &ds, kTile * kTile, &row_lse, kTile, &delta, kTile);
  load_tile(ks, k, start + k0, n, Hkv, kvh, D);
  load_tile(vs, v, start + k0, n, Hkv, kvh, D);
  for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
    dk_acc[i] = 0.0f;
    dv_acc[i] = 0.0f;
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kvh * G + g;
    for (int64_t q0 = k0; q0 < len; q0 += kTile) {
      const int64_t rows = min(static_cast<int64_t>(kTile), len - q0);
      __syncthreads();
      load_tile(qs, q, start + q0, rows, H, h, D);
      load_tile(gs, dout, start + q0, rows, H, h, D);
      tile_delta(delta, dout, out, start + q0, rows, H, h, D);
      load_tile_lse(row_lse, lse, start + q0, rows, H, h);
      __syncthreads();
      for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
        const int r = i / kTile, j = i % kTile;
        float pv = 0.0f, g2 = 0.0f;
        if (r < rows && j < n && k0 + j <= q0 + r) {
          pv = softmax_exp(dot(qs + r * D, ks + j * D, D) * scale - row_lse[r]);
          g2 = pv * (dot(gs + r * D, vs + j * D, D) - delta[r]);
        }
        p[i] = pv;
        ds[i] = g2;
      }
      __syncthreads();
      for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
        const int64_t j = i / D, d = i % D;
        float a = dv_acc[i], b = dk_acc[i];
        for (int64_t r = 0; r < rows; ++r) {
          a = fmaf(p[r * kTile + j], gs[r * D + d], a);
          b = fmaf(ds[r * kTile + j], qs[r * D + d], b);
        }
        dv_acc[i] = a;
        dk_acc[i] = b;
      }
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n * D; i += blockDim.x) {
    const int64_t j = i / D, d = i % D;
    const int64_t at = ((start + k0 + j) * Hkv + kvh) * D + d;
    dk[at] = dk_acc[i] * scale;
    dv[at] = dv_acc[i];
  }
}

// Values by slot (num_slots, row); keys transposed per block, (num_slots / P, row, P).
template <class T>
__global__ void kv_cache_write_kernel(const float* k, const float* v, const int32_t* slots,
                                      int64_t T_, int64_t row, int64_t P, T* kc, T* vc,
                                      int64_t num_slots) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < T_ * row;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / row, e = i % row, s = slots[t];
    if (s < 0 || s >= num_slots) continue;
    kc[((s / P) * row + e) * P + s % P] = from_f32<T>(k[i]);
    vc[s * row + e] = from_f32<T>(v[i]);
  }
}

// One block per (sequence, head): key blocks of 16 gathered from the paged cache, one warp per
// key for the scores, the online softmax by one thread, the value update across the threads.
template <class T>
__global__ void paged_decode_kernel(const float* q, const T* kc, const T* vc, int64_t num_blocks,
                                    int64_t P, const int32_t* indptr, const int32_t* indices,
                                    int64_t num_indices, const int32_t* last_len, int64_t H,
                                    int64_t Hkv, int64_t D, float* out, float scale) {
  const int64_t b = blockIdx.x, h = blockIdx.y, kvh = h / (H / Hkv);
  extern __shared__ float smem[];
  float *qs, *ks, *vs, *acc, *s;
  carve(smem, &qs, D, &ks, kTile * D, &vs, kTile * D, &acc, D, &s, kTile);
  __shared__ float m, l, alpha;
  __shared__ int bad;
  const int64_t first = indptr[b], blocks = indptr[b + 1] - first;
  const int64_t len = (blocks - 1) * P + last_len[b];
  float* o = out + (b * H + h) * D;
  if (blocks < 1 || first < 0 || first + blocks > num_indices || last_len[b] < 1 ||
      last_len[b] > P) {
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) o[d] = CUDART_NAN_F;
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    qs[d] = q[(b * H + h) * D + d];
    acc[d] = 0.0f;
  }
  if (threadIdx.x == 0) {
    m = -CUDART_INF_F;
    l = 0.0f;
    bad = 0;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t k0 = 0; k0 < len; k0 += kTile) {
    const int64_t n = min(static_cast<int64_t>(kTile), len - k0);
    __syncthreads();
    // Keys (blocks transposed, (Hkv, D, P)) with consecutive threads on consecutive slots;
    // values (by slot, (P, Hkv, D)) on consecutive d.
    for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
      const int64_t d = i / kTile, j = i % kTile;
      float kx = 0.0f;
      if (j < n) {
        const int64_t pos = k0 + j, blk = indices[first + pos / P];
        if (blk < 0 || blk >= num_blocks)
          bad = 1;
        else
          kx = to_f32(kc[((blk * Hkv + kvh) * D + d) * P + pos % P]);
      }
      ks[j * D + d] = kx;
    }
    for (int64_t i = threadIdx.x; i < kTile * D; i += blockDim.x) {
      const int64_t j = i / D, d = i % D;
      float vx = 0.0f;
      if (j < n) {
        const int64_t pos = k0 + j, blk = indices[first + pos / P];
        if (blk >= 0 && blk < num_blocks)
          vx = to_f32(vc[((blk * P + pos % P) * Hkv + kvh) * D + d]);
      }
      vs[i] = vx;
    }
    __syncthreads();
    for (int j = warp; j < kTile; j += warps) {
      float part = 0.0f;
      for (int64_t d = lane; d < D; d += 32) part = fmaf(qs[d], ks[j * D + d], part);
      for (int w = 16; w > 0; w /= 2) part += __shfl_xor_sync(0xffffffffu, part, w);
      if (lane == 0) s[j] = j < n ? part * scale : -CUDART_INF_F;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float mb = -CUDART_INF_F;
      for (int j = 0; j < kTile; ++j) mb = fmaxf(mb, s[j]);
      const float m_new = fmaxf(m, mb);
      const float a = softmax_exp(m - m_new);
      float sum = 0.0f;
      for (int j = 0; j < kTile; ++j) {
        const float p = j < n ? softmax_exp(s[j] - m_new) : 0.0f;
        s[j] = p;
        sum += p;
      }
      l = l * a + sum;
      m = m_new;
      alpha = a;
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float a = acc[d] * alpha;
      for (int64_t j = 0; j < n; ++j) a = fmaf(s[j], vs[j * D + d], a);
      acc[d] = a;
    }
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) o[d] = bad ? CUDART_NAN_F : acc[d] / l;
}

// Grid x for the tile kernels: enough blocks for every sequence's tiles (spares return at once).
unsigned tile_blocks(int64_t B, int64_t T) {
  return static_cast<unsigned>((T + kTile - 1) / kTile + B);
}

template <class K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
}

}  // namespace

void attention(const float* q, const float* k, const float* v, const int32_t* cu_seqlens, int64_t B,
               int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out, float* lse, float scale,
               void* stream) {
  if (T == 0 || B == 0) return;
  const size_t smem = sizeof(float) * (4 * kTile * D + kTile * kTile + 3 * kTile);
  allow_smem(attention_forward_kernel, smem);
  const dim3 grid(tile_blocks(B, T), static_cast<unsigned>(H));
  attention_forward_kernel<<<grid, kThreads, smem, native(stream)>>>(q, k, v, cu_seqlens, B, H, Hkv,
                                                                     D, out, lse, scale);
  CUDA_CHECK_LAUNCH();
}

void attention_backward(const float* dout, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const int32_t* cu_seqlens, int64_t B,
                        int64_t T, int64_t H, int64_t Hkv, int64_t D, float* dq, float* dk,
                        float* dv, float scale, void* stream) {
  if (T == 0 || B == 0) return;
  const size_t dq_smem = sizeof(float) * (5 * kTile * D + kTile * kTile + 2 * kTile);
  allow_smem(attention_dq_kernel, dq_smem);
  attention_dq_kernel<<<dim3(tile_blocks(B, T), static_cast<unsigned>(H)), kThreads, dq_smem,
                        native(stream)>>>(dout, q, k, v, out, lse, cu_seqlens, B, H, Hkv, D, dq,
                                          scale);
  CUDA_CHECK_LAUNCH();
  const size_t kv_smem = sizeof(float) * (6 * kTile * D + 2 * kTile * kTile + 2 * kTile);
  allow_smem(attention_dkdv_kernel, kv_smem);
  attention_dkdv_kernel<<<dim3(tile_blocks(B, T), static_cast<unsigned>(Hkv)), kThreads, kv_smem,
                          native(stream)>>>(dout, q, k, v, out, lse, cu_seqlens, B, H, Hkv, D, dk,
                                            dv, scale);
  CUDA_CHECK_LAUNCH();
}

void kv_cache_write(const float* k, const float* v, const int32_t* slot_mapping, int64_t T,
                    int64_t Hkv, int64_t D, int64_t P, void* k_cache, void* v_cache,
                    DType cache_type, int64_t num_slots, void* stream) {
  if (T == 0) return;
  const int64_t row = Hkv * D;
  const unsigned blocks = blocks_for(T * row, 256);
  if (cache_type == DType::f32) {
    kv_cache_write_kernel<<<blocks, 256, 0, native(stream)>>>(
        k, v, slot_mapping, T, row, P, static_cast<float*>(k_cache), static_cast<float*>(v_cache),
        num_slots);
  } else {
    kv_cache_write_kernel<<<blocks, 256, 0, native(stream)>>>(
        k, v, slot_mapping, T, row, P, static_cast<bf16*>(k_cache), static_cast<bf16*>(v_cache),
        num_slots);
  }
  CUDA_CHECK_LAUNCH();
}

void paged_attention_decode(const float* q, const void* k_cache, const void* v_cache,
                            DType cache_type, int64_t num_blocks, int64_t P,
                            const int32_t* kv_indptr, const int32_t* kv_indices,
                            int64_t num_indices, const int32_t* kv_last_len, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, float* out, float scale, void* stream) {
  if (B == 0) return;
  const size_t smem = sizeof(float) * (2 * D + 2 * kTile * D + kTile);
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>(H));
  if (cache_type == DType::f32) {
    allow_smem(paged_decode_kernel<float>, smem);
    paged_decode_kernel<<<grid, kThreads, smem, native(stream)>>>(
        q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), num_blocks, P,
        kv_indptr, kv_indices, num_indices, kv_last_len, H, Hkv, D, out, scale);
  } else {
    allow_smem(paged_decode_kernel<bf16>, smem);
    paged_decode_kernel<<<grid, kThreads, smem, native(stream)>>>(
        q, static_cast<const bf16*>(k_cache), static_cast<const bf16*>(v_cache), num_blocks, P,
        kv_indptr, kv_indices, num_indices, kv_last_len, H, Hkv, D, out, scale);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::ops::cuda
