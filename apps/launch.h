// `tandem launch --nproc N [--nnodes M --node-rank K --master HOST:PORT] -- command ...`: starts
// the ranks of one node with torchrun-style variables, prefixes their output, stops them together.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace tandem::apps {

struct LaunchOptions {
  int nproc = 1;        // ranks on this node
  int nnodes = 1;       // nodes of the job
  int node_rank = 0;    // this node's index
  std::string master;   // HOST:PORT of rank 0's store; default 127.0.0.1 and a free port
  double grace_s = 10;  // SIGTERM to SIGKILL when stopping the ranks
  std::vector<std::string> command;
};

// Runs the ranks to the end; returns 0, or the exit status of the first rank that failed (128 +
// the signal when a signal ended it).
int launch(const LaunchOptions& options);

void add_launch_command(CLI::App& app);
// The exit code of the launch command, or -1 when it was not the one parsed.
int run_launch_command();

}  // namespace tandem::apps
