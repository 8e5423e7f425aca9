// Hugging Face model directories: config.json parsing and writing, load_hf and save_hf.
#include "model/hf.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/safetensors.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The value of key, or nullptr when it is absent or null (transformers treats both as unset).
const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

int64_t get_int(const json& j, const char* key, const std::string& where,
                std::optional<int64_t> fallback = std::nullopt) {
  const json* v = field(j, key);
  if (v == nullptr) {
    TANDEM_CHECK(fallback.has_value(), "{}: field '{}' is missing (expected an integer)", where,
                 key);
    return *fallback;
  }
  TANDEM_CHECK(v->is_number_integer(), "{}: field '{}' must be an integer, found {}", where, key,
               v->dump());
  return v->get<int64_t>();
}

double get_number(const json& j, const char* key, const std::string& where,
                  std::optional<double> fallback = std::nullopt) {
  const json* v = field(j, key);
  if (v == nullptr) {
    TANDEM_CHECK(fallback.has_value(), "{}: field '{}' is missing (expected a number)", where, key);
    return *fallback;
  }
  TANDEM_CHECK(v->is_number(), "{}: field '{}' must be a number, found {}", where, key, v->dump());
  return v->get<double>();
}

bool get_bool(const json& j, const char* key, const std::string& where, bool fallback) {
  const json* v = field(j, key);
  if (v == nullptr) return fallback;
  TANDEM_CHECK(v->is_boolean(), "{}: field '{}' must be true or false, found {}", where, key,
               v->dump());
  return v->get<bool>();
}

int32_t token_id(const json& v, const char* key, const std::string& where) {
  TANDEM_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX,
               "{}: field '{}' must hold non-negative integer token ids, found {}", where, key,
               v.dump());
  return static_cast<int32_t>(v.get<int64_t>());
}

// The shortest decimal that reads back as f, so config.json says 1e-05, not 9.99999974e-06.
double float_to_json(float f) { return std::stod(fmt::format("{}", f)); }

const char* torch_dtype_name(DType t) {
  switch (t) {
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    default:
      return "float32";
  }
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  TANDEM_CHECK(out.good(), "{}: cannot write: {}", path.string(), std::strerror(errno));
}

std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  const size_t shown = std::min<size_t>(names.size(), 8);
  for (size_t i = 0; i < shown; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > shown) s += fmt::format(" and {} more", names.size() - shown);
  return s;
}

}  // namespace

