// Tests of model/quants: each ggml block layout decoded to values computed here from the format.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "core/half.h"
#include "model/quants.h"

using namespace tandem;
using namespace tandem::model;

namespace {

void put_u16(std::vector<uint8_t>& b, uint16_t v) {
  b.push_back(static_cast<uint8_t>(v & 0xff));
  b.push_back(static_cast<uint8_t>(v >> 8));
}
void put_f16(std::vector<uint8_t>& b, float v) { put_u16(b, f32_to_f16_bits(v)); }

std::vector<float> decode(GgmlType t, const std::vector<uint8_t>& bytes, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(t, bytes.data(), n, out.data(), "test tensor");
  return out;
}

}  // namespace

TEST_CASE("quants decode F32 F16 and BF16 rows", "[unit]") {
  const std::vector<float> f32 = {1.5f, -2.25f, 3e-5f, 1e6f};
  std::vector<uint8_t> b(16);
  std::memcpy(b.data(), f32.data(), 16);
  CHECK(decode(GgmlType::f32, b, 4) == f32);
  b.clear();
  for (uint16_t h : {0x3c00, 0xc000, 0x3800, 0x0001}) put_u16(b, h);  // 1, -2, 0.5, 2^-24
  CHECK(decode(GgmlType::f16, b, 4) == std::vector<float>{1.0f, -2.0f, 0.5f, 0x1p-24f});
  b.clear();
  for (uint16_t h : {0x3f80, 0xc040, 0x4120, 0x3e00}) put_u16(b, h);  // 1, -3, 10, 0.125
  CHECK(decode(GgmlType::bf16, b, 4) == std::vector<float>{1.0f, -3.0f, 10.0f, 0.125f});
}

TEST_CASE("quants decode Q8_0 blocks as d times int8", "[unit]") {
  std::vector<uint8_t> b;
  for (int blk = 0; blk < 2; ++blk) {
    put_f16(b, blk == 0 ? 0.5f : -0.25f);
    for (int j = 0; j < 32; ++j)
      b.push_back(static_cast<uint8_t>(static_cast<int8_t>(j * 7 - 100)));
  }
  const std::vector<float> y = decode(GgmlType::q8_0, b, 64);
  for (int blk = 0; blk < 2; ++blk)
    for (int j = 0; j < 32; ++j)
      CHECK(y[static_cast<size_t>(blk * 32 + j)] == (j * 7 - 100) * (blk == 0 ? 0.5f : -0.25f));
}

TEST_CASE("quants decode Q4_0 low nibbles first then high nibbles minus 8", "[unit]") {
  std::vector<uint8_t> b;
  put_f16(b, 0.25f);
  for (int j = 0; j < 16; ++j) b.push_back(static_cast<uint8_t>(j | ((15 - (j * 3) % 16) << 4)));
  const std::vector<float> y = decode(GgmlType::q4_0, b, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[static_cast<size_t>(j)] == (j - 8) * 0.25f);
    CHECK(y[static_cast<size_t>(j + 16)] == ((15 - (j * 3) % 16) - 8) * 0.25f);
  }
}

TEST_CASE("quants decode Q4_1 as nibble times d plus m", "[unit]") {
  std::vector<uint8_t> b;
  put_f16(b, 0.5f);
  put_f16(b, -1.0f);
  for (int j = 0; j < 16; ++j) b.push_back(static_cast<uint8_t>(((j * 5) % 16) | ((15 - j) << 4)));
  const std::vector<float> y = decode(GgmlType::q4_1, b, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[static_cast<size_t>(j)] == ((j * 5) % 16) * 0.5f - 1.0f);
    CHECK(y[static_cast<size_t>(j + 16)] == (15 - j) * 0.5f - 1.0f);
  }
}

