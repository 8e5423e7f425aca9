// Errors: tandem::Error and the TANDEM_CHECK family that throws it with file:line and values.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tandem {

// Every failure a user can cause or see is a tandem::Error; the message says where and why.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

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
