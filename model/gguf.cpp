// GGUF: parsing a memory-mapped GGUF file, and loading a decoder's config, tokenizer and weights.
#include "model/gguf.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numbers>
#include <unordered_set>

#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"

namespace tandem::model {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kMaxDimsGguf = 4;         // GGML_MAX_DIMS
constexpr int64_t kMaxElems = int64_t{1} << 48;

// Bounds-checked little-endian reads from the mapping.
class Reader {
 public:
  Reader(const std::string& path, const uint8_t* p, size_t size)
      : path_(path), p_(p), size_(size) {}

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  void need(uint64_t n, std::string_view what) const {
    TANDEM_CHECK(n <= left(),
                 "gguf '{}': file truncated: {} needs {} bytes at offset {}, only {} left", path_,
                 what, n, pos_, left());
  }
  template <class T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(std::string_view what) {
    const uint64_t n = read<uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }

 private:
  const std::string& path_;
  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
};

size_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::u8:
    case GgufType::i8:
    case GgufType::boolean:
      return 1;
    case GgufType::u16:
    case GgufType::i16:
      return 2;
    case GgufType::u32:
    case GgufType::i32:
    case GgufType::f32:
      return 4;
    case GgufType::u64:
    case GgufType::i64:
    case GgufType::f64:
    case GgufType::string:  // its length
      return 8;
    case GgufType::array:
      return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= 12; }

void read_values(Reader& r, const std::string& path, const std::string& key, GgufType t,
                 uint64_t count, GgufValue& v) {
  TANDEM_CHECK(count <= r.left() / min_value_bytes(t),
               "gguf '{}': file truncated: key '{}' holds {} {} values, which cannot fit in the {} "
               "bytes left",
               path, key, count, gguf_type_name(t), r.left());
  const std::string what = fmt::format("key '{}'", key);
  auto ints = [&](auto type_tag) {
    using T = decltype(type_tag);
    v.ints.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) v.ints.push_back(static_cast<int64_t>(r.read<T>(what)));
  };
  switch (t) {
    case GgufType::u8:
      return ints(uint8_t{});
    case GgufType::i8:
      return ints(int8_t{});
    case GgufType::u16:
      return ints(uint16_t{});
    case GgufType::i16:
      return ints(int16_t{});
    case GgufType::u32:
      return ints(uint32_t{});
    case GgufType::i32:
      return ints(int32_t{});
    case GgufType::u64:
      return ints(uint64_t{});
    case GgufType::i64:
      return ints(int64_t{});
    case GgufType::boolean:
      for (uint64_t i = 0; i < count; ++i) {
        const uint8_t b = r.read<uint8_t>(what);
        TANDEM_CHECK(b <= 1, "gguf '{}': key '{}': a bool must be 0 or 1, found {}", path, key, b);
        v.ints.push_back(b);
      }
      return;
    case GgufType::f32:
      v.floats.reserve(static_cast<size_t>(count));
      for (uint64_t i = 0; i < count; ++i) v.floats.push_back(r.read<float>(what));
      return;
    case GgufType::f64:
      v.floats.reserve(static_cast<size_t>(count));
      for (uint64_t i = 0; i < count; ++i) v.floats.push_back(r.read<double>(what));
      return;
    case GgufType::string:
      v.strings.reserve(static_cast<size_t>(count));
      for (uint64_t i = 0; i < count; ++i) v.strings.push_back(r.read_string(what));
      return;
    case GgufType::array:
      TANDEM_FAIL("gguf '{}': key '{}': arrays of arrays are not supported", path, key);
  }
}

bool is_int_type(GgufType t) {
  return t != GgufType::f32 && t != GgufType::f64 && t != GgufType::boolean &&
         t != GgufType::string && t != GgufType::array;
}

const char* value_kind(const GgufValue& v) { return v.is_array() ? "array of " : ""; }

