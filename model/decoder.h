// Decoder: the Llama / Qwen2 / Qwen3 network over packed sequences: training forward and
// backward, and inference prefill and decode against a paged KV cache, all from one set of
// per-layer functions built only on kernels/ops.h (see docs/model-decoder.md).
//
// Shapes use the letters of STYLE.md: T packed tokens, B sequences, C width, H query heads,
// Hkv key/value heads, D head size, F MLP width, V vocabulary, L layers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/arena.h"
#include "core/comm.h"
#include "core/device.h"
#include "core/tensor.h"
#include "model/unit_hooks.h"
#include "model/weights.h"

namespace tandem::model {

// A training batch on the host: sequences laid end to end, no padding.
//   tokens (T): the input token ids; positions (T): 0, 1, ... within each sequence;
//   cu_seqlens (B + 1): start of each sequence in T, T at the end;
//   targets (T): the token each position predicts, in [0, V).
// Every row has a target: a sequence of n tokens contributes its first n - 1 tokens as inputs
// and its last n - 1 tokens as targets (the last token predicts nothing and is left out).
// So the logprob of row cu_seqlens[b] + j is log p(seq[j + 1] | seq[0..j]): the logprob of a
// completion token given the prompt and the completion before it.
struct PackedBatch {
  std::vector<int32_t> tokens;      // (T)
  std::vector<int32_t> positions;   // (T)
  std::vector<int32_t> cu_seqlens;  // (B + 1)
  std::vector<int32_t> targets;     // (T)
  // The rows whose logprob is wanted, increasing (a policy loss needs the completion's rows
  // only); empty: every row. The head (final norm, lm_head, log-softmax) runs on these rows
  // alone: the forward's logprob and entropy are 0 elsewhere and backward ignores dlogprob and
  // dentropy there. A row's values do not depend on which other rows are selected.
  std::vector<int32_t> head_rows;
  // Shared prefixes (kernels/ops.h's attention): empty, or (B) with prefix[b] = -1 or the index
  // of another sequence, without a prefix of its own, whose tokens all come before sequence b's
  // (b's positions continue from its prefix's last one). A GRPO group packs its prompt once and
  // each completion as a sequence prefixed by it; every row gets the bits it would get with the
  // prompt packed in front of each completion. CPU only for now.
  std::vector<int32_t> prefix;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_sequences() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  // Row of sequence b whose target is seq_b[j] (1 <= j < n_b): cu_seqlens[b] + j - 1.
  int64_t row_of(int64_t b, int64_t j) const { return cu_seqlens[static_cast<size_t>(b)] + j - 1; }

