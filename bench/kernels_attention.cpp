// Kernel benchmarks of attention (forward, backward; compute-bound) and paged decode (KV bytes).
#include <cmath>
#include <vector>

#include "bench/bench.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::bench {
namespace {

// Uniform values in [-1, 1) from a cheap hash: the benchmark needs no particular distribution,
// only finite, non-degenerate inputs.
Tensor filled(const Shape& shape, DType dtype, uint32_t seed, Device d) {
  Tensor f = Tensor::empty(shape, DType::f32);
  float* p = f.data_as<float>();
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < f.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<float>(x >> 8) * 0x1.0p-23f - 1.0f;
  }
  if (dtype == DType::f32) return f.to(d);
  Tensor c = Tensor::empty(shape, dtype);
  ops::cast(f, c);
  return c.to(d);
}

Tensor ints(const std::vector<int32_t>& v, Device d) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32);
  for (size_t i = 0; i < v.size(); ++i) t.data_as<int32_t>()[i] = v[i];
  return t.to(d);
}

void packed_rows(Runner& runner, const ModelShape& m, int64_t B, int64_t len) {
  const Device d = runner.device();
  const int64_t T = B * len, H = m.H, Hkv = m.Hkv, D = m.D;
  const std::string shape =
      fmt::format("{} B {} x {} (T {}, H {}, Hkv {}, D {})", m.name, B, len, T, H, Hkv, D);
  if (!runner.wants("attention", shape) && !runner.wants("attention_backward", shape)) return;
  std::vector<int32_t> cu{0};
  for (int64_t b = 0; b < B; ++b) cu.push_back(static_cast<int32_t>(cu.back() + len));
  const Tensor cu_seqlens = ints(cu, d);
  const Tensor q = filled({T, H, D}, DType::f32, 1, d), k = filled({T, Hkv, D}, DType::f32, 2, d),
               v = filled({T, Hkv, D}, DType::f32, 3, d),
               dout = filled({T, H, D}, DType::f32, 4, d);
  Tensor out = Tensor::empty({T, H, D}, DType::f32, d), lse = Tensor::empty({T, H}, DType::f32, d);
  Tensor dq = Tensor::empty({T, H, D}, DType::f32, d),
         dk = Tensor::empty({T, Hkv, D}, DType::f32, d),
         dv = Tensor::empty({T, Hkv, D}, DType::f32, d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Causal FLOPs: q·k and p·v over the T^2/2 visible pairs per sequence, 2 FLOPs per MAC.
  const double fwd = 4.0 * static_cast<double>(B) * static_cast<double>(len * len) / 2.0 *
                     static_cast<double>(H * D);
  runner.measure("attention", shape, fwd, 0,
                 [&] { ops::attention(q, k, v, cu_seqlens, {}, out, lse, scale); });
  ops::attention(q, k, v, cu_seqlens, {}, out, lse, scale);
  // The backward's five products of the same size (FlashAttention's 2.5x forward count).
  runner.measure("attention_backward", shape, 2.5 * fwd, 0, [&] {
    ops::attention_backward(dout, q, k, v, out, lse, cu_seqlens, {}, dq, dk, dv, scale);
  });
}

void decode_rows(Runner& runner, const ModelShape& m, int64_t B, int64_t ctx, DType cache) {
  const Device d = runner.device();
  const int64_t H = m.H, Hkv = m.Hkv, D = m.D, P = 16, nb = (ctx + P - 1) / P;
  const std::string shape = fmt::format("{} B {} context {} {} cache (H {}, Hkv {}, D {}, P {})",
                                        m.name, B, ctx, dtype_name(cache), H, Hkv, D, P);
  if (!runner.wants("paged_attention_decode", shape)) return;
  // Every sequence's blocks spread over the pool with a stride, as a long-running cache is.
  const int64_t pool = B * nb;
  std::vector<int32_t> indptr{0}, indices, last;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < nb; ++i) indices.push_back(static_cast<int32_t>((b + i * B) % pool));
    indptr.push_back(static_cast<int32_t>(indices.size()));
    last.push_back(static_cast<int32_t>(ctx - (nb - 1) * P));
  }
  const Tensor q = filled({B, H, D}, DType::f32, 5, d);
  const Tensor kc = filled({pool, Hkv, D, P}, cache, 6, d),
               vc = filled({pool, P, Hkv, D}, cache, 7, d);
  const Tensor ip = ints(indptr, d), ix = ints(indices, d), ll = ints(last, d);
  Tensor out = Tensor::empty({B, H, D}, DType::f32, d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const double bytes =
      2.0 * static_cast<double>(B * ctx * Hkv * D) * static_cast<double>(dtype_size(cache));
  runner.measure("paged_attention_decode", shape, 0, bytes,
                 [&] { ops::paged_attention_decode(q, kc, vc, ip, ix, ll, out, scale); });
}

}  // namespace

TANDEM_KERNEL_BENCH(attention) {
  for (const ModelShape& m : {kSmolLM2_135M, kQwen25_1_5B}) {
    packed_rows(runner, m, 1, 512);
    packed_rows(runner, m, 8, 128);
  }
  const bool quick = runner.options().quick;
  for (const ModelShape& m : {kSmolLM2_135M, kQwen25_1_5B})
    for (int64_t B : {1, 8, 32})
      for (int64_t ctx : {256, 1024}) {
        if (quick && B > 8) continue;
        decode_rows(runner, m, B, ctx, DType::f32);
      }
  // A GRPO rollout's decode: batch 32 at 64-127 cached keys.
  decode_rows(runner, kSmolLM2_135M, 32, 96, DType::f32);
  decode_rows(runner, kSmolLM2_135M, 8, 1024, DType::bf16);
}

}  // namespace tandem::bench
