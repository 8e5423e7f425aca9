#include "bench/forked_ranks.h"

#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace tandem::bench {

int run_forked_ranks(const std::string& what, const std::string& unit, int ranks, double timeout_s,
                     const std::function<void(Communicator& comm)>& body) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("tandem-bench-{}-{}", what, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::fflush(nullptr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = ::fork();
    TANDEM_CHECK(pid >= 0, "bench {}: fork failed for {} {}", what, unit, rank);
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      int rc = 0;
      try {
        set_num_threads(1);
        rendezvous::RankInfo info;
        info.rank = rank;
        info.world_size = ranks;
        info.master_addr = "127.0.0.1";
        info.launcher = "bench";
        CommOptions co;
        co.timeout_s = timeout_s;
        co.store = "file:" + dir.string();
        body(*Communicator::create(info, co));
      } catch (...) {
        std::fprintf(stderr, "tandem bench %s: %s %d: %s\n", what.c_str(), unit.c_str(), rank,
                     current_error_line(false).c_str());
        rc = 1;
      }
      std::fflush(nullptr);
      ::_exit(rc);
    }
    children.push_back(pid);
  }
  bool ok = true;
  for (const pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  fs::remove_all(dir);
  return ok ? 0 : 1;
}

}  // namespace tandem::bench
