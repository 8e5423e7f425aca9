// Builds the text of a tandem::Error.
#include "core/error.h"

#include <filesystem>
#include <new>

namespace tandem {

std::string current_error_line(bool verbose) {
  try {
    throw;
  } catch (const Error& e) {
    if (!verbose || e.where().empty()) return e.what();
    return fmt::format("{} {}", e.what(), e.where());
  } catch (const std::filesystem::filesystem_error& e) {
    // what() is "filesystem error: <operation>: <reason> [path1] [path2]".
    return e.what();
  } catch (const std::bad_alloc&) {
    return "out of memory: the command needs more memory than this machine can give it; lower "
           "the sizes in its config or input";
  } catch (const std::exception& e) {
    return fmt::format("unexpected failure: {}", e.what());
  } catch (...) {
    return "unexpected failure (an exception that is not a std::exception)";
  }
}

}  // namespace tandem

namespace tandem::detail {

void throw_error(const char* file, int line, const char* expr, const std::string& msg) {
  std::string where;
  if (expr != nullptr && expr[0] != '\0') where = fmt::format("[check failed: {}] ", expr);
  where += fmt::format("({}:{})", file, line);
  throw Error(msg, where);
}

void throw_status_error(const char* lib, int code, const char* text, const char* expr,
                        const char* file, int line) {
  throw_error(file, line, expr, fmt::format("{} error {}: {}", lib, code, text));
}

}  // namespace tandem::detail
