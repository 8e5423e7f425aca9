// Errors: tandem::Error and the TANDEM_CHECK family that throws it with file:line and values.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace tandem {

// Every failure a user can cause or see is a tandem::Error. what() is the sentence for the user
// (what failed, where in their input, what to do); where() is the place in tandem's source and
// the failed check ("[check failed: x > 0] (trainer/job.cpp:12)"), "" when there is none, for
// `tandem --verbose` and the logs.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, std::string where = "")
      : std::runtime_error(what), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

// Inside a catch block: the exception being handled as one line for the user, without a trailing
// newline. A tandem::Error gives its sentence (with verbose, followed by where()); a file-system
// error its paths and reason; std::bad_alloc says that memory ran out; any other std::exception
// its text.
std::string current_error_line(bool verbose);

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const char* expr, const std::string& msg);
// For the CUDA-library checks of core/cuda_check.h.
[[noreturn]] void throw_status_error(const char* lib, int code, const char* text, const char* expr,
                                     const char* file, int line);
}  // namespace detail

}  // namespace tandem

// TANDEM_CHECK(cond, "fmt {}", args...): throws tandem::Error naming the condition, the place and
// the formatted message when cond is false.
#define TANDEM_CHECK(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::tandem::detail::throw_error(__FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__)); \
  } while (0)

// TANDEM_CHECK_EQ(a, b, "context"): also prints both values.
#define TANDEM_CHECK_EQ(a, b, ...)                                                       \
  do {                                                                                   \
    const auto& tandem_a_ = (a);                                                         \
    const auto& tandem_b_ = (b);                                                         \
    if (!(tandem_a_ == tandem_b_)) [[unlikely]]                                          \
      ::tandem::detail::throw_error(                                                     \
          __FILE__, __LINE__, #a " == " #b,                                              \
          fmt::format("{} ({} vs {})", fmt::format(__VA_ARGS__), tandem_a_, tandem_b_)); \
  } while (0)

#define TANDEM_FAIL(...) \
  ::tandem::detail::throw_error(__FILE__, __LINE__, "", fmt::format(__VA_ARGS__))
