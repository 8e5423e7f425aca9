// Kernel benchmarks of the layer ops (embedding, rmsnorm, rope, swiglu and their backwards) at
// SmolLM2-135M and Qwen2.5-1.5B shapes; all bandwidth-bound: bytes = what each op must move.
#include <set>
#include <vector>

#include "bench/bench.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::bench {
namespace {

constexpr double kF32 = 4, kI32 = 4;

// Uniform [0, 1) values on the device, seeded.
Tensor uniform(const Shape& shape, Device d, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32, d);
  ops::random_uniform(t, seed, 0);
  return t;
}

Tensor uniform_bf16(const Shape& shape, Device d, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::bf16, d);
  ops::cast(uniform(shape, d, seed), t);
  return t;
}

// Token ids spread over [0, V) by a fixed linear congruential sequence; *unique counts the
// distinct ones (the rows the backward touches).
Tensor token_ids(int64_t T, int64_t V, Device d, int64_t* unique) {
  Tensor host = Tensor::empty({T}, DType::i32);
  std::set<int32_t> seen;
  uint64_t s = 12345;
  for (int64_t t = 0; t < T; ++t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    host.data_as<int32_t>()[t] = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(V));
    seen.insert(host.data_as<int32_t>()[t]);
  }
  *unique = static_cast<int64_t>(seen.size());
  return host.to(d);
}

Tensor positions(int64_t T, Device d) {
  Tensor host = Tensor::empty({T}, DType::i32);
  for (int64_t t = 0; t < T; ++t) host.data_as<int32_t>()[t] = static_cast<int32_t>(t);
  return host.to(d);
}

void bench_model(Runner& runner, const ModelShape& m, float theta) {
  const Device d = runner.device();
  const int64_t C = m.C, F = m.F, V = m.V, D = m.D;
  std::vector<int64_t> tokens = {512};
  if (!runner.options().quick) tokens.push_back(4096);
  const Tensor table_f32 = uniform({V, C}, d, 1);
  const Tensor table_bf16 = uniform_bf16({V, C}, d, 2);
  Tensor dtable = uniform({V, C}, d, 3);
  const Tensor weight = uniform({C}, d, 4);
  Tensor dweight = Tensor::zeros({C}, DType::f32, d);
  ops::RopeParams rope_params;
  rope_params.theta = theta;
  for (const int64_t T : tokens) {
    const std::string shape = fmt::format("{} T={}", m.name, T);
    const double tc = static_cast<double>(T * C);
    int64_t unique = 0;
    const Tensor ids = token_ids(T, V, d, &unique);
    Tensor x = uniform({T, C}, d, 5), out = Tensor::zeros({T, C}, DType::f32, d);
    Tensor delta = uniform({T, C}, d, 6), rstd = Tensor::zeros({T}, DType::f32, d);
    Tensor dx = Tensor::zeros({T, C}, DType::f32, d);

    runner.measure("embedding", shape + " f32 table", 0, T * kI32 + tc * (kF32 + kF32),
                   [&] { ops::embedding(ids, table_f32, out); });
    runner.measure("embedding", shape + " bf16 table", 0, T * kI32 + tc * (2 + kF32),
                   [&] { ops::embedding(ids, table_bf16, out); });
    runner.measure("embedding_backward", shape + " accumulate", 0,
                   T * kI32 + tc * kF32 + 2.0 * static_cast<double>(unique * C) * kF32,
                   [&] { ops::embedding_backward(ids, x, dtable, /*accumulate=*/true); });

    runner.measure("rmsnorm", shape, 0, 2 * tc * kF32 + C * kF32 + T * kF32,
                   [&] { ops::rmsnorm(x, weight, out, rstd, 1e-5f); });
    // In place on the residual stream, as the model runs it.
    runner.measure("add_rmsnorm", shape + " in place", 0, 4 * tc * kF32 + C * kF32 + T * kF32,
                   [&] { ops::add_rmsnorm(x, delta, weight, x, out, rstd, 1e-5f); });
    runner.measure("rmsnorm_backward", shape, 0, 4 * tc * kF32 + 2 * C * kF32 + T * kF32,
                   [&] { ops::rmsnorm_backward(delta, x, weight, rstd, dx, dweight); });

    const Tensor pos = positions(T, d);
    for (const auto& [name, heads] : {std::pair{"q", m.H}, std::pair{"k", m.Hkv}}) {
      Tensor qk = uniform({T, heads, D}, d, 7);
      const double bytes = 2.0 * static_cast<double>(T * heads * D) * kF32 + T * kI32;
      const std::string c = fmt::format("{} {} ({}, {}, {}) in place", shape, name, T, heads, D);
      runner.measure("rope", c, 0, bytes, [&] { ops::rope(qk, pos, qk, rope_params); });
      runner.measure("rope_backward", c, 0, bytes,
                     [&] { ops::rope_backward(qk, pos, qk, rope_params); });
    }

    const double tf = static_cast<double>(T * F);
    Tensor gate_up = uniform({T, 2 * F}, d, 8), act = Tensor::zeros({T, F}, DType::f32, d);
    Tensor dgate_up = Tensor::zeros({T, 2 * F}, DType::f32, d);
    runner.measure("swiglu", fmt::format("{} F={}", shape, F), 0, 3 * tf * kF32,
                   [&] { ops::swiglu(gate_up, act); });
    runner.measure("swiglu_backward", fmt::format("{} F={}", shape, F), 0, 5 * tf * kF32,
                   [&] { ops::swiglu_backward(act, gate_up, dgate_up); });
  }
}

}  // namespace

TANDEM_KERNEL_BENCH(layers) {
  bench_model(runner, kSmolLM2_135M, 100000.0f);
  bench_model(runner, kQwen25_1_5B, 1000000.0f);
}

}  // namespace tandem::bench