  // Packs whole sequences (each at least 2 tokens; throws naming the sequence otherwise).
  static PackedBatch from_sequences(std::span<const std::vector<int32_t>> sequences);
  // Packs prompt + completion pairs for training (prompt and completion at least 1 token each;
  // throws naming the pair otherwise), with head_rows = the rows whose targets are the
  // completions' tokens, pair after pair (pair i's token k is head_rows[completion tokens of the
  // pairs before i + k]). With share_prompts, a run of two or more consecutive pairs with the same
  // prompt of n >= 2 tokens packs the prompt's first n - 1 tokens once, as a prefix sequence, and
  // each pair as the prompt's last token and its completion but the last token, prefixed by it;
  // otherwise (and for the other pairs) each pair is one sequence, prompt then completion.
  struct PromptCompletion {
    std::span<const int32_t> prompt, completion;
  };
  static PackedBatch from_prompts(std::span<const PromptCompletion> pairs, bool share_prompts);
  // The rows `pair` adds to a from_prompts batch right after `previous` (null: it comes first):
  // its completion's when it continues previous's prompt, else prompt + completion - 1.
  static int64_t rows_added(const PromptCompletion& pair, const PromptCompletion* previous,
                            bool share_prompts);
};

struct DecoderOptions {
  int64_t max_tokens = 4096;  // T the activation arena is planned for up front
  // Keep only each layer's input for backward and recompute the layer's internals there
  // (bitwise the same gradients; about L times less activation memory).
  bool recompute = false;
  // A batch larger than max_tokens: re-plan the arena for it (true; addresses change) or throw.
  bool grow = true;
  // Rows the head runs at once in score(): its logits take score_rows V floats.
  int64_t score_rows = 256;
  // When matmuls run on AMX (the bf16 CPU precision, ops::matmul_packs_weights()), pack
  // the projection and head weights once here (bf16 tiles, half the f32 weights' bytes) rather
  // than in every matmul: for callers whose weights change only through set_weights (the
  // rollout engine), which packs them again in place. Same bits either way.
  bool pack_weights = false;
  // Tensor parallelism: the weights are rank tp_group->rank()'s shard of tp_group->size()
  // (model/tensor_parallel.h). Every rank of the group makes the same calls (prefill and decode;
  // forward, backward and score, on the CPU for now) with the same arguments; each runs its
  // heads, MLP columns and vocabulary rows, and the partial outputs meet in collectives (the
  // embedding's all-reduce of (T, C) f32; o_proj's and down_proj's all-gathers of tp (T, C),
  // added in rank order; training adds the head's and the backward's, docs/model-decoder.md).
  // Prefill and decode return the logits of the rank's vocabulary rows, (B, V/tp): the sampler
  // works on the shards (model/tp_sample.h); forward and score return the logprobs and entropies
  // over the whole vocabulary on every rank; backward adds to grads the gradient of the rank's
  // shard (replicated norms: the whole gradient, the same on every rank). Null, or a group of one
  // rank: the whole model, no collective.
  Communicator* tp_group = nullptr;
  // Tensor-parallel training of a shard that holds a single KV head: the model's
  // num_key_value_heads (Hkv), which the shard's shapes do not tell. Hkv = tp (each rank its own
  // head) trains; Hkv < tp (a head replicated on tp / Hkv ranks, which prefill and decode serve)
  // is refused, as backward does not sum those ranks' k/v gradients. 0: not given, and forward
  // refuses such a shard asking for it; otherwise checked against the shard.
  int64_t tp_kv_heads = 0;
  // Sharded training (forward and backward, and the stage calls, only): see UnitHooks. Null:
  // whole weights.
  UnitHooks* unit_hooks = nullptr;
  // Pipeline stages (forward_stage, backward_stage): the micro-batches whose activations the
  // decoder holds at once, each in an arena of its own planned for max_tokens. 1F1B keeps at most
  // P - s in flight on stage s of P.
  int64_t pipeline_slots = 1;
};

// The paged KV cache of one step, in kernels/ops.h's conventions (FlashInfer's CSR layout).
// Tensors live on the decoder's device; index arrays are i32.
struct KvCacheView {
  std::vector<Tensor> k_cache, v_cache;  // per layer, f32 or bf16, in kernels/ops.h's layouts
  // The B sequences' blocks AFTER this step's tokens are written: kv_indptr (B + 1),
  // kv_indices (kv_indptr[B]), kv_last_len (B) in 1..P.
  Tensor kv_indptr, kv_indices, kv_last_len;
  Tensor slot_mapping;  // (T): the cache slot (block * P + offset) of each of this step's tokens
};

class Decoder {
 public:
  // Keeps a reference to weights (which must outlive the decoder) and reserves the activation
  // arena (ArenaClass::activations) on the weights' device for options.max_tokens tokens.
  Decoder(const Weights& weights, const DecoderOptions& options = {});
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // The weights' config: a shard's under tensor parallelism (DecoderOptions::tp_group); the whole
  // model's over a part's weights (num_layers counts every layer).
  const ModelConfig& config() const { return weights_->config(); }
  Device device() const { return weights_->device(); }
  // V of the whole model: the range of the token ids (the logits hold config().vocab_size of
  // them: V/tp under tensor parallelism).
  int64_t vocab_size() const;
  // Points the decoder at new weights of the same config and device (a weight sync; they
  // must outlive the decoder): the activation arena stays, and packed copies
  // (DecoderOptions::pack_weights) are packed again into the memory they hold. Drops a pending
  // forward's state.
  void set_weights(const Weights& weights);
  // Bytes of the activation arenas (as planned for max_tokens: one per pipeline slot).
  size_t activation_bytes() const;
  // Gives the activation arenas back to the device (a colocated job's other phase wants the
  // memory) and drops a pending forward's state; the next call takes it again.
  void release_activations();
  // Bytes a training forward (or an inference call) of T tokens needs under these options: the
  // arena a decoder reserves for max_tokens = T. Tensor parallel: config is the shard's
  // (tp_shard_config, V/tp logits a row) and tp the group's size.
  static size_t plan_bytes(const ModelConfig& config, int64_t T, bool recompute, int tp = 1);

