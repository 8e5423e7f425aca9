// CPU attention: packed causal forward and paged decode around ONE shared online-softmax row step
// (so a token's output is bitwise the same either way), and kv_cache_write; the backward is in
// attention_backward.cpp.
#include "kernels/cpu/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

// GCC 12's shuffle intrinsics pass _mm512_undefined_ps() as the unused merge source, which its
// -Wuninitialized reports once inlined (the key transpose).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "core/error.h"
#include "core/half.h"
#include "core/parallel.h"
#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/transpose_avx512.h"
#include "kernels/exp.h"
#include "kernels/ops.h"

namespace tandem::ops::cpu {
namespace {

using namespace attention_detail;

std::atomic<bool> g_simd_enabled{true};

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") != 0;
  return has;
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// ---------------------------------------------------------------------------------------------
// Key blocks. The row step reads keys transposed, kt (D, 16) with rows ldk floats apart, so
// that the 16 scores of a block come out of one vector loop; values by row, vr[j] (D floats)
// for j < n: f32 values where they lie, others widened into vb (16, D). Lanes >= n of kt do not
// reach any result. The packed path gathers its key rows into kt (ldk 16); the paged cache
// stores keys transposed already, read in place where they suit (see decode_typed), else
// gathered.

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }

// Key j's element d is krows[j][d * kstride]: rows of the packed batch (kstride 1) or columns
// of the paged cache's transposed blocks (kstride P).
template <class T>
void gather_block_portable(const T* const* krows, int64_t kstride, const T* const* vrows, int n,
                           int64_t D, float* kt, float* vb, const float** vr) {
  for (int j = 0; j < kBlk; ++j) {
    if (j < n) {
      const T* kr = krows[j];
      for (int64_t d = 0; d < D; ++d) kt[d * kBlk + j] = widen(kr[d * kstride]);
      if constexpr (std::is_same_v<T, float>) {
        vr[j] = vrows[j];
      } else {
        for (int64_t d = 0; d < D; ++d) vb[j * D + d] = widen(vrows[j][d]);
        vr[j] = vb + j * D;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) kt[d * kBlk + j] = 0.0f;
    }
  }
}

// One key block: for f32 keys with D a multiple of 16, the keys transposed in registers; else
// the portable gather.
void gather_block(const float* const* krows, const float* const* vrows, int n, int64_t D, float* kt,
                  float* vb, const float** vr) {
  if (D % kBlk != 0 || attention_isa() != AttentionIsa::avx512)
    return gather_block_portable(krows, 1, vrows, n, D, kt, vb, vr);
  transpose_rows_avx512(krows, n, D, kt);
  for (int j = 0; j < n; ++j) vr[j] = vrows[j];
}

// ---------------------------------------------------------------------------------------------
// The row step: one query row against one key block of n valid keys (1 <= n <= 16), updating
// the row's state {acc[D], m, l} (see RowState). The arithmetic order, fixed here for both
// implementations:
//   score_j = ((p0 + p1) + (p2 + p3)) * scale, p_r = fma chain over d = r, r+4, r+8, ...
//   mb = tree_max(score) (pairwise halving over the 16 lanes, masked lanes -inf, max(a, b) =
//        a > b ? a : b as MAXPS); m' = std::max(m, mb); alpha = exp(m - m')
//   p_j = exp(score_j - m'); l' = l * alpha + tree_sum(p) (pairwise halving, masked lanes 0)
// with exp = softmax_exp (kernels/exp.h): branch-free, so the 16 lanes vectorise, and the same
// bits as the CUDA kernels.
//   acc'[d] = fma chain over j = 0..n-1 of p_j * v_j[d], starting from acc[d] * alpha.
// The AVX-512 and portable versions perform these same IEEE operations lane by lane.

inline float max_ps(float a, float b) { return a > b ? a : b; }

// After the block max: the new running max, alpha, p from the shifted scores d = score - m'
// (lanes >= n unused), the new running sum. Returns alpha.
inline float softmax_update(const float* d, int n, float m_old, float m_new, float* l, float* p) {
  const float alpha = softmax_exp(m_old - m_new);  // exactly 1 when the max did not move
  for (int j = 0; j < kBlk; ++j) p[j] = softmax_exp(j < n ? d[j] : kNegInf);  // exp(-inf) = 0
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  const float sum = t[0] + t[1];
  *l = *l * alpha + sum;
  return alpha;
}

// Inlined into its callers: the portable loop, and the AVX2 one that compiles these same IEEE
// operations with AVX2 and FMA (rows_step_avx2).
__attribute__((always_inline)) inline void row_step_portable(const float* q, const float* kt,
                                                             int64_t ldk, const float* const* vr,
                                                             int n, int64_t D, float scale,
                                                             float* state) {
  float part[4][kBlk] = {};
  for (int64_t d = 0; d < D; ++d) {
    float* pr = part[d & 3];
    for (int j = 0; j < n; ++j) pr[j] = std::fma(q[d], kt[d * ldk + j], pr[j]);
  }
  float s[kBlk], p[kBlk], t[8];
  for (int j = 0; j < kBlk; ++j)
    s[j] = j < n ? ((part[0][j] + part[1][j]) + (part[2][j] + part[3][j])) * scale : kNegInf;
  for (int i = 0; i < 8; ++i) t[i] = max_ps(s[i], s[i + 8]);
  for (int i = 0; i < 4; ++i) t[i] = max_ps(t[i], t[i + 4]);
  for (int i = 0; i < 2; ++i) t[i] = max_ps(t[i], t[i + 2]);
  const float mb = max_ps(t[0], t[1]);
  const float m_old = state[D], m_new = std::max(m_old, mb);
  for (int j = 0; j < kBlk; ++j) s[j] = s[j] - m_new;
  const float alpha = softmax_update(s, n, m_old, m_new, &state[D + 1], p);
  state[D] = m_new;
  float* acc = state;
  for (int64_t d = 0; d < D; ++d) {
    float a = acc[d] * alpha;
    for (int j = 0; j < n; ++j) a = std::fma(p[j], vr[j][d], a);
    acc[d] = a;
  }
}

// The value update of R rows with acc chunks of 16 lanes kept in registers across the j loop
// (NC = D / 16 chunks per row, R * NC <= 16), sharing the loads of the value rows.
template <int R, int NC>
__attribute__((target("avx512f,fma"), always_inline)) inline void pv_rows_avx512(
    float* const* acc, const float (*p)[kBlk], const float* const* vr, int n, const float* alpha) {
  __m512 a[R][NC];
  for (int r = 0; r < R; ++r) {
    const __m512 va = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * c), va);
  }
  for (int j = 0; j < n; ++j) {
    for (int c = 0; c < NC; ++c) {
      const __m512 vv = _mm512_loadu_ps(vr[j] + 16 * c);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vv, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a[r][c]);
}

