// CPU matmul, matmul_backward_input and matmul_backward_weight: blocking, bf16 widening, the
// thread split over N, the portable kernel, and the bf16 precision's transposes that turn both
// backward products into the forward one (in f32 they take the outer-product kernel).
#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/parallel.h"

namespace tandem::ops::cpu {
namespace detail {
namespace {

float tree_sum(const float (&a)[kLanes]) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

}  // namespace

void chunk_portable(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                    int64_t rows, int64_t cols, int64_t kc, bool add) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x + i * ldx;
    for (int64_t j = 0; j < cols; ++j) {
      const float* wj = w + j * ldw;
      float acc[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= kc; k += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(xi[k + l], wj[k + l], acc[l]);
      for (int l = 0; k + l < kc; ++l) acc[l] = std::fma(xi[k + l], wj[k + l], acc[l]);
      const float t = tree_sum(acc);
      float& out = y[i * ldy + j];
      out = add ? out + t : t;
    }
  }
}

}  // namespace detail

namespace {

using detail::kChunk;
using detail::kTileCols;
using detail::kTileRows;

MatmulKernel g_kernel = MatmulKernel::automatic;
MatmulBackward g_backward = MatmulBackward::outer;
MatmulPrecision g_precision = MatmulPrecision::f32;

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  return has;
}

// The f32 backward products by the forward's kernel on transposed operands (MatmulBackward).
bool backward_by_transposes() { return g_backward == MatmulBackward::transpose; }

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// The f32 kernels' instruction set now: the best the CPU has, unless the portable one is forced.
detail::F32Isa f32_isa() {
  if (g_kernel == MatmulKernel::portable) return detail::F32Isa::portable;
  if (cpu_has_avx512()) return detail::F32Isa::avx512;
  return cpu_has_avx2() ? detail::F32Isa::avx2 : detail::F32Isa::portable;
}

// The hardware the bf16 precision's products run on now.
MatmulBf16Path bf16_path() {
  switch (g_kernel) {
    case MatmulKernel::portable:
      return MatmulBf16Path::f32_kernel;
    case MatmulKernel::automatic:
      if (detail::amx_usable()) return MatmulBf16Path::amx;
      [[fallthrough]];
    case MatmulKernel::avx512_bf16:
      if (detail::avx512_bf16_usable()) return MatmulBf16Path::avx512_bf16;
  }
  return MatmulBf16Path::f32_kernel;
}

// Bytes of one block of x rows (one chunk of K wide): it stays in a core's L2 while every w panel
// of the thread's range (or work item) of N passes over it.
constexpr int64_t kXBlockBytes = int64_t{512} << 10;
// w panels per work item of a forward product's threads (those of at least 4 items).
constexpr int64_t kPanelsPerItem = 16;
// Most x rows for which the AVX-512 kernel reads a bf16 w directly, widening it in registers
// (the same values, so the same bits): the copy to an f32 panel costs about as much as the
// math when few x rows use it (decode), while with many rows it is amortised and the kernel's
// loop is shorter on f32.
constexpr int64_t kDirectBf16MaxRows = 12;
// Smallest work (multiply-adds) worth a thread of its own.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 17;
// Smallest share of w (bytes) worth a thread of its own: with few x rows (decode) a product is
// bound by reading w, which two cores read faster than one long before the multiply-adds would
// pay for the second thread (SmolLM2's k and v projections at one token: 442 KB).
constexpr int64_t kMinWBytesPerThread = int64_t{64} << 10;

// Grow-only per-thread buffers (detail::grow): the widened x block, the f32 copy of a bf16 w
// panel, and the transposes of the bf16 backward products.
using detail::grow;

// One operand of the forward product: rows of K elements, f32 or bf16, `ld` elements apart
// (0: K).
struct Rows {
  const void* data;
  bool bf16;
  int64_t ld = 0;
};

