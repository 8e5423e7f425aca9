// PCRE2 behind rewards::Regex.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "rewards/regex.h"

#include <pcre2.h>

#include <array>

#include "core/error.h"

namespace tandem::rewards {

Regex::Regex(const std::string& pattern, const Options& options, const std::string& what) {
  uint32_t flags = PCRE2_UTF;
  if (options.dotall) flags |= PCRE2_DOTALL;
  if (options.multiline) flags |= PCRE2_MULTILINE;
  if (options.caseless) flags |= PCRE2_CASELESS;
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   flags, &error, &offset, nullptr);
  if (code == nullptr) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error, message.data(), message.size());
    TANDEM_FAIL("{}: regex '{}' does not compile at offset {}: {}", what, pattern, offset,
                reinterpret_cast<const char*>(message.data()));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // the interpreter runs it where JIT is missing
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

int Regex::match(std::string_view text, size_t start, unsigned flags, RegexMatch* m) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  TANDEM_CHECK(md != nullptr, "out of memory for a regex match");
  const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                             flags, md, nullptr);
  if (rc >= 0 && m != nullptr) {
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    *m = {ov[0], ov[1]};
  }
  pcre2_match_data_free(md);
  return rc;
}

bool Regex::search(std::string_view text) const { return match(text, 0, 0, nullptr) >= 0; }

bool Regex::full_match(std::string_view text) const {
  return match(text, 0, PCRE2_ANCHORED | PCRE2_ENDANCHORED, nullptr) >= 0;
}

std::vector<RegexMatch> Regex::find_all(std::string_view text) const {
  std::vector<RegexMatch> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    RegexMatch m;
    if (match(text, pos, pos == 0 ? 0 : PCRE2_NO_UTF_CHECK, &m) < 0) break;
    out.push_back(m);
    if (m.end == m.begin) {  // an empty match: step over one UTF-8 character
      pos = m.end + 1;
      while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
    } else {
      pos = m.end;
    }
  }
  return out;
}

}  // namespace tandem::rewards
