#include <catch2/catch.hpp>

#include <string>

#include "core/utf8.h"

TEST_CASE("utf8 sequences are measured and invalid bytes replaced one by one", "[unit]") {
  using tandem::to_valid_utf8;
  using tandem::utf8_length;
  CHECK(utf8_length("a", 0) == 1);
  CHECK(utf8_length("\xC3\xA9", 0) == 2);          // é
  CHECK(utf8_length("\xE2\x82\xAC", 0) == 3);      // €
  CHECK(utf8_length("\xF0\x9F\x98\x80", 0) == 4);  // 😀
  CHECK(utf8_length("\xC0\xAF", 0) == 0);          // overlong
  CHECK(utf8_length("\xED\xA0\x80", 0) == 0);      // surrogate
  CHECK(utf8_length("\xF4\x90\x80\x80", 0) == 0);  // above U+10FFFF
  CHECK(utf8_length("\xE2\x82", 0) == 0);          // cut short
  const std::string fffd = "\xEF\xBF\xBD";
  CHECK(to_valid_utf8("caf\xC3\xA9") == "caf\xC3\xA9");
  CHECK(to_valid_utf8("ab\xE2\x82") == "ab" + fffd + fffd);  // a character cut at the end
  CHECK(to_valid_utf8("\xFFx") == fffd + "x");
}
