// Builds the text of a tandem::Error.
#include "core/error.h"

namespace tandem::detail {

void throw_error(const char* file, int line, const char* expr, const std::string& msg) {
  std::string text = msg;
  if (expr != nullptr && expr[0] != '\0') text += fmt::format(" [check failed: {}]", expr);
  text += fmt::format(" ({}:{})", file, line);
  throw Error(text);
}

void throw_status_error(const char* lib, int code, const char* text, const char* expr,
                        const char* file, int line) {
  throw_error(file, line, expr, fmt::format("{} error {}: {}", lib, code, text));
}

}  // namespace tandem::detail
