// `tandem serve serve.toml [key=value ...] [--print-config]`: a rollout worker over Thrift.
#pragma once

#include <CLI/CLI.hpp>

namespace tandem::apps {

void add_serve_command(CLI::App& app);
// The exit code of the serve command, or -1 when it was not the one parsed.
int run_serve_command();

}  // namespace tandem::apps
