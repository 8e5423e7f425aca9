// Kernel benchmarks of matmul and its backward products at SmolLM2-135M and Qwen2.5-1.5B
// shapes, beside OpenBLAS's cblas_sgemm on the same f32 operands (CPU), and the one-core
// instruction rates that bound the f32 and AVX512-BF16 paths.
#include <cblas.h>
#include <immintrin.h>

#include <functional>
#include <vector>

#include "bench/bench.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::bench {
namespace {

// Uniform random values in [0, 1) on the device, in dtype (through f32).
Tensor filled(const Shape& shape, DType dtype, Device d, uint64_t seed) {
  Tensor f = Tensor::empty(shape, DType::f32, d);
  ops::random_uniform(f, seed, 0);
  if (dtype == DType::f32) return f;
  Tensor t = Tensor::empty(shape, dtype, d);
  ops::cast(f, t);
  return t;
}

struct Product {
  const char* name;
  int64_t N, K;
};

// The linear layers of a model: q/o, k/v, fused gate/up, down, lm head.
std::vector<Product> products(const ModelShape& m, bool with_head) {
  std::vector<Product> p = {{"q_proj", m.H * m.D, m.C},
                            {"k_proj", m.Hkv * m.D, m.C},
                            {"gate_up", 2 * m.F, m.C},
                            {"down", m.C, m.F}};
  if (with_head) p.push_back({"lm_head", m.V, m.C});
  return p;
}

// The instruction rates of one core that bound the CPU matmul paths: independent chains of
// vdpbf16ps (the bf16 precision without AMX: 64 flops each) and of vfmadd231ps (the f32 kernel:
// 32 flops each), 12 zmm accumulators, nothing loaded. Their ratio is what the AVX512-BF16 path
// can gain over f32 on a CPU; the kernels' rows below against these say how close each gets.
constexpr int kPeakChains = 12;

__attribute__((target("avx512f,avx512bf16"), noinline)) float vdpbf16ps_chains(int64_t n) {
  __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));
  __m512 c[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakChains; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, a);
    __asm__ volatile("" : "+v"(a));  // one more step, not one folded product
  }
  __m512 s = c[0];
  for (int i = 1; i < kPeakChains; ++i) s = _mm512_add_ps(s, c[i]);
  return _mm512_cvtss_f32(s);
}

__attribute__((target("avx512f,fma"), noinline)) float vfmadd_chains(int64_t n) {
  __m512 a = _mm512_set1_ps(1.0f);
  const __m512 b = _mm512_set1_ps(0.5f);
  __m512 c[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kPeakChains; ++i) c[i] = _mm512_fmadd_ps(c[i], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  __m512 s = c[0];
  for (int i = 1; i < kPeakChains; ++i) s = _mm512_add_ps(s, c[i]);
  return _mm512_cvtss_f32(s);
}

}  // namespace

TANDEM_KERNEL_BENCH(matmul_isa_peak) {
  if (!runner.device().is_cpu() || !__builtin_cpu_supports("avx512f")) return;
  constexpr int64_t kSteps = 1 << 16;
  volatile float sink = 0;
  const double chains = static_cast<double>(kSteps) * kPeakChains;
  if (ops::matmul_has_avx512_bf16() && runner.wants("isa_peak", "vdpbf16ps zmm one core"))
    runner.measure("isa_peak", "vdpbf16ps zmm one core", 64 * chains, 0,
                   [&] { sink = sink + vdpbf16ps_chains(kSteps); });
  if (runner.wants("isa_peak", "vfmadd231ps zmm one core"))
    runner.measure("isa_peak", "vfmadd231ps zmm one core", 32 * chains, 0,
                   [&] { sink = sink + vfmadd_chains(kSteps); });
}

