// Weights: every parameter of a decoder in one arena, with a table of views under their Hugging
// Face names. Loaders fill the views by name; the decoder reads the per-layer structs.
//
// Storage is fused where the math wants it: q, k and v projections are rows of one
// ((H + 2 Hkv) D, C) tensor (one matmul), gate and up projections rows of one (2F, C) tensor (the
// layout swiglu reads). The HF names are views into those. The same class holds gradients (f32,
// ArenaClass::gradients) with the same layout, so an optimizer can walk both tables in step.
//
// A table may hold a part of the model only (ModelPart: a pipeline stage's layers, with the
// embedding on the first stage and the head on the last), under the whole model's names.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "model/config.h"

namespace tandem::model {

struct NamedTensor {
  std::string name;  // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Tensor tensor;
};

struct LayerWeights {
  Tensor input_norm;              // (C)
  Tensor qkv;                     // ((H + 2 Hkv) D, C): q rows, then k rows, then v rows
  Tensor q, k, v;                 // views of qkv: (H D, C), (Hkv D, C), (Hkv D, C)
  Tensor qkv_bias;                // ((H + 2 Hkv) D) when config.attention_bias, else undefined
  Tensor q_bias, k_bias, v_bias;  // views of qkv_bias
  Tensor q_norm, k_norm;          // (D) when config.qk_norm, else undefined
  Tensor o;                       // (C, H D)
  Tensor post_norm;               // (C)
  Tensor gate_up;                 // (2F, C): gate rows, then up rows
  Tensor gate, up;                // views of gate_up: (F, C) each
  Tensor down;                    // (C, F)
};

// The piece of a model a table holds: layers [first_layer, first_layer + num_layers), the
// embedding (a pipeline's first stage) and the head (its last: the final norm and lm_head). With
// tied embeddings a part with the head but not the embedding holds its own copy of the embedding
// matrix as lm_head, under the embedding's name (Megatron's pipeline: the trainer sums the two
// copies' gradients).
struct ModelPart {
  int64_t first_layer = 0;
  int64_t num_layers = 0;
  bool embedding = false;
  bool head = false;

  // Every layer, the embedding and the head.
  static ModelPart whole(const ModelConfig& config);
  // A pipeline stage's part: layers [first, first + count) (trainer::stage_layers), the embedding
  // when they start at layer 0 and the head when they end at the last.
  static ModelPart stage(const ModelConfig& config, int64_t first, int64_t count);
  int64_t end_layer() const { return first_layer + num_layers; }
  bool is_whole(const ModelConfig& config) const { return *this == whole(config); }
  // Throws tandem::Error naming the field when the part is empty or outside the config's layers.
  void validate(const ModelConfig& config) const;
  // "layers 2..3 of 4 with the head", for messages.
  std::string str(const ModelConfig& config) const;
  bool operator==(const ModelPart&) const = default;
};

class Weights {
 public:
  // Allocates (uninitialised) every parameter the config describes, in dtype f32/bf16/f16.
  Weights(const ModelConfig& config, DType dtype, Device device = Device::cpu(),
          ArenaClass cls = ArenaClass::parameters);
  // Allocates the parameters of `part` only; the tensors of the rest stay undefined.
  Weights(const ModelConfig& config, const ModelPart& part, DType dtype,
          Device device = Device::cpu(), ArenaClass cls = ArenaClass::parameters);
  // A table without memory: every tensor undefined until bind() points a range of storage tensors
  // at memory the caller holds (a sharded trainer's gathered unit or gradient bucket).
  static std::unique_ptr<Weights> unbound(const ModelConfig& config, DType dtype,
                                          Device device = Device::cpu());
  static std::unique_ptr<Weights> unbound(const ModelConfig& config, const ModelPart& part,
                                          DType dtype, Device device = Device::cpu());
  Weights(const Weights&) = delete;
  Weights& operator=(const Weights&) = delete;

  // The whole model's config (num_layers counts every layer, held or not).
  const ModelConfig& config() const { return config_; }
  const ModelPart& part() const { return part_; }
  bool whole() const { return part_.is_whole(config_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  Tensor embed;                      // (V, C), when part().embedding
  std::vector<LayerWeights> layers;  // part().num_layers: layers[i] is layer first_layer + i
  Tensor final_norm;                 // (C), when part().head
  // (V, C), when part().head; the same tensor as embed when config.tie_word_embeddings and the
  // part holds both, a copy of the embedding matrix of its own when tied without the embedding.
  Tensor lm_head;

  // Every HF-named tensor the part holds, in a fixed order (the order of a HF checkpoint's state
  // dict), under the whole model's names ("model.layers.<first_layer + i>..."); lm_head.weight is
  // absent when tied (a tied head without the embedding is "model.embed_tokens.weight").
  std::span<const NamedTensor> named() const { return named_; }
  // The view with this HF name, or nullptr.
  const Tensor* find(std::string_view name) const;
  // The view with this HF name; throws tandem::Error naming it (and the part) when there is none.
  const Tensor& at(std::string_view name) const;
  // The fused tensors (qkv, qkv_bias, gate_up and the rest), each once, covering all storage:
  // what an optimizer or a copy walks.
  std::span<const NamedTensor> storage() const { return storage_; }

  // The shape of storage tensor i, bound or not.
  const Shape& storage_shape(size_t i) const { return shapes_[i]; }
  // Points storage tensors [first, end) at `flat` (contiguous, this dtype and device, at least
  // their elements one after the other), and every view of them; unbind() leaves them undefined.
  // An unbound table only.
  void bind(size_t first, size_t end, const Tensor& flat);
  void unbind(size_t first, size_t end);

  void zero();
  // Copies every tensor this table holds from other (same config; dtypes may differ: cast), which
  // holds the same part or any part including this one's (a stage's tensors from the whole
  // model's, by name); throws naming the first tensor other lacks.
  void copy_from(const Weights& other);
  size_t nbytes() const { return arena_->used(); }
  // The elements of the storage tensors the part holds (a tied head's copy counted again).
  int64_t num_parameters() const;

 private:
  struct Unbound {};
  Weights(const ModelConfig& config, const ModelPart& part, DType dtype, Device device, Unbound);
  // Builds the storage tensors (alloc(shape) for each, in storage order) and every view.
  template <class Alloc>
  void build(Alloc&& alloc);
  void rebuild_views();

  ModelConfig config_;
  ModelPart part_;
  DType dtype_;
  Device device_;
  std::unique_ptr<Arena> arena_;
  std::vector<NamedTensor> named_;
  std::vector<NamedTensor> storage_;
  std::unordered_map<std::string, size_t> index_;
  std::vector<Shape> shapes_;  // of storage_
};

// The uniform range init_random draws storage tensor `name` from (fan_in: a matrix's row length).
struct InitRange {
  double lo, hi;
};
InitRange init_range(std::string_view name, int64_t fan_in);

// Fills f32 CPU weights with a seeded random initialisation that keeps activations O(1) through
// any depth: norm weights uniform in [0.7, 1.3], biases in [-0.3, 0.3], matrices in
// ±1.7/sqrt(fan-in), embeddings in [-1, 1). The same seed gives the same weights on any machine
// (Philox: element i of storage tensor t is word i%4 of philox_random(seed, t, i/4), t numbered in
// the whole model's storage order, so a part gets the whole model's values of what it holds and a
// tied head's copy the embedding's). For a published shape without its trained weights: memory
// and speed work, never quality.
void init_random(Weights& w, uint64_t seed);

}  // namespace tandem::model
