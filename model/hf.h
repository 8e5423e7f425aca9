// Hugging Face model directories: config.json <-> ModelConfig, safetensors checkpoints (one file
// or shards) -> Weights, and Weights -> a directory transformers' AutoModelForCausalLM loads.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/weights.h"

namespace tandem::model {

// Reads a transformers config (model_type llama, qwen2 or qwen3). `where` names the source in
// errors (e.g. the config.json path); every error names it and the field.
ModelConfig config_from_hf(const nlohmann::json& j, const std::string& where);
ModelConfig config_from_hf_file(const std::string& path);
// The config.json transformers needs for this model; torch_dtype from dtype.
nlohmann::json config_to_hf(const ModelConfig& config, DType dtype = DType::f32);

// Loads a model: path is a directory with config.json and model.safetensors or
// model.safetensors.index.json (+ shards), or a .safetensors file with config.json beside it.
// Every parameter must be present with its shape, in F32/BF16/F16 (cast to dtype); tensors the
// model does not have are an error, except rotary inv_freq buffers and a tied lm_head.weight
// equal to the embedding.
std::unique_ptr<Weights> load_hf(const std::string& path, DType dtype = DType::f32);

struct SaveOptions {
  // Dtype of the saved tensors (f32/bf16/f16); the weights' own when unset.
  std::optional<DType> dtype;
  // Above this many bytes of tensors the checkpoint is split into numbered shards.
  size_t max_shard_bytes = 5'000'000'000;
  // Extra files written beside the model (file name -> contents), e.g. tokenizer.json.
  std::map<std::string, std::string> extra_files;
  // generation_config.json's do_sample (tandem samples its rollouts).
  bool do_sample = true;
};

// Writes config.json, generation_config.json, the safetensors checkpoint and the extra files
// into dir + ".tmp-<pid>", then moves that over dir (an existing dir is replaced whole).
void save_hf(const Weights& weights, const std::string& dir, const SaveOptions& options = {});

}  // namespace tandem::model