TANDEM_KERNEL_BENCH(matmul) {
  const Device d = runner.device();
  const bool cpu = d.is_cpu();
  const bool quick = runner.options().quick;
  if (cpu) openblas_set_num_threads(num_threads());

  // Forward y (M, N) = x (M, K) w (N, K)^T.
  const auto forward = [&](const ModelShape& model, const Product& p, int64_t M, DType wt) {
    const std::string name = fmt::format("{} {} ({}, {})x({}, {}) w {}", model.name, p.name, M, p.K,
                                         p.N, p.K, dtype_name(wt));
    if (!runner.wants("matmul", name)) return;
    const Tensor x = filled({M, p.K}, DType::f32, d, 1);
    const Tensor w = filled({p.N, p.K}, wt, d, 2);
    Tensor y = Tensor::empty({M, p.N}, DType::f32, d);
    const double flops = 2.0 * static_cast<double>(M * p.N * p.K);
    const double bytes = static_cast<double>(w.nbytes() + x.nbytes() + y.nbytes());
    const auto ours = [&] { ops::matmul(x, w, y); };
    if (!cpu || wt != DType::f32) return runner.measure("matmul", name, flops, bytes, ours);
    runner.measure("matmul", name, flops, bytes, ours, openblas_peer(), [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M),
                  static_cast<int>(p.N), static_cast<int>(p.K), 1.0f, x.data_as<float>(),
                  static_cast<int>(p.K), w.data_as<float>(), static_cast<int>(p.K), 0.0f,
                  y.data_as<float>(), static_cast<int>(p.N));
    });
  };
  for (const int64_t M : {int64_t{512}, int64_t{2048}}) {
    if (quick && M > 512) continue;
    for (const Product& p : products(kSmolLM2_135M, true)) forward(kSmolLM2_135M, p, M, DType::f32);
  }
  for (const Product& p : products(kSmolLM2_135M, true))
    forward(kSmolLM2_135M, p, 512, DType::bf16);
  // Decode: one token and a small batch (bound by reading w).
  for (const int64_t M : {int64_t{1}, int64_t{32}}) {
    for (const Product& p : products(kSmolLM2_135M, true)) {
      forward(kSmolLM2_135M, p, M, DType::f32);
      forward(kSmolLM2_135M, p, M, DType::bf16);
    }
  }
  // Decode as the model runs it: every layer's products against its own w, so that w streams
  // from memory as in a decode step (the cases above reuse one w, which stays in cache).
  for (const int64_t M : {int64_t{1}, int64_t{32}}) {
    const ModelShape& m = kSmolLM2_135M;
    constexpr int kLayers = 30;
    const std::string name = fmt::format(
        "{} {} layers' q k v o gate_up down, M = {}, w f32 from memory", m.name, kLayers, M);
    if (!runner.wants("matmul", name)) continue;
    const std::vector<Product> layer = {{"q", m.H * m.D, m.C},     {"k", m.Hkv * m.D, m.C},
                                        {"v", m.Hkv * m.D, m.C},   {"o", m.C, m.H * m.D},
                                        {"gate_up", 2 * m.F, m.C}, {"down", m.C, m.F}};
    std::vector<Tensor> ws, xs, ys;
    double flops = 0, bytes = 0;
    for (int l = 0; l < kLayers; ++l)
      for (const Product& p : layer) {
        ws.push_back(filled({p.N, p.K}, DType::f32, d, 10 + ws.size()));
        xs.push_back(filled({M, p.K}, DType::f32, d, 1));
        ys.push_back(Tensor::empty({M, p.N}, DType::f32, d));
        flops += 2.0 * static_cast<double>(M * p.N * p.K);
        bytes += static_cast<double>(ws.back().nbytes());
      }
    runner.measure("matmul", name, M == 1 ? 0 : flops, M == 1 ? bytes : 0, [&] {
      for (size_t i = 0; i < ws.size(); ++i) ops::matmul(xs[i], ws[i], ys[i]);
    });
  }
  // The bf16 precision (CPU): operands rounded to bf16, AMX tiles or AVX512-BF16 where the CPU
  // has them (named in the case); the peer is OpenBLAS's sgemm on the f32 operands, as above.
  const std::string bf16 = bf16_compute_name();
  const auto bf16_compute = [&](const std::string& op, const std::string& name, double flops,
                                const std::function<void()>& ours) {
    if (!cpu || !runner.wants(op, name)) return;
    const ops::ScopedMatmulPrecision precision(ops::MatmulPrecision::bf16);
    runner.measure(op, name, flops, 0, ours);
  };
  for (const int64_t M : {int64_t{32}, int64_t{512}, int64_t{2048}}) {
    if (quick && M > 512) continue;
    for (const Product& p : products(kSmolLM2_135M, true)) {
      const std::string name = fmt::format("{} {} ({}, {})x({}, {}) {}", kSmolLM2_135M.name, p.name,
                                           M, p.K, p.N, p.K, bf16);
      const Tensor x = filled({M, p.K}, DType::f32, d, 1);
      const Tensor w = filled({p.N, p.K}, DType::f32, d, 2);
      Tensor y = Tensor::empty({M, p.N}, DType::f32, d);
      bf16_compute("matmul", name, 2.0 * static_cast<double>(M * p.N * p.K),
                   [&] { ops::matmul(x, w, y); });
    }
  }
  if (!quick)
    for (const Product& p : products(kQwen25_1_5B, false))
      forward(kQwen25_1_5B, p, 512, DType::f32);

  // Backward products at M = 512 tokens: dx (M, K) = dy (M, N) w (N, K);
  // dw (N, K) = dy^T (N, M) x (M, K).
  const int64_t M = 512;
  for (const Product& p : products(kSmolLM2_135M, false)) {
    const std::string name =
        fmt::format("{} {} dy ({}, {}) w ({}, {})", kSmolLM2_135M.name, p.name, M, p.N, p.N, p.K);
    const double flops = 2.0 * static_cast<double>(M * p.N * p.K);
    const Tensor dy = filled({M, p.N}, DType::f32, d, 3);
    const Tensor w = filled({p.N, p.K}, DType::f32, d, 4);
    const Tensor x = filled({M, p.K}, DType::f32, d, 5);
    Tensor dx = Tensor::empty({M, p.K}, DType::f32, d);
    Tensor dw = Tensor::empty({p.N, p.K}, DType::f32, d);
    const int m = static_cast<int>(M), n = static_cast<int>(p.N), k = static_cast<int>(p.K);
    const auto dx_ours = [&] { ops::matmul_backward_input(dy, w, dx); };
    const auto dw_ours = [&] { ops::matmul_backward_weight(dy, x, dw); };
    bf16_compute("matmul_backward_input", name + " " + bf16, flops, dx_ours);
    bf16_compute("matmul_backward_weight", name + " " + bf16, flops, dw_ours);
    if (!cpu) {
      runner.measure("matmul_backward_input", name, flops, 0, dx_ours);
      runner.measure("matmul_backward_weight", name, flops, 0, dw_ours);
      continue;
    }
    runner.measure("matmul_backward_input", name, flops, 0, dx_ours, openblas_peer(), [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, k, n, 1.0f, dy.data_as<float>(), n,
                  w.data_as<float>(), k, 0.0f, dx.data_as<float>(), k);
    });
    runner.measure("matmul_backward_weight", name, flops, 0, dw_ours, openblas_peer(), [&] {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, k, m, 1.0f, dy.data_as<float>(), n,
                  x.data_as<float>(), k, 0.0f, dw.data_as<float>(), k);
    });
  }
}

}  // namespace tandem::bench