ModelConfig config_from_hf(const json& j, const std::string& where) {
  TANDEM_CHECK(j.is_object(), "{}: a model config must be a JSON object, found {}", where,
               j.type_name());
  std::string model_type;
  if (const json* mt = field(j, "model_type")) {
    TANDEM_CHECK(mt->is_string(), "{}: field 'model_type' must be a string, found {}", where,
                 mt->dump());
    model_type = mt->get<std::string>();
  } else if (const json* ar = field(j, "architectures");
             ar != nullptr && ar->is_array() && !ar->empty() && (*ar)[0].is_string()) {
    const std::string a = (*ar)[0].get<std::string>();
    model_type = a == "LlamaForCausalLM"   ? "llama"
                 : a == "Qwen2ForCausalLM" ? "qwen2"
                 : a == "Qwen3ForCausalLM" ? "qwen3"
                                           : a;
  } else {
    TANDEM_FAIL("{}: field 'model_type' is missing (expected llama, qwen2 or qwen3)", where);
  }

  ModelConfig c;
  if (model_type == "llama") {
    c.arch = Architecture::llama;
    c.attention_bias = get_bool(j, "attention_bias", where, false);
    TANDEM_CHECK(!get_bool(j, "mlp_bias", where, false),
                 "{}: field 'mlp_bias' is true: MLP biases are not supported", where);
  } else if (model_type == "qwen2") {
    c.arch = Architecture::qwen2;
    c.attention_bias = true;  // Qwen2 always has q/k/v biases
  } else if (model_type == "qwen3") {
    c.arch = Architecture::qwen3;
    c.attention_bias = get_bool(j, "attention_bias", where, false);
    c.qk_norm = true;
  } else {
    TANDEM_FAIL("{}: model_type '{}' is not supported (expected llama, qwen2 or qwen3)", where,
                model_type);
  }
  if (c.arch != Architecture::llama) {
    TANDEM_CHECK(!get_bool(j, "use_sliding_window", where, false),
                 "{}: field 'use_sliding_window' is true: sliding-window attention is not "
                 "supported",
                 where);
  }
  if (const json* act = field(j, "hidden_act")) {
    TANDEM_CHECK(act->is_string() && act->get<std::string>() == "silu",
                 "{}: field 'hidden_act' is {}, only \"silu\" is supported", where, act->dump());
  }

  c.vocab_size = get_int(j, "vocab_size", where);
  c.hidden_size = get_int(j, "hidden_size", where);
  c.intermediate_size = get_int(j, "intermediate_size", where);
  c.num_layers = get_int(j, "num_hidden_layers", where);
  c.num_heads = get_int(j, "num_attention_heads", where);
  TANDEM_CHECK(c.num_heads > 0, "{}: field 'num_attention_heads' must be positive, found {}", where,
               c.num_heads);
  c.num_kv_heads = get_int(j, "num_key_value_heads", where, c.num_heads);
  c.head_dim = get_int(j, "head_dim", where, c.hidden_size / c.num_heads);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", where);
  c.rms_norm_eps = static_cast<float>(get_number(j, "rms_norm_eps", where));
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", where, false);

  // transformers 5 moves rope_theta and the scaling into rope_parameters.
  const json* rope_params = field(j, "rope_parameters");
  TANDEM_CHECK(rope_params == nullptr || rope_params->is_object(),
               "{}: field 'rope_parameters' must be an object, found {}", where,
               rope_params ? rope_params->dump() : "");
  double theta_fallback = 10000.0;
  if (rope_params != nullptr)
    theta_fallback = get_number(*rope_params, "rope_theta", where + ": rope_parameters", 10000.0);
  c.rope.theta = static_cast<float>(get_number(j, "rope_theta", where, theta_fallback));
  const json* scaling = field(j, "rope_scaling");
  if (scaling == nullptr) scaling = rope_params;
  if (scaling != nullptr) {
    const std::string sw = where + ": rope_scaling";
    TANDEM_CHECK(scaling->is_object(), "{}: field 'rope_scaling' must be an object, found {}",
                 where, scaling->dump());
    const json* type = field(*scaling, "rope_type");
    if (type == nullptr) type = field(*scaling, "type");
    const std::string t = type != nullptr && type->is_string() ? type->get<std::string>()
                          : type != nullptr                    ? type->dump()
                                                               : "default";
    if (t == "llama3") {
      c.rope.factor = static_cast<float>(get_number(*scaling, "factor", sw));
      c.rope.low_freq_factor = static_cast<float>(get_number(*scaling, "low_freq_factor", sw));
      c.rope.high_freq_factor = static_cast<float>(get_number(*scaling, "high_freq_factor", sw));
      c.rope.original_max_position = get_int(*scaling, "original_max_position_embeddings", sw);
      TANDEM_CHECK(c.rope.factor > 0, "{}: field 'factor' must be positive, found {}", sw,
                   c.rope.factor);
    } else {
      TANDEM_CHECK(t == "default", "{}: rope type '{}' is not supported (expected llama3)", sw, t);
    }
  }

  if (const json* bos = field(j, "bos_token_id"))
    c.bos_token_id = token_id(*bos, "bos_token_id", where);
  if (const json* eos = field(j, "eos_token_id")) {
    if (eos->is_array()) {
      for (const json& e : *eos) c.eos_token_ids.push_back(token_id(e, "eos_token_id", where));
    } else {
      c.eos_token_ids.push_back(token_id(*eos, "eos_token_id", where));
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    TANDEM_FAIL("{}: {}", where, e.what());
  }
  return c;
}

ModelConfig config_from_hf_file(const std::string& path) {
  std::ifstream in(path);
  TANDEM_CHECK(in.good(), "{}: cannot open the model config: {}", path, std::strerror(errno));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    TANDEM_FAIL("{}: not valid JSON: {}", path, e.what());
  }
  return config_from_hf(j, path);
}

