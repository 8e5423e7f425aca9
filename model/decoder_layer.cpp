// Decoder network (model/decoder_internal.h): one layer forward, its backward mirroring it, the
// head, and the projections packed for AMX, each a straight run of kernels/ops.h calls.
#include "model/decoder_internal.h"

namespace tandem::model::detail {

void Net::pack_weights() {
  if (!w_->device().is_cpu() || !ops::matmul_packs_weights()) {
    packed_.clear();
    packed_head_ = ops::PackedWeight();
    return;
  }
  packed_.resize(w_->layers.size());
  for (size_t l = 0; l < packed_.size(); ++l) {
    const LayerWeights& w = w_->layers[l];
    PackedLayer& p = packed_[l];
    p.q.pack(w.q);
    p.k.pack(w.k);
    p.v.pack(w.v);
    p.o.pack(w.o);
    p.gate_up.pack(w.gate_up);
    p.down.pack(w.down);
  }
  if (w_->lm_head.defined())
    packed_head_.pack(w_->lm_head);
  else
    packed_head_ = ops::PackedWeight();  // a pipeline stage without the head
}

void Net::layer_forward(int64_t l, LayerActs& a, const Tensor& h_in, const Tensor& h_out,
                        const AttentionInputs& in) const {
  const LayerWeights& w = w_->layers[static_cast<size_t>(l)];
  const int64_t T = h_in.size(0), H = c_->num_heads, Hkv = c_->num_kv_heads, D = c_->head_dim;
  const float eps = c_->rms_norm_eps;
  ops::rmsnorm(h_in, w.input_norm, a.x1, a.rstd1, eps, s_);
  // Projections: q and k straight into the attention inputs unless a q/k norm comes first.
  const Tensor q_lin = c_->qk_norm ? a.q_raw : a.q.view({T, H * D});
  const Tensor k_lin = c_->qk_norm ? a.k_raw : a.k.view({T, Hkv * D});
  const Tensor v_lin = a.v.view({T, Hkv * D});
  const PackedLayer* p = packed_.empty() ? nullptr : &packed_[static_cast<size_t>(l)];
  linear(a.x1, w.q, p ? &p->q : nullptr, q_lin, false);
  linear(a.x1, w.k, p ? &p->k : nullptr, k_lin, false);
  linear(a.x1, w.v, p ? &p->v : nullptr, v_lin, false);
  if (c_->attention_bias) {
    // y += ones (T, 1) · bias (N, 1)^T: a bias add with the ops at hand, on any device.
    ops::matmul(in.ones, w.q_bias.view({H * D, 1}), q_lin, true, s_);
    ops::matmul(in.ones, w.k_bias.view({Hkv * D, 1}), k_lin, true, s_);
    ops::matmul(in.ones, w.v_bias.view({Hkv * D, 1}), v_lin, true, s_);
  }
  if (c_->qk_norm) {
    ops::rmsnorm(a.q_raw.view({T * H, D}), w.q_norm, a.q.view({T * H, D}), a.rstd_q, eps, s_);
    ops::rmsnorm(a.k_raw.view({T * Hkv, D}), w.k_norm, a.k.view({T * Hkv, D}), a.rstd_k, eps, s_);
  }
  ops::rope(a.q, in.positions, a.q, c_->rope, s_);
  ops::rope(a.k, in.positions, a.k, c_->rope, s_);
  if (in.kv != nullptr) {
    ops::kv_cache_write(a.k, a.v, in.kv->slot_mapping, in.kv->k_cache[static_cast<size_t>(l)],
                        in.kv->v_cache[static_cast<size_t>(l)], s_);
  }
  if (in.indptr.defined()) {
    ops::paged_attention_decode(a.q, in.kv->k_cache[static_cast<size_t>(l)],
                                in.kv->v_cache[static_cast<size_t>(l)], in.indptr, in.indices,
                                in.last_len, a.att, scale(), s_);
  } else {
    ops::attention(a.q, a.k, a.v, in.cu_seqlens, in.prefix, a.att, a.lse, scale(), s_);
  }
  linear(a.att.view({T, H * D}), w.o, p ? &p->o : nullptr, a.o_out, false);
  if (tp_ != nullptr) tp_sum(a.o_out, in.tp_parts);  // the TP group's heads: (T, C) f32
  ops::add_rmsnorm(h_in, a.o_out, w.post_norm, a.h_mid, a.x2, a.rstd2, eps, s_);
  linear(a.x2, w.gate_up, p ? &p->gate_up : nullptr, a.gate_up, false);
  ops::swiglu(a.gate_up, a.act, s_);
  if (tp_ == nullptr) {
    Tensor(h_out).copy_from(a.h_mid);
    linear(a.act, w.down, p ? &p->down : nullptr, h_out, true);
    return;
  }
  // The group's MLP columns summed into o_out (free again: backward does not read it), then
  // h_out = h_mid + it (one f32 add, as add_rmsnorm's; x2 and rstd2 stay for backward).
  linear(a.act, w.down, p ? &p->down : nullptr, a.o_out, false);
  tp_sum(a.o_out, in.tp_parts);  // the TP group's MLP columns: (T, C) f32
  Tensor(h_out).copy_from(a.h_mid);
  ops::add(a.o_out, h_out, s_);
}

void Net::tp_sum(const Tensor& t, const Tensor& parts) const {
  const int tp = tp_->size();
  const int64_t n = t.numel();
  TANDEM_CHECK(t.dtype() == DType::f32 && parts.dtype() == DType::f32 && parts.numel() >= tp * n,
               "tensor-parallel sum: {} needs {} f32 of gather space, got {}", t.str(), tp * n,
               parts.str());
  const Tensor all = parts.view({parts.numel()}).narrow(0, tp * n);
  tp_->all_gather(t.view({n}), all);  // tp x (T, C) f32
  Tensor(t).copy_from(all.narrow(0, n).view(t.shape()));
  for (int r = 1; r < tp; ++r) ops::add(all.narrow(r * n, n).view(t.shape()), t, s_);
}

void Net::layer_backward(int64_t l, const LayerActs& a, const Tensor& h_in,
                         const AttentionInputs& in, LayerGrads& g, const LayerWeights& gw) const {
  const LayerWeights& w = w_->layers[static_cast<size_t>(l)];
  const int64_t T = h_in.size(0), H = c_->num_heads, Hkv = c_->num_kv_heads, D = c_->head_dim;
  // MLP branch.
  ops::matmul_backward_input(g.dh, w.down, g.d_act, false, s_);
  ops::matmul_backward_weight(g.dh, a.act, gw.down, true, s_);
  ops::swiglu_backward(g.d_act, a.gate_up, g.d_gu, s_);
  ops::matmul_backward_input(g.d_gu, w.gate_up, g.dx, false, s_);
  // Tensor parallel: each rank's F columns give a part of d x2.
  if (tp_ != nullptr) tp_->all_reduce(g.dx);  // the TP group's MLP columns: (T, C) f32 summed
  ops::matmul_backward_weight(g.d_gu, a.x2, gw.gate_up, true, s_);
  ops::rmsnorm_backward(g.dx, a.h_mid, w.post_norm, a.rstd2, g.dh, gw.post_norm, true, true, s_);
  // Attention branch (g.dh is now dL/dh_mid).
  ops::matmul_backward_input(g.dh, w.o, g.d_att, false, s_);
  ops::matmul_backward_weight(g.dh, a.att.view({T, H * D}), gw.o, true, s_);
  ops::attention_backward(g.d_att.view({T, H, D}), a.q, a.k, a.v, a.att, a.lse, in.cu_seqlens,
                          in.prefix, g.dq, g.dk, g.dv, scale(), s_);
  ops::rope_backward(g.dq, in.positions, g.dq, c_->rope, s_);
  ops::rope_backward(g.dk, in.positions, g.dk, c_->rope, s_);
  Tensor dq_lin = g.dq.view({T, H * D}), dk_lin = g.dk.view({T, Hkv * D});
  const Tensor dv_lin = g.dv.view({T, Hkv * D});
  // The q/k norm weights serve every head: under tensor parallelism this rank's heads give a
  // part of their gradient, written to g.d_qk_norm and summed with dx below.
  const bool qk_norm_parts = c_->qk_norm && tp_ != nullptr;
  if (c_->qk_norm) {
    const Tensor dq_norm = qk_norm_parts ? g.d_qk_norm.narrow(0, D) : gw.q_norm;
    const Tensor dk_norm = qk_norm_parts ? g.d_qk_norm.narrow(D, D) : gw.k_norm;
    ops::rmsnorm_backward(g.dq.view({T * H, D}), a.q_raw.view({T * H, D}), w.q_norm, a.rstd_q,
                          g.dq_raw.view({T * H, D}), dq_norm, false, !qk_norm_parts, s_);
    ops::rmsnorm_backward(g.dk.view({T * Hkv, D}), a.k_raw.view({T * Hkv, D}), w.k_norm, a.rstd_k,
                          g.dk_raw.view({T * Hkv, D}), dk_norm, false, !qk_norm_parts, s_);
    dq_lin = g.dq_raw;
    dk_lin = g.dk_raw;
  }
  if (c_->attention_bias) {
    // dbias (N, 1) += dy^T · ones: the column sums of dy.
    ops::matmul_backward_weight(dq_lin, in.ones, gw.q_bias.view({H * D, 1}), true, s_);
    ops::matmul_backward_weight(dk_lin, in.ones, gw.k_bias.view({Hkv * D, 1}), true, s_);
    ops::matmul_backward_weight(dv_lin, in.ones, gw.v_bias.view({Hkv * D, 1}), true, s_);
  }
  ops::matmul_backward_weight(dq_lin, a.x1, gw.q, true, s_);
  ops::matmul_backward_weight(dk_lin, a.x1, gw.k, true, s_);
  ops::matmul_backward_weight(dv_lin, a.x1, gw.v, true, s_);
  ops::matmul_backward_input(dq_lin, w.q, g.dx, false, s_);
  ops::matmul_backward_input(dk_lin, w.k, g.dx, true, s_);
  ops::matmul_backward_input(dv_lin, w.v, g.dx, true, s_);
  if (qk_norm_parts) {
    // dx and the q/k norm weights' parts lie end to end in g.dx_qk_norm: one call for both.
    tp_->all_reduce(g.dx_qk_norm);  // the TP group's heads: (T C + 2 D) f32 summed
    ops::add(g.d_qk_norm.narrow(0, D), gw.q_norm, s_);
    ops::add(g.d_qk_norm.narrow(D, D), gw.k_norm, s_);
  } else if (tp_ != nullptr) {
    tp_->all_reduce(g.dx);  // the TP group's heads: (T, C) f32 summed
  }
  ops::rmsnorm_backward(g.dx, h_in, w.input_norm, a.rstd1, g.dh, gw.input_norm, true, true, s_);
}

void Net::head(const Tensor& h, const Tensor& xf, const Tensor& rstdf, const Tensor& logits) const {
  ops::rmsnorm(h, w_->final_norm, xf, rstdf, c_->rms_norm_eps, s_);
  linear(xf, w_->lm_head, packed_head_.empty() ? nullptr : &packed_head_, logits, false);
}

void Net::linear(const Tensor& x, const Tensor& w, const ops::PackedWeight* packed, const Tensor& y,
                 bool accumulate) const {
  if (packed != nullptr && ops::matmul_packs_weights())
    ops::matmul(x, *packed, y, accumulate);
  else
    ops::matmul(x, w, y, accumulate, s_);
}

}  // namespace tandem::model::detail
