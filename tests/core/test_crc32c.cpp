// CRC-32C: the standard check value, RFC 3720's vectors, and the SSE4.2 path against the table.
#include <catch2/catch.hpp>

#include <random>
#include <string>

#include "core/crc32c.h"

using tandem::crc32c;
using tandem::crc32c_portable;

TEST_CASE("crc32c gives the standard check values on both paths", "[unit]") {
  CHECK(crc32c("123456789") == 0xe3069283u);
  CHECK(crc32c_portable("123456789") == 0xe3069283u);
  CHECK(crc32c("") == 0u);
  // RFC 3720 B.4: 32 bytes of zeros, of 0xff, and ascending 0..31.
  CHECK(crc32c(std::string(32, '\0')) == 0x8a9136aau);
  CHECK(crc32c(std::string(32, '\xff')) == 0x62a8ab43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(static_cast<char>(i));
  CHECK(crc32c(ascending) == 0x46dd794eu);
}

TEST_CASE("crc32c continues across pieces and agrees with the table on random bytes", "[unit]") {
  std::mt19937 rng(7);
  // Past 3 x 4096 bytes the hardware path runs three streams and joins them.
  for (size_t n : {1u, 7u, 8u, 9u, 63u, 1000u, 4099u, 12287u, 12288u, 12295u, 40000u, 100003u}) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    INFO(n);
    CHECK(crc32c(s) == crc32c_portable(s));
    const size_t cut = n / 3;
    CHECK(crc32c(s.substr(cut), crc32c(s.substr(0, cut))) == crc32c(s));
  }
}