// "i32" or "array of string".
std::string describe(const GgufValue& v) {
  return fmt::format("{}{}", value_kind(v), gguf_type_name(v.elem_type));
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  static constexpr const char* kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                           "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

size_t GgufValue::size() const {
  switch (elem_type) {
    case GgufType::f32:
    case GgufType::f64:
      return floats.size();
    case GgufType::string:
      return strings.size();
    default:
      return ints.size();
  }
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

Shape GgufTensorInfo::shape() const { return Shape(ne.rbegin(), ne.rend()); }

GgufFile::GgufFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TANDEM_CHECK(fd >= 0, "gguf '{}': cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    TANDEM_FAIL("gguf '{}': cannot stat: {}", path, std::strerror(e));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    TANDEM_FAIL("gguf '{}': file is empty, expected a GGUF header", path);
  }
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TANDEM_CHECK(m != MAP_FAILED, "gguf '{}': cannot map {} bytes: {}", path, size_,
               std::strerror(map_errno));
  map_ = static_cast<const uint8_t*>(m);

  try {
    Reader r(path_, map_, size_);
    const uint32_t magic = r.read<uint32_t>("the magic");
    TANDEM_CHECK(magic == kGgufMagic,
                 "gguf '{}': bad magic 0x{:08x}, expected 0x{:08x} (\"GGUF\"): not a GGUF file",
                 path_, magic, kGgufMagic);
    version_ = r.read<uint32_t>("the version");
    TANDEM_CHECK(version_ == 2 || version_ == 3,
                 "gguf '{}': version {} is not supported, expected 3 (or 2)", path_, version_);
    const uint64_t n_tensors = r.read<uint64_t>("the tensor count");
    const uint64_t n_kv = r.read<uint64_t>("the metadata count");
    TANDEM_CHECK(
        n_kv <= r.left() / 12 && n_tensors <= r.left() / 24,
        "gguf '{}': file truncated: {} metadata entries and {} tensors cannot fit in {} bytes",
        path_, n_kv, n_tensors, size_);

    for (uint64_t i = 0; i < n_kv; ++i) {
      std::string key = r.read_string(fmt::format("metadata key {}", i));
      const uint32_t type = r.read<uint32_t>(fmt::format("the type of key '{}'", key));
      TANDEM_CHECK(valid_value_type(type), "gguf '{}': key '{}' has unknown value type {}", path_,
                   key, type);
      GgufValue v;
      v.type = v.elem_type = static_cast<GgufType>(type);
      uint64_t count = 1;
      if (v.type == GgufType::array) {
        const uint32_t et = r.read<uint32_t>(fmt::format("the element type of key '{}'", key));
        TANDEM_CHECK(valid_value_type(et), "gguf '{}': key '{}' has unknown element type {}", path_,
                     key, et);
        v.elem_type = static_cast<GgufType>(et);
        count = r.read<uint64_t>(fmt::format("the length of key '{}'", key));
      }
      read_values(r, path_, key, v.elem_type, count, v);
      TANDEM_CHECK(!metadata_.contains(key), "gguf '{}': key '{}' appears twice", path_, key);
      keys_.push_back(key);
      metadata_.emplace(std::move(key), std::move(v));
    }

    if (const GgufValue* a = find("general.alignment")) {
      const int64_t al = get_int("general.alignment");
      TANDEM_CHECK(al > 0 && (al & (al - 1)) == 0 && !a->is_array(),
                   "gguf '{}': key 'general.alignment' must be a power of two, found {}", path_,
                   al);
      alignment_ = static_cast<uint64_t>(al);
    }

    tensors_.reserve(static_cast<size_t>(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) {
      GgufTensorInfo t;
      t.name = r.read_string(fmt::format("the name of tensor {}", i));
      const std::string what = fmt::format("tensor '{}'", t.name);
      const uint32_t n_dims = r.read<uint32_t>(what);
      TANDEM_CHECK(n_dims >= 1 && n_dims <= kMaxDimsGguf,
                   "gguf '{}': tensor '{}' has {} dimensions, expected 1 to {}", path_, t.name,
                   n_dims, kMaxDimsGguf);
      int64_t numel = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t n = r.read<uint64_t>(what);
        TANDEM_CHECK(n >= 1 && n <= static_cast<uint64_t>(kMaxElems) &&
                         static_cast<int64_t>(n) <= kMaxElems / numel,
                     "gguf '{}': tensor '{}' has an invalid size {} in dimension {}", path_, t.name,
                     n, d);
        t.ne.push_back(static_cast<int64_t>(n));
        numel *= static_cast<int64_t>(n);
      }
      const uint32_t type = r.read<uint32_t>(what);
      const GgmlTypeTraits* traits = ggml_type_traits(type);
      TANDEM_CHECK(traits != nullptr, "gguf '{}': tensor '{}' has unknown ggml type {}", path_,
                   t.name, type);
      t.type = static_cast<GgmlType>(type);
      TANDEM_CHECK(t.ne[0] % traits->block_size == 0,
                   "gguf '{}': tensor '{}': row length {} is not a multiple of the {} block size "
                   "{}",
                   path_, t.name, t.ne[0], traits->name, traits->block_size);
      t.nbytes = ggml_nbytes(t.type, numel);
      t.offset = r.read<uint64_t>(what);
      TANDEM_CHECK(t.offset % alignment_ == 0,
                   "gguf '{}': tensor '{}' data offset {} is not a multiple of the alignment {}",
                   path_, t.name, t.offset, alignment_);
      TANDEM_CHECK(!tensor_index_.contains(t.name), "gguf '{}': tensor '{}' appears twice", path_,
                   t.name);
      tensor_index_.emplace(t.name, tensors_.size());
      tensors_.push_back(std::move(t));
    }

    const uint64_t data_start = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
    TANDEM_CHECK(data_start <= size_ || tensors_.empty(),
                 "gguf '{}': file truncated: the data section would start at {}, past the end "
                 "({} bytes)",
                 path_, data_start, size_);
    data_ = map_ + std::min<uint64_t>(data_start, size_);
    const uint64_t data_size = size_ - std::min<uint64_t>(data_start, size_);
    for (const GgufTensorInfo& t : tensors_) {
      TANDEM_CHECK(t.offset <= data_size && t.nbytes <= data_size - t.offset,
                   "gguf '{}': tensor '{}' ({} {}, {} bytes at data offset {}) extends past the "
                   "end of the file (data section is {} bytes): file truncated?",
                   path_, t.name, ggml_type_name(static_cast<uint32_t>(t.type)), t.shape(),
                   t.nbytes, t.offset, data_size);
    }
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), size_);
    throw;
  }
}