// GCC 12 reports the "undefined" pass-through operand inside its own AVX-512 max and shuffle
// intrinsics as used uninitialized (GCC bug 105593); the intrinsics are correct.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
// The row step for R rows (R <= 4) that see the same key block with the same n: their score
// chains are interleaved and share the loads of kt; each row's arithmetic is exactly the one of
// a single-row step.
template <int R>
__attribute__((target("avx512f,fma"))) void rows_step_avx512(const float* const* q, const float* kt,
                                                             int64_t ldk, const float* const* vr,
                                                             int n, int64_t D, float scale,
                                                             float* const* state) {
  __m512 part[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) part[r][c] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 4 <= D; d += 4) {
    for (int c = 0; c < 4; ++c) {
      const __m512 kv = _mm512_loadu_ps(kt + (d + c) * ldk);
      for (int r = 0; r < R; ++r)
        part[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d + c]), kv, part[r][c]);
    }
  }
  for (int c = 0; d + c < D; ++c) {
    const __m512 kv = _mm512_loadu_ps(kt + (d + c) * ldk);
    for (int r = 0; r < R; ++r)
      part[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d + c]), kv, part[r][c]);
  }
  float s[R][kBlk], p[R][kBlk], alpha[R], m_old[R], m_new[R];
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  for (int r = 0; r < R; ++r) {
    const __m512 sv =
        _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid,
                           _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                                       _mm512_add_ps(part[r][2], part[r][3])),
                                         _mm512_set1_ps(scale)));
    // tree_max: lanes i and i + 8, then i + 4, i + 2, i + 1, with MAXPS's a > b ? a : b.
    __m512 x = _mm512_max_ps(sv, _mm512_shuffle_f32x4(sv, sv, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
    const float mb = _mm512_cvtss_f32(x);
    m_old[r] = state[r][D];
    m_new[r] = std::max(m_old[r], mb);
    _mm512_storeu_ps(s[r], _mm512_sub_ps(sv, _mm512_set1_ps(m_new[r])));
  }
  for (int r = 0; r < R; ++r) {
    alpha[r] = softmax_update(s[r], n, m_old[r], m_new[r], &state[r][D + 1], p[r]);
    state[r][D] = m_new[r];
  }
  if (D == 64) return pv_rows_avx512<R, 4>(state, p, vr, n, alpha);
  if (D == 128) {
    for (int r = 0; r + 1 < R; r += 2) pv_rows_avx512<2, 8>(state + r, p + r, vr, n, alpha + r);
    if (R % 2 == 1) pv_rows_avx512<1, 8>(state + R - 1, p + R - 1, vr, n, alpha + R - 1);
    return;
  }
  for (int r = 0; r < R; ++r) {
    float* acc = state[r];
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + c), _mm512_set1_ps(alpha[r]));
      for (int j = 0; j < n; ++j)
        a = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), _mm512_loadu_ps(vr[j] + c), a);
      _mm512_storeu_ps(acc + c, a);
    }
    for (; c < D; ++c) {
      float a = acc[c] * alpha[r];
      for (int j = 0; j < n; ++j) a = std::fma(p[r][j], vr[j][c], a);
      acc[c] = a;
    }
  }
}

