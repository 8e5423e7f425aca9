// The tandem command: train, serve, generate, launch and bench subcommands.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>

#include "core/build_info.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"

namespace {

void print_version() {
  fmt::print("tandem {} (commit {})\n", tandem::version_string(), tandem::git_commit());
  fmt::print("cuda: {}\n", tandem::cuda_compiled() ? "compiled in" : "not compiled in");
  fmt::print("nccl: {}\n", tandem::nccl_compiled() ? "compiled in" : "not compiled in");
  fmt::print("gpu: {}\n", tandem::gpu_summary());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem: GRPO post-training of LLMs, rollout and training in tandem"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "print the version, commit, compiled-in backends and GPUs");

  CLI11_PARSE(app, argc, argv);
  try {
    tandem::init_logging();
    if (version || app.get_subcommands().empty()) {
      print_version();
      return 0;
    }
  } catch (const tandem::Error& e) {
    std::fprintf(stderr, "tandem: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
