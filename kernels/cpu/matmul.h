// CPU matmul and its backward products: a batch-invariant dot-product kernel for the forward
// (AVX-512, AVX2 or a portable fallback, all with the same bits), cache-blocked and split over N
// across threads, and an outer-product kernel for the f32 backward products.
#pragma once

#include <cstdint>
#include <vector>

#include "core/half.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::ops::cpu {

// Arguments already checked by kernels/matmul.cpp.
void matmul(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate);
void matmul_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate);
void matmul_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate);

// Whether this CPU runs the AVX-512 kernel when the kernel is `automatic` (ops::MatmulKernel).
bool matmul_has_avx512();
// Whether it has AVX2 and FMA: without AVX-512 it then runs the AVX2 kernel (the same bits).
bool matmul_has_avx2();
// The process-wide settings (set_matmul_precision, set_matmul_kernel, set_matmul_backward) and
// PackedWeight are declared in kernels/ops.h and implemented in matmul.cpp.

namespace detail {

// Rows of x and w per register tile: kTileRows x rows against kTileCols w rows, one
// accumulator per output element.
inline constexpr int kTileRows = 4;
inline constexpr int kTileCols = 6;
// The arithmetic of every output element, whatever M, the tiling or the thread count:
// K is cut into chunks [0, kChunk), [kChunk, 2 kChunk), ...; a chunk's partial dot product
// runs kLanes f32 accumulators from zero, lane l taking k = l, l + 16, ... of the chunk in
// increasing order with fused multiply-adds (a last partial step updates only its first lanes),
// then sums them with the fixed halving tree s8[l] = a[l] + a[l + 8], s4[l] = s8[l] + s8[l + 4],
// s2[l] = s4[l] + s4[l + 2], t = s2[0] + s2[1]. The chunks' partials add up in order into y:
// y = t0 (or y_old + t0 when accumulating), then y = y + t1, y = y + t2, ...
// Chunking bounds what a tile touches in L1 (K = 576 is one chunk; the sum is a fixed function
// of K, so rows stay batch-invariant).
inline constexpr int kLanes = 16;
inline constexpr int64_t kChunk = 768;

// One chunk over a block: y (rows, cols) = [y +] the chunk partials of x rows against w rows,
// both of kc values, row-major with leading dimensions ldx and ldw. Same arithmetic in both.
void chunk_portable(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                    int64_t rows, int64_t cols, int64_t kc, bool add);
// Memory the AVX-512 kernel should bring into L2 while it works (the next w panel): `rows` rows
// of row_bytes bytes, stride_bytes apart.
struct Prefetch {
  const char* base = nullptr;
  int64_t rows = 0, row_bytes = 0, stride_bytes = 0;
};
void chunk_avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                  int64_t rows, int64_t cols, int64_t kc, bool add, const Prefetch& next);
// The same with AVX2 and FMA (kernels/cpu/matmul_avx2.cpp), for CPUs without AVX-512.
void chunk_avx2(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                int64_t rows, int64_t cols, int64_t kc, bool add);
// The same with w rows of bf16 bits, widened in registers: bitwise the result of the f32
// overload on an f32 copy of w (bf16 -> f32 is exact), without the copy.
void chunk_avx512(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
                  int64_t ldy, int64_t rows, int64_t cols, int64_t kc, bool add,
                  const Prefetch& next);

// dst (16 x 16, leading dimension ldd) = src (16 x 16, leading dimension lds)^T, with AVX-512
// (a copy: the same bits as any other transpose).
void transpose16_avx512(const float* src, int64_t lds, float* dst, int64_t ldd);
// dst[i] = the f32 value of the bf16 bits src[i] (exact), i < n, with AVX-512.
void widen_bf16_avx512(const uint16_t* src, float* dst, int64_t n);

// A grow-only per-thread buffer: at least n elements, grown to the largest n seen and never
// freed, so the steady state allocates nothing. The returned pointer is 64-byte aligned: with
// rows a multiple of 16 floats long, no vector load then straddles two cache lines.
template <class T>
T* grow(std::vector<T>& buf, int64_t n) {
  constexpr int64_t kAlign = 64 / sizeof(T);
  if (static_cast<int64_t>(buf.size()) < n + kAlign) buf.resize(static_cast<size_t>(n + kAlign));
  const auto address = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + (kAlign - static_cast<int64_t>(address / sizeof(T) % kAlign)) % kAlign;
}

