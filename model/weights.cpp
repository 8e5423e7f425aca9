// Weights: one arena, fused storage, HF-named views.
#include "model/weights.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "kernels/ops.h"

namespace tandem::model {
namespace {

size_t padded_bytes(const Shape& s, DType dtype) {
  size_t n = static_cast<size_t>(s.numel()) * dtype_size(dtype);
  return (n + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
}

}  // namespace

ModelPart ModelPart::whole(const ModelConfig& config) { return {0, config.num_layers, true, true}; }

ModelPart ModelPart::stage(const ModelConfig& config, int64_t first, int64_t count) {
  return {first, count, first == 0, first + count == config.num_layers};
}

void ModelPart::validate(const ModelConfig& config) const {
  TANDEM_CHECK(first_layer >= 0 && num_layers >= 0 && end_layer() <= config.num_layers,
               "model part: layers [{}, {}) are not within the model's {} layers", first_layer,
               end_layer(), config.num_layers);
  TANDEM_CHECK(num_layers > 0 || embedding || head,
               "model part: holds nothing (no layer, no embedding, no head)");
}

std::string ModelPart::str(const ModelConfig& config) const {
  std::string s = num_layers == 0 ? std::string("no layers")
                                  : fmt::format("layers {}..{} of {}", first_layer, end_layer() - 1,
                                                config.num_layers);
  if (embedding) s += " with the embedding";
  if (head) s += embedding ? " and the head" : " with the head";
  return s;
}

Weights::Weights(const ModelConfig& config, DType dtype, Device device, ArenaClass cls)
    : Weights(config, ModelPart::whole(config), dtype, device, cls) {}

Weights::Weights(const ModelConfig& config, const ModelPart& part, DType dtype, Device device,
                 ArenaClass cls)
    : config_(config), part_(part), dtype_(dtype), device_(device) {
  config_.validate();
  part_.validate(config_);
  TANDEM_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
               "weights: dtype must be f32, bf16 or f16, got {}", dtype);
  // Plan the arena first (build() counting the bytes): one allocation for everything.
  size_t bytes = 0;
  build([&](const Shape& shape) {
    bytes += padded_bytes(shape, dtype);
    return Tensor();
  });
  arena_ = std::make_unique<Arena>(cls, device, bytes);
  build([&](const Shape& shape) { return arena_->alloc(shape, dtype); });
}

Weights::Weights(const ModelConfig& config, const ModelPart& part, DType dtype, Device device,
                 Unbound)
    : config_(config), part_(part), dtype_(dtype), device_(device) {
  config_.validate();
  part_.validate(config_);
  build([](const Shape&) { return Tensor(); });
}

std::unique_ptr<Weights> Weights::unbound(const ModelConfig& config, DType dtype, Device device) {
  return unbound(config, ModelPart::whole(config), dtype, device);
}

std::unique_ptr<Weights> Weights::unbound(const ModelConfig& config, const ModelPart& part,
                                          DType dtype, Device device) {
  return std::unique_ptr<Weights>(new Weights(config, part, dtype, device, Unbound{}));
}

void Weights::bind(size_t first, size_t end, const Tensor& flat) {
  TANDEM_CHECK(!arena_ && first <= end && end <= storage_.size(),
               "weights: bind() of storage tensors [{}, {}) needs an unbound table of {} tensors",
               first, end, storage_.size());
  int64_t need = 0;
  for (size_t i = first; i < end; ++i) need += shapes_[i].numel();
  TANDEM_CHECK(
      flat.defined() && flat.dtype() == dtype_ && flat.device() == device_ && flat.numel() >= need,
      "weights: bind() needs {} contiguous {} elements on {}, got {}", need, dtype_, device_.str(),
      flat.defined() ? flat.str() : std::string("an undefined tensor"));
  const Tensor whole = flat.view({flat.numel()});
  int64_t at = 0;
  for (size_t i = first; i < end; ++i) {
    storage_[i].tensor = whole.narrow(at, shapes_[i].numel()).view(shapes_[i]);
    at += shapes_[i].numel();
  }
  rebuild_views();
}

void Weights::unbind(size_t first, size_t end) {
  TANDEM_CHECK(!arena_ && first <= end && end <= storage_.size(),
               "weights: unbind() of storage tensors [{}, {}) needs an unbound table", first, end);
  for (size_t i = first; i < end; ++i) storage_[i].tensor = Tensor();
  rebuild_views();
}

void Weights::rebuild_views() {
  size_t next = 0;
  build([&](const Shape&) { return storage_[next++].tensor; });
}

template <class Alloc>
void Weights::build(Alloc&& alloc) {
  const ModelConfig& config = config_;
  const int64_t V = config.vocab_size, C = config.hidden_size, F = config.intermediate_size;
  const int64_t D = config.head_dim, H = config.num_heads, Hkv = config.num_kv_heads;
  const int64_t QKV = (H + 2 * Hkv) * D;
  std::vector<NamedTensor> storage;
  named_.clear();
  index_.clear();
  shapes_.clear();
  auto add_storage = [&](std::string name, const Shape& shape) {
    Tensor t = alloc(shape);
    storage.push_back({std::move(name), t});
    shapes_.push_back(shape);
    return t;
  };
  auto add_named = [&](std::string name, const Tensor& t) {
    index_.emplace(name, named_.size());
    named_.push_back({std::move(name), t});
  };
  // A view of a bound tensor (unbound: undefined).
  auto narrow = [](const Tensor& t, int64_t start, int64_t len) {
    return t.defined() ? t.narrow(start, len) : Tensor();
  };
  const ModelPart& part = part_;
  embed = Tensor();
  if (part.embedding) {
    embed = add_storage("model.embed_tokens.weight", {V, C});
    add_named("model.embed_tokens.weight", embed);
  }
  layers.assign(static_cast<size_t>(part.num_layers), LayerWeights{});
  for (int64_t i = 0; i < part.num_layers; ++i) {
    LayerWeights& w = layers[static_cast<size_t>(i)];
    const std::string p = hf_layer_prefix(part.first_layer + i);
    w.input_norm = add_storage(p + "input_layernorm.weight", {C});
    w.qkv = add_storage(p + "self_attn.qkv_proj.weight", {QKV, C});
    w.q = narrow(w.qkv, 0, H * D);
    w.k = narrow(w.qkv, H * D, Hkv * D);
    w.v = narrow(w.qkv, (H + Hkv) * D, Hkv * D);
    if (config.attention_bias) {
      w.qkv_bias = add_storage(p + "self_attn.qkv_proj.bias", {QKV});
      w.q_bias = narrow(w.qkv_bias, 0, H * D);
      w.k_bias = narrow(w.qkv_bias, H * D, Hkv * D);
      w.v_bias = narrow(w.qkv_bias, (H + Hkv) * D, Hkv * D);
    }
    if (config.qk_norm) {
      w.q_norm = add_storage(p + "self_attn.q_norm.weight", {D});
      w.k_norm = add_storage(p + "self_attn.k_norm.weight", {D});
    }
    w.o = add_storage(p + "self_attn.o_proj.weight", {C, H * D});
    w.post_norm = add_storage(p + "post_attention_layernorm.weight", {C});
    w.gate_up = add_storage(p + "mlp.gate_up_proj.weight", {2 * F, C});
    w.gate = narrow(w.gate_up, 0, F);
    w.up = narrow(w.gate_up, F, F);
    w.down = add_storage(p + "mlp.down_proj.weight", {C, F});

    // HF state-dict order within a layer.
    add_named(p + "input_layernorm.weight", w.input_norm);
    add_named(p + "self_attn.q_proj.weight", w.q);
    if (config.attention_bias) add_named(p + "self_attn.q_proj.bias", w.q_bias);
    add_named(p + "self_attn.k_proj.weight", w.k);
    if (config.attention_bias) add_named(p + "self_attn.k_proj.bias", w.k_bias);
    add_named(p + "self_attn.v_proj.weight", w.v);
    if (config.attention_bias) add_named(p + "self_attn.v_proj.bias", w.v_bias);
    add_named(p + "self_attn.o_proj.weight", w.o);
    if (config.qk_norm) {
      add_named(p + "self_attn.q_norm.weight", w.q_norm);
      add_named(p + "self_attn.k_norm.weight", w.k_norm);
    }
    add_named(p + "mlp.gate_proj.weight", w.gate);
    add_named(p + "mlp.up_proj.weight", w.up);
    add_named(p + "mlp.down_proj.weight", w.down);
    add_named(p + "post_attention_layernorm.weight", w.post_norm);
  }
  final_norm = lm_head = Tensor();
  if (part.head) {
    final_norm = add_storage("model.norm.weight", {C});
    add_named("model.norm.weight", final_norm);
    if (config.tie_word_embeddings && part.embedding) {
      lm_head = embed;
    } else {
      // Tied without the embedding: the head's own copy of the embedding matrix, by its name.
      const char* name =
          config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
      lm_head = add_storage(name, {V, C});
      add_named(name, lm_head);
    }
  }
  storage_ = std::move(storage);
}

const Tensor* Weights::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &named_[it->second].tensor;
}

