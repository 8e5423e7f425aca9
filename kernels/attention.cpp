// attention, attention_backward, kv_cache_write, paged_attention_decode: checks and dispatch.
#include <utility>

#include "core/error.h"
#include "kernels/check.h"
#include "kernels/cpu/attention.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/attention.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

// q (T, H, D), k and v (T, Hkv, D), cu_seqlens (B + 1) i32, H a multiple of Hkv.
void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor& cu_seqlens) {
  check_dtype(op, "q", q, {DType::f32});
  check_dtype(op, "k", k, {DType::f32});
  check_dtype(op, "v", v, {DType::f32});
  check_dtype(op, "cu_seqlens", cu_seqlens, {DType::i32});
  check_ndim(op, "q", q, 3);
  check_ndim(op, "k", k, 3);
  check_ndim(op, "cu_seqlens", cu_seqlens, 1);
  [[maybe_unused]] const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TANDEM_CHECK(Hkv > 0 && H % Hkv == 0 && D > 0,
               "{}: q {} has {} heads, not a positive multiple of the {} heads of k {}", op,
               q.shape().str(), H, Hkv, k.shape().str());
  check_shape(op, "k", k, {T, Hkv, D});
  check_shape(op, "v", v, {T, Hkv, D});
  TANDEM_CHECK(cu_seqlens.numel() >= 1, "{}: cu_seqlens {} is empty", op, cu_seqlens.shape().str());
}

// prefix: undefined, or (B) i32 on q's device; CPU only.
void check_prefix(const char* op, const Tensor& prefix, const Tensor& q, const Tensor& cu_seqlens) {
  if (!prefix.defined()) return;
  check_dtype(op, "prefix", prefix, {DType::i32});
  check_shape(op, "prefix", prefix, {cu_seqlens.numel() - 1});
  check_device(op, q.device(), {&prefix});
  TANDEM_CHECK(!q.device().is_cuda(),
               "{}: shared prefixes (a defined prefix) run on the CPU only; on {} pack each "
               "sequence whole",
               op, q.device().str());
}

// v_cache (num_blocks, P, Hkv, D) and k_cache (num_blocks, Hkv, D, P), both f32 or both bf16.
void check_cache(const char* op, const Tensor& k_cache, const Tensor& v_cache, int64_t Hkv,
                 int64_t D) {
  check_dtype(op, "v_cache", v_cache, {DType::f32, DType::bf16});
  check_ndim(op, "v_cache", v_cache, 4);
  TANDEM_CHECK(v_cache.size(2) == Hkv && v_cache.size(3) == D,
               "{}: v_cache {} does not hold {} heads of size {}", op, v_cache.shape().str(), Hkv,
               D);
  const int64_t N = v_cache.size(0), P = v_cache.size(1);
  TANDEM_CHECK(k_cache.ndim() == 4 && k_cache.size(0) == N && k_cache.size(1) == Hkv &&
                   k_cache.size(2) == D && k_cache.size(3) == P,
               "{}: k_cache {} must be ({}, {}, {}, {}) for v_cache {}: keys are stored "
               "transposed per block and head, (num_blocks, Hkv, D, P) (see kernels/ops.h)",
               op, k_cache.shape().str(), N, Hkv, D, P, v_cache.shape().str());
  TANDEM_CHECK(k_cache.dtype() == v_cache.dtype(), "{}: k_cache is {} but v_cache is {}", op,
               k_cache.dtype(), v_cache.dtype());
}

}  // namespace

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
               const Tensor& prefix, const Tensor& out, const Tensor& lse, float scale,
               const Stream& stream) {
  const OpTimer timer("attention");
  constexpr const char* op = "attention";
  check_qkv(op, q, k, v, cu_seqlens);
  check_prefix(op, prefix, q, cu_seqlens);
  [[maybe_unused]] const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  check_dtype(op, "out", out, {DType::f32});
  check_dtype(op, "lse", lse, {DType::f32});
  check_shape(op, "out", out, q.shape());
  check_shape(op, "lse", lse, {T, H});
  check_device(op, q.device(), {&q, &k, &v, &cu_seqlens, &out, &lse});
  check_stream(op, q.device(), stream);
  TANDEM_ON_CUDA(q.device(), attention, q.data_as<float>(), k.data_as<float>(), v.data_as<float>(),
                 cu_seqlens.data_as<int32_t>(), cu_seqlens.numel() - 1, T, H, Hkv, D,
                 out.data_as<float>(), lse.data_as<float>(), scale, stream.handle);
  cpu::attention(q, k, v, cu_seqlens, prefix, out, lse, scale);
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                        const Tensor& prefix, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        float scale, const Stream& stream) {
  const OpTimer timer("attention_backward");
  constexpr const char* op = "attention_backward";
  check_qkv(op, q, k, v, cu_seqlens);
  check_prefix(op, prefix, q, cu_seqlens);
  [[maybe_unused]] const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  for (auto [name, t] : {std::pair{"dout", &dout}, {"out", &out}, {"dq", &dq}}) {
    check_dtype(op, name, *t, {DType::f32});
    check_shape(op, name, *t, q.shape());
  }
  for (auto [name, t] : {std::pair{"dk", &dk}, {"dv", &dv}}) {
    check_dtype(op, name, *t, {DType::f32});
    check_shape(op, name, *t, k.shape());
  }
  check_dtype(op, "lse", lse, {DType::f32});
  check_shape(op, "lse", lse, {T, H});
  check_device(op, q.device(), {&dout, &q, &k, &v, &out, &lse, &cu_seqlens, &dq, &dk, &dv});
  check_stream(op, q.device(), stream);
  TANDEM_ON_CUDA(q.device(), attention_backward, dout.data_as<float>(), q.data_as<float>(),
                 k.data_as<float>(), v.data_as<float>(), out.data_as<float>(), lse.data_as<float>(),
                 cu_seqlens.data_as<int32_t>(), cu_seqlens.numel() - 1, T, H, Hkv, D,
                 dq.data_as<float>(), dk.data_as<float>(), dv.data_as<float>(), scale,
                 stream.handle);
  cpu::attention_backward(dout, q, k, v, out, lse, cu_seqlens, prefix, dq, dk, dv, scale);
}

