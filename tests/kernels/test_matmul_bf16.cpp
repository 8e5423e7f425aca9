// The bf16 precision of the CPU matmuls on each of its paths this CPU has (AMX, AVX512-BF16, and
// always the portable one: the f32 kernel on the rounded operands, which stands in for a path the
// CPU lacks): against f64 references of the rounded operands, batch invariance and
// thread-count independence bit for bit, packed weights, the packing against scalar rounding,
// and the AVX512-BF16 kernel against a scalar model of `vdpbf16ps`.
#include <catch2/catch.hpp>

#include <cpuid.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/parallel.h"
#include "kernels/cpu/matmul.h"
#include "kernels/ops.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;
namespace cpu = tandem::ops::cpu;

namespace {

// The bf16 precision with a kernel choice for one scope.
struct Bf16Scope {
  explicit Bf16Scope(ops::MatmulKernel kernel = ops::MatmulKernel::automatic)
      : precision(ops::MatmulPrecision::bf16) {
    ops::set_matmul_kernel(kernel);
  }
  ~Bf16Scope() { ops::set_matmul_kernel(ops::MatmulKernel::automatic); }
  Bf16Scope(const Bf16Scope&) = delete;
  Bf16Scope& operator=(const Bf16Scope&) = delete;
  ops::ScopedMatmulPrecision precision;
};

// The kernel choices that reach each bf16 path this CPU has: automatic (AMX, else
// AVX512-BF16), avx512_bf16 where AMX would be taken otherwise, and the portable reference.
std::vector<ops::MatmulKernel> bf16_kernels() {
  std::vector<ops::MatmulKernel> k = {ops::MatmulKernel::automatic};
  if (cpu::detail::amx_usable() && cpu::detail::avx512_bf16_usable())
    k.push_back(ops::MatmulKernel::avx512_bf16);
  k.push_back(ops::MatmulKernel::portable);
  if (!cpu::detail::avx512_bf16_usable())
    WARN("no AVX512-BF16 here: only the portable bf16 path is exercised");
  else if (!cpu::detail::amx_usable())
    WARN("no AMX-BF16 here: the AMX path is not exercised");
  return k;
}

// Where the path a kernel choice takes is named in a failure.
std::string path_now() { return ops::matmul_bf16_path_name(ops::matmul_bf16_path()); }

double rounded(double v) {
  return bf16_bits_to_f32(cpu::detail::bf16_bits_daz(static_cast<float>(v)));
}

enum class Op { forward, backward_input, backward_weight };

struct Run {
  Tensor out;
  std::vector<double> truth;  // f64 product of the bf16-rounded operands
  std::vector<double> bound;  // f32 summation error bound per element: R * eps * sum |a b|
};

// out (R, C) = sum_s a(r, s) b(c, s) [+ init], given by strides, in f64 on rounded operands.
void reference(const std::vector<double>& a, int64_t a_rs, int64_t a_ss,
               const std::vector<double>& b, int64_t b_cs, int64_t b_ss, int64_t R, int64_t C,
               int64_t S, const std::vector<double>* init, Run& run) {
  run.truth.assign(static_cast<size_t>(R * C), 0.0);
  run.bound.assign(static_cast<size_t>(R * C), 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0, mag = 0;
      for (int64_t s = 0; s < S; ++s) {
        const double p = rounded(a[static_cast<size_t>(r * a_rs + s * a_ss)]) *
                         rounded(b[static_cast<size_t>(c * b_cs + s * b_ss)]);
        acc += p;
        mag += std::abs(p);
      }
      const size_t o = static_cast<size_t>(r * C + c);
      if (init) {
        acc += (*init)[o];
        mag += std::abs((*init)[o]);
      }
      run.truth[o] = acc;
      run.bound[o] = static_cast<double>(S + 2) * 0x1p-24 * mag + 1e-30;
    }
}

Run run_op(Op op, int64_t M, int64_t N, int64_t K, DType a_type, DType b_type, bool accumulate,
           uint64_t seed) {
  Tensor a, b;
  Run run;
  switch (op) {
    case Op::forward:
      a = random_tensor({M, K}, a_type, seed);
      b = random_tensor({N, K}, b_type, seed + 1);
      run.out = random_tensor({M, N}, DType::f32, seed + 2);
      break;
    case Op::backward_input:
      a = random_tensor({M, N}, DType::f32, seed);
      b = random_tensor({N, K}, b_type, seed + 1);
      run.out = random_tensor({M, K}, DType::f32, seed + 2);
      break;
    case Op::backward_weight:
      a = random_tensor({M, N}, DType::f32, seed);
      b = random_tensor({M, K}, b_type, seed + 1);
      run.out = random_tensor({N, K}, DType::f32, seed + 2);
      break;
  }
  const std::vector<double> av = to_f64(a), bv = to_f64(b), init = to_f64(run.out);
  const std::vector<double>* ip = accumulate ? &init : nullptr;
  switch (op) {
    case Op::forward:
      reference(av, K, 1, bv, K, 1, M, N, K, ip, run);
      ops::matmul(a, b, run.out, accumulate);
      break;
    case Op::backward_input:
      reference(av, N, 1, bv, 1, K, M, K, N, ip, run);
      ops::matmul_backward_input(a, b, run.out, accumulate);
      break;
    case Op::backward_weight:
      reference(av, 1, N, bv, 1, K, N, K, M, ip, run);
      ops::matmul_backward_weight(a, b, run.out, accumulate);
      break;
  }
  return run;
}

void check_run(const Run& run, const std::string& what) {
  INFO(what);
  const std::vector<double> got = to_f64(run.out);
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - run.truth[i]) <= run.bound[i])) ++bad;
  CHECK(bad == 0);
}