// dst (rows, kc) f32 = columns [k0, k0 + kc) of src rows [i0, i0 + rows) (leading dimension
// ld), widened.
void copy_rows(Rows src, int64_t ld, int64_t i0, int64_t rows, int64_t k0, int64_t kc, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = (i0 + r) * ld + k0;
    float* d = dst + r * kc;
    if (src.bf16) {
      const uint16_t* s = static_cast<const uint16_t*>(src.data) + base;
      if (cpu_has_avx512()) {
        detail::widen_bf16_avx512(s, d, kc);
      } else {
        for (int64_t c = 0; c < kc; ++c) d[c] = bf16_bits_to_f32(s[c]);
      }
    } else {
      std::memcpy(d, static_cast<const float*>(src.data) + base,
                  static_cast<size_t>(kc) * sizeof(float));
    }
  }
}

// Rows [r0, r0 + rows), columns [k0, k0 + kc) of an operand as f32: in place (leading
// dimension ld = ld_src) or, bf16, widened into scratch (ld = kc).
const float* f32_block(Rows src, int64_t ld_src, int64_t r0, int64_t rows, int64_t k0, int64_t kc,
                       std::vector<float>& scratch, int64_t& ld) {
  if (!src.bf16) {
    ld = ld_src;
    return static_cast<const float*>(src.data) + r0 * ld_src + k0;
  }
  float* d = grow(scratch, rows * kc);
  copy_rows(src, ld_src, r0, rows, k0, kc, d);
  ld = kc;
  return d;
}

// y (M, N) [+]= x (M, K) · w (N, K)^T. Threads take contiguous ranges of kTileCols-row panels
// of w (items of kPanelsPerItem panels as they finish, when there are many) and never split K;
// blocks of x rows and chunks of K are visited in a fixed order, so every element's arithmetic is
// the one of detail::kChunk, whatever M, N and the thread count.
void forward(Rows x, Rows w, float* y, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (M == 0 || N == 0) return;
  const detail::F32Isa isa = f32_isa();
  const bool avx512 = isa == detail::F32Isa::avx512;
  const bool w_direct = avx512 && w.bf16 && M <= kDirectBf16MaxRows;
  const int64_t ldx_src = x.ld > 0 ? x.ld : K, ldw_src = w.ld > 0 ? w.ld : K;
  const int64_t panels = (N + kTileCols - 1) / kTileCols;
  const int64_t kc_max = std::min(K, kChunk);
  const int64_t row_bytes = 4 * std::max<int64_t>(1, kc_max);
  const int64_t max_block = std::max<int64_t>(kTileRows, kXBlockBytes / row_bytes);
  const int64_t blocks = (M + max_block - 1) / max_block;
  const int64_t block_rows = ((M + blocks - 1) / blocks + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t panel_work = std::max<int64_t>(1, M * kTileCols * K);
  const int64_t panel_bytes = std::max<int64_t>(1, kTileCols * K * (w.bf16 ? 2 : 4));
  const int64_t min_panels = std::max<int64_t>(
      1, std::min(kMinWorkPerThread / panel_work, kMinWBytesPerThread / panel_bytes));
  const auto body = [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> x_scratch, w_scratch;
    const int64_t j0 = p0 * kTileCols, j1 = std::min(N, p1 * kTileCols);
    for (int64_t i0 = 0; i0 < M; i0 += block_rows) {
      const int64_t rows = std::min(block_rows, M - i0);
      // K = 0: every chunk loop below is empty; y is an empty sum.
      if (K == 0 && !accumulate)
        for (int64_t i = i0; i < i0 + rows; ++i) std::fill(y + i * N + j0, y + i * N + j1, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, K - k0);
        const bool add = accumulate || k0 > 0;
        int64_t ldx = ldx_src;
        const float* xb = f32_block(x, ldx_src, i0, rows, k0, kc, x_scratch, ldx);
        for (int64_t j = j0; j < j1; j += kTileCols) {
          const int64_t cols = std::min<int64_t>(kTileCols, N - j);
          // w_direct: read in place by the bf16 overload of chunk_avx512 below.
          int64_t ldw = ldw_src;
          const float* wp =
              w_direct ? nullptr : f32_block(w, ldw_src, j, cols, k0, kc, w_scratch, ldw);
          float* yb = y + i0 * N + j;
          if (avx512) {
            detail::Prefetch next;
            // Every product prefetches its next w panel: in a model's pass each w is read
            // once and comes from memory, however small (docs/kernels-matmul.md).
            if (j + kTileCols < N) {
              const int64_t esize = w.bf16 ? 2 : 4;
              next.base =
                  static_cast<const char*>(w.data) + ((j + kTileCols) * ldw_src + k0) * esize;
              next.rows = std::min<int64_t>(kTileCols, N - j - kTileCols);
              next.row_bytes = kc * esize;
              next.stride_bytes = ldw_src * esize;
            }
            if (w_direct) {
              const uint16_t* wb = static_cast<const uint16_t*>(w.data) + j * ldw_src + k0;
              detail::chunk_avx512(xb, ldx, wb, ldw, yb, N, rows, cols, kc, add, next);
            } else {
              detail::chunk_avx512(xb, ldx, wp, ldw, yb, N, rows, cols, kc, add, next);
            }
          } else if (isa == detail::F32Isa::avx2) {
            detail::chunk_avx2(xb, ldx, wp, ldw, yb, N, rows, cols, kc, add);
          } else {
            detail::chunk_portable(xb, ldx, wp, ldw, yb, N, rows, cols, kc, add);
          }
        }
      }
    }
  };
  // Products of many panels: threads take items of kPanelsPerItem panels as they finish, so
  // that a thread the machine slows down takes fewer, where equal ranges left the other waiting
  // at the join. Which thread computes a panel changes no bit.
  const int64_t threads = std::min<int64_t>(num_threads(), (panels + min_panels - 1) / min_panels);
  if (threads <= 1 || panels < 4 * kPanelsPerItem) return parallel_for(panels, body, min_panels);
  const int64_t items = (panels + kPanelsPerItem - 1) / kPanelsPerItem;
  parallel_for_dynamic(
      items,
      [&](int64_t item) {
        body(item * kPanelsPerItem, std::min(panels, (item + 1) * kPanelsPerItem));
      },
      items / threads);
}