#pragma GCC diagnostic pop

constexpr int kMaxRows = 4;

void rows_step_portable(int R, const float* const* q, const float* kt, int64_t ldk,
                        const float* const* vr, int n, int64_t D, float scale,
                        float* const* state) {
  for (int r = 0; r < R; ++r) row_step_portable(q[r], kt, ldk, vr, n, D, scale, state[r]);
}

__attribute__((target("avx2,fma"))) void rows_step_avx2(int R, const float* const* q,
                                                        const float* kt, int64_t ldk,
                                                        const float* const* vr, int n, int64_t D,
                                                        float scale, float* const* state) {
  for (int r = 0; r < R; ++r) row_step_portable(q[r], kt, ldk, vr, n, D, scale, state[r]);
}

// R rows (any R) against one key block, each with n valid keys.
void rows_step(int R, const float* const* q, const float* kt, int64_t ldk, const float* const* vr,
               int n, int64_t D, float scale, float* const* state) {
  switch (attention_isa()) {
    case AttentionIsa::portable:
      return rows_step_portable(R, q, kt, ldk, vr, n, D, scale, state);
    case AttentionIsa::avx2:
      return rows_step_avx2(R, q, kt, ldk, vr, n, D, scale, state);
    case AttentionIsa::avx512:
      break;
  }
  for (int r0 = 0; r0 < R; r0 += kMaxRows) {
    switch (std::min(kMaxRows, R - r0)) {
      case 1:
        rows_step_avx512<1>(q + r0, kt, ldk, vr, n, D, scale, state + r0);
        break;
      case 2:
        rows_step_avx512<2>(q + r0, kt, ldk, vr, n, D, scale, state + r0);
        break;
      case 3:
        rows_step_avx512<3>(q + r0, kt, ldk, vr, n, D, scale, state + r0);
        break;
      default:
        rows_step_avx512<4>(q + r0, kt, ldk, vr, n, D, scale, state + r0);
        break;
    }
  }
}

// A row's state: acc (D), then m and l; rows are 16 floats apart so that acc stays aligned.
inline int64_t state_stride(int64_t D) { return (D + 2 + 15) / 16 * 16; }

inline void init_row(float* state, int64_t D) {
  std::fill(state, state + D, 0.0f);
  state[D] = kNegInf;
  state[D + 1] = 0.0f;
}

inline void finish_row(const float* state, int64_t D, float* out, float* lse) {
  const float l = state[D + 1];
  for (int64_t d = 0; d < D; ++d) out[d] = state[d] / l;
  if (lse != nullptr) *lse = state[D] + logf(l);
}

}  // namespace

namespace attention_detail {

// Per-thread scratch that grows once to the largest shape seen; 64-byte aligned.
float* scratch_floats(int slot, size_t n) {
  thread_local std::vector<float> bufs[4];
  std::vector<float>& v = bufs[slot];
  if (v.size() < n + 16) v.resize(n + 16);
  const uintptr_t at = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - at % 64) % 64) / sizeof(float);
}

