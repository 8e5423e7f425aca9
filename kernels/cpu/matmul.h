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

// Rows of x and w per register tile: MR x rows against NR w rows, MR * NR accumulators.
inline constexpr int kTileRows = 4;
inline constexpr int kTileCols = 6;
// Every output element y[i][j] = dot(x_i, w_j) is computed as kLanes f32 accumulators, lane l
// taking k = l, l + 16, ... in increasing order with fused multiply-adds (the last partial
// chunk only updates its first K % 16 lanes), then summed by the fixed halving tree
// s8[l] = a[l] + a[l + 8], s4[l] = s8[l] + s8[l + 4], s2[l] = s4[l] + s4[l + 2],
// s = s2[0] + s2[1], and finally y = y_old + s when accumulating.
inline constexpr int kLanes = 16;

// y (M, N) [+]= x (M, K) · w (N, K)^T on f32 rows with leading dimensions ldx, ldw, ldy; one
// thread, no blocking: the caller blocks and splits. Each is the same arithmetic.
void tiles_portable(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, bool accumulate);
void tiles_avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy,
                  int64_t M, int64_t N, int64_t K, bool accumulate);

}  // namespace detail
}  // namespace tandem::ops::cpu
