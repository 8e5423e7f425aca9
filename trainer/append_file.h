// A text file that a job appends lines to (metrics.jsonl, samples.jsonl), every write checked: a
// failed write (disk full, file system gone) throws naming the file instead of leaving it short.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace tandem::trainer {

class AppendFile {
 public:
  // Opens path for appending (created when missing); throws tandem::Error naming it on failure.
  explicit AppendFile(std::string path);
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  // Appends text and a newline and flushes them to the file; throws tandem::Error naming the file
  // and the reason when any of it fails.
  void write_line(std::string_view text);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tandem::trainer