struct Dims {
  int64_t M, N, K;
};
constexpr Dims kShapes[] = {{7, 13, 37},  {65, 33, 577}, {1, 5, 16},   {3, 7, 1},
                            {33, 48, 64}, {5, 9, 1601},  {40, 70, 100}};

}  // namespace

TEST_CASE("bf16 matmuls match f64 products of the rounded operands on every path", "[unit]") {
  for (const ops::MatmulKernel kernel : bf16_kernels()) {
    Bf16Scope scope(kernel);
    for (const Dims& d : kShapes)
      for (const Op op : {Op::forward, Op::backward_input, Op::backward_weight})
        for (const DType bt : {DType::f32, DType::bf16})
          for (const bool acc : {false, true}) {
            const DType at = op == Op::forward ? bt : DType::f32;
            const Run run = run_op(op, d.M, d.N, d.K, at, bt, acc, 900 + static_cast<int>(op));
            check_run(run, fmt::format("path={} op={} M={} N={} K={} {} accumulate={}", path_now(),
                                       static_cast<int>(op), d.M, d.N, d.K, dtype_name(bt), acc));
          }
  }
}

TEST_CASE("bf16 matmul rows are bitwise the same alone and inside batches of any size", "[unit]") {
  for (const ops::MatmulKernel kernel : bf16_kernels()) {
    Bf16Scope scope(kernel);
    INFO("path=" << path_now());
    const int64_t N = 70, K = 200;
    const Tensor x = random_tensor({50, K}, DType::f32, 31);
    const Tensor w = random_tensor({N, K}, DType::bf16, 32);
    Tensor all = Tensor::empty({50, N}, DType::f32);
    ops::matmul(x, w, all);
    for (const int64_t first : {int64_t{0}, int64_t{17}, int64_t{49}}) {
      for (const int64_t rows : {int64_t{1}, int64_t{2}, int64_t{33}}) {
        if (first + rows > 50) continue;
        Tensor part = Tensor::empty({rows, N}, DType::f32);
        ops::matmul(x.narrow(first, rows), w, part);
        CHECK(bitwise_equal(part, all.narrow(first, rows)));
      }
    }
  }
}

