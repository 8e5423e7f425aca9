// CPU attention backward, FlashAttention-2 style over the forward's work items (dq per query
// tile, dk and dv per key tile, including the queries of the sequences a prefix serves), with
// AVX-512 and portable versions that agree bitwise.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/clones.h"
#include "kernels/exp.h"

namespace tandem::ops::cpu {
namespace {

using namespace attention_detail;

// ---------------------------------------------------------------------------------------------
// Backward, FlashAttention-2 style: scores and dP of a (query tile, key block) from tile_dots,
// the gradient sums from axpys, each in an AVX-512 and a portable version that do the same IEEE
// operations in the same order, so they agree bitwise.

// out[i * 16 + j] = sum over d of x[i * xs + d] * xt[d * 16 + j] for rows i < rows, in 4
// partial fma chains over d = r (mod 4) combined as (p0 + p1) + (p2 + p3).
// The portable functions are inlined into their callers, so that the AVX2 instances of the
// items (dq_item_avx2, dkdv_item_avx2) compile these same IEEE operations with AVX2 and FMA.
__attribute__((always_inline)) inline void tile_dots_portable(const float* x, int64_t xs,
                                                              int64_t rows, const float* xt,
                                                              int64_t D, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    float part[4][kBlk] = {};
    for (int64_t d = 0; d < D; ++d) {
      float* pr = part[d & 3];
      for (int j = 0; j < kBlk; ++j) pr[j] = std::fma(x[i * xs + d], xt[d * kBlk + j], pr[j]);
    }
    for (int j = 0; j < kBlk; ++j)
      out[i * kBlk + j] = (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]);
  }
}

template <int R>
__attribute__((target("avx512f,fma"), always_inline)) inline void tile_dots_rows_avx512(
    const float* x, int64_t xs, const float* xt, int64_t D, float* out) {
  // The partial sum of d is part[d & 3]; d runs in steps of 4 so that every index is a constant
  // and the 4 R accumulators stay in registers.
  __m512 part[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) part[r][c] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 4 <= D; d += 4)
    for (int c = 0; c < 4; ++c) {
      const __m512 kv = _mm512_loadu_ps(xt + (d + c) * kBlk);
      for (int r = 0; r < R; ++r)
        part[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + d + c]), kv, part[r][c]);
    }
  for (int c = 0; d + c < D; ++c) {
    const __m512 kv = _mm512_loadu_ps(xt + (d + c) * kBlk);
    for (int r = 0; r < R; ++r)
      part[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + d + c]), kv, part[r][c]);
  }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + r * kBlk, _mm512_add_ps(_mm512_add_ps(part[r][0], part[r][1]),
                                                   _mm512_add_ps(part[r][2], part[r][3])));
}

__attribute__((target("avx512f,fma"))) void tile_dots_avx512(const float* x, int64_t xs,
                                                             int64_t rows, const float* xt,
                                                             int64_t D, float* out) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) tile_dots_rows_avx512<4>(x + i * xs, xs, xt, D, out + i * kBlk);
  for (; i < rows; ++i) tile_dots_rows_avx512<1>(x + i * xs, xs, xt, D, out + i * kBlk);
}

// acc[d] = fma(c[t * cs], x[t * xs + d], acc[d]), for t = 0..count-1 in order.
__attribute__((always_inline)) inline void axpys_portable(float* acc, const float* c, int64_t cs,
                                                          const float* x, int64_t xs, int count,
                                                          int64_t D) {
  for (int64_t d = 0; d < D; ++d) {
    float v = acc[d];
    for (int t = 0; t < count; ++t) v = std::fma(c[t * cs], x[t * xs + d], v);
    acc[d] = v;
  }
}

