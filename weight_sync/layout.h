// Layout: for every parameter (storage name, global shape, dtype), which elements each rank of a
// group holds and where they sit in that rank's local tensor: replicated, the trainer's ZeRO
// ranges, the trainer's data × tensor × pipeline parallel grid, or tensor-parallel shards (fused
// q/k/v and gate/up, row-split o and down, the vocabulary split). A layout is a value: built once
// from the placement, printed, compared, planned over.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::model {
class ShardLayout;
}

namespace tandem::weight_sync {

// One parameter as both sides of a sync name it: the storage tensors of model::Weights (fused
// "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight", the rest under their HF names).
struct ParamSpec {
  std::string name;
  Shape shape;  // global
  DType dtype;
};

// Elements [global, global + length) of the flattened parameter, at [local, local + length) of the
// rank's local tensor (flattened).
struct Run {
  int64_t global = 0, length = 0, local = 0;
};

// One rank's part of one parameter. A rank that holds none of it has no runs and numel 0.
struct Shard {
  Shape shape{0};         // the rank's local tensor (e.g. (V / tp, C)); numel() elements
  std::vector<Run> runs;  // ascending `global`, disjoint, inside the parameter and the local tensor
  int64_t held() const;   // elements the runs cover
};

// The model dimensions a tensor-parallel split needs (from model::ModelConfig; the split itself is
// model/tensor_parallel.h's).
struct TpDims {
  int64_t heads = 0;         // H
  int64_t kv_heads = 0;      // Hkv
  int64_t head_dim = 0;      // D
  int64_t intermediate = 0;  // F
  int64_t vocab = 0;         // V
};

// Layers [first, end) of one pipeline stage (trainer::stage_layers gives the trainer's).
struct LayerRange {
  int64_t first = 0, end = 0;
};

class Layout {
 public:
  // Every parameter held by no rank yet; fill with set_shard.
  Layout(std::string name, int world, std::vector<ParamSpec> params);

  // Every rank holds every parameter whole (a data-parallel trainer after its all-gather, or
  // rollout engines without tensor parallelism).
  static Layout replicated(std::vector<ParamSpec> params, int world);
  // The ZeRO split of a data-parallel trainer (model::ShardLayout, the one the optimizer and the
  // checkpoint use): `params` are the storage tensors in storage order, `shards` their units over
  // its ranks; rank r owns, of each unit u, the flat elements shards.range(u, r). full_tensors: a
  // rank's local tensor of a parameter is the whole parameter (ZeRO-1/2: every rank keeps whole
  // parameters and owns ranges of them). Else (ZeRO-3) it is the rank's local buffer itself
  // (shards.local_size() elements, unit u's piece at units()[u].local): the parameter's run sits
  // where its elements lie in that buffer, so every parameter binds to the same buffer
  // (bind_local) and nothing is copied out of it. Throws tandem::Error naming the parameter when
  // the parameters are not the layout's storage tensors.
  static Layout zero(std::vector<ParamSpec> params, const model::ShardLayout& shards,
                     bool full_tensors = true);
  // `replicas` engines of `tp` ranks each, replica k being ranks [k tp, (k + 1) tp), tensor
  // parallel in the Megatron split: qkv_proj (weight and bias) by heads, rank t holding its H/tp
  // query heads, then its key heads, then its value heads (a key/value head replicated over
  // tp/Hkv ranks when Hkv < tp); gate_up_proj by rows, rank t holding its F/tp gate rows then its
  // up rows; o_proj and down_proj by columns (their input dimension); embed_tokens and lm_head by
  // vocabulary rows; everything else (norms) replicated. The ranges are model::tp_split's and
  // model::tp_slice's (model/tensor_parallel.h, the decoder's own split), laid out in the fused
  // storage tensors. Throws tandem::Error naming the parameter and the sizes when tp does not
  // divide them (model::tp_split's rule), before anything else.
  static Layout tensor_parallel(const TpDims& dims, std::vector<ParamSpec> params, int tp,
                                int replicas);

  // A trainer whose tp · dp · pp ranks form a data × tensor × pipeline parallel grid in
  // trainer::ParallelGrid's order: rank (s dp + d) tp + t is tensor-parallel rank t of stage s in
  // data-parallel replica d. Stage s (of stages.size()) holds the parameters of layers stages[s]
  // ("model.layers.<i>.*"), the first stage also the embedding, the last the rest (final norm,
  // lm_head); with tied embeddings (no "lm_head.weight" among params) the last stage also holds
  // "model.embed_tokens.weight" as its head, so both stages hold that parameter. Of each
  // parameter its stage holds, tensor-parallel rank t's local tensor is its shard as in
  // tensor_parallel (the same split, computed by the same code), and every data-parallel replica
  // holds the same (parameters whole within the DP group: trainer.shard = optimizer or
  // gradients). Throws tandem::Error naming the stage or parameter when the stages are not
  // contiguous non-empty ranges covering the parameters' layers from 0, and as tensor_parallel
  // when tp does not divide the model.
  static Layout grid(const TpDims& dims, std::vector<ParamSpec> params, int tp, int dp,
                     std::span<const LayerRange> stages);
  // As grid, with the parameters sharded within each data-parallel group (trainer.shard =
  // parameters: ZeRO-3 of the tensor-parallel shards). Position (s, t)'s flat shard is the local
  // tensors grid gives it (the parameters stage s holds, in params' order, each its
  // tensor-parallel shard), flattened one after the other; shards[s tp + t] is its
  // model::ShardLayout over the dp ranks (built from those tensors' names and element counts),
  // and data-parallel rank d's local tensor of each parameter is its local buffer
  // (local_size() elements), the parameter's runs where its elements lie in it, as zero without
  // full tensors (bind_local). dp is the shard layouts' world. Throws tandem::Error naming the
  // position and tensor when a shard layout's tensors are not that position's, and as grid.
  static Layout grid_zero(const TpDims& dims, std::vector<ParamSpec> params, int tp,
                          std::span<const LayerRange> stages,
                          std::span<const model::ShardLayout> shards);

  // The same layout on ranks [first, first + world()) of a world of `world` ranks (e.g. rollout
  // engines after the trainer's ranks); the other ranks hold nothing.
  Layout placed(int first, int world) const;
  // The same parameters in another dtype (e.g. the engines' bf16 copy of an f32 layout).
  Layout with_dtype(DType dtype) const;

  // Checks a rank's runs (ascending, disjoint, inside the parameter and the local shape) and sets
  // them. Throws tandem::Error naming the parameter and the rank.
  void set_shard(size_t param, int rank, Shard shard);

  const std::string& name() const { return name_; }
  int world() const { return world_; }
  std::span<const ParamSpec> params() const { return params_; }
  const Shard& shard(size_t param, int rank) const;
  // Elements of all parameters a rank holds.
  int64_t held(int rank) const;
  // One line per parameter and rank: the runs (merged where consecutive), for logs and tests.
  std::string describe() const;

 private:
  std::string name_;
  int world_ = 0;
  std::vector<ParamSpec> params_;
  std::vector<std::vector<Shard>> shards_;  // [param][rank]
};

}  // namespace tandem::weight_sync