TEST_CASE("bf16 matmul products are bitwise the same with 1 and 2 threads", "[unit]") {
  for (const ops::MatmulKernel kernel : bf16_kernels()) {
    Bf16Scope scope(kernel);
    INFO("path=" << path_now());
    const int threads = num_threads();
    const Tensor x = random_tensor({300, 96}, DType::f32, 41);
    const Tensor w = random_tensor({200, 96}, DType::f32, 42);
    const Tensor dy = random_tensor({300, 200}, DType::f32, 43);
    auto all = [&] {
      Tensor y = Tensor::empty({300, 200}, DType::f32), dx = Tensor::empty({300, 96}, DType::f32),
             dw = Tensor::empty({200, 96}, DType::f32);
      ops::matmul(x, w, y);
      ops::matmul_backward_input(dy, w, dx);
      ops::matmul_backward_weight(dy, x, dw);
      return std::vector<Tensor>{y, dx, dw};
    };
    set_num_threads(1);
    const std::vector<Tensor> one = all();
    set_num_threads(2);
    const std::vector<Tensor> two = all();
    set_num_threads(threads);
    for (size_t i = 0; i < one.size(); ++i) CHECK(bitwise_equal(one[i], two[i]));
  }
}

TEST_CASE("bf16 rounding keeps NaN and infinities and sends denormals to zero", "[unit]") {
  const float denormal = std::numeric_limits<float>::denorm_min() * 1000.0f;
  CHECK(cpu::detail::bf16_bits_daz(denormal) == 0);
  CHECK(cpu::detail::bf16_bits_daz(-denormal) == 0x8000);
  CHECK(cpu::detail::bf16_bits_daz(std::numeric_limits<float>::infinity()) == 0x7f80);
  const uint16_t nan = cpu::detail::bf16_bits_daz(std::numeric_limits<float>::quiet_NaN());
  CHECK(std::isnan(bf16_bits_to_f32(nan)));
  CHECK(cpu::detail::bf16_bits_daz(1.0f + 0x1p-8f) == 0x3f80);             // tie to even
  CHECK(cpu::detail::bf16_bits_daz(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // above the tie
}

TEST_CASE("bf16 packing rounds as the scalar bf16 rounding and lays out pairs", "[unit]") {
  if (!cpu::detail::avx512_bf16_usable()) {
    WARN("no AVX512-BF16 here: the packing (AMX and AVX512-BF16 paths) is not exercised");
    return;
  }
  // Values across magnitudes, with denormals, ties, infinities and NaN.
  const int64_t rows = 21, k = 45, kp = 64;
  std::vector<float> src(static_cast<size_t>(rows * k));
  for (size_t i = 0; i < src.size(); ++i) {
    const double v = std::sin(static_cast<double>(i) * 1.7) * std::pow(2.0, (i % 61) - 30.0);
    src[i] = static_cast<float>(v);
  }
  src[3] = std::numeric_limits<float>::denorm_min() * 77.0f;
  src[4] = -src[3];
  src[5] = 1.0f + 0x1p-8f;
  src[6] = std::numeric_limits<float>::infinity();
  src[7] = std::numeric_limits<float>::quiet_NaN();
  auto expect = [&](int64_t r, int64_t c) -> uint16_t {
    return r < rows && c < k ? cpu::detail::bf16_bits_daz(src[static_cast<size_t>(r * k + c)])
                             : uint16_t{0};
  };
  std::vector<uint16_t> a(static_cast<size_t>(rows * kp), 0xffff);
  cpu::detail::amx_pack_rows(src.data(), false, k, rows, k, a.data(), kp);
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kp; ++c) bad += a[static_cast<size_t>(r * kp + c)] != expect(r, c);
  CHECK(bad == 0);
  // src as (cols = rows, k) rows: the forward's w. Two groups of 16 columns.
  std::vector<uint16_t> b(static_cast<size_t>(32 * kp), 0xffff);
  cpu::detail::amx_pack_transposed(src.data(), false, k, rows, k, b.data(), 0, 2, kp);
  bad = 0;
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t p = 0; p < kp / 2; ++p)
      for (int64_t c = 0; c < 16; ++c)
        for (int64_t h = 0; h < 2; ++h)
          bad += b[static_cast<size_t>(g * kp * 16 + p * 32 + c * 2 + h)] !=
                 expect(g * 16 + c, 2 * p + h);
  CHECK(bad == 0);
  // src as (r_count = rows, cols = k) rows: the backward products' second operand.
  const int64_t kp2 = 32, groups = 3;  // r_count 21 -> 32; cols 45 -> 48
  std::vector<uint16_t> t(static_cast<size_t>(groups * 16 * kp2), 0xffff);
  cpu::detail::amx_pack_pairs(src.data(), false, k, rows, k, t.data(), 0, groups, kp2);
  bad = 0;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t p = 0; p < kp2 / 2; ++p)
      for (int64_t c = 0; c < 16; ++c)
        for (int64_t h = 0; h < 2; ++h)
          bad += t[static_cast<size_t>(g * kp2 * 16 + p * 32 + c * 2 + h)] !=
                 expect(2 * p + h, g * 16 + c);
  CHECK(bad == 0);
}