__attribute__((target("avx512f,fma"))) void axpys_avx512(float* acc, const float* c, int64_t cs,
                                                         const float* x, int64_t xs, int count,
                                                         int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 v0 = _mm512_loadu_ps(acc + d), v1 = _mm512_loadu_ps(acc + d + 16);
    __m512 v2 = _mm512_loadu_ps(acc + d + 32), v3 = _mm512_loadu_ps(acc + d + 48);
    for (int t = 0; t < count; ++t) {
      const __m512 ct = _mm512_set1_ps(c[t * cs]);
      const float* xr = x + t * xs + d;
      v0 = _mm512_fmadd_ps(ct, _mm512_loadu_ps(xr), v0);
      v1 = _mm512_fmadd_ps(ct, _mm512_loadu_ps(xr + 16), v1);
      v2 = _mm512_fmadd_ps(ct, _mm512_loadu_ps(xr + 32), v2);
      v3 = _mm512_fmadd_ps(ct, _mm512_loadu_ps(xr + 48), v3);
    }
    _mm512_storeu_ps(acc + d, v0);
    _mm512_storeu_ps(acc + d + 16, v1);
    _mm512_storeu_ps(acc + d + 32, v2);
    _mm512_storeu_ps(acc + d + 48, v3);
  }
  for (; d + 16 <= D; d += 16) {
    __m512 v = _mm512_loadu_ps(acc + d);
    for (int t = 0; t < count; ++t)
      v = _mm512_fmadd_ps(_mm512_set1_ps(c[t * cs]), _mm512_loadu_ps(x + t * xs + d), v);
    _mm512_storeu_ps(acc + d, v);
  }
  for (; d < D; ++d) {
    float v = acc[d];
    for (int t = 0; t < count; ++t) v = std::fma(c[t * cs], x[t * xs + d], v);
    acc[d] = v;
  }
}

struct BackwardArgs {
  const float *dout, *q, *k, *v, *lse, *delta;  // delta (T, H) = rowsum(dout * out)
  float *dq, *dk, *dv;
  int64_t H, Hkv, D;
  float scale;
  const Sequences* seqs;
};

// kt, vt (D, 16): head kvh's keys and values of the token rows rows[0..n) transposed, lanes >= n
// zero.
template <bool kSimd>
__attribute__((always_inline)) inline void gather_kv_transposed(const BackwardArgs& a, int64_t kvh,
                                                                const int64_t* rows, int n,
                                                                float* kt, float* vt) {
  const int64_t D = a.D;
  const float* krows[kBlk];
  const float* vrows[kBlk];
  for (int j = 0; j < n; ++j) {
    krows[j] = a.k + (rows[j] * a.Hkv + kvh) * D;
    vrows[j] = a.v + (rows[j] * a.Hkv + kvh) * D;
  }
  if (kSimd && D % kBlk == 0) {
    transpose_rows_avx512(krows, n, D, kt);
    transpose_rows_avx512(vrows, n, D, vt);
    return;
  }
  for (int j = 0; j < kBlk; ++j)
    for (int64_t d = 0; d < D; ++d) {
      kt[d * kBlk + j] = j < n ? krows[j][d] : 0.0f;
      vt[d * kBlk + j] = j < n ? vrows[j][d] : 0.0f;
    }
}

// One row of a tile's probabilities: p_j = exp(s_j * scale - lse) for the nv visible keys, 0 for
// the others, and ds_j = p_j * (ds_j - delta). Built per vector width (clones.h); the arithmetic
// comes before the select so that the 16 lanes vectorise.
TANDEM_CPU_CLONES void probs_row(const float* __restrict s, float scale, float lse, float delta,
                                 int64_t nv, float* __restrict p, float* __restrict ds) {
  for (int j = 0; j < kBlk; ++j) {
    const float x = s[j] * scale - lse;
    const float pj = softmax_exp(j < nv ? x : kNegInf);
    p[j] = pj;
    ds[j] = pj * (ds[j] - delta);
  }
}

