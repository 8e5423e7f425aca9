// Tensor parallelism of the decoder (the Megatron split): which heads, MLP columns and vocabulary
// rows rank r of a group of tp holds, the config of such a shard, and cutting a shard from full
// weights (see docs/model-decoder.md, "Tensor-parallel shards").
//
// Rank r of tp holds, per layer: query heads [r H/tp, (r + 1) H/tp) (rows of q_proj and
// columns of o_proj), its KV heads (rows of k_proj and v_proj: Hkv/tp heads from r Hkv/tp, or
// with Hkv < tp the one head r Hkv / tp, replicated on tp / Hkv ranks), MLP columns
// [r F/tp, (r + 1) F/tp) (rows of gate_proj and up_proj, columns of down_proj), and vocabulary
// rows [r V/tp, (r + 1) V/tp) of embed_tokens and lm_head. Norms are replicated. A shard is a
// model::Weights whose config (tp_shard_config) has those sizes, fused storage kept: its qkv
// holds its q heads, then its k heads, then its v heads.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "model/config.h"
#include "model/weights.h"

namespace tandem::model {

struct TpSplit {
  int rank = 0, size = 1;
  int64_t q_head0 = 0, num_q_heads = 0;    // query heads [q_head0, q_head0 + num_q_heads)
  int64_t kv_head0 = 0, num_kv_heads = 0;  // KV heads held (1 when replicated)
  bool kv_replicated = false;              // Hkv < tp: each KV head on tp / Hkv ranks
  int64_t f0 = 0, num_f = 0;               // MLP columns [f0, f0 + num_f)
  int64_t vocab0 = 0, num_vocab = 0;       // vocabulary rows [vocab0, vocab0 + num_vocab)
};

// Rank `rank` of `size`'s part of a model. Throws tandem::Error naming the parameter and the
// sizes when size does not divide num_attention_heads, intermediate_size or vocab_size, or
// divides neither num_key_value_heads nor is a multiple of it, and listing the sizes that fit.
TpSplit tp_split(const ModelConfig& full, int rank, int size);
// The config a shard's Weights are allocated with: H/tp heads, the KV heads held, F/tp, V/tp,
// the rest as in full (head_dim and hidden_size unchanged).
ModelConfig tp_shard_config(const ModelConfig& full, int size);

// Where a parameter of the full model is cut for one rank (what a weight-sync Layout of a
// tensor-parallel engine says per HF name): the whole tensor (dim -1: replicated), or elements
// [begin, begin + length) along dim 0 (rows) or dim 1 (columns) of the full tensor. The rank's
// tensor of that name (in a Weights of tp_shard_config) is exactly that block.
struct TpSlice {
  int dim = -1;
  int64_t begin = 0, length = 0;  // along dim; replicated: 0 and the full size of dim 0
};
// The slice of the parameter with HF name `name` (a name of Weights::named()) for split's rank.
// Throws naming the parameter when the name is not one of the model's.
TpSlice tp_slice(const ModelConfig& full, const TpSplit& split, std::string_view name);

// The collectives over the TP group of one training forward and backward (model::Decoder with
// DecoderOptions::tp_group) of a micro-batch of T packed rows, R of them through the head (R = T
// when the batch lists no head rows), all f32; bytes as CallStats counts them (an all-reduce's
// tensor, an all-gather's output: tp times a rank's part). All-reduces, in place: the embedding's
// rows (T, C); in backward per layer the MLP columns' and the heads' input gradients (T, C) (the
// heads' with the q/k norm weights' parts, 2 D, under qk_norm), and the head's input gradient
// (R, C). All-gathers: per layer forward the heads' and the MLP columns' outputs, tp (T, C) each
// (added in rank order: Net::tp_sum), recompute running them again; the vocabulary-parallel row
// statistics, maxima tp (R) then sums tp (R, 4) (model::vocab_parallel_logprob). The same on every
// rank; `config` the full model's or a shard's (C, L, D and qk_norm are both's).
struct TpCollectives {
  int64_t reduce_calls = 0, reduce_bytes = 0;
  int64_t gather_calls = 0, gather_bytes = 0;
};
TpCollectives tp_training_collectives(const ModelConfig& config, int64_t T, int64_t R, int tp,
                                      bool recompute);

// New Weights holding rank `rank` of `size`'s shard of `full` (same dtype and device), copied
// slice by slice (tp_slice).
std::unique_ptr<Weights> cut_tp_shard(const Weights& full, int rank, int size);

}  // namespace tandem::model