// dst (cols, rows; leading dimension ldd) f32 = src (rows, cols)^T, f32 or bf16, in 16 x 16
// blocks (with AVX-512 for whole f32 blocks).
void transpose(Rows src, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  constexpr int64_t kB = 16;
  const bool avx512 = cpu_has_avx512() && !src.bf16;
  const int64_t col_blocks = (cols + kB - 1) / kB;
  parallel_for(
      col_blocks,
      [&](int64_t cb0, int64_t cb1) {
        for (int64_t c0 = cb0 * kB; c0 < std::min(cols, cb1 * kB); c0 += kB) {
          const int64_t c1 = std::min(cols, c0 + kB);
          for (int64_t r0 = 0; r0 < rows; r0 += kB) {
            const int64_t r1 = std::min(rows, r0 + kB);
            if (avx512 && c1 - c0 == kB && r1 - r0 == kB) {
              detail::transpose16_avx512(static_cast<const float*>(src.data) + r0 * cols + c0, cols,
                                         dst + c0 * ldd + r0, ldd);
              continue;
            }
            for (int64_t c = c0; c < c1; ++c) {
              float* d = dst + c * ldd;
              if (src.bf16) {
                const uint16_t* s = static_cast<const uint16_t*>(src.data);
                for (int64_t r = r0; r < r1; ++r) d[r] = bf16_bits_to_f32(s[r * cols + c]);
              } else {
                const float* s = static_cast<const float*>(src.data);
                for (int64_t r = r0; r < r1; ++r) d[r] = s[r * cols + c];
              }
            }
          }
        }
      },
      4);
}

Rows rows_of(const Tensor& t) { return {t.data(), t.dtype() == DType::bf16}; }

// The leading dimension of a transposed scratch of rows of n: rows that are a multiple of 1 KiB
// apart would fall into the same few L1 sets, so every row is padded by one cache line.
int64_t padded(int64_t n) { return (n + 15) / 16 * 16 + 16; }

