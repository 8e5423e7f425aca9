// XXH3-64 (the weight channel's bucket checksum): the reference's known values, and the streamed
// hash equal to the one-shot one whatever the pieces, with copies that continue independently.
#include <catch2/catch.hpp>

#include <random>
#include <string>

#include "core/xxh3.h"

using tandem::Xxh3;
using tandem::xxh3;

TEST_CASE("xxh3 gives the reference's values", "[unit]") {
  CHECK(xxh3("") == 0x2d06800538d394c2ull);  // XXH3_64bits of no bytes, seed 0 (xxhash.h)
  CHECK(Xxh3().digest() == 0x2d06800538d394c2ull);
  CHECK(xxh3("a") != xxh3("b"));
}

TEST_CASE("xxh3 streamed in any pieces equals the one-shot hash", "[unit]") {
  std::mt19937 rng(5);
  std::string data(1 << 20, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (size_t n : {0u, 1u, 16u, 17u, 240u, 241u, 1024u, 65536u, 1000003u}) {
    const std::string_view s(data.data() + 1, n);
    INFO(n);
    for (size_t piece : {1u, 7u, 256u, 4096u, 262144u}) {
      if (piece == 1 && n > 65536) continue;
      Xxh3 h;
      for (size_t at = 0; at < n; at += piece) h.update(s.data() + at, std::min(piece, n - at));
      CHECK(h.digest() == xxh3(s));
    }
  }
  // A copy taken midway continues on its own: the pushes to several workers share a bucket's
  // state after each chunk.
  Xxh3 a;
  a.update(data.data(), 300000);
  Xxh3 b = a;
  a.update(data.data() + 300000, 500000);
  CHECK(a.digest() == xxh3({data.data(), 800000}));
  CHECK(b.digest() == xxh3({data.data(), 300000}));
  b.update(data.data() + 300000, 500000);
  CHECK(b.digest() == a.digest());
}
