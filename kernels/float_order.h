// Floats as integer keys in the order of their values, and the binary search over them that
// sampling uses to find its top-k and top-p thresholds without sorting: the same steps on the CPU
// and on CUDA (where pred is a block reduction every thread of the block evaluates).
#pragma once

#include <cstdint>

#include "core/half.h"

namespace tandem::ops {

// Float bit patterns mapped to integers in the order of their values (NaN aside).
TANDEM_HD uint32_t ordered_key(float f) {
  const uint32_t b = float_bits(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
TANDEM_HD float key_value(uint32_t k) {
  return bits_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The largest float t in [lo, hi] with pred(t), for pred true at lo and monotone (true up to
// some value): a binary search over the ordered bit patterns, at most 32 steps.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Pred>
TANDEM_HD float largest_value_where(float lo, float hi, Pred pred) {
  uint32_t a = ordered_key(lo), b = ordered_key(hi);
  while (a < b) {
    const uint32_t mid = a + (b - a) / 2 + 1;
    if (pred(key_value(mid))) {
      a = mid;
    } else {
      b = mid - 1;
    }
  }
  return key_value(a);
}

}  // namespace tandem::ops
