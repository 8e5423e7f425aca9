// Safetensors: reading (memory-mapped, every bound checked) and writing Hugging Face's
// .safetensors files, one file or a sharded set with a model.safetensors.index.json.
//
// Format: 8-byte little-endian header size N, N bytes of JSON {"__metadata__": {str: str},
// name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}, then the data;
// offsets count from the end of the header.
#pragma once

#include <cstddef>
#include <cstdio>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/weights.h"

namespace tandem::model {

// Safetensors dtype names ("F32", "BF16", "F16", "I32", "I64", "U8") and back; the parser
// throws tandem::Error naming `where` and the accepted names.
const char* safetensors_dtype_name(DType t);
DType safetensors_dtype_from_name(std::string_view name, const std::string& where);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  size_t begin = 0;  // byte offsets into the data section, end - begin == numel * dtype size
  size_t end = 0;
};

// One .safetensors file, mapped read-only into memory (copy-on-write: writing through a view
// never reaches the file). Opening checks the whole header; any inconsistency throws one
// tandem::Error naming the file and the tensor.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Every tensor, in the order of its data in the file.
  const std::vector<SafetensorsEntry>& tensors() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The entry named so, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const;
  // The entry named so; throws tandem::Error naming the file and the tensor otherwise.
  const SafetensorsEntry& at(std::string_view name) const;

  // A CPU tensor borrowing the mapped bytes, valid while this file is open; an aligned copy
  // when the file does not align the data for its dtype (mixed dtypes written back to back).
  Tensor view(std::string_view name) const;
  // Copies the tensor into dst (same shape, any device). Float dtypes (F32/BF16/F16) cast to
  // dst's float dtype; other dtypes must match exactly.
  void read_into(std::string_view name, const Tensor& dst) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const char* data_ = nullptr;  // start of the data section
  std::vector<SafetensorsEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: one .safetensors file or the shards a model.safetensors.index.json names.
class SafetensorsCheckpoint {
 public:
  // path: a .safetensors file, a *.safetensors.index.json, or a directory holding
  // model.safetensors.index.json or model.safetensors.
  explicit SafetensorsCheckpoint(const std::string& path);

  // The file or index opened.
  const std::string& path() const { return path_; }
  // Every tensor name: shard by shard, each in file order.
  const std::vector<std::string>& names() const { return names_; }
  const SafetensorsEntry* find(std::string_view name) const;
  // The file holding the tensor; throws tandem::Error naming the checkpoint and the tensor.
  const SafetensorsFile& file_of(std::string_view name) const;
  const SafetensorsEntry& at(std::string_view name) const { return file_of(name).at(name); }
  Tensor view(std::string_view name) const { return file_of(name).view(name); }
  void read_into(std::string_view name, const Tensor& dst) const {
    file_of(name).read_into(name, dst);
  }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, size_t> file_index_;  // name -> files_ index
};

// A .safetensors file written a tensor at a time: the header from every tensor's name, dtype and
// shape (SafetensorsEntry's offsets are computed), then append() each tensor's data in that order,
// then finish() (to path + ".tmp", flushed, renamed to path). Destroyed unfinished, it removes
// the .tmp file. For data that never sits whole in memory (a sharded trainer's gathered units).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The next tensor's data (any device, contiguous; the dtype and shape of its entry).
  void append(const Tensor& t);
  void finish();

 private:
  void put(const void* data, size_t n);
  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  size_t next_ = 0;
  std::FILE* file_ = nullptr;
  bool ok_ = true;
  std::string why_;
};

// Writes the tensors (any device, contiguous) in the given order, back to back (the format allows
// no gaps), the header padded with spaces to a multiple of 8 bytes as HF does. Written to path +
// ".tmp", flushed, then renamed to path.
void write_safetensors(const std::string& path, std::span<const NamedTensor> tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace tandem::model