json config_to_hf(const ModelConfig& c, DType dtype) {
  json j;
  const char* arch = c.arch == Architecture::llama   ? "LlamaForCausalLM"
                     : c.arch == Architecture::qwen2 ? "Qwen2ForCausalLM"
                                                     : "Qwen3ForCausalLM";
  j["architectures"] = json::array({arch});
  j["model_type"] = architecture_name(c.arch);
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = float_to_json(c.rms_norm_eps);
  j["rope_theta"] = float_to_json(c.rope.theta);
  if (c.rope.factor > 0) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", float_to_json(c.rope.factor)},
                         {"low_freq_factor", float_to_json(c.rope.low_freq_factor)},
                         {"high_freq_factor", float_to_json(c.rope.high_freq_factor)},
                         {"original_max_position_embeddings", c.rope.original_max_position}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["bos_token_id"] = c.bos_token_id >= 0 ? json(c.bos_token_id) : json(nullptr);
  if (c.eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else {
    j["eos_token_id"] = c.eos_token_ids;
  }
  j["hidden_act"] = "silu";
  j["initializer_range"] = 0.02;
  j["attention_dropout"] = 0.0;
  j["use_cache"] = true;
  j["torch_dtype"] = torch_dtype_name(dtype);
  if (c.arch == Architecture::llama) {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  } else {
    if (c.arch == Architecture::qwen3) j["attention_bias"] = c.attention_bias;
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_layers;
    j["layer_types"] =
        std::vector<std::string>(static_cast<size_t>(c.num_layers), "full_attention");
  }
  return j;
}

std::unique_ptr<Weights> load_hf(const std::string& path, DType dtype) {
  const fs::path p(path);
  TANDEM_CHECK(fs::exists(p),
               "{}: no such file or directory (expected a Hugging Face model "
               "directory or a .safetensors file)",
               path);
  const fs::path config_path =
      fs::is_directory(p) ? p / "config.json" : p.parent_path() / "config.json";
  const ModelConfig config = config_from_hf_file(config_path.string());
  const SafetensorsCheckpoint ckpt(path);
  auto weights = std::make_unique<Weights>(config, dtype);

  // Check names, shapes and dtypes before reading any data.
  std::vector<std::string> unexpected, missing;
  bool has_tied_head = false;
  for (const std::string& name : ckpt.names()) {
    if (weights->find(name) != nullptr || name.ends_with(".rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && config.tie_word_embeddings) {
      has_tied_head = true;
      continue;
    }
    unexpected.push_back(name);
  }
  TANDEM_CHECK(unexpected.empty(),
               "{}: the checkpoint holds tensors the {} model described by {} does not have: {}",
               ckpt.path(), architecture_name(config.arch), config_path.string(),
               join_names(unexpected));
  for (const NamedTensor& nt : weights->named()) {
    const SafetensorsEntry* e = ckpt.find(nt.name);
    if (e == nullptr) {
      missing.push_back(nt.name);
      continue;
    }
    TANDEM_CHECK(e->shape == nt.tensor.shape(), "{}: tensor '{}' has shape {}, expected {}",
                 ckpt.file_of(nt.name).path(), nt.name, e->shape, nt.tensor.shape());
    TANDEM_CHECK(dtype_is_float(e->dtype), "{}: tensor '{}' is {}, expected F32, BF16 or F16",
                 ckpt.file_of(nt.name).path(), nt.name, safetensors_dtype_name(e->dtype));
  }
  TANDEM_CHECK(missing.empty(), "{}: the checkpoint lacks tensors the {} model needs: {}",
               ckpt.path(), architecture_name(config.arch), join_names(missing));

  for (const NamedTensor& nt : weights->named()) ckpt.read_into(nt.name, nt.tensor);

  if (has_tied_head) {
    const SafetensorsEntry& e = ckpt.at("lm_head.weight");
    const std::string& file = ckpt.file_of("lm_head.weight").path();
    TANDEM_CHECK(e.shape == weights->embed.shape(),
                 "{}: tensor 'lm_head.weight' has shape {}, expected {} (tied to the embedding)",
                 file, e.shape, weights->embed.shape());
    Tensor head = Tensor::empty(e.shape, dtype);
    ckpt.read_into("lm_head.weight", head);
    TANDEM_CHECK(std::memcmp(head.data(), weights->embed.data(), head.nbytes()) == 0,
                 "{}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but {} "
                 "says tie_word_embeddings: set it to false or drop lm_head.weight",
                 file, config_path.string());
  }
  return weights;
}

HfWriter::HfWriter(const ModelConfig& config, std::span<const NamedShape> tensors,
                   const std::string& dir, const SaveOptions& options)
    : options_(options), out_(options.dtype.value_or(DType::f32)) {
  TANDEM_CHECK(dtype_is_float(out_), "{}: save dtype must be f32, bf16 or f16, got {}", dir, out_);
  TANDEM_CHECK(options.max_shard_bytes > 0, "{}: max_shard_bytes must be positive", dir);
  for (const auto& [name, contents] : options.extra_files) {
    const bool ours = name == "config.json" || name == "generation_config.json" ||
                      name.ends_with(".safetensors") || name == "model.safetensors.index.json";
    TANDEM_CHECK(!name.empty() && name != "." && name != ".." &&
                     name.find('/') == std::string::npos && !ours,
                 "{}: extra file '{}' must be a plain file name not written by save_hf", dir, name);
  }

  target_ = fs::path(dir);
  if (target_.filename().empty()) target_ = target_.parent_path();  // "dir/" -> "dir"
  TANDEM_CHECK(!target_.empty(), "save_hf: empty directory name");
  pid_ = std::to_string(::getpid());
  tmp_ = target_;
  tmp_ += ".tmp-" + pid_;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
  if (target_.has_parent_path()) fs::create_directories(target_.parent_path(), ec);
  fs::create_directory(tmp_, ec);
  TANDEM_CHECK(!ec, "{}: cannot create directory: {}", tmp_.string(), ec.message());

  try {
    write_text(tmp_ / "config.json", config_to_hf(config, out_).dump(2) + "\n");
    json gen = {{"_from_model_config", false}, {"do_sample", options.do_sample}};
    gen["bos_token_id"] = config.bos_token_id >= 0 ? json(config.bos_token_id) : json(nullptr);
    if (config.eos_token_ids.size() == 1) {
      gen["eos_token_id"] = config.eos_token_ids[0];
    } else if (!config.eos_token_ids.empty()) {
      gen["eos_token_id"] = config.eos_token_ids;
    }
    write_text(tmp_ / "generation_config.json", gen.dump(2) + "\n");

    // Shards as transformers cuts them: a new shard when the next tensor would pass the limit.
    size_t shard_bytes = 0;
    for (const NamedShape& t : tensors) {
      const size_t bytes = static_cast<size_t>(t.shape.numel()) * dtype_size(out_);
      if (shards_.empty() || (shard_bytes > 0 && shard_bytes + bytes > options.max_shard_bytes)) {
        shards_.emplace_back();
        shard_bytes = 0;
      }
      shards_.back().push_back({t.name, out_, t.shape});
      shard_bytes += bytes;
      total_bytes_ += bytes;
    }
  } catch (...) {
    fs::remove_all(tmp_, ec);
    throw;
  }
}

HfWriter::~HfWriter() {
  if (done_) return;
  writer_.reset();
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

std::string HfWriter::shard_file(size_t s) const {
  return shards_.size() == 1
             ? std::string("model.safetensors")
             : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards_.size());
}

void HfWriter::append(const Tensor& tensor) {
  TANDEM_CHECK(!done_, "{}: already written", target_.string());
  if (!writer_ || next_ == shards_[shard_].size()) {
    if (writer_) {
      writer_->finish();
      ++shard_;
    }
    TANDEM_CHECK(shard_ < shards_.size(), "{}: more tensors than the model has", target_.string());
    writer_ =
        std::make_unique<SafetensorsWriter>((tmp_ / shard_file(shard_)).string(), shards_[shard_],
                                            std::map<std::string, std::string>{{"format", "pt"}});
    next_ = 0;
  }
  Tensor t = tensor.device().is_cpu() ? tensor : tensor.to(Device::cpu());
  if (t.dtype() != out_) {
    Tensor cast = Tensor::empty(t.shape(), out_);
    ops::cast(t, cast);
    t = cast;
  }
  writer_->append(t);
  ++next_;
}

void HfWriter::finish() {
  TANDEM_CHECK(!done_ && shard_ + 1 == shards_.size() && next_ == shards_.back().size(),
               "{}: not every tensor was written", target_.string());
  writer_->finish();
  writer_.reset();
  if (shards_.size() > 1) {
    json weight_map = json::object();
    for (size_t s = 0; s < shards_.size(); ++s)
      for (const SafetensorsEntry& e : shards_[s]) weight_map[e.name] = shard_file(s);
    json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
    write_text(tmp_ / "model.safetensors.index.json", index.dump(2) + "\n");
  }
  for (const auto& [name, contents] : options_.extra_files) write_text(tmp_ / name, contents);

  // Move the new directory in; an old one is renamed away first and deleted last, so `dir`
  // always holds either the old or the new model whole.
  std::error_code ec;
  done_ = true;
  if (fs::exists(target_)) {
    fs::path old = target_;
    old += ".old-" + pid_;
    fs::remove_all(old, ec);
    fs::rename(target_, old, ec);
    if (ec) {
      fs::remove_all(tmp_);
      TANDEM_FAIL("{}: cannot move the existing directory away: {}", target_.string(),
                  ec.message());
    }
    fs::rename(tmp_, target_, ec);
    if (ec) {
      std::error_code ec2;
      fs::rename(old, target_, ec2);
      TANDEM_FAIL("{}: cannot move the new model into place ({} is left): {}", target_.string(),
                  tmp_.string(), ec.message());
    }
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp_, target_, ec);
    TANDEM_CHECK(!ec, "{}: cannot move the new model into place ({} is left): {}", target_.string(),
                 tmp_.string(), ec.message());
  }
}

void save_hf(const Weights& weights, const std::string& dir, const SaveOptions& options) {
  TANDEM_CHECK(weights.whole(),
               "save_hf '{}': the weights hold a model part ({}); a Hugging Face directory holds "
               "the whole model",
               dir, weights.part().str(weights.config()));
  SaveOptions o = options;
  o.dtype = options.dtype.value_or(weights.dtype());
  std::vector<HfWriter::NamedShape> shapes;
  for (const NamedTensor& nt : weights.named()) shapes.push_back({nt.name, nt.tensor.shape()});
  HfWriter writer(weights.config(), shapes, dir, o);
  for (const NamedTensor& nt : weights.named()) writer.append(nt.tensor);
  writer.finish();
}

}  // namespace tandem::model
