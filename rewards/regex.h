// A compiled PCRE2 pattern (UTF) for the rewards: search, full match, all matches.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::rewards {

struct RegexMatch {
  size_t begin = 0;
  size_t end = 0;
};

class Regex {
 public:
  struct Options {
    bool dotall = false;     // "." also matches a newline
    bool multiline = false;  // "^" and "$" match at line starts and ends
    bool caseless = false;
  };
  // Throws tandem::Error naming `what` (e.g. "reward 'fmt' option 'pattern'") and the offset when
  // the pattern does not compile.
  Regex(const std::string& pattern, const Options& options, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Text that is not valid UTF-8 never matches.
  bool search(std::string_view text) const;
  bool full_match(std::string_view text) const;
  std::vector<RegexMatch> find_all(std::string_view text) const;

 private:
  int match(std::string_view text, size_t start, unsigned flags, RegexMatch* m) const;
  void* code_ = nullptr;  // pcre2_code_8
};

}  // namespace tandem::rewards