// P (16, 16) and dS (16, 16) of the query token rows [qrow0, qrow0 + rows) of head h against a
// key block of n keys (kt, vt gathered): P_ij = exp(scale * q_i.k_j - lse_i), dS_ij = P_ij (dP_ij
// - delta_i), dP_ij = dout_i.v_j; zero where the key is masked: query i sees keys j < diag + i + 1
// (diag: the first query's position minus the first key's). S holds (16, 16) scratch.
template <bool kSimd>
__attribute__((always_inline)) inline void tile_probs(const BackwardArgs& a, int64_t h,
                                                      int64_t qrow0, int64_t rows, int64_t diag,
                                                      int n, const float* kt, const float* vt,
                                                      float* S, float* P, float* dS) {
  const int64_t first = qrow0 * a.H + h, D = a.D;
  if constexpr (kSimd) {
    tile_dots_avx512(a.q + first * D, a.H * D, rows, kt, D, S);
    tile_dots_avx512(a.dout + first * D, a.H * D, rows, vt, D, dS);
  } else {
    tile_dots_portable(a.q + first * D, a.H * D, rows, kt, D, S);
    tile_dots_portable(a.dout + first * D, a.H * D, rows, vt, D, dS);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = first + i * a.H;
    const int64_t nv = std::min<int64_t>(n, diag + i + 1);
    probs_row(S + i * kBlk, a.scale, a.lse[row], a.delta[row], nv, P + i * kBlk, dS + i * kBlk);
  }
}

// A thread's scratch for one backward item: the key block's k and v transposed (D, 16), the
// score, probability and dS tiles (16, 16), then `extra` floats.
struct ItemScratch {
  float *kt, *vt, *S, *P, *dS, *extra;
};
inline ItemScratch item_scratch(int64_t D, int64_t extra) {
  ItemScratch sc;
  sc.kt = scratch_floats(0, static_cast<size_t>(D * kBlk));
  sc.vt = scratch_floats(1, static_cast<size_t>(D * kBlk));
  sc.S = scratch_floats(2, static_cast<size_t>(3 * kBlk * kBlk + extra));
  sc.P = sc.S + kBlk * kBlk;
  sc.dS = sc.P + kBlk * kBlk;
  sc.extra = sc.dS + kBlk * kBlk;
  return sc;
}

// dq rows of one item's query tiles: dq_i = scale * sum_j dS_ij k_j, key blocks in order of
// position (the prefix's, then the sequence's own).
template <bool kSimd>
__attribute__((always_inline)) inline void dq_item(const BackwardArgs& a, const TileItem& it) {
  const int64_t D = a.D, G = a.H / a.Hkv;
  const SeqSpan& sp = it.span;
  const ItemScratch sc = item_scratch(D, 0);
  float *kt = sc.kt, *vt = sc.vt, *S = sc.S, *P = sc.P, *dS = sc.dS;
  const int64_t tiles[2] = {it.tile_a, it.tile_b};
  for (int ti = 0; ti < (it.tile_a == it.tile_b ? 1 : 2); ++ti) {
    const int64_t q0 = tiles[ti] * kBlk, rows = std::min<int64_t>(kBlk, sp.len - q0);
    const int64_t pos0 = sp.ctx_len + q0;  // the first query's position
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < rows; ++i) {
        float* dq = a.dq + ((sp.start + q0 + i) * a.H + it.kvh * G + g) * D;
        std::fill(dq, dq + D, 0.0f);
      }
    for (int64_t k0 = 0; k0 < pos0 + rows; k0 += kBlk) {
      const int n = static_cast<int>(std::min<int64_t>(kBlk, sp.ctx_len + sp.len - k0));
      int64_t kr[kBlk];
      for (int j = 0; j < n; ++j) kr[j] = sp.key_row(k0 + j);
      gather_kv_transposed<kSimd>(a, it.kvh, kr, n, kt, vt);
      // The block's keys in runs of consecutive rows (two where it straddles the prefix's end).
      int runs[3] = {0, n, n}, nruns = 1;
      for (int j = 1; j < n; ++j)
        if (kr[j] != kr[j - 1] + 1) {
          runs[1] = j;
          nruns = 2;
        }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = it.kvh * G + g;
        tile_probs<kSimd>(a, h, sp.start + q0, rows, pos0 - k0, n, kt, vt, S, P, dS);
        for (int64_t i = 0; i < rows; ++i) {
          float* dq = a.dq + ((sp.start + q0 + i) * a.H + h) * D;
          for (int r = 0; r < nruns; ++r) {
            const int j0 = runs[r], count = runs[r + 1] - j0;
            const float* kb = a.k + (kr[j0] * a.Hkv + it.kvh) * D;  // rows Hkv * D apart
            if constexpr (kSimd) {
              axpys_avx512(dq, dS + i * kBlk + j0, 1, kb, a.Hkv * D, count, D);
            } else {
              axpys_portable(dq, dS + i * kBlk + j0, 1, kb, a.Hkv * D, count, D);
            }
          }
        }
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < rows; ++i) {
        float* dq = a.dq + ((sp.start + q0 + i) * a.H + it.kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dq[d] = dq[d] * a.scale;
      }
  }
}