// ---------------------------------------------------------------------------------------------
// The bf16 precision.

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The second operand of a product, the (N, R) matrix whose rows y's columns are dotted with:
// given as its rows (the forward's w) or as the rows of its transpose, (R, N) row-major with
// leading dimension ld (the backward products' w and x).
struct Second {
  Rows src;
  bool transposed;
};

// Bytes of packed first-operand rows a thread keeps in its L2 while the column blocks pass.
constexpr int64_t kAmxRowBlockBytes = int64_t{512} << 10;
// Columns per work item (two 32-column groups).
constexpr int64_t kAmxColBlock = 64;

// The second operand in the AMX tile layout (the AVX512-BF16 path's too): round_up(N, 32) / 16
// column groups of kp / 2 pair-rows (detail::amx_pack_pairs).
void pack_second(Second b, int64_t ldb, int64_t N, int64_t R, int64_t kp, uint16_t* bp) {
  parallel_for(
      round_up(N, 32) / 16,
      [&](int64_t g0, int64_t g1) {
        if (b.transposed)
          detail::amx_pack_pairs(b.src.data, b.src.bf16, ldb, R, N, bp, g0, g1, kp);
        else
          detail::amx_pack_transposed(b.src.data, b.src.bf16, ldb, N, R, bp, g0, g1, kp);
      },
      4);
}

// The first operand of a product, (M, R): given as its rows, or (transposed) as the rows of its
// transpose, (R, M) row-major (dyᵀ in dw).
struct First {
  Rows src;
  int64_t ld;
  bool transposed = false;
};

// y (M, N) [+]= a (M, R) · b^T on AMX (`amx`) or AVX512-BF16, b packed by pack_second: packs
// a's rows, then the (row block, 64-column block) items go to threads as they finish (each item
// sums whole elements, so the bits do not depend on which thread runs it).
void packed_product(First a, const uint16_t* bp, float* y, int64_t M, int64_t N, int64_t R,
                    int64_t kp, bool accumulate, bool amx) {
  if (M == 0 || N == 0) return;
  if (R == 0) {  // an empty sum
    if (!accumulate) std::fill(y, y + M * N, 0.0f);
    return;
  }
  const int64_t Mp = round_up(M, 32), Np = round_up(N, 32);
  thread_local std::vector<uint16_t> a_buf;
  uint16_t* ap = grow(a_buf, Mp * kp);
  parallel_for(
      Mp / 32,
      [&](int64_t g0, int64_t g1) {
        const int64_t r0 = g0 * 32, r1 = std::min(M, g1 * 32);
        if (r1 > r0 && a.transposed) {
          detail::amx_pack_rows_transposed(a.src.data, a.src.bf16, a.ld, R, M, ap, 2 * g0,
                                           (r1 + 15) / 16, kp);
        } else if (r1 > r0) {
          const size_t esize = a.src.bf16 ? 2 : 4;
          detail::amx_pack_rows(static_cast<const char*>(a.src.data) + r0 * a.ld * esize,
                                a.src.bf16, a.ld, r1 - r0, R, ap + r0 * kp, kp);
        }
        // AMX reads whole 32-row groups; AVX512-BF16 reads only the M rows.
        const int64_t z0 = std::max(r0, r1);
        if (amx && g1 * 32 > z0)
          std::memset(ap + z0 * kp, 0, static_cast<size_t>((g1 * 32 - z0) * kp) * 2);
      },
      4);
  // Row blocks of equal size (in 32-row groups) that fit the L2 budget.
  const int64_t max_rows = std::max<int64_t>(32, kAmxRowBlockBytes / (kp * 2) / 32 * 32);
  const int64_t row_blocks = (Mp + max_rows - 1) / max_rows;
  const int64_t block_rows = round_up((Mp + row_blocks - 1) / row_blocks, 32);
  const int64_t col_blocks = (Np + kAmxColBlock - 1) / kAmxColBlock;
  if (!amx) {
    // Items of the work of the rows there are (decode: few), so that a memory-bound product
    // takes the threads the f32 kernel would.
    const int64_t item_work = std::max<int64_t>(1, std::min(M, block_rows) * kAmxColBlock * kp);
    parallel_for_dynamic(
        row_blocks * col_blocks,
        [&](int64_t item) {
          const int64_t ib = item / col_blocks, jb = item % col_blocks;
          const int64_t r0 = ib * block_rows, c0 = jb * kAmxColBlock;
          detail::dp_blocks(ap + r0 * kp, std::min(M, r0 + block_rows) - r0, bp + c0 * kp,
                            std::min(N, c0 + kAmxColBlock) - c0, kp, y + r0 * N + c0, N,
                            accumulate);
        },
        std::max<int64_t>(1, kMinWorkPerThread / item_work));
    return;
  }
  const int64_t item_work = std::max<int64_t>(1, std::min(Mp, block_rows) * kAmxColBlock * kp);
  parallel_for_dynamic(
      row_blocks * col_blocks,
      [&](int64_t item) {
        const int64_t ib = item / col_blocks, jb = item % col_blocks;
        const int64_t r0 = ib * block_rows, c0 = jb * kAmxColBlock;
        const int64_t row_groups = (std::min(Mp, r0 + block_rows) - r0) / 32;
        const int64_t col_groups = (std::min(Np, c0 + kAmxColBlock) - c0) / 32;
        detail::amx_blocks(ap + r0 * kp, row_groups, bp + c0 * kp, col_groups, kp, y + r0 * N + c0,
                           N, M - r0, N - c0, accumulate);
      },
      std::max<int64_t>(1, kMinWorkPerThread * 8 / item_work));
}