GgufFile::~GgufFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), size_);
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufValue& GgufFile::at(std::string_view key) const {
  const GgufValue* v = find(key);
  TANDEM_CHECK(v != nullptr, "gguf '{}': metadata key '{}' is missing", path_, key);
  return *v;
}

namespace {
[[noreturn]] void wrong_type(const std::string& path, std::string_view key, const char* expected,
                             const GgufValue& v) {
  TANDEM_FAIL("gguf '{}': metadata key '{}' is {}, expected {}", path, key, describe(v), expected);
}
}  // namespace

std::optional<std::string> GgufFile::find_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->is_array() || v->elem_type != GgufType::string) wrong_type(path_, key, "a string", *v);
  return v->strings[0];
}

std::optional<int64_t> GgufFile::find_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->is_array() || !is_int_type(v->elem_type)) wrong_type(path_, key, "an integer", *v);
  TANDEM_CHECK(v->elem_type != GgufType::u64 || v->ints[0] >= 0,
               "gguf '{}': metadata key '{}' = {} does not fit in an int64", path_, key,
               static_cast<uint64_t>(v->ints[0]));
  return v->ints[0];
}

std::optional<double> GgufFile::find_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->is_array()) wrong_type(path_, key, "a number", *v);
  if (v->elem_type == GgufType::f32 || v->elem_type == GgufType::f64) return v->floats[0];
  if (is_int_type(v->elem_type)) return static_cast<double>(*find_int(key));
  wrong_type(path_, key, "a number", *v);
}

std::optional<bool> GgufFile::find_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->is_array() || v->elem_type != GgufType::boolean) wrong_type(path_, key, "a bool", *v);
  return v->ints[0] != 0;
}

const std::vector<std::string>* GgufFile::find_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return nullptr;
  if (!v->is_array() || v->elem_type != GgufType::string)
    wrong_type(path_, key, "an array of string", *v);
  return &v->strings;
}

