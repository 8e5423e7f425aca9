// Logging through spdlog: one format, the level from TANDEM_LOG_LEVEL or the job config.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace tandem {

// Sets the level ("trace", "debug", "info", "warn", "error", "off") and the line format.
void init_logging(const std::string& level = "");

}  // namespace tandem
