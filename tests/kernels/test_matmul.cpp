// matmul and its backward products: against f64 references, by finite differences, batch
// invariance and thread-count independence bit for bit, AVX-512 == portable kernel (forward and
// backward), bad arguments, and their parity cases.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/matmul.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;
using tandem::ops::cpu::detail::F32Isa;

namespace {

// The products as plain loops over (already widened) values: in f64 (the truth) and in f32
// with one sequential accumulator (the same-precision reference).
// out (R, C) = sum over s of a(r, s) * b(c, s), with a = (R, S) and b = (C, S) given by strides.
template <class T>
std::vector<double> product(const std::vector<double>& a, int64_t a_rs, int64_t a_ss,
                            const std::vector<double>& b, int64_t b_cs, int64_t b_ss, int64_t R,
                            int64_t C, int64_t S, const std::vector<double>* init) {
  std::vector<double> out(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      T acc = 0;
      for (int64_t s = 0; s < S; ++s)
        acc += static_cast<T>(a[static_cast<size_t>(r * a_rs + s * a_ss)]) *
               static_cast<T>(b[static_cast<size_t>(c * b_cs + s * b_ss)]);
      const size_t o = static_cast<size_t>(r * C + c);
      if (init) acc = static_cast<T>((*init)[o]) + acc;
      out[o] = static_cast<double>(acc);
    }
  }
  return out;
}

enum class Op { forward, backward_input, backward_weight };

// Runs one op on the CPU and checks it against both references. M, N, K as in ops.h.
void check_op(Op op, int64_t M, int64_t N, int64_t K, DType a_type, DType b_type, bool accumulate,
              uint64_t seed) {
  Tensor a, b, out;
  std::vector<double> truth, ref;
  const std::string what =
      fmt::format("op {} M={} N={} K={} {} {} accumulate={}", static_cast<int>(op), M, N, K,
                  dtype_name(a_type), dtype_name(b_type), accumulate);
  switch (op) {
    case Op::forward:
      a = random_tensor({M, K}, a_type, seed);      // x
      b = random_tensor({N, K}, b_type, seed + 1);  // w
      out = random_tensor({M, N}, DType::f32, seed + 2);
      break;
    case Op::backward_input:
      a = random_tensor({M, N}, DType::f32, seed);  // dy
      b = random_tensor({N, K}, b_type, seed + 1);  // w
      out = random_tensor({M, K}, DType::f32, seed + 2);
      break;
    case Op::backward_weight:
      a = random_tensor({M, N}, DType::f32, seed);  // dy
      b = random_tensor({M, K}, b_type, seed + 1);  // x
      out = random_tensor({N, K}, DType::f32, seed + 2);
      break;
  }
  const std::vector<double> av = to_f64(a), bv = to_f64(b), init = to_f64(out);
  const std::vector<double>* ip = accumulate ? &init : nullptr;
  switch (op) {
    case Op::forward:
      truth = product<double>(av, K, 1, bv, K, 1, M, N, K, ip);
      ref = product<float>(av, K, 1, bv, K, 1, M, N, K, ip);
      ops::matmul(a, b, out, accumulate);
      break;
    case Op::backward_input:  // dx[m][k] = sum_n dy[m][n] w[n][k]
      truth = product<double>(av, N, 1, bv, 1, K, M, K, N, ip);
      ref = product<float>(av, N, 1, bv, 1, K, M, K, N, ip);
      ops::matmul_backward_input(a, b, out, accumulate);
      break;
    case Op::backward_weight:  // dw[n][k] = sum_m dy[m][n] x[m][k]
      truth = product<double>(av, 1, N, bv, 1, K, N, K, M, ip);
      ref = product<float>(av, 1, N, bv, 1, K, N, K, M, ip);
      ops::matmul_backward_weight(a, b, out, accumulate);
      break;
  }
  check_within_reference_error(out, truth, ref, what);
}