  // Training forward: logprob_out (T) f32 = log softmax(logits / temperature)[target],
  // entropy_out (T) f32 (or undefined: skipped) = the entropy of that distribution. Keeps what
  // backward needs until the next call of any method. Tensor parallel: over the whole vocabulary
  // (model::vocab_parallel_logprob), the same values on every rank, equal to the whole model's
  // but for f32 rounding (the sums are split by rank); refuses KV heads replicated over ranks
  // (DecoderOptions::tp_kv_heads).
  void forward(const PackedBatch& batch, const Tensor& logprob_out, const Tensor& entropy_out,
               float temperature = 1.0f);
  // Scoring forward: forward's logprob_out and entropy_out, the same bits (tensor parallel: the
  // same bits when its chunks are forward's rows, else but for the order of the sums over the
  // group), keeping nothing for backward. The layers run over the batch with one layer's
  // activations and the head over chunks of DecoderOptions::score_rows rows, so the arena grows
  // to about 4 (2 C + one layer's activations) bytes a token plus 4 score_rows (V + 2 C) bytes:
  // linear in T with a slope L times smaller than forward's, which keeps every layer's
  // activations and two (T, V) logit buffers for backward. A larger batch grows the arena to
  // this plan only (max_tokens is left as it is).
  void score(const PackedBatch& batch, const Tensor& logprob_out, const Tensor& entropy_out,
             float temperature = 1.0f);
  // logits_out (T, V) f32 of the batch (targets are not read); keeps nothing for backward. Not
  // under tensor parallelism.
  void forward_logits(const PackedBatch& batch, const Tensor& logits_out);
  // After forward: grads += d(sum_t dlogprob_t * logprob_t + dentropy_t * entropy_t)/dtheta.
  // dlogprob (T) f32, dentropy (T) f32 or undefined. grads: f32 Weights of the same config on the
  // same device (ArenaClass::gradients); with tied embeddings grads.embed gets both the lm_head
  // and the embedding contributions. Consumes the forward's state (a second backward throws).
  // Tensor parallel: grads is the rank's shard (tp_shard_config) and gets the shard's part of the
  // whole model's gradient (its vocabulary rows of the embedding and lm_head, its heads and MLP
  // columns), as model::cut_tp_shard would cut it, but for f32 rounding.
  void backward(const Tensor& dlogprob, const Tensor& dentropy, Weights& grads);

