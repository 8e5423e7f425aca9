// CRC-32C (Castagnoli, the checksum of TFRecord and TensorBoard event files): SSE4.2's crc32
// instruction where the CPU has it, a table otherwise. Debian ships no C/C++ CRC-32C library.
#pragma once

#include <cstdint>
#include <string_view>

namespace tandem {

// The CRC-32C of `data` continued from `crc` (0 to start): crc32c("123456789") = 0xe3069283.
uint32_t crc32c(std::string_view data, uint32_t crc = 0);
// The table path alone, for tests that compare both paths.
uint32_t crc32c_portable(std::string_view data, uint32_t crc = 0);

}  // namespace tandem