struct Dims {
  int64_t M, N, K;
};
// K = 1601 spans three chunks of the CPU kernel (ops::cpu::detail::kChunk).
constexpr Dims kOddShapes[] = {{7, 13, 37}, {65, 33, 577}, {1, 5, 16},
                               {3, 7, 1},   {9, 6, 48},    {5, 9, 1601}};

// y rows [first, first + rows) of x against w, as a fresh (rows, N) tensor.
Tensor forward_rows(const Tensor& x, const Tensor& w, int64_t first, int64_t rows) {
  Tensor y = Tensor::empty({rows, w.size(0)}, DType::f32);
  ops::matmul(x.narrow(first, rows), w, y);
  return y;
}

bool rows_equal(const Tensor& a, int64_t a_row, const Tensor& b, int64_t b_row) {
  const int64_t n = a.size(1);
  return std::memcmp(a.data_as<float>() + a_row * n, b.data_as<float>() + b_row * n,
                     static_cast<size_t>(n) * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("matmul matches an f64 reference on odd shapes in every dtype mix", "[unit]") {
  uint64_t seed = 100;
  for (const Dims& d : kOddShapes) {
    for (DType xt : {DType::f32, DType::bf16}) {
      for (DType wt : {DType::f32, DType::bf16}) {
        for (bool acc : {false, true}) check_op(Op::forward, d.M, d.N, d.K, xt, wt, acc, ++seed);
      }
    }
  }
}

TEST_CASE("matmul backward products match f64 references on odd shapes", "[unit]") {
  uint64_t seed = 200;
  for (const Dims& d : kOddShapes) {
    for (DType t : {DType::f32, DType::bf16}) {
      for (bool acc : {false, true}) {
        check_op(Op::backward_input, d.M, d.N, d.K, DType::f32, t, acc, ++seed);
        check_op(Op::backward_weight, d.M, d.N, d.K, DType::f32, t, acc, ++seed);
      }
    }
  }
}

TEST_CASE("matmul backward products match finite differences of a weighted sum", "[unit]") {
  const int64_t M = 11, N = 19, K = 41;
  const Tensor x = random_tensor({M, K}, DType::f32, 301);
  const Tensor w = random_tensor({N, K}, DType::f32, 302);
  const Tensor r = random_tensor({M, N}, DType::f32, 303);  // dloss/dy
  Tensor y = Tensor::empty({M, N}, DType::f32);
  const auto loss = [&] {
    ops::matmul(x, w, y);
    return weighted_sum(y, r);
  };
  Tensor dx = Tensor::empty({M, K}, DType::f32);
  Tensor dw = Tensor::empty({N, K}, DType::f32);
  ops::matmul_backward_input(r, w, dx);
  ops::matmul_backward_weight(r, x, dw);
  check_gradient(x, loss, dx, "dx");
  check_gradient(w, loss, dw, "dw");
}

TEST_CASE("matmul rows are bitwise the same alone and inside batches of any size", "[unit]") {
  const int threads = num_threads();
  struct Case {
    int64_t N, K;
    DType xt, wt;
    int64_t big;  // one larger batch besides 1..64
  };
  // K = 1536 runs two chunks of the CPU kernel.
  for (const Case& c :
       {Case{576, 576, DType::f32, DType::f32, 2048}, Case{1536, 576, DType::f32, DType::f32, 300},
        Case{576, 576, DType::bf16, DType::bf16, 300}, Case{576, 1536, DType::f32, DType::f32, 300},
        Case{13, 37, DType::f32, DType::f32, 300}}) {
    INFO("N=" << c.N << " K=" << c.K << " x " << dtype_name(c.xt) << " w " << dtype_name(c.wt));
    const Tensor x = random_tensor({c.big, c.K}, c.xt, 401);
    const Tensor w = random_tensor({c.N, c.K}, c.wt, 402);
    // Every row alone, on one thread.
    set_num_threads(1);
    Tensor alone = Tensor::empty({c.big, c.N}, DType::f32);
    for (int64_t i = 0; i < c.big; ++i) {
      Tensor yi =
          Tensor::wrap(alone.data_as<float>() + i * c.N, {1, c.N}, DType::f32, Device::cpu());
      ops::matmul(x.narrow(i, 1), w, yi);
    }
    for (int t : {1, 2}) {
      set_num_threads(t);
      INFO(t << " threads");
      // Batches of 1..64 rows starting at varied offsets, and the whole batch.
      int bad = 0;
      for (int64_t m = 1; m <= 64; ++m) {
        const int64_t first = (m * 37) % (c.big - m + 1);
        const Tensor y = forward_rows(x, w, first, m);
        for (int64_t i = 0; i < m; ++i) bad += !rows_equal(y, i, alone, first + i);
      }
      const Tensor all = forward_rows(x, w, 0, c.big);
      for (int64_t i = 0; i < c.big; ++i) bad += !rows_equal(all, i, alone, i);
      CHECK(bad == 0);
    }
  }
  set_num_threads(threads);
}

TEST_CASE("matmul backward products are bitwise the same with 1 and 2 threads", "[unit]") {
  const int threads = num_threads();
  // The second shape gives both products several blocks of rows to share between threads.
  for (const Dims& d : {Dims{70, 200, 96}, Dims{600, 300, 100}}) {
    INFO("M=" << d.M << " N=" << d.N << " K=" << d.K);
    const Tensor dy = random_tensor({d.M, d.N}, DType::f32, 501);
    const Tensor w = random_tensor({d.N, d.K}, DType::bf16, 502);
    const Tensor x = random_tensor({d.M, d.K}, DType::f32, 503);
    std::vector<Tensor> dx, dw;
    for (int t : {1, 2}) {
      set_num_threads(t);
      dx.push_back(Tensor::empty({d.M, d.K}, DType::f32));
      dw.push_back(Tensor::empty({d.N, d.K}, DType::f32));
      ops::matmul_backward_input(dy, w, dx.back());
      ops::matmul_backward_weight(dy, x, dw.back());
    }
    set_num_threads(threads);
    CHECK(bitwise_equal(dx[0], dx[1]));
    CHECK(bitwise_equal(dw[0], dw[1]));
  }
}

// The outer-product kernel of the f32 backward products (the default; not
// ops::MatmulBackward::transpose): dx = dy · w and dw = dyᵀ · x through
// ops::cpu::detail::outer_product as matmul.cpp calls it.
void outer_dx(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate, F32Isa isa) {
  const int64_t M = dy.size(0), N = dy.size(1), K = w.size(1);
  ops::cpu::detail::outer_product({dy.data(), false, N, 1}, {w.data(), false, K},
                                  dx.data_as<float>(), M, K, N, accumulate, isa);
}
void outer_dw(const Tensor& dy, const Tensor& x, const Tensor& dw, bool accumulate, F32Isa isa) {
  const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  ops::cpu::detail::outer_product({dy.data(), false, 1, N}, {x.data(), false, K},
                                  dw.data_as<float>(), N, K, M, accumulate, isa);
}

// A data-parallel job sums one rank's gradient with another's zero, or a micro-batch's into the
// gradient of the ones before it: both must be c + (the product alone), bit for bit, whatever
// the number of chunks of the sum.
// The best instruction set of the f32 kernels on this CPU.
F32Isa best_isa() {
  if (ops::cpu::matmul_has_avx512()) return F32Isa::avx512;
  return ops::cpu::matmul_has_avx2() ? F32Isa::avx2 : F32Isa::portable;
}

TEST_CASE("accumulating outer product backward kernels add the product computed alone", "[unit]") {
  const F32Isa avx512 = best_isa();
  for (const Dims& d : {Dims{300, 70, 96}, Dims{33, 129, 50}}) {  // 3 chunks over M; 1 chunk
    INFO("M=" << d.M << " N=" << d.N << " K=" << d.K);
    const Tensor dy = random_tensor({d.M, d.N}, DType::f32, 701, -100.0, 100.0);
    const Tensor w = random_tensor({d.N, d.K}, DType::f32, 702, -3.0, 3.0);
    const Tensor x = random_tensor({d.M, d.K}, DType::f32, 703, -3.0, 3.0);
    const Tensor dx0 = random_tensor({d.M, d.K}, DType::f32, 704);
    const Tensor dw0 = random_tensor({d.N, d.K}, DType::f32, 705);
    Tensor dx = dx0.to(Device::cpu()), dw = dw0.to(Device::cpu());
    outer_dx(dy, w, dx, true, avx512);
    outer_dw(dy, x, dw, true, avx512);
    Tensor dx_alone = Tensor::empty({d.M, d.K}, DType::f32);
    Tensor dw_alone = Tensor::empty({d.N, d.K}, DType::f32);
    outer_dx(dy, w, dx_alone, false, avx512);
    outer_dw(dy, x, dw_alone, false, avx512);
    const auto added = [](const Tensor& c, const Tensor& p) {
      Tensor out = c.to(Device::cpu());
      float* o = out.data_as<float>();
      const float* q = p.data_as<float>();
      for (int64_t i = 0; i < out.numel(); ++i) o[i] += q[i];
      return out;
    };
    CHECK(bitwise_equal(dx, added(dx0, dx_alone)));
    CHECK(bitwise_equal(dw, added(dw0, dw_alone)));
  }
}

TEST_CASE(
    "outer product backward kernels are bitwise the same with 1 and 2 threads and on "
    "both ISA paths",
    "[unit]") {
  const int threads = num_threads();
  const F32Isa best = best_isa();
  if (best == F32Isa::portable)
    WARN("this CPU has no AVX2: every run below uses the portable tile");
  for (const Dims& d : {Dims{70, 200, 96}, Dims{600, 300, 100}, Dims{7, 13, 37}}) {
    INFO("M=" << d.M << " N=" << d.N << " K=" << d.K);
    const Tensor dy = random_tensor({d.M, d.N}, DType::f32, 721, -100.0, 100.0);
    const Tensor w = random_tensor({d.N, d.K}, DType::f32, 722, -3.0, 3.0);
    const Tensor x = random_tensor({d.M, d.K}, DType::f32, 723, -3.0, 3.0);
    std::vector<Tensor> dx, dw;
    for (const auto& [t, isa] : {std::pair{1, best}, std::pair{2, best}, std::pair{2, F32Isa::avx2},
                                 std::pair{2, F32Isa::portable}}) {
      if (isa == F32Isa::avx2 && !ops::cpu::matmul_has_avx2()) continue;
      set_num_threads(t);
      dx.push_back(Tensor::empty({d.M, d.K}, DType::f32));
      dw.push_back(Tensor::empty({d.N, d.K}, DType::f32));
      outer_dx(dy, w, dx.back(), false, isa);
      outer_dw(dy, x, dw.back(), false, isa);
    }
    set_num_threads(threads);
    for (size_t i = 1; i < dx.size(); ++i) {
      CHECK(bitwise_equal(dx[0], dx[i]));
      CHECK(bitwise_equal(dw[0], dw[i]));
    }
  }
}

// A (R, C) tensor's transpose (C, R), materialised.
Tensor transposed(const Tensor& a) {
  const int64_t R = a.size(0), C = a.size(1);
  Tensor t = Tensor::empty({C, R}, DType::f32);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) t.data_as<float>()[c * R + r] = a.data_as<float>()[r * C + c];
  return t;
}

TEST_CASE("the transpose backward setting runs the forward kernel on transposed operands",
          "[unit]") {
  for (const Dims& d : {Dims{600, 70, 96}, Dims{7, 13, 37}}) {
    INFO("M=" << d.M << " N=" << d.N << " K=" << d.K);
    const Tensor dy = random_tensor({d.M, d.N}, DType::f32, 631, -100.0, 100.0);
    const Tensor w = random_tensor({d.N, d.K}, DType::f32, 632, -3.0, 3.0);
    const Tensor x = random_tensor({d.M, d.K}, DType::f32, 633, -3.0, 3.0);
    Tensor dx = Tensor::empty({d.M, d.K}, DType::f32), dw = Tensor::empty({d.N, d.K}, DType::f32);
    Tensor dx_outer = Tensor::empty({d.M, d.K}, DType::f32);
    Tensor dw_outer = Tensor::empty({d.N, d.K}, DType::f32);
    ops::matmul_backward_input(dy, w, dx_outer);
    ops::matmul_backward_weight(dy, x, dw_outer);
    {
      const ops::ScopedMatmulSettings transpose({ops::MatmulPrecision::f32,
                                                 ops::MatmulKernel::automatic,
                                                 ops::MatmulBackward::transpose});
      REQUIRE(ops::matmul_backward() == ops::MatmulBackward::transpose);
      ops::matmul_backward_input(dy, w, dx);
      ops::matmul_backward_weight(dy, x, dw);
    }
    CHECK(ops::matmul_backward() == ops::MatmulBackward::outer);
    // dx = dy · (wᵀ)ᵀ and dw = dyᵀ · (xᵀ)ᵀ: the forward product, bit for bit.
    Tensor dx_forward = Tensor::empty({d.M, d.K}, DType::f32);
    Tensor dw_forward = Tensor::empty({d.N, d.K}, DType::f32);
    ops::matmul(dy, transposed(w), dx_forward);
    ops::matmul(transposed(dy), transposed(x), dw_forward);
    CHECK(bitwise_equal(dx, dx_forward));
    CHECK(bitwise_equal(dw, dw_forward));
    // The outer-product kernel sums over M in another order: dw's bits differ when M is long.
    if (d.M > 100) CHECK_FALSE(bitwise_equal(dw, dw_outer));
  }
}

TEST_CASE("the SIMD and portable backward products agree bit for bit", "[unit]") {
  if (best_isa() == F32Isa::portable)
    WARN("this CPU has no AVX2: both runs below use the portable kernel");
  // Rows and columns off the 8 x 48 tile, sums over several chunks of kOuterChunk, bf16 w/x.
  for (const Dims& d : {Dims{7, 13, 37}, Dims{65, 300, 577}, Dims{300, 129, 50}, Dims{9, 1, 96}}) {
    for (DType t : {DType::f32, DType::bf16}) {
      INFO("M=" << d.M << " N=" << d.N << " K=" << d.K << " " << dtype_name(t));
      const Tensor dy = random_tensor({d.M, d.N}, DType::f32, 611, -100.0, 100.0);
      const Tensor w = random_tensor({d.N, d.K}, t, 612, -3.0, 3.0);
      const Tensor x = random_tensor({d.M, d.K}, t, 613, -3.0, 3.0);
      for (bool acc : {false, true}) {
        Tensor dx = random_tensor({d.M, d.K}, DType::f32, 614);
        Tensor dw = random_tensor({d.N, d.K}, DType::f32, 615);
        Tensor dx_portable = dx.to(Device::cpu()), dw_portable = dw.to(Device::cpu());
        ops::matmul_backward_input(dy, w, dx, acc);
        ops::matmul_backward_weight(dy, x, dw, acc);
        ops::set_matmul_kernel(ops::MatmulKernel::portable);
        ops::matmul_backward_input(dy, w, dx_portable, acc);
        ops::matmul_backward_weight(dy, x, dw_portable, acc);
        ops::set_matmul_kernel(ops::MatmulKernel::automatic);
        CHECK(bitwise_equal(dx, dx_portable));
        CHECK(bitwise_equal(dw, dw_portable));
      }
    }
  }
}

// On a CPU with AVX-512 the AVX2 tile is never chosen: it is checked here directly, so that
// both machine kinds test it.
TEST_CASE("the AVX2 forward tile agrees bit for bit with the portable one", "[unit]") {
  if (!ops::cpu::matmul_has_avx2()) {
    WARN("this CPU has no AVX2 and FMA: the AVX2 tile cannot run here");
    return;
  }
  // Rows and columns off the 2 x 3 tile; K with and without a partial last step of 16 lanes.
  for (const Dims& d : {Dims{1, 1, 1}, Dims{2, 3, 16}, Dims{5, 7, 37}, Dims{4, 6, 768},
                        Dims{3, 5, 9}, Dims{7, 11, 200}}) {
    INFO("rows=" << d.M << " cols=" << d.N << " kc=" << d.K);
    const Tensor x = random_tensor({d.M, d.K}, DType::f32, 631, -100.0, 100.0);
    const Tensor w = random_tensor({d.N, d.K}, DType::f32, 632, -3.0, 3.0);
    for (bool add : {false, true}) {
      Tensor fast = random_tensor({d.M, d.N}, DType::f32, 633);
      Tensor portable = fast.to(Device::cpu());
      ops::cpu::detail::chunk_avx2(x.data_as<float>(), d.K, w.data_as<float>(), d.K,
                                   fast.data_as<float>(), d.N, d.M, d.N, d.K, add);
      ops::cpu::detail::chunk_portable(x.data_as<float>(), d.K, w.data_as<float>(), d.K,
                                       portable.data_as<float>(), d.N, d.M, d.N, d.K, add);
      CHECK(bitwise_equal(fast, portable));
    }
  }
}

TEST_CASE("the SIMD matmul kernel and the portable kernel agree bit for bit", "[unit]") {
  if (best_isa() == F32Isa::portable)
    WARN("this CPU has no AVX2: both runs below use the portable kernel");
  struct Case {
    int64_t M, N, K;
    DType xt, wt;
  };
  for (const Case& c :
       {Case{7, 13, 37, DType::f32, DType::f32}, Case{65, 33, 577, DType::bf16, DType::f32},
        Case{33, 576, 576, DType::f32, DType::bf16}, Case{5, 11, 1536, DType::f32, DType::f32},
        Case{6, 7, 1601, DType::bf16, DType::bf16}, Case{2, 3, 5, DType::f32, DType::f32}}) {
    INFO("M=" << c.M << " N=" << c.N << " K=" << c.K);
    // Large, mixed-sign values so that cancellation exercises the reduction order.
    const Tensor x = random_tensor({c.M, c.K}, c.xt, 601, -100.0, 100.0);
    const Tensor w = random_tensor({c.N, c.K}, c.wt, 602, -3.0, 3.0);
    for (bool acc : {false, true}) {
      Tensor fast = random_tensor({c.M, c.N}, DType::f32, 603);
      Tensor portable = fast.to(Device::cpu());
      ops::matmul(x, w, fast, acc);
      ops::set_matmul_kernel(ops::MatmulKernel::portable);
      ops::matmul(x, w, portable, acc);
      ops::set_matmul_kernel(ops::MatmulKernel::automatic);
      CHECK(bitwise_equal(fast, portable));
    }
  }
}

TEST_CASE("matmul with bf16 w is bitwise the product with w widened to f32 first", "[unit]") {
  // Small M reads bf16 w in place (widened in registers), larger M through an f32 copy: both
  // must give the bits of the same product against an f32 w holding the exact widened values.
  // K = 1601 spans three chunks; K = 48 and 1536 take the whole-vector tiles.
  for (const int64_t K : {int64_t{37}, int64_t{48}, int64_t{577}, int64_t{1536}, int64_t{1601}}) {
    for (const int64_t N : {int64_t{5}, int64_t{13}, int64_t{37}}) {
      const Tensor w = random_tensor({N, K}, DType::bf16, 701, -3.0, 3.0);
      Tensor w_f32 = Tensor::empty({N, K}, DType::f32);
      ops::cast(w, w_f32);
      for (const int64_t M : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{8},
                              int64_t{12}, int64_t{13}, int64_t{33}, int64_t{70}}) {
        for (DType xt : {DType::f32, DType::bf16}) {
          const Tensor x = random_tensor({M, K}, xt, 702, -100.0, 100.0);
          for (bool acc : {false, true}) {
            INFO("M=" << M << " N=" << N << " K=" << K << " x " << dtype_name(xt)
                      << " accumulate=" << acc);
            Tensor y = random_tensor({M, N}, DType::f32, 703);
            Tensor y_f32 = y.to(Device::cpu());
            ops::matmul(x, w, y, acc);
            ops::matmul(x, w_f32, y_f32, acc);
            CHECK(bitwise_equal(y, y_f32));
          }
        }
      }
    }
  }
}