// Reads and checks cu_seqlens and prefix (undefined: no prefixes); reuses the calling thread's
// buffers.
const Sequences& read_sequences(const char* op, const Tensor& cu_seqlens, const Tensor& prefix,
                                int64_t T) {
  const int32_t* cu = cu_seqlens.data_as<int32_t>();
  const int64_t n = cu_seqlens.numel(), B = n - 1;
  TANDEM_CHECK(n >= 1 && cu[0] == 0, "{}: cu_seqlens {} must start with 0", op,
               cu_seqlens.shape().str());
  thread_local Sequences s;
  s.seqs.resize(static_cast<size_t>(B));
  for (int64_t i = 1; i < n; ++i) {
    TANDEM_CHECK(cu[i] >= cu[i - 1],
                 "{}: cu_seqlens must not decrease, but cu_seqlens[{}] = {} < cu_seqlens[{}] = {}",
                 op, i, cu[i], i - 1, cu[i - 1]);
    s.seqs[static_cast<size_t>(i - 1)] = {cu[i - 1], cu[i] - cu[i - 1], 0, 0};
  }
  TANDEM_CHECK(cu[n - 1] == T, "{}: cu_seqlens ends with {} but there are {} tokens", op, cu[n - 1],
               T);
  s.child_ptr.assign(static_cast<size_t>(B + 1), 0);
  s.children.clear();
  if (!prefix.defined()) return s;
  const int32_t* pre = prefix.data_as<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t p = pre[b];
    if (p == -1) continue;
    TANDEM_CHECK(p >= 0 && p < B && p != b && pre[p] == -1,
                 "{}: prefix[{}] = {} must be -1 or another of the {} sequences that has no "
                 "prefix itself",
                 op, b, p, B);
    SeqSpan& q = s.seqs[static_cast<size_t>(b)];
    q.ctx_start = s.seqs[static_cast<size_t>(p)].start;
    q.ctx_len = s.seqs[static_cast<size_t>(p)].len;
    ++s.child_ptr[static_cast<size_t>(p) + 1];
  }
  for (int64_t b = 0; b < B; ++b)
    s.child_ptr[static_cast<size_t>(b) + 1] += s.child_ptr[static_cast<size_t>(b)];
  s.children.resize(static_cast<size_t>(s.child_ptr[static_cast<size_t>(B)]));
  std::vector<int64_t> fill(s.child_ptr.begin(), s.child_ptr.end() - 1);
  for (int64_t b = 0; b < B; ++b)
    if (pre[b] != -1) s.children[static_cast<size_t>(fill[static_cast<size_t>(pre[b])]++)] = b;
  return s;
}

const std::vector<TileItem>& tile_items(const Sequences& s, int64_t Hkv) {
  thread_local std::vector<TileItem> items;
  items.clear();
  for (size_t b = 0; b < s.seqs.size(); ++b) {
    const SeqSpan& q = s.seqs[b];
    const int64_t tiles = (q.len + kBlk - 1) / kBlk;
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t p = 0; p < (tiles + 1) / 2; ++p)
        items.push_back({static_cast<int64_t>(b), q, kvh, p, tiles - 1 - p});
  }
  return items;
}

// Multiply-adds of the forward: 2 * (len^2 / 2 + len * ctx_len) * H * D per sequence.
double causal_macs(const Sequences& s, int64_t H, int64_t D) {
  double macs = 0;
  for (const SeqSpan& q : s.seqs)
    macs += static_cast<double>(q.len) * static_cast<double>(q.len + 2 * q.ctx_len);
  return macs * static_cast<double>(H * D);
}

// dst (D, 16) = the n rows (D floats each) transposed, lanes >= n zero; D a multiple of 16, in
// 16 x 16 register blocks (data movement only: the same floats).
__attribute__((target("avx512f"))) void transpose_rows_avx512(const float* const* rows, int n,
                                                              int64_t D, float* dst) {
  for (int64_t d0 = 0; d0 < D; d0 += kBlk) {
    __m512 r[kBlk];
    for (int j = 0; j < kBlk; ++j)
      r[j] = j < n ? _mm512_loadu_ps(rows[j] + d0) : _mm512_setzero_ps();
    detail::transpose16x16(r);
    for (int i = 0; i < kBlk; ++i) _mm512_storeu_ps(dst + (d0 + i) * kBlk, r[i]);
  }
}

}  // namespace attention_detail