const std::vector<int64_t>* GgufFile::find_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return nullptr;
  if (!v->is_array() || !is_int_type(v->elem_type))
    wrong_type(path_, key, "an array of integers", *v);
  return &v->ints;
}

std::optional<std::vector<double>> GgufFile::find_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_array()) wrong_type(path_, key, "an array of numbers", *v);
  if (v->elem_type == GgufType::f32 || v->elem_type == GgufType::f64) return v->floats;
  if (is_int_type(v->elem_type)) return std::vector<double>(v->ints.begin(), v->ints.end());
  wrong_type(path_, key, "an array of numbers", *v);
}

std::string GgufFile::get_string(std::string_view key) const {
  at(key);
  return *find_string(key);
}
int64_t GgufFile::get_int(std::string_view key) const {
  at(key);
  return *find_int(key);
}
double GgufFile::get_float(std::string_view key) const {
  at(key);
  return *find_float(key);
}
bool GgufFile::get_bool(std::string_view key) const {
  at(key);
  return *find_bool(key);
}
const std::vector<std::string>& GgufFile::get_string_array(std::string_view key) const {
  at(key);
  return *find_string_array(key);
}
const std::vector<int64_t>& GgufFile::get_int_array(std::string_view key) const {
  at(key);
  return *find_int_array(key);
}
std::vector<double> GgufFile::get_float_array(std::string_view key) const {
  at(key);
  return *find_float_array(key);
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* t = find_tensor(name);
  TANDEM_CHECK(t != nullptr, "gguf '{}': tensor '{}' is missing", path_, name);
  return *t;
}

void GgufFile::read_tensor(const GgufTensorInfo& t, const Tensor& out) const {
  TANDEM_CHECK(out.numel() == t.numel(), "gguf '{}': tensor '{}' has {} values, {} expected", path_,
               t.name, t.numel(), out.numel());
  dequantize(t.type, tensor_data(t), t.rows(), t.row_len(), out,
             fmt::format("gguf '{}': tensor '{}'", path_, t.name));
}

// ---------------------------------------------------------------------------------------------
// Model config and tokenizer.

