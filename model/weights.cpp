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

Weights::Weights(const ModelConfig& config, DType dtype, Device device, ArenaClass cls)
    : config_(config), dtype_(dtype), device_(device) {
  config_.validate();
  TANDEM_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
               "weights: dtype must be f32, bf16 or f16, got {}", dtype);
  const int64_t V = config.vocab_size, C = config.hidden_size, F = config.intermediate_size;
  const int64_t D = config.head_dim, H = config.num_heads, Hkv = config.num_kv_heads;
  const int64_t QKV = (H + 2 * Hkv) * D;

  // Plan the arena first: one allocation for everything.
  std::vector<Shape> plan = {{V, C}, {C}};
  if (!config.tie_word_embeddings) plan.push_back({V, C});
  for (int64_t l = 0; l < config.num_layers; ++l) {
    plan.insert(plan.end(), {{C}, {QKV, C}, {C, H * D}, {C}, {2 * F, C}, {C, F}});
    if (config.attention_bias) plan.push_back({QKV});
    if (config.qk_norm) plan.insert(plan.end(), {{D}, {D}});
  }
  size_t bytes = 0;
  for (const Shape& s : plan) bytes += padded_bytes(s, dtype);
  arena_ = std::make_unique<Arena>(cls, device, bytes);
  build([&](const Shape& shape) { return arena_->alloc(shape, dtype); });
}

Weights::Weights(const ModelConfig& config, DType dtype, Device device, Unbound)
    : config_(config), dtype_(dtype), device_(device) {
  config_.validate();
  build([](const Shape&) { return Tensor(); });
}

std::unique_ptr<Weights> Weights::unbound(const ModelConfig& config, DType dtype, Device device) {
  return std::unique_ptr<Weights>(new Weights(config, dtype, device, Unbound{}));
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
  embed = add_storage("model.embed_tokens.weight", {V, C});
  add_named("model.embed_tokens.weight", embed);
  layers.resize(static_cast<size_t>(config.num_layers));
  for (int64_t l = 0; l < config.num_layers; ++l) {
    LayerWeights& w = layers[static_cast<size_t>(l)];
    const std::string p = hf_layer_prefix(l);
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
  final_norm = add_storage("model.norm.weight", {C});
  add_named("model.norm.weight", final_norm);
  if (config.tie_word_embeddings) {
    lm_head = embed;
  } else {
    lm_head = add_storage("lm_head.weight", {V, C});
    add_named("lm_head.weight", lm_head);
  }
  storage_ = std::move(storage);
}

const Tensor* Weights::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &named_[it->second].tensor;
}

const Tensor& Weights::at(std::string_view name) const {
  const Tensor* t = find(name);
  TANDEM_CHECK(t != nullptr, "weights: the {} model has no parameter named '{}'",
               architecture_name(config_.arch), name);
  return *t;
}

void Weights::zero() {
  for (NamedTensor& s : storage_) s.tensor.zero();
}

void Weights::copy_from(const Weights& other) {
  TANDEM_CHECK(other.storage_.size() == storage_.size(),
               "weights: copy between different models ({} and {} tensors)", other.storage_.size(),
               storage_.size());
  for (size_t i = 0; i < storage_.size(); ++i) {
    const Tensor& src = other.storage_[i].tensor;
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
  for (size_t t = 0; t < storage.size(); ++t) {
    const NamedTensor& s = storage[t];
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