void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                    const Tensor& k_cache, const Tensor& v_cache, const Stream& stream) {
  constexpr const char* op = "kv_cache_write";
  check_dtype(op, "k", k, {DType::f32});
  check_dtype(op, "v", v, {DType::f32});
  check_ndim(op, "k", k, 3);
  check_shape(op, "v", v, k.shape());
  check_dtype(op, "slot_mapping", slot_mapping, {DType::i32});
  check_shape(op, "slot_mapping", slot_mapping, {k.size(0)});
  check_cache(op, k_cache, v_cache, k.size(1), k.size(2));
  check_device(op, k.device(), {&k, &v, &slot_mapping, &k_cache, &v_cache});
  check_stream(op, k.device(), stream);
  TANDEM_ON_CUDA(k.device(), kv_cache_write, k.data_as<float>(), v.data_as<float>(),
                 slot_mapping.data_as<int32_t>(), k.size(0), k.size(1), k.size(2), v_cache.size(1),
                 k_cache.data(), v_cache.data(), k_cache.dtype(), v_cache.size(0) * v_cache.size(1),
                 stream.handle);
  cpu::kv_cache_write(k, v, slot_mapping, k_cache, v_cache);
}

void paged_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& kv_indptr, const Tensor& kv_indices,
                            const Tensor& kv_last_len, const Tensor& out, float scale,
                            const Stream& stream) {
  constexpr const char* op = "paged_attention_decode";
  check_dtype(op, "q", q, {DType::f32});
  check_ndim(op, "q", q, 3);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_ndim(op, "v_cache", v_cache, 4);
  const int64_t Hkv = v_cache.size(2);
  TANDEM_CHECK(Hkv > 0 && H % Hkv == 0 && D > 0,
               "{}: q {} has {} heads, not a positive multiple of the {} heads of v_cache {}", op,
               q.shape().str(), H, Hkv, v_cache.shape().str());
  check_cache(op, k_cache, v_cache, Hkv, D);
  for (auto [name, t] : {std::pair{"kv_indptr", &kv_indptr},
                         {"kv_indices", &kv_indices},
                         {"kv_last_len", &kv_last_len}}) {
    check_dtype(op, name, *t, {DType::i32});
    check_ndim(op, name, *t, 1);
  }
  check_shape(op, "kv_indptr", kv_indptr, {B + 1});
  check_shape(op, "kv_last_len", kv_last_len, {B});
  check_dtype(op, "out", out, {DType::f32});
  check_shape(op, "out", out, q.shape());
  check_device(op, q.device(),
               {&q, &k_cache, &v_cache, &kv_indptr, &kv_indices, &kv_last_len, &out});
  check_stream(op, q.device(), stream);
  TANDEM_ON_CUDA(q.device(), paged_attention_decode, q.data_as<float>(), k_cache.data(),
                 v_cache.data(), k_cache.dtype(), v_cache.size(0), v_cache.size(1),
                 kv_indptr.data_as<int32_t>(), kv_indices.data_as<int32_t>(), kv_indices.numel(),
                 kv_last_len.data_as<int32_t>(), B, H, Hkv, D, out.data_as<float>(), scale,
                 stream.handle);
  cpu::paged_attention_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_len, out, scale);
}

}  // namespace tandem::ops