// dk, dv rows of one item's key tiles, summed over the group's heads, then the queries in order:
// the sequence's own, then those of every sequence it prefixes (which see all of its keys).
template <bool kSimd>
__attribute__((always_inline)) inline void dkdv_item(const BackwardArgs& a, const TileItem& it) {
  const int64_t D = a.D, G = a.H / a.Hkv;
  const SeqSpan& sp = it.span;
  const ItemScratch sc = item_scratch(D, 2 * kBlk * D);
  float *kt = sc.kt, *vt = sc.vt, *S = sc.S, *P = sc.P, *dS = sc.dS;
  float* dk = sc.extra;       // (16, D)
  float* dv = dk + kBlk * D;  // (16, D)
  const Sequences& seqs = *a.seqs;
  const int64_t c0 = seqs.child_ptr[static_cast<size_t>(it.seq)];
  const int64_t c1 = seqs.child_ptr[static_cast<size_t>(it.seq) + 1];
  const int64_t tiles[2] = {it.tile_a, it.tile_b};
  for (int ti = 0; ti < (it.tile_a == it.tile_b ? 1 : 2); ++ti) {
    const int64_t k0 = tiles[ti] * kBlk;
    const int n = static_cast<int>(std::min<int64_t>(kBlk, sp.len - k0));
    int64_t kr[kBlk];
    for (int j = 0; j < n; ++j) kr[j] = sp.start + k0 + j;
    gather_kv_transposed<kSimd>(a, it.kvh, kr, n, kt, vt);
    std::fill(dk, dk + 2 * kBlk * D, 0.0f);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = it.kvh * G + g;
      // Query rows [qrow0, qrow0 + rows) whose first sits diag positions after the block's.
      // Inlined, so that it is compiled for the item's instruction set (dkdv_item_avx2's AVX2 and
      // FMA): a lambda is a function of its own, compiled for the baseline, whose portable sums
      // would call libm's fmaf for every product.
      auto add_tile = [&](int64_t qrow0, int64_t rows, int64_t diag)
          __attribute__((always_inline)) {
        tile_probs<kSimd>(a, h, qrow0, rows, diag, n, kt, vt, S, P, dS);
        const float* qr = a.q + (qrow0 * a.H + h) * D;  // rows H * D apart
        const float* gr = a.dout + (qrow0 * a.H + h) * D;
        for (int j = 0; j < n; ++j) {
          if constexpr (kSimd) {
            axpys_avx512(dv + j * D, P + j, kBlk, gr, a.H * D, static_cast<int>(rows), D);
            axpys_avx512(dk + j * D, dS + j, kBlk, qr, a.H * D, static_cast<int>(rows), D);
          } else {
            axpys_portable(dv + j * D, P + j, kBlk, gr, a.H * D, static_cast<int>(rows), D);
            axpys_portable(dk + j * D, dS + j, kBlk, qr, a.H * D, static_cast<int>(rows), D);
          }
        }
      };
      for (int64_t q0 = k0; q0 < sp.len; q0 += kBlk)
        add_tile(sp.start + q0, std::min<int64_t>(kBlk, sp.len - q0), q0 - k0);
      for (int64_t c = c0; c < c1; ++c) {
        const SeqSpan& ch = seqs.seqs[static_cast<size_t>(seqs.children[static_cast<size_t>(c)])];
        for (int64_t q0 = 0; q0 < ch.len; q0 += kBlk)
          add_tile(ch.start + q0, std::min<int64_t>(kBlk, ch.len - q0), ch.ctx_len + q0 - k0);
      }
    }
    for (int j = 0; j < n; ++j) {
      const int64_t row = (sp.start + k0 + j) * a.Hkv + it.kvh;
      for (int64_t d = 0; d < D; ++d) {
        a.dk[row * D + d] = dk[j * D + d] * a.scale;
        a.dv[row * D + d] = dv[j * D + d];
      }
    }
  }
}