namespace {

// Llama-3 rope frequency factors as llama.cpp's converter writes them into rope_freqs.weight.
std::vector<double> llama3_rope_factors(const ops::RopeParams& p, int64_t dim) {
  std::vector<double> out;
  const double low_wavelen = p.original_max_position / p.low_freq_factor;
  const double high_wavelen = p.original_max_position / p.high_freq_factor;
  for (int64_t i = 0; i < dim; i += 2) {
    const double freq = 1.0 / std::pow(static_cast<double>(p.theta), static_cast<double>(i) / dim);
    const double wavelen = 2 * std::numbers::pi / freq;
    if (wavelen < high_wavelen) {
      out.push_back(1.0);
    } else if (wavelen > low_wavelen) {
      out.push_back(p.factor);
    } else {
      const double smooth = (p.original_max_position / wavelen - p.low_freq_factor) /
                            (p.high_freq_factor - p.low_freq_factor);
      out.push_back(1.0 / ((1 - smooth) / p.factor + smooth));
    }
  }
  return out;
}

// Recovers Llama-3 scaling from rope_freqs.weight: the factor is its largest entry; the other
// parameters are those of every Llama 3.x release (or the file's rope.scaling.* keys), checked
// against every entry.
void rope_from_freqs_tensor(const GgufFile& f, const std::string& arch, int64_t head_dim,
                            ops::RopeParams& rope) {
  const GgufTensorInfo& t = f.tensor("rope_freqs.weight");
  const int64_t dim = f.find_int(arch + ".rope.dimension_count").value_or(head_dim);
  TANDEM_CHECK(t.numel() == dim / 2,
               "gguf '{}': tensor 'rope_freqs.weight' has {} values, expected {} (rope dimension "
               "{} / 2)",
               f.path(), t.numel(), dim / 2, dim);
  std::vector<float> got(static_cast<size_t>(t.numel()));
  f.read_tensor(t, Tensor::wrap(got.data(), {t.numel()}, DType::f32));
  float factor = 1;
  for (float g : got) factor = std::max(factor, g);
  if (factor == 1.0f) return;  // all ones: no scaling
  ops::RopeParams p = rope;
  p.factor = factor;
  p.low_freq_factor =
      static_cast<float>(f.find_float(arch + ".rope.scaling.low_freq_factor").value_or(1.0));
  p.high_freq_factor =
      static_cast<float>(f.find_float(arch + ".rope.scaling.high_freq_factor").value_or(4.0));
  p.original_max_position =
      f.find_int(arch + ".rope.scaling.original_context_length").value_or(8192);
  const std::vector<double> want = llama3_rope_factors(p, dim);
  for (size_t i = 0; i < got.size(); ++i) {
    TANDEM_CHECK(std::abs(got[i] - want[i]) <= 1e-3 * want[i],
                 "gguf '{}': tensor 'rope_freqs.weight' entry {} is {}, but Llama-3 scaling with "
                 "factor {}, low_freq_factor {}, high_freq_factor {}, original context {} gives "
                 "{}: this rope scaling is not supported",
                 f.path(), i, got[i], p.factor, p.low_freq_factor, p.high_freq_factor,
                 p.original_max_position, want[i]);
  }
  rope = p;
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& f) {
  ModelConfig c;
  const std::string arch = f.get_string("general.architecture");
  if (arch == "llama") {
    c.arch = Architecture::llama;
  } else if (arch == "qwen2") {
    c.arch = Architecture::qwen2;
    c.attention_bias = true;
  } else if (arch == "qwen3") {
    c.arch = Architecture::qwen3;
    c.qk_norm = true;
  } else {
    TANDEM_FAIL(
        "gguf '{}': metadata key 'general.architecture' is '{}', expected llama, qwen2 or qwen3",
        f.path(), arch);
  }
  const std::string p = arch + ".";
  c.num_layers = f.get_int(p + "block_count");
  c.hidden_size = f.get_int(p + "embedding_length");
  c.intermediate_size = f.get_int(p + "feed_forward_length");
  c.num_heads = f.get_int(p + "attention.head_count");
  c.num_kv_heads = f.find_int(p + "attention.head_count_kv").value_or(c.num_heads);
  c.rms_norm_eps = static_cast<float>(f.get_float(p + "attention.layer_norm_rms_epsilon"));
  c.rope.theta = static_cast<float>(f.find_float(p + "rope.freq_base").value_or(10000.0));
  c.max_position_embeddings = f.get_int(p + "context_length");
  TANDEM_CHECK(c.num_heads > 0, "gguf '{}': key '{}attention.head_count' must be positive, is {}",
               f.path(), p, c.num_heads);
  c.head_dim = f.find_int(p + "attention.key_length").value_or(c.hidden_size / c.num_heads);
  if (const auto* tokens = f.find_string_array("tokenizer.ggml.tokens")) {
    c.vocab_size = static_cast<int64_t>(tokens->size());
  } else {
    c.vocab_size = f.get_int(p + "vocab_size");
  }

  const std::string scaling = f.find_string(p + "rope.scaling.type").value_or("none");
  TANDEM_CHECK(scaling == "none" || scaling == "llama3",
               "gguf '{}': key '{}rope.scaling.type' is '{}'; only Llama-3 scaling (or none) is "
               "supported",
               f.path(), p, scaling);
  if (f.find_tensor("rope_freqs.weight") != nullptr) {
    rope_from_freqs_tensor(f, arch, c.head_dim, c.rope);
  } else if (scaling == "llama3") {
    c.rope.factor = static_cast<float>(f.get_float(p + "rope.scaling.factor"));
    c.rope.low_freq_factor =
        static_cast<float>(f.find_float(p + "rope.scaling.low_freq_factor").value_or(1.0));
    c.rope.high_freq_factor =
        static_cast<float>(f.find_float(p + "rope.scaling.high_freq_factor").value_or(4.0));
    c.rope.original_max_position =
        f.find_int(p + "rope.scaling.original_context_length").value_or(8192);
  }

  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
  if (auto bos = f.find_int("tokenizer.ggml.bos_token_id"))
    c.bos_token_id = static_cast<int32_t>(*bos);
  if (auto eos = f.find_int("tokenizer.ggml.eos_token_id"))
    c.eos_token_ids.push_back(static_cast<int32_t>(*eos));
  if (auto eot = f.find_int("tokenizer.ggml.eot_token_id")) {
    if (c.eos_token_ids.empty() || c.eos_token_ids[0] != *eot)
      c.eos_token_ids.push_back(static_cast<int32_t>(*eot));
  }
  try {
    c.validate();
  } catch (const Error& e) {
    TANDEM_FAIL("gguf '{}': {}", f.path(), e.what());
  }
  return c;
}

TokenizerData tokenizer_data_from_gguf(const GgufFile& f) {
  TokenizerData t;
  t.model = f.get_string("tokenizer.ggml.model");
  TANDEM_CHECK(t.model == "gpt2",
               "gguf '{}': metadata key 'tokenizer.ggml.model' is '{}', expected 'gpt2' (only "
               "byte-level BPE tokenizers are supported)",
               f.path(), t.model);
  t.pre = f.find_string("tokenizer.ggml.pre").value_or("default");
  t.tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (const auto* types = f.find_int_array("tokenizer.ggml.token_type")) {
    TANDEM_CHECK(types->size() == t.tokens.size(),
                 "gguf '{}': key 'tokenizer.ggml.token_type' has {} entries, expected {} (one "
                 "per token)",
                 f.path(), types->size(), t.tokens.size());
    t.token_types.reserve(types->size());
    for (size_t i = 0; i < types->size(); ++i) {
      const int64_t v = (*types)[i];
      TANDEM_CHECK(v >= 1 && v <= 6,
                   "gguf '{}': key 'tokenizer.ggml.token_type' entry {} is {}, expected 1 to 6 "
                   "(normal, unknown, control, user_defined, unused, byte)",
                   f.path(), i, v);
      t.token_types.push_back(static_cast<TokenType>(v));
    }
  }
  if (const auto* merges = f.find_string_array("tokenizer.ggml.merges")) {
    t.merges.reserve(merges->size());
    for (size_t i = 0; i < merges->size(); ++i) {
      const std::string& m = (*merges)[i];
      const size_t sp = m.find(' ');
      TANDEM_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < m.size(),
                   "gguf '{}': key 'tokenizer.ggml.merges' entry {} is '{}', expected two tokens "
                   "separated by a space",
                   f.path(), i, m);
      t.merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
    }
  }
  const auto vocab = static_cast<int64_t>(t.tokens.size());
  auto id = [&](const char* key) {
    const auto v = f.find_int(key);
    if (!v) return int32_t{-1};
    TANDEM_CHECK(*v >= 0 && *v < vocab, "gguf '{}': key '{}' is {}, outside the vocabulary [0, {})",
                 f.path(), key, *v, vocab);
    return static_cast<int32_t>(*v);
  };
  t.bos_id = id("tokenizer.ggml.bos_token_id");
  t.eos_id = id("tokenizer.ggml.eos_token_id");
  t.pad_id = id("tokenizer.ggml.padding_token_id");
  t.unk_id = id("tokenizer.ggml.unknown_token_id");
  t.add_bos = f.find_bool("tokenizer.ggml.add_bos_token").value_or(false);
  t.chat_template = f.find_string("tokenizer.chat_template").value_or("");
  return t;
}

