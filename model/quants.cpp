// Quants: ggml's block layouts decoded exactly as ggml's dequantize_row_* functions do.
#include "model/quants.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/parallel.h"

namespace tandem::model {
namespace {

constexpr int64_t kQK = 32;     // values per Q4_0 / Q4_1 / Q8_0 block
constexpr int64_t kQK_K = 256;  // values per K-quant super-block

struct TypeEntry {
  uint32_t id;
  GgmlTypeTraits traits;
};

// ggml.c's type_traits: block sizes and bytes of every type a GGUF file may hold.
constexpr std::array kTypes = {
    TypeEntry{0, {"F32", 1, 4, true}},          TypeEntry{1, {"F16", 1, 2, true}},
    TypeEntry{2, {"Q4_0", 32, 18, true}},       TypeEntry{3, {"Q4_1", 32, 20, true}},
    TypeEntry{6, {"Q5_0", 32, 22, false}},      TypeEntry{7, {"Q5_1", 32, 24, false}},
    TypeEntry{8, {"Q8_0", 32, 34, true}},       TypeEntry{9, {"Q8_1", 32, 36, false}},
    TypeEntry{10, {"Q2_K", 256, 84, false}},    TypeEntry{11, {"Q3_K", 256, 110, false}},
    TypeEntry{12, {"Q4_K", 256, 144, true}},    TypeEntry{13, {"Q5_K", 256, 176, false}},
    TypeEntry{14, {"Q6_K", 256, 210, true}},    TypeEntry{15, {"Q8_K", 256, 292, false}},
    TypeEntry{16, {"IQ2_XXS", 256, 66, false}}, TypeEntry{17, {"IQ2_XS", 256, 74, false}},
    TypeEntry{18, {"IQ3_XXS", 256, 98, false}}, TypeEntry{19, {"IQ1_S", 256, 50, false}},
    TypeEntry{20, {"IQ4_NL", 32, 18, false}},   TypeEntry{21, {"IQ3_S", 256, 110, false}},
    TypeEntry{22, {"IQ2_S", 256, 82, false}},   TypeEntry{23, {"IQ4_XS", 256, 136, false}},
    TypeEntry{24, {"I8", 1, 1, false}},         TypeEntry{25, {"I16", 1, 2, false}},
    TypeEntry{26, {"I32", 1, 4, false}},        TypeEntry{27, {"I64", 1, 8, false}},
    TypeEntry{28, {"F64", 1, 8, false}},        TypeEntry{29, {"IQ1_M", 256, 56, false}},
    TypeEntry{30, {"BF16", 1, 2, true}},        TypeEntry{34, {"TQ1_0", 256, 54, false}},
    TypeEntry{35, {"TQ2_0", 256, 66, false}},   TypeEntry{39, {"MXFP4", 32, 17, false}},
};

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float load_f16(const uint8_t* p) { return f16_bits_to_f32(load_u16(p)); }

// block_q8_0: f16 d, int8 qs[32]; value = qs * d.
void decode_q8_0(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int64_t j = 0; j < kQK; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// block_q4_0: f16 d, uint8 qs[16]; element j is the low nibble of qs[j], element j + 16 the high
// one; value = (nibble - 8) * d.
void decode_q4_0(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const uint8_t* qs = b + 2;
  for (int64_t j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
    y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// block_q4_1: f16 d, f16 m, uint8 qs[16]; value = nibble * d + m.
void decode_q4_1(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const float m = load_f16(b + 2);
  const uint8_t* qs = b + 4;
  for (int64_t j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    y[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// ggml's get_scale_min_k4: eight 6-bit scales and mins packed in 12 bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// block_q4_K: f16 d, f16 dmin, uint8 scales[12], uint8 qs[128]; 8 sub-blocks of 32 values, each
// 64-value chunk holding two sub-blocks in the low and high nibbles of 32 bytes.
void decode_q4_k(const uint8_t* b, float* y) {
  const float d = load_f16(b);
  const float dmin = load_f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int64_t j = 0; j < kQK_K; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0f) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

// block_q6_K: uint8 ql[128] (low 4 bits), uint8 qh[64] (high 2 bits), int8 scales[16], f16 d;
// value = d * scale * (q - 32), 16 sub-blocks of 16 values.
void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_f16(b + 208);
  for (int64_t n = 0; n < kQK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

template <void (*Decode)(const uint8_t*, float*)>
void decode_blocks(const uint8_t* src, int64_t n, int64_t block_size, size_t block_bytes,
                   float* dst) {
  for (int64_t i = 0; i < n / block_size; ++i) Decode(src + i * block_bytes, dst + i * block_size);
}

}  // namespace

const GgmlTypeTraits* ggml_type_traits(uint32_t type) {
  for (const TypeEntry& e : kTypes)
    if (e.id == type) return &e.traits;
  return nullptr;
}

std::string ggml_type_name(uint32_t type) {
  const GgmlTypeTraits* t = ggml_type_traits(type);
  return t != nullptr ? std::string(t->name) : fmt::format("unknown({})", type);
}

size_t ggml_nbytes(GgmlType type, int64_t n) {
  const GgmlTypeTraits* t = ggml_type_traits(static_cast<uint32_t>(type));
  TANDEM_CHECK(t != nullptr, "ggml type {} is unknown", static_cast<uint32_t>(type));
  TANDEM_CHECK(n >= 0 && n % t->block_size == 0, "{} values are not whole {} blocks of {}", n,
               t->name, t->block_size);
  return static_cast<size_t>(n / t->block_size) * t->block_bytes;
}

void dequantize_row(GgmlType type, const void* src, int64_t n, float* dst, std::string_view what) {
  const uint32_t id = static_cast<uint32_t>(type);
  const GgmlTypeTraits* t = ggml_type_traits(id);
  TANDEM_CHECK(t != nullptr && t->decodable,
               "{}: tensor type {} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
               "Q4_K, Q6_K)",
               what, ggml_type_name(id));
  TANDEM_CHECK(n % t->block_size == 0,
               "{}: a row of {} values is not a whole number of {} blocks of {}", what, n, t->name,
               t->block_size);
  if (n == 0) return;
  const auto* s = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::f32:
      std::memcpy(dst, s, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::f16:
      for (int64_t i = 0; i < n; ++i) dst[i] = load_f16(s + 2 * i);
      return;
    case GgmlType::bf16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(load_u16(s + 2 * i));
      return;
    case GgmlType::q8_0:
      return decode_blocks<decode_q8_0>(s, n, t->block_size, t->block_bytes, dst);
    case GgmlType::q4_0:
      return decode_blocks<decode_q4_0>(s, n, t->block_size, t->block_bytes, dst);
    case GgmlType::q4_1:
      return decode_blocks<decode_q4_1>(s, n, t->block_size, t->block_bytes, dst);
    case GgmlType::q4_k:
      return decode_blocks<decode_q4_k>(s, n, t->block_size, t->block_bytes, dst);
    case GgmlType::q6_k:
      return decode_blocks<decode_q6_k>(s, n, t->block_size, t->block_bytes, dst);
    default:
      TANDEM_FAIL("{}: tensor type {} has no decoder", what, t->name);
  }
}

void dequantize(GgmlType type, const void* src, int64_t rows, int64_t row_len, const Tensor& out,
                std::string_view what, std::span<const int64_t> row_order) {
  TANDEM_CHECK(out.device().is_cpu() && dtype_is_float(out.dtype()),
               "{}: dequantize writes CPU f32/bf16/f16 tensors, not {}", what, out.str());
  TANDEM_CHECK(out.numel() == rows * row_len, "{}: {} x {} values do not fit {}", what, rows,
               row_len, out.str());
  TANDEM_CHECK(row_order.empty() || static_cast<int64_t>(row_order.size()) == rows,
               "{}: row order has {} entries for {} rows", what, row_order.size(), rows);
  const size_t row_bytes = ggml_nbytes(type, row_len);
  // Fail before the parallel region: errors must not escape OpenMP threads.
  dequantize_row(type, src, 0, nullptr, what);
  const auto* s = static_cast<const uint8_t*>(src);
  const DType dtype = out.dtype();
  char* base = static_cast<char*>(out.data());
  const size_t out_row_bytes = static_cast<size_t>(row_len) * dtype_size(dtype);
  parallel_for(
      rows,
      [&](int64_t begin, int64_t end) {
        std::vector<float> buf(dtype == DType::f32 ? 0 : static_cast<size_t>(row_len));
        for (int64_t r = begin; r < end; ++r) {
          const int64_t dst_row = row_order.empty() ? r : row_order[static_cast<size_t>(r)];
          char* dst = base + static_cast<size_t>(dst_row) * out_row_bytes;
          float* f = dtype == DType::f32 ? reinterpret_cast<float*>(dst) : buf.data();
          dequantize_row(type, s + static_cast<size_t>(r) * row_bytes, row_len, f, what);
          if (dtype == DType::bf16) {
            auto* o = reinterpret_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < row_len; ++i) o[i] = f32_to_bf16_bits(f[i]);
          } else if (dtype == DType::f16) {
            auto* o = reinterpret_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < row_len; ++i) o[i] = f32_to_f16_bits(f[i]);
          }
        }
      },
      std::max<int64_t>(1, 65536 / std::max<int64_t>(row_len, 1)));
}

}  // namespace tandem::model
