// `tandem train job.toml [key=value ...] [--print-config]`: the GRPO job.
#pragma once

#include <CLI/CLI.hpp>

namespace tandem::apps {

void add_train_command(CLI::App& app);
// The exit code of the train command, or -1 when it was not the one parsed.
int run_train_command();

}  // namespace tandem::apps