TEST_CASE("a packed weight gives bitwise the bf16 matmul against the weight", "[unit]") {
  {
    Bf16Scope portable(ops::MatmulKernel::portable);
    CHECK_THROWS_WITH(ops::PackedWeight(random_tensor({4, 4}, DType::f32, 1)),
                      Catch::Contains("AVX512-BF16"));
  }
  Bf16Scope scope;
  if (!ops::matmul_packs_weights()) {
    WARN("no AMX-BF16 or AVX512-BF16 here: weights are not packed");
    return;
  }
  for (const ops::MatmulKernel kernel : bf16_kernels()) {
    if (kernel == ops::MatmulKernel::portable) continue;
    ops::set_matmul_kernel(kernel);
    for (const DType wt : {DType::f32, DType::bf16}) {
      for (const Dims& d : kShapes) {
        INFO("path=" << path_now() << " M=" << d.M << " N=" << d.N << " K=" << d.K << " "
                     << dtype_name(wt));
        const Tensor x = random_tensor({d.M, d.K}, DType::f32, 51);
        const Tensor w = random_tensor({d.N, d.K}, wt, 52);
        const ops::PackedWeight packed(w);
        CHECK(packed.rows() == d.N);
        CHECK(packed.cols() == d.K);
        for (const bool acc : {false, true}) {
          Tensor want = random_tensor({d.M, d.N}, DType::f32, 53);
          Tensor got = want.to(Device::cpu());
          ops::matmul(x, w, want, acc);
          ops::matmul(x, packed, got, acc);
          CHECK(bitwise_equal(want, got));
        }
      }
    }
  }
  ops::set_matmul_kernel(ops::MatmulKernel::automatic);
  if (cpu::detail::amx_usable() && cpu::detail::avx512_bf16_usable()) {
    // One layout for both paths: packed while AMX runs, used on AVX512-BF16.
    const Tensor x = random_tensor({9, 70}, DType::f32, 54);
    const Tensor w = random_tensor({33, 70}, DType::f32, 55);
    const ops::PackedWeight packed(w);
    ops::set_matmul_kernel(ops::MatmulKernel::avx512_bf16);
    Tensor want = Tensor::empty({9, 33}, DType::f32), got = Tensor::empty({9, 33}, DType::f32);
    ops::matmul(x, w, want);
    ops::matmul(x, packed, got);
    CHECK(bitwise_equal(want, got));
    ops::set_matmul_kernel(ops::MatmulKernel::automatic);
  }
  // Moved, the packed copy stays valid; with the f32 precision it is refused.
  const Tensor x = random_tensor({3, 40}, DType::f32, 61);
  const Tensor w = random_tensor({20, 40}, DType::f32, 62);
  ops::PackedWeight a(w);
  const ops::PackedWeight b = std::move(a);
  Tensor want = Tensor::empty({3, 20}, DType::f32), got = Tensor::empty({3, 20}, DType::f32);
  ops::matmul(x, w, want);
  ops::matmul(x, b, got, false);
  CHECK(bitwise_equal(want, got));
  CHECK_THROWS_WITH(ops::matmul(random_tensor({3, 41}, DType::f32, 63), b, got, false),
                    Catch::Contains("packed w (20, 40)"));
  // Packed again with new values of the same shape: the same memory, the new values' product.
  ops::PackedWeight c(w);
  const void* before = c.data();
  const Tensor w2 = random_tensor({20, 40}, DType::f32, 64);
  c.pack(w2);
  CHECK(c.data() == before);
  ops::matmul(x, w2, want);
  ops::matmul(x, c, got, false);
  CHECK(bitwise_equal(want, got));
  ops::set_matmul_precision(ops::MatmulPrecision::f32);
  CHECK_THROWS_WITH(ops::matmul(x, b, got, false), Catch::Contains("bf16 precision"));
}