const Tensor& Weights::at(std::string_view name) const {
  const Tensor* t = find(name);
  TANDEM_CHECK(t != nullptr, "weights: the {} model{} has no parameter named '{}'",
               architecture_name(config_.arch),
               whole() ? std::string() : fmt::format(" part ({})", part_.str(config_)), name);
  return *t;
}

void Weights::zero() {
  for (NamedTensor& s : storage_) s.tensor.zero();
}

void Weights::copy_from(const Weights& other) {
  const bool same_part = other.part_ == part_;
  TANDEM_CHECK((same_part && other.storage_.size() == storage_.size()) ||
                   (!same_part && other.config_.num_layers == config_.num_layers &&
                    other.config_.tie_word_embeddings == config_.tie_word_embeddings),
               "weights: copy between different models ({} and {} tensors, {} and {} layers)",
               other.storage_.size(), storage_.size(), other.config_.num_layers,
               config_.num_layers);
  // Another part: each of this table's storage tensors from other's of the same name.
  std::unordered_map<std::string_view, size_t> theirs;
  if (!same_part)
    for (size_t i = 0; i < other.storage_.size(); ++i) theirs.emplace(other.storage_[i].name, i);
  for (size_t i = 0; i < storage_.size(); ++i) {
    size_t j = i;
    if (!same_part) {
      const auto it = theirs.find(storage_[i].name);
      TANDEM_CHECK(it != theirs.end(),
                   "weights: copy of {} into {} from a table that lacks it ({}): copy from the "
                   "whole model or the same part",
                   storage_[i].name, part_.str(config_), other.part_.str(other.config_));
      j = it->second;
    }
    const Tensor& src = other.storage_[j].tensor;
    Tensor& dst = storage_[i].tensor;
    TANDEM_CHECK(src.shape() == dst.shape(), "weights: {} is {} here and {} in the source",
                 storage_[i].name, dst.shape(), src.shape());
    if (src.dtype() == dst.dtype()) {
      dst.copy_from(src);
    } else {
      TANDEM_CHECK(src.device() == dst.device(), "weights: a casting copy needs one device");
      ops::cast(src, dst);
    }
  }
}