namespace {

// ---------------------------------------------------------------------------------------------
// Paged cache helpers. k_cache (num_blocks, Hkv, D, P): each block's keys transposed per head;
// v_cache (num_blocks, P, Hkv, D): by slot.

template <class T>
void write_slots(const Tensor& k, const Tensor& v, const int32_t* slots, const Tensor& k_cache,
                 const Tensor& v_cache) {
  const int64_t T_ = k.size(0), Hkv = k.size(1), D = k.size(2), row = Hkv * D;
  const int64_t P = v_cache.size(1);
  const float* ks = k.data_as<float>();
  const float* vs = v.data_as<float>();
  T* kc = static_cast<T*>(k_cache.data());
  T* vc = static_cast<T*>(v_cache.data());
  parallel_for(
      T_,
      [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const int64_t s = slots[t];
          // Key element (h, d) of slot s: block s / P, row h * D + d, column s % P.
          T* kcol = kc + (s / P) * row * P + s % P;
          for (int64_t i = 0; i < row; ++i) {
            if constexpr (std::is_same_v<T, float>) {
              kcol[i * P] = ks[t * row + i];
              vc[s * row + i] = vs[t * row + i];
            } else {
              kcol[i * P] = T(ks[t * row + i]);
              vc[s * row + i] = T(vs[t * row + i]);
            }
          }
        }
      },
      16);
}

// Asks for the key block at kb (D rows of 16 floats, ldk apart) and its 16 value rows from v0
// (vstride apart) to be brought into the cache.
inline void prefetch_block(const float* kb, int64_t ldk, const float* v0, int64_t vstride,
                           int64_t D) {
  for (int64_t d = 0; d < D; ++d) __builtin_prefetch(kb + d * ldk);
  for (int j = 0; j < kBlk; ++j)
    for (int64_t c = 0; c < D; c += 16) __builtin_prefetch(v0 + j * vstride + c);
}

// Key blocks of 16 positions. With f32 keys and P a multiple of 16, a key block lies in one cache
// block, its keys already transposed: the row step reads them in place (rows P floats apart),
// the very floats a gather would copy. Otherwise (bf16, or a key block across cache blocks) the
// keys are gathered into kt. In place, the next key block (of the item, else the first of the
// next item) is prefetched while this one is computed: blocks lie scattered over the pool.
template <class T>
void decode_typed(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const int32_t* indptr, const int32_t* indices, const int32_t* last_len,
                  const Tensor& out, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t P = v_cache.size(1), Hkv = v_cache.size(2), G = H / Hkv;
  const bool in_place = std::is_same_v<T, float> && P % kBlk == 0;
  const T* kc = static_cast<const T*>(k_cache.data());
  const T* vc = static_cast<const T*>(v_cache.data());
  const float* qp = q.data_as<float>();
  float* op = out.data_as<float>();
  double macs = 0;
  for (int64_t b = 0; b < B; ++b) macs += static_cast<double>(indptr[b + 1] - indptr[b]) * P;
  macs *= 2.0 * static_cast<double>(H * D);
  // Sequence bb's position pos in head h: its key (a column of the block's transposed keys, the
  // next key P elements on) and, in *v, its value row.
  const auto at = [&](int64_t bb, int64_t h, int64_t pos, const T** v) {
    const int64_t blk = indices[indptr[bb] + pos / P];
    *v = vc + ((blk * P + pos % P) * Hkv + h) * D;
    return kc + (blk * Hkv + h) * D * P + pos % P;
  };
  parallel_items(B * Hkv, macs, [&](int64_t begin, int64_t end) {
    float* kt = scratch_floats(0, static_cast<size_t>(D * kBlk));
    float* vb = scratch_floats(1, static_cast<size_t>(D * kBlk));
    float* state = scratch_floats(2, static_cast<size_t>(G * state_stride(D)));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv;
      const int64_t len = (indptr[b + 1] - indptr[b] - 1) * P + last_len[b];
      for (int64_t g = 0; g < G; ++g) init_row(state + g * state_stride(D), D);
      for (int64_t k0 = 0; k0 < len; k0 += kBlk) {
        const int n = static_cast<int>(std::min<int64_t>(kBlk, len - k0));
        const float* vr[kBlk];
        const float* kb = kt;
        int64_t ldk = kBlk;
        if constexpr (std::is_same_v<T, float>) {
          if (in_place) {
            const float* v0 = nullptr;
            kb = at(b, kvh, k0, &v0);
            ldk = P;
            for (int j = 0; j < n; ++j) vr[j] = v0 + j * Hkv * D;
            const float* vn = nullptr;
            if (k0 + kBlk < len) {
              prefetch_block(at(b, kvh, k0 + kBlk, &vn), P, vn, Hkv * D, D);
            } else if (item + 1 < B * Hkv) {
              prefetch_block(at((item + 1) / Hkv, (item + 1) % Hkv, 0, &vn), P, vn, Hkv * D, D);
            }
          }
        }
        if (!in_place) {
          const T* kcols[kBlk];
          const T* vrows[kBlk];
          for (int j = 0; j < n; ++j) kcols[j] = at(b, kvh, k0 + j, &vrows[j]);
          gather_block_portable(kcols, P, vrows, n, D, kt, vb, vr);
        }
        for (int64_t g0 = 0; g0 < G; g0 += kMaxRows) {
          const int R = static_cast<int>(std::min<int64_t>(kMaxRows, G - g0));
          const float* qs[kMaxRows];
          float* ss[kMaxRows];
          for (int r = 0; r < R; ++r) {
            qs[r] = qp + (b * H + kvh * G + g0 + r) * D;
            ss[r] = state + (g0 + r) * state_stride(D);
          }
          rows_step(R, qs, kb, ldk, vr, n, D, scale, ss);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        finish_row(state + g * state_stride(D), D, op + (b * H + kvh * G + g) * D, nullptr);
    }
  });
}

}  // namespace