// ---------------------------------------------------------------------------------------------
// Weights.

std::string gguf_tensor_name(std::string_view hf) {
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  constexpr std::string_view kLayers = "model.layers.";
  TANDEM_CHECK(hf.starts_with(kLayers), "no GGUF name for parameter '{}'", hf);
  const size_t dot = hf.find('.', kLayers.size());
  TANDEM_CHECK(dot != std::string_view::npos, "no GGUF name for parameter '{}'", hf);
  const std::string_view layer = hf.substr(kLayers.size(), dot - kLayers.size());
  const std::string_view rest = hf.substr(dot + 1);
  static constexpr std::pair<std::string_view, std::string_view> kMap[] = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  for (const auto& [h, g] : kMap)
    if (rest == h) return fmt::format("blk.{}.{}", layer, g);
  TANDEM_FAIL("no GGUF name for parameter '{}'", hf);
}

std::vector<int64_t> llama_qk_gguf_to_hf_rows(int64_t heads, int64_t head_dim) {
  TANDEM_CHECK(head_dim % 2 == 0, "head_dim {} must be even", head_dim);
  std::vector<int64_t> rows(static_cast<size_t>(heads * head_dim));
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t a = 0; a < 2; ++a)
        rows[static_cast<size_t>(h * head_dim + 2 * i + a)] = h * head_dim + a * half + i;
  return rows;
}

