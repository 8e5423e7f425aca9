// UTF-8 validity, shared by the tokenizer's pre-tokenizer and the text sent to remote services.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tandem {

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is not valid there
// (overlong forms, surrogates and code points above U+10FFFF are invalid).
size_t utf8_length(std::string_view s, size_t i);

// s with every byte that does not start a valid sequence replaced by U+FFFD (a completion cut at
// the token limit can end inside a character; services decode their strings as UTF-8).
std::string to_valid_utf8(std::string_view s);

}  // namespace tandem
