// Logging set-up.
#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

#include "core/error.h"

namespace tandem {

namespace {

// TANDEM_LOG_LEVEL, or "" when unset.
std::string level_of_environment() {
  const char* env = std::getenv("TANDEM_LOG_LEVEL");
  return env != nullptr ? env : "";
}

}  // namespace

void init_logging(const std::string& level) {
  std::string name = level.empty() ? level_of_environment() : level;
  if (name.empty()) name = "info";
  const auto lvl = spdlog::level::from_str(name);
  TANDEM_CHECK(lvl != spdlog::level::off || name == "off",
               "unknown log level '{}': use trace, debug, info, warn, error or off", name);
  // Logs go to stderr: stdout carries results (JSON lines, completions).
  static const bool once = [] {
    spdlog::set_default_logger(spdlog::stderr_color_mt("tandem"));
    return true;
  }();
  (void)once;
  spdlog::set_level(lvl);
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
}

void apply_config_log_level(const std::string& level) {
  if (level_of_environment().empty()) init_logging(level);
}

}  // namespace tandem
