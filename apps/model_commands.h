// The model subcommands of `tandem`: generate, score and convert.
#pragma once

#include <CLI/CLI.hpp>

namespace tandem::apps {

// Adds the subcommands to app; run_model_commands runs the one that was parsed (returns its
// exit code, or -1 when none of them was).
void add_model_commands(CLI::App& app);
int run_model_commands();

}  // namespace tandem::apps
