// Philox-4x32-10 counter-based RNG (Salmon et al., SC'11): the same stream on CPU and CUDA.
#pragma once

#include <cstdint>

#include "core/half.h"  // TANDEM_HD

namespace tandem {

struct Philox4x32 {
  uint32_t v[4];
};

TANDEM_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Ten rounds over a 128-bit counter with a 64-bit key.
TANDEM_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, ctr.v[0], hi0, lo0);
    philox_mulhilo(kM1, ctr.v[2], hi1, lo1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ key0, lo1, hi0 ^ ctr.v[3] ^ key1, lo0}};
    key0 += kW0;
    key1 += kW1;
  }
  return ctr;
}

// Four random words for (seed, stream, offset): seed is the key, stream and offset fill the
// counter. A sequence's sampler uses its own stream and the decode step as the offset.
TANDEM_HD Philox4x32 philox_random(uint64_t seed, uint64_t stream, uint64_t offset) {
  const Philox4x32 ctr{{static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                        static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// A uniform float in [0, 1) from the top 24 bits of a word: exact, the same on every device.
TANDEM_HD float uniform_from_bits(uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace tandem