TEST_CASE("quants decode Q4_K super-blocks with 6-bit scales and mins", "[unit]") {
  // Eight sub-blocks of 32 values; sub-block s has scale sc[s] and min m[s] (6 bits each), packed
  // into 12 bytes: bytes 0-3 hold sc[0..3] and the top 2 bits of sc[4..7], bytes 4-7 m[0..3] and
  // the top bits of m[4..7], bytes 8-11 the low 4 bits of sc[4..7] (low) and m[4..7] (high).
  const int sc[8] = {1, 63, 17, 5, 48, 33, 2, 60};
  const int m[8] = {0, 7, 62, 31, 16, 41, 63, 9};
  std::vector<uint8_t> b;
  put_f16(b, 1.0f);  // d
  put_f16(b, 0.5f);  // dmin
  for (int j = 0; j < 4; ++j) b.push_back(static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6)));
  for (int j = 0; j < 4; ++j) b.push_back(static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6)));
  for (int j = 0; j < 4; ++j)
    b.push_back(static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4)));
  // 128 bytes of quants: 64-value chunk c uses bytes [32c, 32c + 32): sub-block 2c in the low
  // nibbles, sub-block 2c + 1 in the high ones.
  for (int i = 0; i < 128; ++i) b.push_back(static_cast<uint8_t>((i * 37 + 11) % 256));
  REQUIRE(b.size() == 144);
  const std::vector<float> y = decode(GgmlType::q4_k, b, 256);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b[static_cast<size_t>(16 + 32 * (s / 2) + l)];
      const int q = s % 2 == 0 ? byte & 15 : byte >> 4;
      CHECK(y[static_cast<size_t>(32 * s + l)] == 1.0f * sc[s] * q - 0.5f * m[s]);
    }
  }
}

TEST_CASE("quants decode Q6_K super-blocks of 4 plus 2 bit quants minus 32", "[unit]") {
  // Value e of 256: half n = e / 128, r = e % 128, quarter g = r / 32, l = r % 32. Its low 4 bits
  // are the low (g < 2) or high (g >= 2) nibble of ql[64 n + l + 32 (g % 2)], its high 2 bits
  // bits 2g..2g+1 of qh[32 n + l]; its scale is scales[8 n + 2 g + l / 16].
  std::vector<uint8_t> b;
  for (int i = 0; i < 128; ++i) b.push_back(static_cast<uint8_t>((i * 53 + 7) % 256));  // ql
  for (int i = 0; i < 64; ++i) b.push_back(static_cast<uint8_t>((i * 29 + 3) % 256));   // qh
  for (int i = 0; i < 16; ++i) b.push_back(static_cast<uint8_t>(static_cast<int8_t>(i * 9 - 70)));
  put_f16(b, 0.25f);
  REQUIRE(b.size() == 210);
  const std::vector<float> y = decode(GgmlType::q6_k, b, 256);
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, r = e % 128, g = r / 32, l = r % 32;
    const uint8_t lo = b[static_cast<size_t>(64 * n + l + 32 * (g % 2))];
    const uint8_t hi = b[static_cast<size_t>(128 + 32 * n + l)];
    const int q = ((g < 2 ? lo & 15 : lo >> 4) | (((hi >> (2 * g)) & 3) << 4)) - 32;
    const int scale = static_cast<int8_t>(b[static_cast<size_t>(192 + 8 * n + 2 * g + l / 16)]);
    CHECK(y[static_cast<size_t>(e)] == 0.25f * scale * q);
  }
}

TEST_CASE("quants dequantize writes bf16 rows in a given row order", "[unit]") {
  std::vector<uint8_t> b;
  for (int r = 0; r < 3; ++r) {
    put_f16(b, static_cast<float>(r + 1));
    for (int j = 0; j < 32; ++j) b.push_back(static_cast<uint8_t>(j - 16));
  }
  Tensor out = Tensor::empty({3, 32}, DType::bf16);
  const std::vector<int64_t> order = {2, 0, 1};  // source row r goes to row order[r]
  dequantize(GgmlType::q8_0, b.data(), 3, 32, out, "t", order);
  const auto* o = out.data_as<bf16>();
  for (int r = 0; r < 3; ++r)
    for (int j = 0; j < 32; ++j)
      CHECK(static_cast<float>(o[order[static_cast<size_t>(r)] * 32 + j]) ==
            static_cast<float>((j - 16) * (r + 1)));
}

TEST_CASE("quants reject unsupported and unknown types naming the tensor and type", "[unit]") {
  std::vector<uint8_t> b(176);
  std::vector<float> y(256);
  REQUIRE_THROWS_WITH(dequantize_row(GgmlType::q5_k, b.data(), 256, y.data(), "blk.0.ffn_up"),
                      Catch::Contains("blk.0.ffn_up") && Catch::Contains("Q5_K"));
  REQUIRE_THROWS_WITH(dequantize_row(static_cast<GgmlType>(77), b.data(), 32, y.data(), "w"),
                      Catch::Contains("unknown(77)"));
  REQUIRE_THROWS_WITH(dequantize_row(GgmlType::q4_0, b.data(), 48, y.data(), "w2"),
                      Catch::Contains("w2") && Catch::Contains("48"));
  CHECK(ggml_type_name(14) == "Q6_K");
  CHECK(ggml_nbytes(GgmlType::q4_1, 64) == 40);
}