void set_attention_simd(bool enabled) { g_simd_enabled = enabled; }
bool attention_simd_active() { return attention_isa() != AttentionIsa::portable; }
AttentionIsa attention_isa() {
  if (!g_simd_enabled) return AttentionIsa::portable;
  if (cpu_has_avx512()) return AttentionIsa::avx512;
  return cpu_has_avx2() ? AttentionIsa::avx2 : AttentionIsa::portable;
}

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
               const Tensor& prefix, const Tensor& out, const Tensor& lse, float scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), G = H / Hkv;
  const Sequences& seqs = read_sequences("attention", cu_seqlens, prefix, T);
  const std::vector<TileItem>& items = tile_items(seqs, Hkv);
  const float* qp = q.data_as<float>();
  const float* kp = k.data_as<float>();
  const float* vp = v.data_as<float>();
  float* op = out.data_as<float>();
  float* lp = lse.data_as<float>();
  parallel_items(
      static_cast<int64_t>(items.size()), causal_macs(seqs, H, D), [&](int64_t begin, int64_t end) {
        float* kt = scratch_floats(0, static_cast<size_t>(D * kBlk));
        float* vb = scratch_floats(1, static_cast<size_t>(D * kBlk));
        // Rows of an item: tile, head of the group, query of the tile.
        float* state = scratch_floats(2, static_cast<size_t>(2 * G * kBlk * state_stride(D)));
        for (int64_t w = begin; w < end; ++w) {
          const TileItem& it = items[static_cast<size_t>(w)];
          const SeqSpan& sp = it.span;
          const int64_t cl = sp.ctx_len;  // own token i sits at position cl + i
          const int ntiles = it.tile_a == it.tile_b ? 1 : 2;
          const int64_t tiles[2] = {it.tile_a, it.tile_b};
          auto row_state = [&](int ti, int64_t g, int64_t i) {
            return state + ((ti * G + g) * kBlk + (i - tiles[ti] * kBlk)) * state_stride(D);
          };
          int64_t last = 0;
          for (int ti = 0; ti < ntiles; ++ti) {
            const int64_t r0 = tiles[ti] * kBlk, r1 = std::min(sp.len, r0 + kBlk);
            last = std::max(last, r1);
            for (int64_t g = 0; g < G; ++g)
              for (int64_t i = r0; i < r1; ++i) init_row(row_state(ti, g, i), D);
          }
          // Key blocks by position: the prefix's tokens, then the sequence's own.
          for (int64_t k0 = 0; k0 < cl + last; k0 += kBlk) {
            const int n = static_cast<int>(std::min<int64_t>(kBlk, cl + sp.len - k0));
            const float* krows[kBlk];
            const float* vrows[kBlk];
            for (int j = 0; j < n; ++j) {
              const int64_t off = (sp.key_row(k0 + j) * Hkv + it.kvh) * D;
              krows[j] = kp + off;
              vrows[j] = vp + off;
            }
            const float* vr[kBlk];
            gather_block(krows, vrows, n, D, kt, vb, vr);
            // Rows that see the whole block go in groups of up to kMaxRows; the diagonal block's
            // rows, each with its own count of visible keys, one by one.
            const float* qs[kMaxRows];
            float* ss[kMaxRows];
            int R = 0;
            for (int ti = 0; ti < ntiles; ++ti) {
              const int64_t r0 = std::max(tiles[ti] * kBlk, k0 - cl);
              const int64_t r1 = std::min(sp.len, tiles[ti] * kBlk + kBlk);
              for (int64_t g = 0; g < G; ++g) {
                const int64_t h = it.kvh * G + g;
                for (int64_t i = r0; i < r1; ++i) {
                  const int nv = static_cast<int>(std::min<int64_t>(n, cl + i - k0 + 1));
                  const float* qr = qp + ((sp.start + i) * H + h) * D;
                  if (nv < n) {
                    float* st = row_state(ti, g, i);
                    rows_step(1, &qr, kt, kBlk, vr, nv, D, scale, &st);
                    continue;
                  }
                  qs[R] = qr;
                  ss[R] = row_state(ti, g, i);
                  if (++R == kMaxRows) {
                    rows_step(R, qs, kt, kBlk, vr, n, D, scale, ss);
                    R = 0;
                  }
                }
              }
            }
            if (R > 0) rows_step(R, qs, kt, kBlk, vr, n, D, scale, ss);
          }
          for (int ti = 0; ti < ntiles; ++ti) {
            const int64_t r0 = tiles[ti] * kBlk, r1 = std::min(sp.len, r0 + kBlk);
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = it.kvh * G + g;
              for (int64_t i = r0; i < r1; ++i) {
                const int64_t row = (sp.start + i) * H + h;
                finish_row(row_state(ti, g, i), D, op + row * D, lp + row);
              }
            }
          }
        }
      });
}

