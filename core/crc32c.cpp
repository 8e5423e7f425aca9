// CRC-32C, hardware and table.
#include "core/crc32c.h"

#include <array>
#include <cstring>

#include <nmmintrin.h>

namespace tandem {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // reflected Castagnoli polynomial

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(std::string_view data, uint32_t crc) {
  uint64_t c = ~crc;
  const char* p = data.data();
  size_t n = data.size();
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, static_cast<uint8_t>(*p));
  return ~c32;
}

}  // namespace

uint32_t crc32c_portable(std::string_view data, uint32_t crc) {
  uint32_t c = ~crc;
  for (unsigned char b : data) c = kTable[(c ^ b) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c(std::string_view data, uint32_t crc) {
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  return sse42 ? crc32c_sse42(data, crc) : crc32c_portable(data, crc);
}

}  // namespace tandem
