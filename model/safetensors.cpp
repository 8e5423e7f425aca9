// Safetensors reading (mmap, checked header) and writing (padded header, atomic rename).
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;

// The Rust reference refuses headers above 100 MB; so do we (a corrupt size is caught early).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {{DType::f32, "F32"}, {DType::bf16, "BF16"},
                                     {DType::f16, "F16"}, {DType::i32, "I32"},
                                     {DType::i64, "I64"}, {DType::u8, "U8"}};

std::string json_type(const nlohmann::json& j) { return j.type_name(); }

// Reads a non-negative integer out of a header value.
uint64_t header_uint(const nlohmann::json& j, const std::string& path, const std::string& name,
                     const char* field) {
  if (!j.is_number_unsigned()) {
    TANDEM_FAIL("{}: tensor '{}': {} must hold non-negative integers, found {}", path, name, field,
                j.dump());
  }
  return j.get<uint64_t>();
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

const char* safetensors_dtype_name(DType t) {
  for (const DTypeName& d : kDTypeNames)
    if (d.dtype == t) return d.name;
  TANDEM_FAIL("safetensors: no name for dtype {}", t);
}

DType safetensors_dtype_from_name(std::string_view name, const std::string& where) {
  for (const DTypeName& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  TANDEM_FAIL("{}: dtype '{}' is not supported (expected F32, BF16, F16, I32, I64 or U8)", where,
              name);
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TANDEM_CHECK(fd >= 0, "{}: cannot open safetensors file: {}", path, errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    TANDEM_FAIL("{}: cannot stat safetensors file: {}", path, why);
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    TANDEM_FAIL("{}: not a safetensors file: {} bytes, expected at least 8 (the header size)", path,
                file_bytes);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TANDEM_CHECK(map != MAP_FAILED, "{}: cannot map safetensors file: {}", path,
               std::strerror(map_errno));
  map_ = map;
  map_bytes_ = file_bytes;

  // From here on a failure must unmap before it propagates.
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[i];
    TANDEM_CHECK(header_bytes <= kMaxHeaderBytes && header_bytes <= file_bytes - 8,
                 "{}: header size {} bytes runs past the end of the file ({} bytes) or above the "
                 "100 MB limit: the file is truncated or not safetensors",
                 path, header_bytes, file_bytes);
    const size_t data_bytes = file_bytes - 8 - header_bytes;
    data_ = static_cast<const char*>(map_) + 8 + header_bytes;

    nlohmann::json header;
    try {
      header = nlohmann::json::parse(reinterpret_cast<const char*>(bytes + 8),
                                     reinterpret_cast<const char*>(bytes + 8 + header_bytes));
    } catch (const nlohmann::json::exception& e) {
      TANDEM_FAIL("{}: the safetensors header is not valid JSON: {}", path, e.what());
    }
    TANDEM_CHECK(header.is_object(), "{}: the safetensors header must be a JSON object, found {}",
                 path, json_type(header));

    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const nlohmann::json& v = it.value();
      if (name == "__metadata__") {
        TANDEM_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings, found {}", path,
                     json_type(v));
        for (auto m = v.begin(); m != v.end(); ++m) {
          TANDEM_CHECK(m.value().is_string(),
                       "{}: __metadata__ entry '{}' must be a string, found {}", path, m.key(),
                       json_type(m.value()));
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      TANDEM_CHECK(
          v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
          "{}: tensor '{}': expected an object with dtype, shape and data_offsets, "
          "found {}",
          path, name, v.dump());
      const nlohmann::json& jd = v["dtype"];
      const nlohmann::json& js = v["shape"];
      const nlohmann::json& jo = v["data_offsets"];
      TANDEM_CHECK(jd.is_string(), "{}: tensor '{}': dtype must be a string, found {}", path, name,
                   jd.dump());
      SafetensorsEntry e;
      e.name = name;
      e.dtype = safetensors_dtype_from_name(jd.get<std::string>(),
                                            fmt::format("{}: tensor '{}'", path, name));
      TANDEM_CHECK(js.is_array() && js.size() <= static_cast<size_t>(kMaxDims),
                   "{}: tensor '{}': shape must be an array of at most {} sizes, found {}", path,
                   name, kMaxDims, js.dump());
      uint64_t numel = 1;
      for (const nlohmann::json& d : js) {
        uint64_t n = header_uint(d, path, name, "shape");
        TANDEM_CHECK(n == 0 || numel <= (uint64_t{1} << 62) / n,
                     "{}: tensor '{}': shape {} is too large", path, name, js.dump());
        numel *= n;
        e.shape.push_back(static_cast<int64_t>(n));
      }
      TANDEM_CHECK(jo.is_array() && jo.size() == 2,
                   "{}: tensor '{}': data_offsets must be [begin, end], found {}", path, name,
                   jo.dump());
      const uint64_t begin = header_uint(jo[0], path, name, "data_offsets");
      const uint64_t end = header_uint(jo[1], path, name, "data_offsets");
      TANDEM_CHECK(begin <= end && end <= data_bytes,
                   "{}: tensor '{}': data_offsets [{}, {}] lie outside the {} bytes of data (the "
                   "file is truncated or corrupt)",
                   path, name, begin, end, data_bytes);
      const uint64_t expected = numel * dtype_size(e.dtype);
      TANDEM_CHECK(end - begin == expected,
                   "{}: tensor '{}': data_offsets [{}, {}] hold {} bytes, but shape {} of {} needs "
                   "{} bytes",
                   path, name, begin, end, end - begin, e.shape, jd.get<std::string>(), expected);
      e.begin = begin;
      e.end = end;
      entries_.push_back(std::move(e));
    }
    std::stable_sort(
        entries_.begin(), entries_.end(),
        [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.begin < b.begin; });
    for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const SafetensorsEntry& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  TANDEM_CHECK(e != nullptr, "{}: no tensor named '{}'", path_, name);
  return *e;
}

Tensor SafetensorsFile::view(std::string_view name) const {
  const SafetensorsEntry& e = at(name);
  // Tensors of mixed dtypes written back to back need not be aligned for their element type:
  // hand out an aligned copy then.
  const char* p = data_ + e.begin;
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0)
    return Tensor::wrap(const_cast<char*>(p), e.shape, e.dtype);
  Tensor copy = Tensor::empty(e.shape, e.dtype);
  if (e.end > e.begin) std::memcpy(copy.data(), p, e.end - e.begin);
  return copy;
}

void SafetensorsFile::read_into(std::string_view name, const Tensor& dst) const {
  const SafetensorsEntry& e = at(name);
  TANDEM_CHECK(e.shape == dst.shape(), "{}: tensor '{}' has shape {}, expected {}", path_, name,
               e.shape, dst.shape());
  const Tensor src = view(name);
  Tensor out = dst;  // a handle to dst's memory
  if (e.dtype == dst.dtype()) {
    out.copy_from(src);
    return;
  }
  TANDEM_CHECK(dtype_is_float(e.dtype) && dtype_is_float(dst.dtype()),
               "{}: tensor '{}' is {}, expected {} (only float dtypes convert)", path_, name,
               safetensors_dtype_name(e.dtype), safetensors_dtype_name(dst.dtype()));
  if (dst.device().is_cpu()) {
    ops::cast(src, dst);
  } else {
    Tensor tmp = Tensor::empty(e.shape, dst.dtype());
    ops::cast(src, tmp);
    out.copy_from(tmp);
  }
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p)) {
    if (fs::exists(p / "model.safetensors.index.json")) {
      p /= "model.safetensors.index.json";
    } else if (fs::exists(p / "model.safetensors")) {
      p /= "model.safetensors";
    } else {
      TANDEM_FAIL("{}: no model.safetensors or model.safetensors.index.json in this directory",
                  path);
    }
  }
  path_ = p.string();
  TANDEM_CHECK(fs::exists(p), "{}: no such file", path_);

  const std::string fname = p.filename().string();
  const bool is_index = fname.size() > 5 && fname.ends_with(".json");
  if (!is_index) {
    files_.push_back(std::make_unique<SafetensorsFile>(path_));
    for (const SafetensorsEntry& e : files_[0]->tensors()) {
      names_.push_back(e.name);
      file_index_.emplace(e.name, 0);
    }
    return;
  }

  nlohmann::json index;
  {
    std::ifstream in(p);
    TANDEM_CHECK(in.good(), "{}: cannot open the index", path_);
    try {
      index = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TANDEM_FAIL("{}: the index is not valid JSON: {}", path_, e.what());
    }
  }
  TANDEM_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               "{}: expected an object with a weight_map object (tensor name -> shard file)",
               path_);
  const nlohmann::json& weight_map = index["weight_map"];
  // Shards in first-mention order of a sorted walk are not file order; sort shard names so the
  // numbered HF shards come in order.
  std::map<std::string, std::vector<std::string>> by_shard;
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    TANDEM_CHECK(it.value().is_string(), "{}: weight_map entry '{}' must be a file name, found {}",
                 path_, it.key(), it.value().dump());
    const std::string shard = it.value().get<std::string>();
    TANDEM_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "..",
                 "{}: weight_map entry '{}': shard '{}' must be a file name in the same directory",
                 path_, it.key(), shard);
    by_shard[shard].push_back(it.key());
  }
  for (const auto& [shard, wanted] : by_shard) {
    const size_t fi = files_.size();
    files_.push_back(std::make_unique<SafetensorsFile>((p.parent_path() / shard).string()));
    const SafetensorsFile& f = *files_.back();
    for (const std::string& name : wanted) {
      TANDEM_CHECK(f.find(name) != nullptr,
                   "{}: weight_map puts tensor '{}' in {}, but that file has no such tensor", path_,
                   name, f.path());
    }
    for (const SafetensorsEntry& e : f.tensors()) {
      if (!weight_map.contains(e.name) || weight_map[e.name].get<std::string>() != shard) continue;
      names_.push_back(e.name);
      file_index_.emplace(e.name, fi);
    }
  }
}

