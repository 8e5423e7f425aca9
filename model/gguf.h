// GGUF: a memory-mapped GGUF v3 (or v2) file's metadata and tensors, and the loader that turns a
// llama / qwen2 / qwen3 GGUF into a ModelConfig, TokenizerData and Weights.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/config.h"
#include "model/quants.h"
#include "model/tokenizer_data.h"
#include "model/weights.h"

namespace tandem::model {

// GGUF metadata value types (gguf.h, enum gguf_type).
enum class GgufType : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};
const char* gguf_type_name(GgufType t);

// One metadata value. A scalar is held like an array of one element: integers and bools in
// `ints` (u64 by its bits), floats in `floats`, strings in `strings`.
struct GgufValue {
  GgufType type = GgufType::u8;       // array for arrays
  GgufType elem_type = GgufType::u8;  // the element type (== type for scalars)
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;

  bool is_array() const { return type == GgufType::array; }
  size_t size() const;  // elements (1 for a scalar)
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // GGUF order: ne[0] is the row length (the innermost dimension)
  GgmlType type = GgmlType::f32;
  uint64_t offset = 0;  // from the start of the data section
  size_t nbytes = 0;

  int64_t numel() const;
  int64_t row_len() const { return ne.empty() ? 1 : ne[0]; }
  int64_t rows() const { return numel() / row_len(); }
  Shape shape() const;  // outermost first: ne reversed
};

class GgufFile {
 public:
  // Maps the file read-only and parses header, metadata and tensor infos; throws tandem::Error
  // naming the file (and key or tensor) for anything malformed.
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }

  // Metadata keys in file order.
  const std::vector<std::string>& keys() const { return keys_; }
  const GgufValue* find(std::string_view key) const;
  // Throws naming the file and key when the key is absent.
  const GgufValue& at(std::string_view key) const;

  // Typed getters: throw naming the file, key, expected and found type when absent or mistyped.
  std::string get_string(std::string_view key) const;
  int64_t get_int(std::string_view key) const;   // any integer type
  double get_float(std::string_view key) const;  // f32, f64 (or an integer)
  bool get_bool(std::string_view key) const;
  const std::vector<std::string>& get_string_array(std::string_view key) const;
  const std::vector<int64_t>& get_int_array(std::string_view key) const;
  std::vector<double> get_float_array(std::string_view key) const;
  // The same, empty when the key is absent (and throwing when it is present but mistyped).
  std::optional<std::string> find_string(std::string_view key) const;
  std::optional<int64_t> find_int(std::string_view key) const;
  std::optional<double> find_float(std::string_view key) const;
  std::optional<bool> find_bool(std::string_view key) const;
  const std::vector<std::string>* find_string_array(std::string_view key) const;
  const std::vector<int64_t>* find_int_array(std::string_view key) const;
  std::optional<std::vector<double>> find_float_array(std::string_view key) const;

  // Tensors in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  const GgufTensorInfo& tensor(std::string_view name) const;  // throws naming file and tensor
  // The tensor's bytes inside the mapping (valid while this file lives).
  const uint8_t* tensor_data(const GgufTensorInfo& t) const { return data_ + t.offset; }
  // Decodes a tensor into out (CPU f32/bf16/f16 with the same number of values).
  void read_tensor(const GgufTensorInfo& t, const Tensor& out) const;

 private:
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  const uint8_t* data_ = nullptr;  // the data section
  std::vector<std::string> keys_;
  std::unordered_map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// The decoder's shape from general.architecture (llama, qwen2, qwen3) and <arch>.* keys.
ModelConfig config_from_gguf(const GgufFile& file);
// The tokenizer.ggml.* metadata and tokenizer.chat_template.
TokenizerData tokenizer_data_from_gguf(const GgufFile& file);

// The GGUF name of an HF parameter name ("model.layers.3.mlp.up_proj.weight" ->
// "blk.3.ffn_up.weight").
std::string gguf_tensor_name(std::string_view hf_name);

// llama.cpp's convert_hf_to_gguf permute() of llama q/k weights as a row map: entry g is the HF
// row that GGUF row g holds. Within head h, GGUF row h D + 2 i + a holds HF row h D + a D/2 + i
// (HF keeps each rotation pair's first elements in [0, D/2), GGUF interleaves the pairs).
std::vector<int64_t> llama_qk_gguf_to_hf_rows(int64_t heads, int64_t head_dim);

// Fills every HF-named view of weights from the file: each shape checked, llama q/k rows
// un-permuted, every file tensor used (rope_freqs.weight is the only one ignored).
void load_gguf_weights(const GgufFile& file, Weights& weights);

struct GgufModel {
  ModelConfig config;
  TokenizerData tokenizer;
  std::unique_ptr<Weights> weights;
};
// Everything a GGUF holds, weights in dtype (f32, bf16 or f16) on the CPU.
GgufModel load_gguf_model(const std::string& path, DType dtype = DType::f32);
// Just the weights (and the config through config_out when it is not null).
std::unique_ptr<Weights> load_gguf(const std::string& path, DType dtype = DType::f32,
                                   ModelConfig* config_out = nullptr);

}  // namespace tandem::model