__attribute__((target("avx512f"))) void dq_item_avx512(const BackwardArgs& a, const TileItem& it) {
  dq_item<true>(a, it);
}
void dq_item_portable(const BackwardArgs& a, const TileItem& it) { dq_item<false>(a, it); }
__attribute__((target("avx2,fma"))) void dq_item_avx2(const BackwardArgs& a, const TileItem& it) {
  dq_item<false>(a, it);
}
__attribute__((target("avx512f"))) void dkdv_item_avx512(const BackwardArgs& a,
                                                         const TileItem& it) {
  dkdv_item<true>(a, it);
}
void dkdv_item_portable(const BackwardArgs& a, const TileItem& it) { dkdv_item<false>(a, it); }
__attribute__((target("avx2,fma"))) void dkdv_item_avx2(const BackwardArgs& a, const TileItem& it) {
  dkdv_item<false>(a, it);
}

}  // namespace

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                        const Tensor& prefix, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        float scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  const Sequences& seqs = read_sequences("attention_backward", cu_seqlens, prefix, T);
  const std::vector<TileItem>& items = tile_items(seqs, Hkv);
  // delta (T, H) = rowsum(dout * out), summed in order over d.
  float* delta = scratch_floats(3, static_cast<size_t>(T * H));
  const float* gp = dout.data_as<float>();
  const float* op = out.data_as<float>();
  parallel_for(
      T * H,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          float s = 0.0f;
          for (int64_t d = 0; d < D; ++d) s = s + gp[r * D + d] * op[r * D + d];
          delta[r] = s;
        }
      },
      64);
  const BackwardArgs a{gp,
                       q.data_as<float>(),
                       k.data_as<float>(),
                       v.data_as<float>(),
                       lse.data_as<float>(),
                       delta,
                       dq.data_as<float>(),
                       dk.data_as<float>(),
                       dv.data_as<float>(),
                       H,
                       Hkv,
                       D,
                       scale,
                       &seqs};
  const AttentionIsa isa = attention_isa();
  parallel_items(static_cast<int64_t>(items.size()), 4 * causal_macs(seqs, H, D),
                 [&](int64_t b, int64_t e) {
                   for (int64_t w = b; w < e; ++w) {
                     const TileItem& it = items[static_cast<size_t>(w)];
                     if (isa == AttentionIsa::avx512) {
                       dq_item_avx512(a, it);
                       dkdv_item_avx512(a, it);
                     } else if (isa == AttentionIsa::avx2) {
                       dq_item_avx2(a, it);
                       dkdv_item_avx2(a, it);
                     } else {
                       dq_item_portable(a, it);
                       dkdv_item_portable(a, it);
                     }
                   }
                 });
}

}  // namespace tandem::ops::cpu
