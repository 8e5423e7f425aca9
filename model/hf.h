// Hugging Face model directories: config.json <-> ModelConfig, safetensors checkpoints (one file
// or shards) -> Weights, and Weights -> a directory transformers' AutoModelForCausalLM loads.
#pragma once

#include <cstddef>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/safetensors.h"
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

// save_hf for tensors that arrive one at a time (e.g. gathered unit by unit from the ranks of a
// sharded trainer, never whole in one place): the names and shapes of every tensor up front, in
// the order append() then gets them (Weights::named()'s); options.dtype the saved dtype (f32 when
// unset). Shards, files and the move into place as save_hf; destroyed unfinished, it removes its
// temporary directory and leaves dir as it was.
class HfWriter {
 public:
  struct NamedShape {
    std::string name;
    Shape shape;
  };
  HfWriter(const ModelConfig& config, std::span<const NamedShape> tensors, const std::string& dir,
           const SaveOptions& options = {});
  ~HfWriter();
  HfWriter(const HfWriter&) = delete;
  HfWriter& operator=(const HfWriter&) = delete;

  // The next tensor (its shape, any float dtype: cast; any device).
  void append(const Tensor& tensor);
  // Writes the index and extra files and moves the directory over dir.
  void finish();

 private:
  std::string shard_file(size_t s) const;
  SaveOptions options_;
  DType out_;
  std::filesystem::path target_, tmp_;
  std::string pid_;
  std::vector<std::vector<SafetensorsEntry>> shards_;
  size_t total_bytes_ = 0, shard_ = 0, next_ = 0;
  std::unique_ptr<SafetensorsWriter> writer_;
  bool done_ = false;
};

}  // namespace tandem::model
