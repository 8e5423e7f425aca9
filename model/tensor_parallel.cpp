// Tensor-parallel shards: the split of each parameter, its checks, and the cut from full weights.
#include "model/tensor_parallel.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace tandem::model {
namespace {

// "1, 3 or 9": the group sizes that divide n, for the error messages (those up to 64 said so).
std::string divisors(int64_t n) {
  constexpr int64_t kMost = 64;
  std::string out;
  std::vector<int64_t> d;
  for (int64_t k = 1; k <= n && k <= kMost; ++k)
    if (n % k == 0) d.push_back(k);
  for (size_t i = 0; i < d.size(); ++i)
    out += fmt::format("{}{}", i == 0 ? "" : (i + 1 == d.size() ? " or " : ", "), d[i]);
  return n > kMost ? out + fmt::format(" of the sizes up to {}", kMost) : out;
}

void check_divides(int64_t n, int size, const char* param) {
  TANDEM_CHECK(n % size == 0,
               "tensor parallel: {} = {} is not divisible by the tensor-parallel size {}: choose "
               "a size that divides it ({})",
               param, n, size, divisors(n));
}

// dst (rows, n) = columns [col0, col0 + n) of src (rows, N), one row at a time (tensors are
// row-major and contiguous: a column range is a strided view they cannot express).
void copy_columns(const Tensor& src, int64_t col0, const Tensor& dst) {
  const int64_t rows = src.size(0), N = src.size(1), n = dst.size(1);
  for (int64_t r = 0; r < rows; ++r)
    dst.narrow(r, 1).view({n}).copy_from(src.narrow(r, 1).view({N}).narrow(col0, n));
}

}  // namespace

TpSplit tp_split(const ModelConfig& full, int rank, int size) {
  TANDEM_CHECK(size >= 1 && rank >= 0 && rank < size,
               "tensor parallel: rank {} of a group of {} (the size must be >= 1 and the rank in "
               "[0, size))",
               rank, size);
  check_divides(full.num_heads, size, "num_attention_heads");
  const int64_t Hkv = full.num_kv_heads;
  TANDEM_CHECK(Hkv % size == 0 || size % Hkv == 0,
               "tensor parallel: num_key_value_heads = {} and the tensor-parallel size {}: the "
               "size must divide the KV heads ({}) or be a multiple of them (each KV head then "
               "replicated on size / {} ranks)",
               Hkv, size, divisors(Hkv), Hkv);
  check_divides(full.intermediate_size, size, "intermediate_size");
  check_divides(full.vocab_size, size, "vocab_size");
  TpSplit s;
  s.rank = rank;
  s.size = size;
  s.num_q_heads = full.num_heads / size;
  s.q_head0 = rank * s.num_q_heads;
  s.kv_replicated = Hkv < size;
  s.num_kv_heads = s.kv_replicated ? 1 : Hkv / size;
  // Replicated: rank r's query heads all belong to KV head r Hkv / size (H/size divides the
  // group size H/Hkv, as Hkv divides size).
  s.kv_head0 = s.kv_replicated ? rank * Hkv / size : rank * s.num_kv_heads;
  s.num_f = full.intermediate_size / size;
  s.f0 = rank * s.num_f;
  s.num_vocab = full.vocab_size / size;
  s.vocab0 = rank * s.num_vocab;
  return s;
}

ModelConfig tp_shard_config(const ModelConfig& full, int size) {
  const TpSplit s = tp_split(full, 0, size);
  ModelConfig c = full;
  c.num_heads = s.num_q_heads;
  c.num_kv_heads = s.num_kv_heads;
  c.intermediate_size = s.num_f;
  c.vocab_size = s.num_vocab;
  return c;
}

TpSlice tp_slice(const ModelConfig& full, const TpSplit& split, std::string_view name) {
  const int64_t D = full.head_dim;
  auto ends_with = [&](std::string_view suffix) { return name.ends_with(suffix); };
  const bool layer = name.starts_with("model.layers.");
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight")
    return {0, split.vocab0, split.num_vocab};
  if (name == "model.norm.weight") return {-1, 0, full.hidden_size};
  if (layer &&
      (ends_with(".input_layernorm.weight") || ends_with(".post_attention_layernorm.weight")))
    return {-1, 0, full.hidden_size};
  if (layer && (ends_with(".self_attn.q_norm.weight") || ends_with(".self_attn.k_norm.weight")))
    return {-1, 0, D};
  if (layer && (ends_with(".self_attn.q_proj.weight") || ends_with(".self_attn.q_proj.bias")))
    return {0, split.q_head0 * D, split.num_q_heads * D};
  if (layer && (ends_with(".self_attn.k_proj.weight") || ends_with(".self_attn.k_proj.bias") ||
                ends_with(".self_attn.v_proj.weight") || ends_with(".self_attn.v_proj.bias")))
    return {0, split.kv_head0 * D, split.num_kv_heads * D};
  if (layer && ends_with(".self_attn.o_proj.weight"))
    return {1, split.q_head0 * D, split.num_q_heads * D};
  if (layer && (ends_with(".mlp.gate_proj.weight") || ends_with(".mlp.up_proj.weight")))
    return {0, split.f0, split.num_f};
  if (layer && ends_with(".mlp.down_proj.weight")) return {1, split.f0, split.num_f};
  TANDEM_FAIL("tensor parallel: '{}' is not a parameter of a {} model, so it has no split", name,
              architecture_name(full.arch));
}

std::unique_ptr<Weights> cut_tp_shard(const Weights& full, int rank, int size) {
  const ModelConfig& fc = full.config();
  const TpSplit split = tp_split(fc, rank, size);
  auto out = std::make_unique<Weights>(tp_shard_config(fc, size), full.dtype(), full.device());
  for (const NamedTensor& n : out->named()) {
    const TpSlice s = tp_slice(fc, split, n.name);
    const Tensor& src = full.at(n.name);
    Tensor dst = n.tensor;
    if (s.dim == -1)
      dst.copy_from(src);
    else if (s.dim == 0)
      dst.copy_from(src.narrow(s.begin, s.length));
    else
      copy_columns(src, s.begin, dst);
  }
  return out;
}

TpCollectives tp_training_collectives(const ModelConfig& config, int64_t T, int64_t R, int tp,
                                      bool recompute) {
  TANDEM_CHECK(T >= 1 && R >= 1 && R <= T && tp >= 2,
               "tp_training_collectives: a micro-batch of T = {} rows with R = {} head rows over "
               "tp = {} ranks needs 1 <= R <= T and tp >= 2",
               T, R, tp);
  const int64_t C = config.hidden_size, L = config.num_layers, f32 = sizeof(float);
  const int64_t forwards = recompute ? 2 : 1;  // each layer's forward runs again in backward
  TpCollectives c;
  c.reduce_calls = 1 + 2 * L + 1;
  c.reduce_bytes = (T * C                                             // embedding rows
                    + 2 * L * T * C                                   // input gradients
                    + (config.qk_norm ? L * 2 * config.head_dim : 0)  // q/k norm parts
                    + R * C) *                                        // head input gradient
                   f32;
  c.gather_calls = 2 * L * forwards + 2;
  c.gather_bytes = tp *
                   (2 * L * forwards * T * C  // heads' and MLP columns' outputs
                    + R + 4 * R) *            // row maxima and sums
                   f32;
  return c;
}

}  // namespace tandem::model
