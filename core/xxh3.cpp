// XXH3-64 through libxxhash's x86 dispatch (the widest of SSE2, AVX2, AVX-512 the CPU runs).
#include "core/xxh3.h"

#include <xxh_x86dispatch.h>

namespace tandem {

Xxh3::Xxh3() { XXH3_64bits_reset(&state_); }

void Xxh3::update(const void* data, size_t bytes) {
  XXH3_64bits_update_dispatch(&state_, data, bytes);
}

uint64_t Xxh3::digest() const { return XXH3_64bits_digest(&state_); }

uint64_t xxh3(std::string_view data) { return XXH3_64bits_dispatch(data.data(), data.size()); }

}  // namespace tandem