TEST_CASE("matmul ops reject mismatched shapes and dtypes naming both shapes", "[unit]") {
  using Catch::Matchers::Contains;
  const Tensor x = random_tensor({7, 37}, DType::f32, 1);
  const Tensor w = random_tensor({13, 36}, DType::f32, 2);
  Tensor y = Tensor::empty({7, 13}, DType::f32);
  CHECK_THROWS_WITH(ops::matmul(x, w, y),
                    Contains("matmul") && Contains("(7, 37)") && Contains("(13, 36)"));
  const Tensor w_ok = random_tensor({13, 37}, DType::f32, 3);
  CHECK_THROWS_WITH(ops::matmul(x, w_ok, Tensor::empty({7, 12}, DType::f32)),
                    Contains("(7, 12)") && Contains("(7, 13)"));
  CHECK_THROWS_WITH(ops::matmul(x, w_ok, Tensor::empty({7, 13}, DType::bf16)),
                    Contains("matmul") && Contains("y"));
  CHECK_THROWS_AS(ops::matmul(random_tensor({7, 37}, DType::f16, 4), w_ok, y), Error);
  CHECK_THROWS_AS(ops::matmul(random_tensor({7, 37, 1}, DType::f32, 4), w_ok, y), Error);
  // Backward: dy (7, 13) against w (12, 37) and x (8, 37).
  const Tensor dy = random_tensor({7, 13}, DType::f32, 5);
  CHECK_THROWS_WITH(
      ops::matmul_backward_input(dy, random_tensor({12, 37}, DType::f32, 6),
                                 Tensor::empty({7, 37}, DType::f32)),
      Contains("matmul_backward_input") && Contains("(7, 13)") && Contains("(12, 37)"));
  CHECK_THROWS_WITH(
      ops::matmul_backward_weight(dy, random_tensor({8, 37}, DType::f32, 7),
                                  Tensor::empty({13, 37}, DType::f32)),
      Contains("matmul_backward_weight") && Contains("(7, 13)") && Contains("(8, 37)"));
  CHECK_THROWS_AS(ops::matmul_backward_input(random_tensor({7, 13}, DType::bf16, 8), w_ok,
                                             Tensor::empty({7, 37}, DType::f32)),
                  Error);
}