// The f32 backward products (matmul_backward.cpp): c (rows, cols) [+]= a (rows, R) · b (R, cols)
// with an outer-product kernel, kOuterRows x kOuterCols outputs per register tile. The
// arithmetic of every output element, whatever the shapes, the tiling or the thread count: R is
// cut into chunks [0, kOuterChunk), [kOuterChunk, 2 kOuterChunk), ...; a chunk's sum is one f32
// accumulator from zero taking r in increasing order with fused multiply-adds; the chunks' sums
// add up in order into c: c = s0 (or c_old + s0 when accumulating), then c = c + s1, ...
// The AVX-512 tile and the portable one give the same bits.
inline constexpr int64_t kOuterRows = 8;
inline constexpr int64_t kOuterCols = 48;
inline constexpr int64_t kOuterChunk = 128;
// An operand of outer_product: a(i, r) = data[i * row_stride + r * col_stride] (f32 only);
// b(r, j) = data[r * row_stride + j] (f32 or bf16 bits).
struct OuterOperand {
  const void* data;
  bool bf16;
  int64_t row_stride;
  int64_t col_stride = 1;
};
// The instruction set of the f32 kernels (forward and backward): every one gives the same bits.
enum class F32Isa { portable, avx2, avx512 };
void outer_product(const OuterOperand& a, const OuterOperand& b, float* c, int64_t rows,
                   int64_t cols, int64_t R, bool accumulate, F32Isa isa);
// The backward tile with AVX2 and FMA: tile_portable's arithmetic (matmul_avx2.cpp). b is a
// packed panel kOuterCols wide; a(i, r) = a[i * ars + r * acs] for i < rows.
void outer_tile_avx2(const float* a, int64_t ars, int64_t acs, const float* b, int64_t kc, float* c,
                     int64_t ldc, bool add, int64_t rows, int64_t cols);

// f32 -> bf16 as the bf16 precision rounds (AVX512-BF16's conversion): to nearest even, a
// denormal input becomes a zero of its sign, a NaN stays a quiet NaN.
inline uint16_t bf16_bits_daz(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  return f32_to_bf16_bits(f);
}

// The AMX path of the bf16 precision (kernels/cpu/matmul_amx.cpp). Packed operands have kp
// values per row, K rounded up to kAmxK and zero-filled. The AVX512-BF16 path reads the same
// layouts (so one PackedWeight serves both); the packing needs AVX512-BF16, not AMX.
inline constexpr int64_t kAmxK = 32;
bool amx_usable();
// dst rows (kp bf16 each) = src rows (k values, f32 or bf16, leading dimension ld), rounded.
void amx_pack_rows(const void* src, bool bf16, int64_t ld, int64_t rows, int64_t k, uint16_t* dst,
                   int64_t kp);
// The same from the transpose: dst row n (n in [16 g0, 16 g1) and < rows) = src column n over
// src rows 0 ... r_count - 1 (src (r_count, rows) row-major), zero-filled to kp.
void amx_pack_rows_transposed(const void* src, bool bf16, int64_t ld, int64_t r_count, int64_t rows,
                              uint16_t* dst, int64_t g0, int64_t g1, int64_t kp);
// Column groups [g0, g1) of the second operand, 16 columns each, in the tile layout: group g
// holds kp / 2 pair-rows of 32 bf16, (B[2p][c], B[2p + 1][c]) for c = 16 g ... 16 g + 15, at
// dst + g kp 16. From src (r_count, cols) row-major (B itself: amx_pack_pairs) or src
// (cols, k) row-major (B^T: amx_pack_transposed); out-of-range values are zero.
void amx_pack_pairs(const void* src, bool bf16, int64_t ld, int64_t r_count, int64_t cols,
                    uint16_t* dst, int64_t g0, int64_t g1, int64_t kp);
void amx_pack_transposed(const void* src, bool bf16, int64_t ld, int64_t cols, int64_t k,
                         uint16_t* dst, int64_t g0, int64_t g1, int64_t kp);
// y (rows, cols; leading dimension ldy) [+]= a · b over row_groups 32-row groups of packed a
// and col_groups 32-column groups of packed b (4 tiles per 32 x 32 block, summed over kp from
// zero, then added to y when `add`). Rows and columns past rows/cols are not written.
void amx_blocks(const uint16_t* a, int64_t row_groups, const uint16_t* b, int64_t col_groups,
                int64_t kp, float* y, int64_t ldy, int64_t rows, int64_t cols, bool add);

// The AVX512-BF16 path of the bf16 precision (kernels/cpu/matmul_avx512bf16.cpp), for CPUs
// without AMX. Whether this CPU (and its OS) runs AVX-512 with AVX512-BF16:
bool avx512_bf16_usable();
// y (rows, cols; leading dimension ldy) [+]= a · b: a packed rows (amx_pack_rows: kp values
// each, `rows` of them, no padding rows needed), b from its first 16-column group (amx_pack_pairs
// or amx_pack_transposed; ceil(cols / 16) groups). Each output element is one f32 lane of
// `vdpbf16ps` that starts at y_old (`add`) or +0 and takes K's pairs (k, k + 1), k = 0, 2, ...,
// kp - 2, in order: acc = dpbf16(acc, (a_k, a_k+1), (b_k, b_k+1)) (the hardware adds the pair's
// two products into acc its own way: on Intel, acc + p_k+1, then + p_k, each rounded). So the
// element depends on its own row, b and kp only: not on rows, the tiling or the thread count.
void dp_blocks(const uint16_t* a, int64_t rows, const uint16_t* b, int64_t cols, int64_t kp,
               float* y, int64_t ldy, bool add);

}  // namespace detail
}  // namespace tandem::ops::cpu
