// CPU matmul and its backward products: a batch-invariant dot-product kernel (AVX-512 or a
// portable fallback with the same bits), cache-blocked and split over N across threads.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace tandem::ops::cpu {

// Arguments already checked by kernels/matmul.cpp.
void matmul(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate);
void matmul_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate);
void matmul_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate);

// Which inner kernel the CPU matmuls use. Both compute every output element the same way, so
// they give bitwise the same results; `portable` exists so that tests can prove it.
enum class MatmulKernel { automatic, portable };
void set_matmul_kernel(MatmulKernel kernel);
// Whether this CPU runs the AVX-512 kernel when the choice is `automatic`.
bool matmul_has_avx512();

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

}  // namespace detail
}  // namespace tandem::ops::cpu
