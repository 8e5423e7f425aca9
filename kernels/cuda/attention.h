// CUDA attention (packed causal forward and backward), kv_cache_write and paged decode, on raw
// pointers; stream is a cudaStream_t. Index arrays live on the device and are not read on the
// host: out-of-range slots are skipped and out-of-range blocks make a sequence's output NaN.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::ops::cuda {

// q (T, H, D), k and v (T, Hkv, D), cu_seqlens (B + 1) -> out (T, H, D), lse (T, H).
void attention(const float* q, const float* k, const float* v, const int32_t* cu_seqlens, int64_t B,
               int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out, float* lse, float scale,
               void* stream);
void attention_backward(const float* dout, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const int32_t* cu_seqlens, int64_t B,
                        int64_t T, int64_t H, int64_t Hkv, int64_t D, float* dq, float* dk,
                        float* dv, float scale, void* stream);
// k, v (T, Hkv, D) f32 into the caches' slots (block * P + offset), cache_type f32 or bf16:
// v_cache (num_slots / P, P, Hkv, D), k_cache (num_slots / P, Hkv, D, P) (kernels/ops.h).
void kv_cache_write(const float* k, const float* v, const int32_t* slot_mapping, int64_t T,
                    int64_t Hkv, int64_t D, int64_t P, void* k_cache, void* v_cache,
                    DType cache_type, int64_t num_slots, void* stream);
// q (B, H, D), k_cache (num_blocks, Hkv, D, P), v_cache (num_blocks, P, Hkv, D) -> out (B, H, D).
void paged_attention_decode(const float* q, const void* k_cache, const void* v_cache,
                            DType cache_type, int64_t num_blocks, int64_t P,
                            const int32_t* kv_indptr, const int32_t* kv_indices,
                            int64_t num_indices, const int32_t* kv_last_len, int64_t B, int64_t H,
                            int64_t Hkv, int64_t D, float* out, float scale, void* stream);

}  // namespace tandem::ops::cuda