namespace {

// y (M, N) [+]= x (M, K) w (N, K)^T and the backward products on one shape; the CUDA run
// computes in bf16 whenever an operand is bf16 (the f32 operand is rounded to bf16 first), so
// those cases allow the normalised error of one bf16 rounding of an operand in a K-term dot
// product (about 2^-18 per product, ~1e-6 in all); all-f32 cases run an f32 GEMM on the GPU
// and differ from the CPU only by summation order.
void add_matmul_cases(const std::string& what, int64_t M, int64_t N, int64_t K, DType t,
                      bool accumulate) {
  const double nmse = t == DType::bf16 ? 1e-5 : 1e-10;
  const std::string tag = fmt::format("{} {}{} M={} N={} K={}", what, dtype_name(t),
                                      accumulate ? " accumulate" : "", M, N, K);
  const auto out_init = [accumulate](Shape s) {
    return [accumulate, s](const std::vector<Tensor>&) {
      return std::vector<Tensor>{accumulate ? random_tensor(s, DType::f32, 77)
                                            : Tensor::zeros(s, DType::f32)};
    };
  };
  add_parity_case({
      .name = "matmul " + tag,
      .inputs =
          [=](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({M, K}, DType::f32, seed),
                                       random_tensor({N, K}, t, seed + 1)};
          },
      .outputs = out_init({M, N}),
      .run = [accumulate](
                 const std::vector<Tensor>& in,
                 const std::vector<Tensor>& out) { ops::matmul(in[0], in[1], out[0], accumulate); },
      .max_nmse = nmse,
  });
  add_parity_case({
      .name = "matmul_backward_input " + tag,
      .inputs =
          [=](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({M, N}, DType::f32, seed),
                                       random_tensor({N, K}, t, seed + 1)};
          },
      .outputs = out_init({M, K}),
      .run =
          [accumulate](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
            ops::matmul_backward_input(in[0], in[1], out[0], accumulate);
          },
      .max_nmse = nmse,
  });
  add_parity_case({
      .name = "matmul_backward_weight " + tag,
      .inputs =
          [=](uint64_t seed) {
            return std::vector<Tensor>{random_tensor({M, N}, DType::f32, seed),
                                       random_tensor({M, K}, t, seed + 1)};
          },
      .outputs = out_init({N, K}),
      .run =
          [accumulate](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
            ops::matmul_backward_weight(in[0], in[1], out[0], accumulate);
          },
      .max_nmse = nmse,
  });
}

}  // namespace