namespace {

bool cpu_is_intel() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0, &a, &b, &c, &d);
  return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "GenuineIntel"
}

// An f32 of `vdpbf16ps` with its denormals as zeros of their sign (DAZ in, FTZ out).
float flush(float f) { return (float_bits(f) & 0x7f800000u) == 0 ? std::copysign(0.0f, f) : f; }

}  // namespace

TEST_CASE("the AVX512-BF16 kernel computes each output as a scalar model of vdpbf16ps", "[unit]") {
  if (!cpu::detail::avx512_bf16_usable()) {
    WARN("no AVX512-BF16 here: the portable path covers the bf16 precision instead");
    return;
  }
  // Intel documents each lane of vdpbf16ps as acc += a1 b1, then acc += a0 b0, each an f32
  // fused multiply-add (exact here: bf16 products fit in f32) with DAZ, FTZ and round to
  // nearest even. Other vendors add the pair their own way: then only the f64 bounds above apply.
  const bool intel = cpu_is_intel();
  if (!intel) WARN("not an Intel CPU: the kernel is checked against the model within f32 error");
  // Rows across register tiles (6) and columns across groups (16) and blocks (64); K across
  // passes (256) with a zero-filled tail; large mixed-sign values for cancellation.
  for (const Dims& d : {Dims{1, 5, 16}, Dims{7, 70, 37}, Dims{13, 129, 600}, Dims{6, 64, 512}}) {
    const int64_t kp = (d.K + cpu::detail::kAmxK - 1) / cpu::detail::kAmxK * cpu::detail::kAmxK;
    const Tensor a = random_tensor({d.M, d.K}, DType::f32, 71, -100.0, 100.0);
    const Tensor b = random_tensor({d.N, d.K}, DType::f32, 72, -3.0, 3.0);
    const int64_t groups = (d.N + 31) / 32 * 2;
    std::vector<uint16_t> ap(static_cast<size_t>(d.M * kp)),
        bp(static_cast<size_t>(groups * 16 * kp));
    cpu::detail::amx_pack_rows(a.data(), false, d.K, d.M, d.K, ap.data(), kp);
    cpu::detail::amx_pack_transposed(b.data(), false, d.K, d.N, d.K, bp.data(), 0, groups, kp);
    for (const bool add : {false, true}) {
      INFO("M=" << d.M << " N=" << d.N << " K=" << d.K << " accumulate=" << add);
      const Tensor y0 = random_tensor({d.M, d.N}, DType::f32, 73);
      Tensor y = y0.to(Device::cpu());
      cpu::detail::dp_blocks(ap.data(), d.M, bp.data(), d.N, kp, y.data_as<float>(), d.N, add);
      const float* init = y0.data_as<float>();
      const float* got = y.data_as<float>();
      const float* av = a.data_as<float>();
      const float* bv = b.data_as<float>();
      int64_t differ = 0, bad = 0;
      for (int64_t i = 0; i < d.M; ++i)
        for (int64_t j = 0; j < d.N; ++j) {
          float acc = add ? flush(init[i * d.N + j]) : 0.0f;
          double truth = add ? init[i * d.N + j] : 0.0, mag = std::abs(truth);
          auto at = [](const float* v, int64_t r, int64_t k, int64_t K) {
            return k < K ? rounded(v[r * K + k]) : 0.0;
          };
          for (int64_t k = 0; k < kp; k += 2) {
            const double a0 = at(av, i, k, d.K), a1 = at(av, i, k + 1, d.K);
            const double b0 = at(bv, j, k, d.K), b1 = at(bv, j, k + 1, d.K);
            acc = flush(std::fma(static_cast<float>(a1), static_cast<float>(b1), acc));
            acc = flush(std::fma(static_cast<float>(a0), static_cast<float>(b0), acc));
            truth += a0 * b0 + a1 * b1;
            mag += std::abs(a0 * b0) + std::abs(a1 * b1);
          }
          const float out = got[i * d.N + j];
          differ += std::memcmp(&out, &acc, sizeof(float)) != 0;
          bad += !(std::abs(out - truth) <= static_cast<double>(d.K + 2) * 0x1p-24 * mag + 1e-30);
        }
      CHECK(bad == 0);
      if (intel) CHECK(differ == 0);
    }
  }
}
