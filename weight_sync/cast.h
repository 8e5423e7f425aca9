// The f32 -> bf16 cast of weight publishing: round to nearest even, the bits of core/half.h's
// f32_to_bf16_bits for every input (NaN quieted, subnormals kept), with AVX512-BF16 where the CPU
// has it and a portable loop elsewhere; both exposed so that a test can compare them.
#pragma once

#include <cstdint>

namespace tandem::weight_sync {

// n floats at s into bf16 bits at d, by the fastest path this CPU has. stream: non-temporal
// stores (a destination much larger than the caches that nothing reads soon, e.g. an engine's
// weights; not a bucket about to be sent).
void f32_to_bf16(const float* s, uint16_t* d, int64_t n, bool stream = false);

// The portable loop (vectorized by the compiler for the x86 vector widths).
void f32_to_bf16_portable(const float* s, uint16_t* d, int64_t n);

// Whether this CPU has AVX512-BF16 (vcvtne2ps2bf16).
bool has_avx512_bf16();
// The AVX512-BF16 path: vcvtne2ps2bf16 32 elements at a time, blocks holding an f32 subnormal
// (which the instruction flushes to zero) done by the portable loop. Only where
// has_avx512_bf16().
void f32_to_bf16_avx512_bf16(const float* s, uint16_t* d, int64_t n, bool stream);

}  // namespace tandem::weight_sync
