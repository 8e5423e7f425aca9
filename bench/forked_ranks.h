// What the multi-process benchmarks (pipeline, tp) share: their ranks as processes forked from the
// bench, meeting through a file store in a temporary directory of their own.
#pragma once

#include <functional>
#include <string>

namespace tandem::bench {

// Runs body(rank, dir) in `ranks` forked processes, dir a fresh temporary directory they share
// (removed after), each ended with SIGTERM if the bench dies. A rank that throws prints "tandem
// bench <what>: <unit> <rank>: <error>" and exits 1. Returns 0 when every rank exited 0, else 1.
int run_forked_ranks(const std::string& what, const std::string& unit, int ranks,
                     const std::function<void(int rank, const std::string& dir)>& body);

}  // namespace tandem::bench