void load_gguf_weights(const GgufFile& f, Weights& w) {
  const ModelConfig& c = w.config();
  TANDEM_CHECK(w.device().is_cpu(), "gguf '{}': weights must be on the CPU to load, not {}",
               f.path(), w.device().str());
  const std::vector<int64_t> q_rows = c.arch == Architecture::llama
                                          ? llama_qk_gguf_to_hf_rows(c.num_heads, c.head_dim)
                                          : std::vector<int64_t>{};
  const std::vector<int64_t> k_rows = c.arch == Architecture::llama
                                          ? llama_qk_gguf_to_hf_rows(c.num_kv_heads, c.head_dim)
                                          : std::vector<int64_t>{};
  std::unordered_set<std::string> used;
  // Check everything before decoding anything: no partial result on bad input.
  struct Job {
    const GgufTensorInfo* info;
    const NamedTensor* dst;
  };
  std::vector<Job> jobs;
  for (const NamedTensor& nt : w.named()) {
    const std::string g = gguf_tensor_name(nt.name);
    const GgufTensorInfo* info = f.find_tensor(g);
    TANDEM_CHECK(info != nullptr, "gguf '{}': tensor '{}' ({}, shape {}) is missing", f.path(), g,
                 nt.name, nt.tensor.shape());
    TANDEM_CHECK(info->shape() == nt.tensor.shape(),
                 "gguf '{}': tensor '{}' ({}) has shape {} (ne {}), expected {}", f.path(), g,
                 nt.name, info->shape(), fmt::join(info->ne, ", "), nt.tensor.shape());
    const GgmlTypeTraits* traits = ggml_type_traits(static_cast<uint32_t>(info->type));
    TANDEM_CHECK(traits->decodable,
                 "gguf '{}': tensor '{}' has type {}, which is not supported (supported: F32, F16, "
                 "BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)",
                 f.path(), g, traits->name);
    used.insert(g);
    jobs.push_back({info, &nt});
  }
  for (const GgufTensorInfo& t : f.tensors()) {
    TANDEM_CHECK(used.contains(t.name) || t.name == "rope_freqs.weight",
                 "gguf '{}': tensor '{}' is not a parameter of this {} model (L={}, tied={})",
                 f.path(), t.name, architecture_name(c.arch), c.num_layers, c.tie_word_embeddings);
  }
  for (const Job& j : jobs) {
    std::span<const int64_t> order;
    if (j.dst->name.ends_with("self_attn.q_proj.weight")) order = q_rows;
    if (j.dst->name.ends_with("self_attn.k_proj.weight")) order = k_rows;
    dequantize(j.info->type, f.tensor_data(*j.info), j.info->rows(), j.info->row_len(),
               j.dst->tensor, fmt::format("gguf '{}': tensor '{}'", f.path(), j.info->name), order);
  }
}

GgufModel load_gguf_model(const std::string& path, DType dtype) {
  const auto start = std::chrono::steady_clock::now();
  GgufFile f(path);
  GgufModel m;
  m.config = config_from_gguf(f);
  m.tokenizer = tokenizer_data_from_gguf(f);
  m.weights = std::make_unique<Weights>(m.config, dtype);
  load_gguf_weights(f, *m.weights);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("loaded {} ({} model, {} parameters, {}) in {:.3f} s", path,
               architecture_name(m.config.arch), m.weights->num_parameters(), dtype, s);
  return m;
}

std::unique_ptr<Weights> load_gguf(const std::string& path, DType dtype, ModelConfig* config_out) {
  GgufFile f(path);
  const ModelConfig c = config_from_gguf(f);
  auto w = std::make_unique<Weights>(c, dtype);
  load_gguf_weights(f, *w);
  if (config_out != nullptr) *config_out = c;
  return w;
}

}  // namespace tandem::model
