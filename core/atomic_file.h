// Whole-file writes through a temporary file and a rename: a reader sees the old file or the new
// one whole, and a write that fails (disk full, rename refused) leaves no temporary file behind.
#pragma once

#include <string>
#include <string_view>

namespace tandem {

// Writes `contents` to `path` through `path`.tmp and a rename. On any failure removes the
// temporary file and throws a tandem::Error naming the path, the system's reason and `advice`
// (what the user should do: "free space or move logging.dir").
void write_file_atomically(const std::string& path, std::string_view contents,
                           std::string_view advice);

}  // namespace tandem
