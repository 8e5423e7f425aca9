// XXH3-64 (xxHash, Debian's libxxhash, dispatched at run time to the CPU's widest vectors: AVX2
// here, AVX-512 where the CPU has it), fed in pieces: the checksum of the weight channel's buckets,
// 1.7x the CRC-32C's speed on the AVX2 machine (docs/serve.md, "Weights over the wire").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#define XXH_STATIC_LINKING_ONLY  // the state's layout, so that it can be copied
#include <xxhash.h>

namespace tandem {

// The XXH3-64 (seed 0) of all bytes given so far; copies continue independently.
class Xxh3 {
 public:
  Xxh3();
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  XXH3_state_t state_;
};

// The XXH3-64 of `data` at once.
uint64_t xxh3(std::string_view data);

}  // namespace tandem
