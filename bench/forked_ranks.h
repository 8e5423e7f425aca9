// What the multi-process benchmarks (pipeline, tp) share: their ranks as processes forked from the
// bench, meeting through a file store in a temporary directory of their own.
#pragma once

#include <functional>
#include <string>

#include "core/comm.h"

namespace tandem::bench {

// Runs body(comm) in `ranks` forked processes of one thread each, comm their Communicator (its
// file store in a fresh temporary directory, removed after; every call bounded by timeout_s),
// each ended with SIGTERM if the bench dies. A rank that throws prints "tandem bench <what>:
// <unit> <rank>: <error>" and exits 1. Returns 0 when every rank exited 0, else 1.
int run_forked_ranks(const std::string& what, const std::string& unit, int ranks, double timeout_s,
                     const std::function<void(Communicator& comm)>& body);

}  // namespace tandem::bench
