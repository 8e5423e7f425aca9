// Helpers of the weight_sync tests and their per-rank worker: a small model whose sizes every tp
// of the tests divides, its parameters as layout specs, and a shard's expected contents.
#pragma once

#include <cstring>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "model/config.h"
#include "model/shard_layout.h"
#include "model/weights.h"
#include "trainer/rollout_group.h"
#include "weight_sync/layout.h"

namespace tandem::test {

// Qwen2-shaped (q/k/v biases, tied embeddings unless untied): H = 4, Hkv = 2, D = 16, F = 96,
// V = 96, C = 64, 2 layers (about 90k parameters).
inline model::ModelConfig sync_model_config(bool untied = false) {
  model::ModelConfig c;
  c.arch = model::Architecture::qwen2;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 256;
  c.attention_bias = true;
  c.tie_word_embeddings = !untied;
  return c;
}

// Seeded values in [-1, 1) in every storage tensor (the same on every rank for one seed).
inline void fill_sync_weights(model::Weights& w, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const model::NamedTensor& s : w.storage()) {
    Tensor f = Tensor::empty(s.tensor.shape(), DType::f32);
    for (int64_t i = 0; i < f.numel(); ++i) f.data_as<float>()[i] = u(rng);
    ops::cast(f, s.tensor);
  }
}

using trainer::param_specs;
using trainer::tp_dims;

// What a rank's local tensor of `shard` holds when the parameter is `full`, cast to dtype
// (elements the shard does not hold stay zero).
inline Tensor shard_image(const weight_sync::Shard& shard, const Tensor& full, DType dtype) {
  Tensor cast = Tensor::zeros(full.shape(), dtype);
  ops::cast(full, cast);
  Tensor out = Tensor::zeros(shard.shape, dtype);
  const size_t es = dtype_size(dtype);
  for (const weight_sync::Run& r : shard.runs)
    std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(r.local) * es,
                static_cast<const char*>(cast.data()) + static_cast<size_t>(r.global) * es,
                static_cast<size_t>(r.length) * es);
  return out;
}

// Rank `rank`'s local buffer of a ZeRO-3 trainer (f32, shards.local_size() elements): of every unit
// u, the flat elements shards.range(u, rank) of `full` at units()[u].local, zeros after them.
inline Tensor zero3_local(const model::ShardLayout& shards, int rank, const model::Weights& full) {
  std::vector<float> flat;
  for (const model::NamedTensor& s : full.storage()) {
    Tensor f = Tensor::empty(s.tensor.shape(), DType::f32);
    ops::cast(s.tensor, f);
    flat.insert(flat.end(), f.data_as<float>(), f.data_as<float>() + f.numel());
  }
  Tensor local = Tensor::zeros({shards.local_size()}, DType::f32);
  for (size_t u = 0; u < shards.units().size(); ++u) {
    const model::FlatRange r = shards.range(u, rank);
    std::memcpy(local.data_as<float>() + shards.units()[u].local, flat.data() + r.begin,
                static_cast<size_t>(r.size()) * sizeof(float));
  }
  return local;
}

}  // namespace tandem::test
