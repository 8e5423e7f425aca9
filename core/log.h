// Logging through spdlog: one format, the level from the job config (logging.level) or, for
// debugging and for the commands without a config, TANDEM_LOG_LEVEL.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace tandem {

// Sets the level ("trace", "debug", "info", "warn", "error", "off") and the line format; an
// empty level: TANDEM_LOG_LEVEL's, else "info".
void init_logging(const std::string& level = "");
// Sets a config's level (a job's logging.level), unless TANDEM_LOG_LEVEL is set: that one wins,
// so that one run can be debugged without editing its file.
void apply_config_log_level(const std::string& level);

}  // namespace tandem
