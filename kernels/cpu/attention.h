// CPU causal attention (packed forward and backward), paged KV cache write and paged decode.
// Arguments are checked by kernels/attention.cpp; index values (cu_seqlens, prefix, slots, block
// ids) are validated here, where they are read.
#pragma once

#include "core/tensor.h"

namespace tandem::ops::cpu {

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
               const Tensor& prefix, const Tensor& out, const Tensor& lse, float scale);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                        const Tensor& prefix, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        float scale);
void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                    const Tensor& k_cache, const Tensor& v_cache);
void paged_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& kv_indptr, const Tensor& kv_indices,
                            const Tensor& kv_last_len, const Tensor& out, float scale);

// Whether a SIMD row kernel is used (AVX-512, else AVX2 with FMA, when the CPU has it); false
// forces the portable one. All give bitwise the same numbers; tests switch it to prove that.
void set_attention_simd(bool enabled);
bool attention_simd_active();
// The kernels' instruction set now.
enum class AttentionIsa { portable, avx2, avx512 };
AttentionIsa attention_isa();

}  // namespace tandem::ops::cpu
