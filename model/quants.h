// Quants: ggml tensor types (block sizes, names) and their decoders to f32, bf16 or f16 rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "core/tensor.h"

namespace tandem::model {

// ggml's type ids, as stored in GGUF tensor infos (ggml.h, enum ggml_type).
enum class GgmlType : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  iq2_xxs = 16,
  iq2_xs = 17,
  iq3_xxs = 18,
  iq1_s = 19,
  iq4_nl = 20,
  iq3_s = 21,
  iq2_s = 22,
  iq4_xs = 23,
  i8 = 24,
  i16 = 25,
  i32 = 26,
  i64 = 27,
  f64 = 28,
  iq1_m = 29,
  bf16 = 30,
  tq1_0 = 34,
  tq2_0 = 35,
  mxfp4 = 39,
};

struct GgmlTypeTraits {
  const char* name;    // "Q4_K", as ggml names it
  int64_t block_size;  // values per block
  size_t block_bytes;  // bytes per block
  bool decodable;      // dequantize() supports it
};

// The traits of a ggml type id, or nullptr when the id is not one ggml defines.
const GgmlTypeTraits* ggml_type_traits(uint32_t type);
// "Q4_K", or "unknown(<id>)".
std::string ggml_type_name(uint32_t type);
// Bytes of n values (n a multiple of the block size); throws for an unknown type.
size_t ggml_nbytes(GgmlType type, int64_t n);

// Decodes n values (a multiple of the type's block size) of a row at src to f32. `what` names the
// tensor in errors (an unsupported type or a bad length).
void dequantize_row(GgmlType type, const void* src, int64_t n, float* dst, std::string_view what);

// Decodes rows (rows, row_len) of src into out (CPU, f32/bf16/f16, rows * row_len values). Row r
// of src goes to row row_order[r] of out when row_order is not empty. Parallel over rows.
void dequantize(GgmlType type, const void* src, int64_t rows, int64_t row_len, const Tensor& out,
                std::string_view what, std::span<const int64_t> row_order = {});

}  // namespace tandem::model