TANDEM_PARITY_CASES(matmul) {
  for (DType t : {DType::f32, DType::bf16}) {
    add_matmul_cases("odd", 7, 13, 37, t, false);
    add_matmul_cases("odd", 65, 33, 577, t, true);
    add_matmul_cases("smollm2 q_proj", 64, 576, 576, t, false);
    add_matmul_cases("smollm2 down_proj", 33, 576, 1536, t, true);
  }
}

TEST_CASE("CUDA matmul rows are bitwise the same alone and inside batches of any size", "[gpu]") {
  skip_without_gpu();
  const Device gpu = Device::cuda();
  for (DType wt : {DType::bf16, DType::f32}) {
    for (const auto& [N, K] : {std::pair<int64_t, int64_t>{576, 576}, {1536, 576}, {576, 1536}}) {
      INFO("N=" << N << " K=" << K << " w " << dtype_name(wt));
      const int64_t big = 300;
      const Tensor x = random_tensor({big, K}, DType::f32, 701).to(gpu);
      const Tensor w = random_tensor({N, K}, wt, 702).to(gpu);
      Tensor alone = Tensor::empty({big, N}, DType::f32, gpu);
      for (int64_t i = 0; i < big; ++i) ops::matmul(x.narrow(i, 1), w, alone.narrow(i, 1));
      const Tensor alone_cpu = alone.to(Device::cpu());
      int bad = 0;
      for (int64_t m : {int64_t{2}, int64_t{7}, int64_t{32}, int64_t{33}, int64_t{64}, big}) {
        const int64_t first = (m * 37) % (big - m + 1);
        Tensor y = Tensor::empty({m, N}, DType::f32, gpu);
        ops::matmul(x.narrow(first, m), w, y);
        const Tensor y_cpu = y.to(Device::cpu());
        for (int64_t i = 0; i < m; ++i) bad += !rows_equal(y_cpu, i, alone_cpu, first + i);
      }
      CHECK(bad == 0);
    }
  }
}