// y (M, N) [+]= a (M, R) · b (N, R)^T in the bf16 precision. a: rows of R, leading dimension
// a.ld (0: R).
void forward_bf16(Rows a, Second b, float* y, int64_t M, int64_t N, int64_t R, bool accumulate) {
  const int64_t lda = a.ld > 0 ? a.ld : R;
  const int64_t ldb = b.src.ld > 0 ? b.src.ld : (b.transposed ? N : R);
  const MatmulBf16Path path = bf16_path();
  if (path == MatmulBf16Path::f32_kernel) {
    // Round both operands to bf16 rows, then the f32 kernel on their exact widening.
    thread_local std::vector<uint16_t> a16, b16;
    thread_local std::vector<float> bt;
    uint16_t* ar = grow(a16, M * R);
    uint16_t* br = grow(b16, N * R);
    auto round_rows = [](Rows src, int64_t ld, int64_t rows, int64_t cols, uint16_t* dst) {
      parallel_for(rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = 0; c < cols; ++c)
            dst[r * cols + c] =
                src.bf16 ? detail::bf16_bits_daz(
                               bf16_bits_to_f32(static_cast<const uint16_t*>(src.data)[r * ld + c]))
                         : detail::bf16_bits_daz(static_cast<const float*>(src.data)[r * ld + c]);
      });
    };
    round_rows(a, lda, M, R, ar);
    if (b.transposed) {
      // (R, N) -> (N, R) f32, then rounded.
      float* t = grow(bt, N * R);
      transpose(b.src, R, N, t, R);  // the backward products' sources are dense: ldb == N
      round_rows({t, false, R}, R, N, R, br);
    } else {
      round_rows(b.src, ldb, N, R, br);
    }
    forward({ar, true, R}, {br, true, R}, y, M, N, R, accumulate);
    return;
  }
  const int64_t kp = round_up(R, detail::kAmxK);
  thread_local std::vector<uint16_t> b_buf;
  uint16_t* bp = grow(b_buf, round_up(N, 32) * kp);
  pack_second(b, ldb, N, R, kp, bp);
  packed_product({a, lda}, bp, y, M, N, R, kp, accumulate, path == MatmulBf16Path::amx);
}

}  // namespace

