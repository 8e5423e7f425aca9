// CRC-32C, hardware (three streams at a time over long inputs) and table.
#include "core/crc32c.h"

#include <array>
#include <cstring>
#include <string>

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

// The crc32 instruction's register over n bytes (a multiple of 8) from c: no inversions.
__attribute__((target("sse4.2"))) uint64_t crc_words(uint64_t c, const char* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  return c;
}

// Long inputs go as three streams of kStripe bytes side by side (the instruction's latency is
// three cycles and its throughput one a cycle), joined by the register's shift over kStripe zero
// bytes: a linear map of the 32-bit register, kept as 4 tables of its bytes' images.
constexpr size_t kStripe = 4096;

struct Shift {
  std::array<std::array<uint32_t, 256>, 4> t{};
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

__attribute__((target("sse4.2"))) Shift make_shift() {
  static const std::string zeros(kStripe, '\0');
  Shift s;
  for (int k = 0; k < 4; ++k)
    for (uint32_t b = 0; b < 256; ++b)
      s.t[k][b] = static_cast<uint32_t>(crc_words(uint64_t{b} << (8 * k), zeros.data(), kStripe));
  return s;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(std::string_view data, uint32_t crc) {
  uint64_t c = ~crc;
  const char* p = data.data();
  size_t n = data.size();
  if (n >= 3 * kStripe) {
    static const Shift shift = make_shift();
    for (; n >= 3 * kStripe; n -= 3 * kStripe, p += 3 * kStripe) {
      uint64_t c1 = 0, c2 = 0;
      for (size_t i = 0; i < kStripe; i += 8) {
        uint64_t w0, w1, w2;
        std::memcpy(&w0, p + i, 8);
        std::memcpy(&w1, p + kStripe + i, 8);
        std::memcpy(&w2, p + 2 * kStripe + i, 8);
        c = _mm_crc32_u64(c, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
      }
      // The register is linear: over A B C from c it is shift(shift(c_A) ^ c_B) ^ c_C, with c_B
      // and c_C run from 0.
      c = shift(shift(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1)) ^
          static_cast<uint32_t>(c2);
    }
  }
  c = crc_words(c, p, n - n % 8);
  p += n - n % 8;
  n %= 8;
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