const SafetensorsEntry* SafetensorsCheckpoint::find(std::string_view name) const {
  auto it = file_index_.find(std::string(name));
  return it == file_index_.end() ? nullptr : files_[it->second]->find(name);
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(std::string_view name) const {
  auto it = file_index_.find(std::string(name));
  TANDEM_CHECK(it != file_index_.end(), "{}: no tensor named '{}'", path_, name);
  return *files_[it->second];
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (SafetensorsEntry& e : entries_) {
    TANDEM_CHECK(e.name != "__metadata__" && !header.contains(e.name),
                 "{}: tensor name '{}' is reserved or used twice", path_, e.name);
    nlohmann::ordered_json shape = nlohmann::ordered_json::array();
    for (int d = 0; d < e.shape.ndim(); ++d) shape.push_back(e.shape[d]);
    e.begin = offset;
    e.end = offset + static_cast<size_t>(e.shape.numel()) * dtype_size(e.dtype);
    header[e.name] = {{"dtype", safetensors_dtype_name(e.dtype)},
                      {"shape", shape},
                      {"data_offsets", {e.begin, e.end}}};
    offset = e.end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  file_ = std::fopen((path_ + ".tmp").c_str(), "wb");
  TANDEM_CHECK(file_ != nullptr, "{}: cannot create: {}", path_ + ".tmp", errno_text());
  unsigned char size_le[8];
  for (int i = 0; i < 8; ++i) size_le[i] = static_cast<unsigned char>(text.size() >> (8 * i));
  put(size_le, 8);
  put(text.data(), text.size());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ == nullptr) return;
  std::fclose(file_);
  std::remove((path_ + ".tmp").c_str());
}

void SafetensorsWriter::put(const void* data, size_t n) {
  if (ok_ && n > 0 && std::fwrite(data, 1, n, file_) != n) {
    ok_ = false;
    why_ = errno_text();
  }
}

void SafetensorsWriter::append(const Tensor& t) {
  TANDEM_CHECK(file_ != nullptr && next_ < entries_.size(),
               "{}: every tensor of the header is written already", path_);
  const SafetensorsEntry& e = entries_[next_];
  TANDEM_CHECK(t.defined(), "{}: tensor '{}' is undefined", path_, e.name);
  TANDEM_CHECK(t.dtype() == e.dtype && t.shape() == e.shape,
               "{}: tensor '{}' is {} {}, its header says {} {}", path_, e.name, t.dtype(),
               t.shape(), e.dtype, e.shape);
  if (t.device().is_cpu()) {
    put(t.data(), t.nbytes());
  } else {
    const Tensor host = t.to(Device::cpu());
    put(host.data(), host.nbytes());
  }
  ++next_;
}

void SafetensorsWriter::finish() {
  TANDEM_CHECK(file_ != nullptr && next_ == entries_.size(),
               "{}: {} of its {} tensors written, finish() needs them all", path_, next_,
               entries_.size());
  const std::string tmp = path_ + ".tmp";
  bool ok = ok_ && std::fflush(file_) == 0 && ::fsync(fileno(file_)) == 0;
  const std::string why = ok ? "" : (why_.empty() ? errno_text() : why_);
  ok = (std::fclose(file_) == 0) && ok;
  file_ = nullptr;
  if (!ok || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    const std::string reason = why.empty() ? errno_text() : why;
    std::remove(tmp.c_str());
    TANDEM_FAIL("{}: cannot write safetensors file: {}", path_, reason);
  }
}

void write_safetensors(const std::string& path, std::span<const NamedTensor> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  for (const NamedTensor& t : tensors) {
    TANDEM_CHECK(t.tensor.defined(), "{}: tensor '{}' is undefined", path, t.name);
    entries.push_back({t.name, t.tensor.dtype(), t.tensor.shape()});
  }
  SafetensorsWriter writer(path, std::move(entries), metadata);
  for (const NamedTensor& t : tensors) writer.append(t.tensor);
  writer.finish();
}

}  // namespace tandem::model