bool matmul_has_avx512() { return cpu_has_avx512(); }
bool matmul_has_avx2() { return cpu_has_avx2(); }

void matmul(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate) {
  if (g_precision == MatmulPrecision::bf16) {
    forward_bf16(rows_of(x), {rows_of(w), false}, y.data_as<float>(), x.size(0), w.size(0),
                 x.size(1), accumulate);
    return;
  }
  forward(rows_of(x), rows_of(w), y.data_as<float>(), x.size(0), w.size(0), x.size(1), accumulate);
}

void matmul_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate) {
  // dx (M, K) = dy (M, N) · w (N, K): in f32 the outer-product kernel on the operands as they
  // are; in bf16 dy · (w^T (K, N))^T, the forward product against w^T.
  const int64_t N = w.size(0), K = w.size(1);
  if (g_precision == MatmulPrecision::bf16) {
    Rows wt = rows_of(w);
    wt.ld = K;
    forward_bf16(rows_of(dy), {wt, true}, dx.data_as<float>(), dy.size(0), K, N, accumulate);
    return;
  }
  if (backward_by_transposes()) {
    const int64_t ld = padded(N);
    thread_local std::vector<float> w_t;  // (K, N), leading dimension ld
    float* wt = grow(w_t, K * ld);
    transpose(rows_of(w), N, K, wt, ld);
    forward(rows_of(dy), {wt, false, ld}, dx.data_as<float>(), dy.size(0), K, N, accumulate);
    return;
  }
  detail::outer_product({dy.data(), false, N, 1}, {w.data(), w.dtype() == DType::bf16, K},
                        dx.data_as<float>(), dy.size(0), K, N, accumulate, f32_isa());
}

void matmul_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate) {
  // dw (N, K) = dy^T (N, M) · x (M, K): in f32 the outer-product kernel reading dy^T in place;
  // in bf16 dy^T · (x^T (K, M))^T.
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  const MatmulBf16Path path = bf16_path();
  if (g_precision == MatmulPrecision::bf16 && path != MatmulBf16Path::f32_kernel) {
    // dyᵀ rounded and packed straight from dy; x as the rows of the second operand's transpose.
    const int64_t kp = round_up(M, detail::kAmxK);
    thread_local std::vector<uint16_t> b_buf;
    uint16_t* bp = grow(b_buf, round_up(K, 32) * kp);
    pack_second({rows_of(x), true}, K, K, M, kp, bp);
    packed_product({rows_of(dy), N, true}, bp, dw.data_as<float>(), N, K, M, kp, accumulate,
                   path == MatmulBf16Path::amx);
    return;
  }
  if (g_precision == MatmulPrecision::bf16) {
    const int64_t ld = padded(M);
    thread_local std::vector<float> dy_t;  // (N, M), leading dimension ld
    float* dyt = grow(dy_t, N * ld);
    transpose(rows_of(dy), M, N, dyt, ld);
    Rows xt = rows_of(x);
    xt.ld = K;
    forward_bf16({dyt, false, ld}, {xt, true}, dw.data_as<float>(), N, K, M, accumulate);
    return;
  }
  if (backward_by_transposes()) {
    const int64_t ld = padded(M);
    thread_local std::vector<float> dy_t, x_t;  // (N, M), (K, M), leading dimension ld
    float* dyt = grow(dy_t, N * ld);
    float* xt = grow(x_t, K * ld);
    transpose(rows_of(dy), M, N, dyt, ld);
    transpose(rows_of(x), M, K, xt, ld);
    forward({dyt, false, ld}, {xt, false, ld}, dw.data_as<float>(), N, K, M, accumulate);
    return;
  }
  detail::outer_product({dy.data(), false, 1, N}, {x.data(), x.dtype() == DType::bf16, K},
                        dw.data_as<float>(), N, K, M, accumulate, f32_isa());
}

}  // namespace tandem::ops::cpu