int64_t Weights::num_parameters() const {
  int64_t n = 0;
  for (const NamedTensor& s : storage_) n += s.tensor.numel();
  return n;
}

InitRange init_range(std::string_view name, int64_t fan_in) {
  if (name.find("norm") != std::string_view::npos) return {0.7, 1.3};
  if (name.find("bias") != std::string_view::npos) return {-0.3, 0.3};
  if (name.find("embed") != std::string_view::npos) return {-1.0, 1.0};
  const double a = 1.7 / std::sqrt(static_cast<double>(fan_in));
  return {-a, a};
}

void init_random(Weights& w, uint64_t seed) {
  TANDEM_CHECK(w.dtype() == DType::f32 && w.device().is_cpu(),
               "init_random fills f32 CPU weights, not {} on {}", w.dtype(), w.device());
  const std::span<const NamedTensor> storage = w.storage();
  // Each storage tensor's index in the whole model: the Philox stream of its values.
  std::unordered_map<std::string_view, uint64_t> stream;
  const std::unique_ptr<Weights> whole = Weights::unbound(w.config(), w.dtype());
  for (size_t t = 0; t < whole->storage().size(); ++t) stream.emplace(whole->storage()[t].name, t);
  for (size_t i = 0; i < storage.size(); ++i) {
    const NamedTensor& s = storage[i];
    const uint64_t t = stream.at(s.name);
    const InitRange r = init_range(s.name, s.tensor.ndim() > 1 ? s.tensor.size(1) : 1);
    const float lo = static_cast<float>(r.lo), hi = static_cast<float>(r.hi);
    float* p = s.tensor.data_as<float>();
    const int64_t n = s.tensor.numel();
    parallel_for((n + 3) / 4,
                 [&](int64_t b, int64_t e) {
                   for (int64_t q = b; q < e; ++q) {
                     const Philox4x32 r = philox_random(seed, t, static_cast<uint64_t>(q));
                     for (int64_t k = 0; k < 4 && 4 * q + k < n; ++k)
                       p[4 * q + k] = lo + (hi - lo) * uniform_from_bits(r.v[k]);
                   }
                 },
                 1 << 14);
  }
}

}  // namespace tandem::model
