// Kernel benchmarks of logprob_gather (and backward), adamw and sample (bandwidth-bound).
#include "bench/bench.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::bench {
namespace {

Tensor filled(const Shape& shape, DType dtype, Device d, float value) {
  Tensor host = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < host.numel(); ++i) {
    if (dtype == DType::f32) host.data_as<float>()[i] = value;
    if (dtype == DType::i32) host.data_as<int32_t>()[i] = static_cast<int32_t>(value);
    if (dtype == DType::i64) host.data_as<int64_t>()[i] = static_cast<int64_t>(value);
  }
  return host.to(d);
}

// Logits with some spread (a ramp folded by a multiplicative hash), so thresholds are not trivial.
Tensor spread_logits(int64_t rows, int64_t V, Device d) {
  Tensor host = Tensor::empty({rows, V}, DType::f32);
  float* x = host.data_as<float>();
  for (int64_t i = 0; i < rows * V; ++i)
    x[i] = static_cast<float>((static_cast<uint64_t>(i) * 2654435761u) % 100003) * 1e-4f - 5.0f;
  return host.to(d);
}

}  // namespace

TANDEM_KERNEL_BENCH(rl) {
  const Device d = runner.device();
  const bool quick = runner.options().quick;

  // logprob_gather at the trainer's packed length, for both vocabularies.
  const int64_t T = quick ? 64 : 512;
  for (const ModelShape& m : {kSmolLM2_135M, kQwen25_1_5B}) {
    if (!runner.wants("logprob_gather", m.name) && !runner.wants("logprob_gather_backward", m.name))
      continue;
    const int64_t V = m.V;
    const Tensor logits = spread_logits(T, V, d);
    const Tensor targets = filled({T}, DType::i32, d, 17);
    Tensor logprob = Tensor::zeros({T}, DType::f32, d), lse = Tensor::zeros({T}, DType::f32, d);
    Tensor entropy = Tensor::zeros({T}, DType::f32, d);
    Tensor dlogits = Tensor::zeros({T, V}, DType::f32, d);
    const Tensor dlogprob = filled({T}, DType::f32, d, 0.5f);
    const Tensor dentropy = filled({T}, DType::f32, d, -0.1f);
    const double nbytes = static_cast<double>(T * V * 4);
    runner.measure("logprob_gather", fmt::format("{} ({}, {}) with entropy", m.name, T, V), 0,
                   nbytes, [&] { ops::logprob_gather(logits, targets, logprob, lse, entropy); });
    runner.measure(
        "logprob_gather_backward", fmt::format("{} ({}, {}) with dentropy", m.name, T, V), 0,
        2 * nbytes,
        [&] { ops::logprob_gather_backward(dlogprob, dentropy, logits, targets, lse, dlogits); });
  }

  // adamw over a SmolLM2-135M parameter set, with and without the bf16 rollout copy.
  if (runner.wants("adamw", "")) {
    const int64_t n = quick ? (int64_t{1} << 22) : 134'515'008;
    Tensor p = filled({n}, DType::f32, d, 0.01f), g = filled({n}, DType::f32, d, 1e-3f);
    Tensor m = Tensor::zeros({n}, DType::f32, d), v = Tensor::zeros({n}, DType::f32, d);
    Tensor copy = Tensor::zeros({n}, DType::bf16, d);
    const double nd = static_cast<double>(n);
    runner.measure("adamw", fmt::format("f32 ({})", n), 0, nd * 4 * 7,
                   [&] { ops::adamw(p, g, m, v, {}); });
    runner.measure("adamw", fmt::format("f32 ({}) with bf16 copy", n), 0, nd * (4 * 7 + 2),
                   [&] { ops::adamw(p, g, m, v, {}, copy); });
  }

  // sample over SmolLM2's vocabulary at decode batch sizes.
  const int64_t V = kSmolLM2_135M.V;
  for (int64_t B : {1, 32, 64}) {
    const Tensor logits = spread_logits(B, V, d);
    Tensor token = Tensor::zeros({B}, DType::i32, d), logprob = Tensor::zeros({B}, DType::f32, d);
    for (const bool filters : {true, false}) {
      const std::string name =
          fmt::format("({}, {}) {}", B, V, filters ? "top_k 50 top_p 0.9" : "filters off");
      if (!runner.wants("sample", name)) continue;
      const ops::SamplingTensors s{filled({B}, DType::f32, d, 0.8f),
                                   filled({B}, DType::i32, d, filters ? 50 : 0),
                                   filled({B}, DType::f32, d, filters ? 0.9f : 1.0f),
                                   filled({B}, DType::f32, d, 0.0f),
                                   filled({B}, DType::i64, d, 1234),
                                   filled({B}, DType::i64, d, 7)};
      runner.measure("sample", name, 0, static_cast<double>(B * V * 4),
                     [&] { ops::sample(logits, s, token, logprob); });
    }
  }
}

}  // namespace tandem::bench