namespace tandem::ops {

void set_matmul_precision(MatmulPrecision precision) { cpu::g_precision = precision; }
MatmulPrecision matmul_precision() { return cpu::g_precision; }
void set_matmul_kernel(MatmulKernel kernel) { cpu::g_kernel = kernel; }
MatmulKernel matmul_kernel() { return cpu::g_kernel; }
void set_matmul_backward(MatmulBackward backward) { cpu::g_backward = backward; }
MatmulBackward matmul_backward() { return cpu::g_backward; }
void set_matmul_settings(MatmulSettings settings) {
  set_matmul_precision(settings.precision);
  set_matmul_kernel(settings.kernel);
  set_matmul_backward(settings.backward);
}
MatmulSettings matmul_settings() {
  return {matmul_precision(), matmul_kernel(), matmul_backward()};
}
bool matmul_has_amx() { return cpu::detail::amx_usable(); }
bool matmul_has_avx512_bf16() { return cpu::detail::avx512_bf16_usable(); }
MatmulBf16Path matmul_bf16_path() { return cpu::bf16_path(); }
const char* matmul_bf16_path_name(MatmulBf16Path path) {
  switch (path) {
    case MatmulBf16Path::amx:
      return "amx";
    case MatmulBf16Path::avx512_bf16:
      return "avx512bf16";
    case MatmulBf16Path::f32_kernel:
      break;
  }
  return "f32-kernel";
}
const char* matmul_f32_path_name() {
  switch (cpu::f32_isa()) {
    case cpu::detail::F32Isa::avx512:
      return "avx512";
    case cpu::detail::F32Isa::avx2:
      return "avx2";
    case cpu::detail::F32Isa::portable:
      break;
  }
  return "portable";
}
bool matmul_packs_weights() {
  return cpu::g_precision == MatmulPrecision::bf16 &&
         cpu::bf16_path() != MatmulBf16Path::f32_kernel;
}

void PackedWeight::pack(const Tensor& w) {
  TANDEM_CHECK(matmul_packs_weights(),
               "PackedWeight needs the bf16 matmul precision on a CPU with AMX-BF16 or "
               "AVX512-BF16 (and no portable kernel forced)");
  TANDEM_CHECK(
      w.device().is_cpu() && w.ndim() == 2 && (w.dtype() == DType::f32 || w.dtype() == DType::bf16),
      "PackedWeight: w must be a 2-d f32 or bf16 CPU tensor, got {} {}", w.shape(),
      dtype_name(w.dtype()));
  n_ = w.size(0);
  k_ = w.size(1);
  kp_ = cpu::round_up(std::max<int64_t>(k_, 1), cpu::detail::kAmxK);
  data_ = cpu::grow(storage_, cpu::round_up(n_, 32) * kp_) - storage_.data();
  cpu::pack_second({cpu::rows_of(w), false}, k_, n_, k_, kp_, storage_.data() + data_);
}

void matmul(const Tensor& x, const PackedWeight& w, const Tensor& y, bool accumulate) {
  TANDEM_CHECK(!w.empty() && matmul_packs_weights(),
               "matmul with a PackedWeight needs one, the bf16 precision and AMX-BF16 or "
               "AVX512-BF16");
  TANDEM_CHECK(x.device().is_cpu() && y.device().is_cpu() && x.ndim() == 2 && y.ndim() == 2 &&
                   x.size(1) == w.cols() && y.size(0) == x.size(0) && y.size(1) == w.rows() &&
                   (x.dtype() == DType::f32 || x.dtype() == DType::bf16) && y.dtype() == DType::f32,
               "matmul: x {} {} against a packed w ({}, {}) into y {} {}", x.shape(),
               dtype_name(x.dtype()), w.rows(), w.cols(), y.shape(), dtype_name(y.dtype()));
  const int64_t M = x.size(0), N = w.rows(), K = w.cols();
  cpu::packed_product({cpu::rows_of(x), K}, w.storage_.data() + w.data_, y.data_as<float>(), M, N,
                      K, w.kp_, accumulate, cpu::bf16_path() == MatmulBf16Path::amx);
}

}  // namespace tandem::ops
