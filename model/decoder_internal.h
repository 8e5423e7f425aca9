// Decoder internals shared by model/decoder.cpp (the activation plan and the entry points) and
// model/decoder_layer.cpp (the layer math): a layer's activations and gradient scratch, what its
// attention reads, and Net, which runs a layer forward or backward and the head.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "core/device.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/weights.h"

namespace tandem::model::detail {

// One layer's activations: everything its backward reads.
struct LayerActs {
  Tensor x1, rstd1;         // (T, C), (T): input rmsnorm
  Tensor q_raw, k_raw;      // (T, H D), (T, Hkv D): projections before the q/k norm (qk_norm only)
  Tensor rstd_q, rstd_k;    // (T H), (T Hkv): q/k norm (qk_norm only)
  Tensor q, k, v;           // (T, H, D), (T, Hkv, D), (T, Hkv, D): attention inputs (q, k roped)
  Tensor att, lse;          // (T, H, D), (T, H)
  Tensor o_out;             // (T, C): att · o^T
  Tensor h_mid, x2, rstd2;  // (T, C), (T, C), (T): h + o_out and its rmsnorm
  Tensor gate_up, act;      // (T, 2F), (T, F)
};

// Gradient scratch of one layer's backward, reused by every layer.
struct LayerGrads {
  Tensor dh, dx;          // (T, C): the residual stream's gradient, a normed input's gradient
  Tensor d_act, d_gu;     // (T, F), (T, 2F)
  Tensor d_att;           // (T, H D)
  Tensor dq, dk, dv;      // (T, H, D), (T, Hkv, D), (T, Hkv, D)
  Tensor dq_raw, dk_raw;  // (T, H D), (T, Hkv D) (qk_norm only)
  // Tensor parallel with q/k norms: dx_qk_norm (T C + 2 D) holds dx's elements, then d_qk_norm
  // (2 D): this rank's heads' parts of the q norm's and the k norm's gradients, so that one
  // all-reduce sums both.
  Tensor dx_qk_norm, d_qk_norm;
};

// What a layer's attention reads besides its own q, k, v.
struct AttentionInputs {
  Tensor positions;                 // (T) i32
  Tensor cu_seqlens;                // (B + 1) i32: packed causal attention over this call's tokens
  const KvCacheView* kv = nullptr;  // inference: write this call's K/V into the cache
  // Defined: paged attention, one query row each, against these block lists (T + 1, ..., T).
  Tensor indptr, indices, last_len;
  Tensor ones;    // (T, 1) for the bias adds
  Tensor prefix;  // (B) i32 or undefined: the packed sequences' shared prefixes
  // Tensor parallel: (tp T C) f32, the forward's sums gather every rank's part here (Net::tp_sum).
  Tensor tp_parts;
};

// A layer's projection weights packed for AMX (DecoderOptions::pack_weights).
struct PackedLayer {
  ops::PackedWeight q, k, v, o, gate_up, down;
};

class Net {
 public:
  Net(const Weights& w, Communicator* tp)
      : w_(&w), c_(&w.config()), s_{w.device(), nullptr}, tp_(tp) {}

  // Points at new weights of the same shapes (the caller checked them).
  void set_weights(const Weights& w) {
    w_ = &w;
    c_ = &w.config();
  }

  // Packs every projection and the head, when matmuls run on AMX (the bf16 precision): the first
  // time into new memory, then (new values of the same shapes) into the same memory again.
  // Otherwise drops any packed copy, which would be stale.
  void pack_weights();

  // h_out = layer l (h_in). One code path for training, prefill and decode.
  void layer_forward(int64_t l, LayerActs& a, const Tensor& h_in, const Tensor& h_out,
                     const AttentionInputs& in) const;

  // On entry g.dh = dL/dh_out; on exit g.dh = dL/dh_in. Parameter gradients accumulate into gw.
  void layer_backward(int64_t l, const LayerActs& a, const Tensor& h_in, const AttentionInputs& in,
                      LayerGrads& g, const LayerWeights& gw) const;

  // xf = final rmsnorm(h), logits = xf · lm_head^T. Row-wise, so B gathered rows give the same
  // bits as the same rows of a packed batch.
  void head(const Tensor& h, const Tensor& xf, const Tensor& rstdf, const Tensor& logits) const;

  // Tensor parallel: t (T, C) f32 = the sum of the group's t, rank 0's part plus rank 1's and so
  // on (all-gathered into parts, at least tp T C f32), never the library's all-reduce: a ring adds
  // an element's parts in an order set by its place in the buffer, so the engine's few decode rows
  // and the trainer's many packed rows would get other bits from 3 ranks on. The forward's two
  // sums a layer go this way; backward's all-reduce (gradients, no logprob reads them).
  void tp_sum(const Tensor& t, const Tensor& parts) const;

  float scale() const { return 1.0f / std::sqrt(static_cast<float>(c_->head_dim)); }
  const Stream& stream() const { return s_; }
  Communicator* tp() const { return tp_; }

 private:
  // y [+]= x · w^T, from w's packed copy when there is one and matmuls still run on AMX (the
  // same bits either way).
  void linear(const Tensor& x, const Tensor& w, const ops::PackedWeight* packed, const Tensor& y,
              bool accumulate) const;

  const Weights* w_;
  const ModelConfig* c_;
  Stream s_;
  std::vector<PackedLayer> packed_;  // empty: not packed
  ops::PackedWeight packed_head_;
  Communicator* tp_;  // the tensor-parallel group, or null
};

}  // namespace tandem::model::detail