  // Pipeline stages. A decoder over a part's weights (model::ModelPart: layers [l0, l1), the
  // embedding on the first stage, the final norm and lm_head on the last) runs that stage of the
  // training forward and backward; the hidden states (T, C) f32 cross the stage boundaries. Every
  // stage gets the whole micro-batch (tokens and positions for its attention; targets and
  // head_rows are read by the last stage only). `micro` names the micro-batch (any id >= 0): up
  // to DecoderOptions::pipeline_slots of them may be forwarded and not yet differentiated, of
  // different lengths, and backward_stage differentiates the one it names, in any order (1F1B:
  // forward m + 1 before backward m). The stages run in sequence give bitwise the whole model's
  // logprobs, entropies and gradients (with tied embeddings the last stage's lm_head gradient is
  // the head's part of the embedding's). The other calls (forward, score, ...) drop every
  // micro-batch in flight, and a stage call drops forward's state; a part's decoder runs the
  // stage calls only (with unit hooks: each stage call one UnitPass, forward or backward). A part
  // of a tensor-parallel shard (its weights cut from the shard's, DecoderOptions::tp_group set)
  // runs its stage on the shard as forward and backward do: the stages of one TP rank together give
  // that rank's TP gradients.
  //
  // A stage without the head: h_in (T, C) the previous stage's output (undefined on the first
  // stage: the batch's tokens are embedded); h_out (T, C) receives the stage's output. Both are
  // read or written during the call only.
  void forward_stage(int64_t micro, const PackedBatch& batch, const Tensor& h_in,
                     const Tensor& h_out);
  // The last stage (the head): forward's logprob_out and entropy_out of micro-batch `micro`.
  void forward_stage(int64_t micro, const PackedBatch& batch, const Tensor& h_in,
                     const Tensor& logprob_out, const Tensor& entropy_out, float temperature);
  // A stage without the head: dh_out (T, C) = dL/dh_out from the next stage; grads (f32 Weights
  // of the same part) += this stage's gradients; dh_in (T, C) receives dL/dh_in for the previous
  // stage (undefined on the first stage, whose embedding gradient is added instead). Frees the
  // micro-batch's slot.
  void backward_stage(int64_t micro, const Tensor& dh_out, Weights& grads, const Tensor& dh_in);
  // The last stage: backward's dlogprob and dentropy (T) of micro-batch `micro`.
  void backward_stage(int64_t micro, const Tensor& dlogprob, const Tensor& dentropy, Weights& grads,
                      const Tensor& dh_in);
  // Forgets micro-batch `micro`'s activations without a backward (a scoring pass through the
  // stages); nothing when it is not in flight.
  void drop_stage(int64_t micro);

  // Inference. Host token ids and positions; cache and outputs on the decoder's device.
  // Prefill: writes K/V of every token (T) into kv.slot_mapping and returns logits_out (B, V)
  // of the last token of each sequence (tensor parallel: (B, V/tp), the rank's vocabulary rows
  // [rank V/tp, (rank + 1) V/tp)). A sequence whose first position is 0 is fresh (its
  // cache holds only this chunk); otherwise its chunk continues a cached prefix (chunked prefill
  // or a shared prompt) and each of its tokens attends to the cached tokens before it.
  void prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
               std::span<const int32_t> cu_seqlens, const KvCacheView& kv,
               const Tensor& logits_out);
  // One new token per sequence: tokens (B), positions (B); logits_out (B, V) (or V/tp, as
  // prefill's).
  void decode(std::span<const int32_t> tokens, std::span<const int32_t> positions,
              const KvCacheView& kv, const Tensor& logits_out);

 private:
  // forward and forward_stage into pipeline slot `slot`: h_in / h_out undefined on the first /
  // last stage; logprob_out, entropy_out and temperature read on the last only.
  void train_forward(size_t slot, const PackedBatch& batch, const Tensor& h_in, const Tensor& h_out,
                     const Tensor& logprob_out, const Tensor& entropy_out, float temperature);
  // backward and backward_stage of slot `slot`'s micro-batch: dh_out on stages without the head,
  // dlogprob and dentropy on the last; dh_in undefined on the first.
  void train_backward(size_t slot, const Tensor& dlogprob, const Tensor& dentropy,
                      const Tensor& dh_out, Weights& grads, const Tensor& dh_in);

  struct Impl;
  const Weights* weights_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::model
