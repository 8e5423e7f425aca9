// Checked appends: fwrite and fflush, each one's result looked at.
#include "trainer/append_file.h"

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace tandem::trainer {

AppendFile::AppendFile(std::string path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "ab");
  TANDEM_CHECK(file_ != nullptr, "{}: cannot open for appending: {}", path_, std::strerror(errno));
}

AppendFile::~AppendFile() {
  if (file_ != nullptr) std::fclose(file_);
}

void AppendFile::write_line(std::string_view text) {
  errno = 0;
  const bool ok = std::fwrite(text.data(), 1, text.size(), file_) == text.size() &&
                  std::fputc('\n', file_) != EOF && std::fflush(file_) == 0;
  if (!ok) {
    const int err = errno;
    std::clearerr(file_);
    TANDEM_FAIL("{}: write failed: {}: free space on its file system or move logging.dir", path_,
                err != 0 ? std::strerror(err) : "unknown error");
  }
}

}  // namespace tandem::trainer