void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                    const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t slots = v_cache.size(0) * v_cache.size(1);
  const int32_t* sm = slot_mapping.data_as<int32_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TANDEM_CHECK(sm[t] >= 0 && sm[t] < slots,
                 "kv_cache_write: slot_mapping[{}] = {} is outside the cache's {} slots {}", t,
                 sm[t], slots, v_cache.shape().str());
  if (k_cache.dtype() == DType::f32) return write_slots<float>(k, v, sm, k_cache, v_cache);
  write_slots<bf16>(k, v, sm, k_cache, v_cache);
}

void paged_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& kv_indptr, const Tensor& kv_indices,
                            const Tensor& kv_last_len, const Tensor& out, float scale) {
  const int64_t B = q.size(0), num_blocks = v_cache.size(0), P = v_cache.size(1);
  const int32_t* indptr = kv_indptr.data_as<int32_t>();
  const int32_t* indices = kv_indices.data_as<int32_t>();
  const int32_t* last_len = kv_last_len.data_as<int32_t>();
  constexpr const char* op = "paged_attention_decode";
  TANDEM_CHECK(indptr[0] == 0, "{}: kv_indptr[0] = {}, expected 0", op, indptr[0]);
  TANDEM_CHECK(indptr[B] <= kv_indices.numel(),
               "{}: kv_indptr[{}] = {} but kv_indices {} holds fewer block ids", op, B, indptr[B],
               kv_indices.shape().str());
  for (int64_t b = 0; b < B; ++b) {
    TANDEM_CHECK(indptr[b + 1] > indptr[b],
                 "{}: sequence {} has no blocks (kv_indptr[{}] = {}, kv_indptr[{}] = {})", op, b, b,
                 indptr[b], b + 1, indptr[b + 1]);
    TANDEM_CHECK(last_len[b] >= 1 && last_len[b] <= P,
                 "{}: kv_last_len[{}] = {} is outside 1..{} (the block size)", op, b, last_len[b],
                 P);
  }
  for (int64_t i = 0; i < indptr[B]; ++i)
    TANDEM_CHECK(indices[i] >= 0 && indices[i] < num_blocks,
                 "{}: kv_indices[{}] = {} is outside the cache's {} blocks", op, i, indices[i],
                 num_blocks);
  if (k_cache.dtype() == DType::f32)
    return decode_typed<float>(q, k_cache, v_cache, indptr, indices, last_len, out, scale);
  decode_typed<bf16>(q, k_cache, v_cache, indptr, indices, last_len, out, scale);
}

}  // namespace tandem::ops::cpu
