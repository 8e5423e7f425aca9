// tandem launch: one child process per local rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
// and MASTER_PORT set; each output line prefixed with "[rank R] "; SIGINT and SIGTERM forwarded;
// the first rank to fail stops the others (SIGTERM, SIGKILL after a grace) and its status is ours;
// a launcher that is killed takes its ranks with it (a watchdog process and a parent-death signal).
#include "apps/launch.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>

#include "core/error.h"
#include "core/rendezvous.h"

extern char** environ;

namespace tandem::apps {
namespace {

using Clock = std::chrono::steady_clock;

int signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(signal_pipe[1], &s, 1);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TANDEM_CHECK(fd >= 0, "tandem launch: socket(): {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  TANDEM_CHECK(ok, "tandem launch: no free port for the coordinator; pass --master HOST:PORT");
  return ntohs(a.sin_port);
}

// One output stream of one rank: its pipe, the line being read, where the lines go.
struct Stream {
  int fd = -1;
  FILE* to = nullptr;
  std::string pending;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  Stream out, err;
  std::optional<int> status;           // exit code, 128 + signal when a signal ended it
  std::deque<std::string> last_lines;  // the end of its output, shown when it fails
};

constexpr size_t kLastLines = 20;

void emit(Rank& r, Stream& s, const std::string& line) {
  std::fprintf(s.to, "[rank %d] %s\n", r.rank, line.c_str());
  std::fflush(s.to);
  r.last_lines.push_back(line);
  if (r.last_lines.size() > kLastLines) r.last_lines.pop_front();
}

// Reads what the pipe has; prints whole lines; at EOF the partial last line too and closes.
void drain(Rank& r, Stream& s) {
  char buf[65536];
  const ssize_t n = ::read(s.fd, buf, sizeof(buf));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {
    if (!s.pending.empty()) emit(r, s, s.pending);
    s.pending.clear();
    ::close(s.fd);
    s.fd = -1;
    return;
  }
  s.pending.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t nl; (nl = s.pending.find('\n', start)) != std::string::npos; start = nl + 1)
    emit(r, s, s.pending.substr(start, nl - start));
  s.pending.erase(0, start);
}

int exit_code(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

std::string describe_status(int code) {
  if (code > 128)
    return fmt::format("was ended by signal {} ({})", code - 128, strsignal(code - 128));
  return fmt::format("exited with status {}", code);
}

// A killed launcher (SIGKILL, the OOM killer) cannot stop its ranks, which would train on as
// orphans holding the run directory's lock. The watchdog, forked before them, holds the read end
// of a socket pair only the launcher writes: the process group of each rank as it starts. When it
// ends without the launcher having stood the watchdog down, the launcher is gone, and it stops
// the groups as the launcher would: SIGTERM, then SIGKILL to what is left after the grace. The
// groups hold whatever the ranks started (a rank's own children) too.
struct Watchdog {
  pid_t pid = -1;
  int fd = -1;  // the launcher's end (close-on-exec: no rank keeps it open)
};

// The watchdog's life after the fork: nothing here allocates (the launcher may have threads
// whose locks the fork copied), so `groups` comes with room for every rank and `notice` made.
[[noreturn]] void watch(int fd, std::vector<pid_t>& groups, const std::string& notice,
                        double grace_s) {
  // Its own process group, deaf to the terminal: a Ctrl-C or a hang-up reaches the launcher,
  // which stops the ranks itself; a dead stderr is no reason to stop.
  ::setpgid(0, 0);
  for (int sig : {SIGINT, SIGHUP, SIGPIPE, SIGTTOU}) ::signal(sig, SIG_IGN);
  if (fd != 3) fd = ::dup2(fd, 3);
  ::close_range(4, ~0u, 0);  // the launcher's other descriptors are not the watchdog's to hold
  for (;;) {
    int32_t group = 0;
    const ssize_t n = ::read(fd, &group, sizeof group);
    if (n == sizeof group) {
      if (groups.size() < groups.capacity()) groups.push_back(group);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;  // the end: the launcher died without standing the watchdog down
  }
  if (groups.empty()) ::_exit(0);
  [[maybe_unused]] const ssize_t w = ::write(STDERR_FILENO, notice.data(), notice.size());
  for (pid_t g : groups) ::kill(-g, SIGTERM);
  const auto until = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
  auto alive = [&] {
    return std::any_of(groups.begin(), groups.end(), [](pid_t g) { return ::kill(-g, 0) == 0; });
  };
  while (alive() && Clock::now() < until) ::usleep(20000);
  for (pid_t g : groups) ::kill(-g, SIGKILL);
  ::_exit(0);
}

Watchdog start_watchdog(int nproc, double grace_s) {
  // A socket rather than a pipe: the launcher's send to a dead watchdog fails (MSG_NOSIGNAL)
  // instead of raising SIGPIPE in it.
  int fds[2];
  TANDEM_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0,
               "tandem launch: socketpair: {}", std::strerror(errno));
  std::vector<pid_t> groups;
  groups.reserve(static_cast<size_t>(nproc));
  const std::string notice = fmt::format(
      "tandem launch: the launcher (pid {}) died; stopping its ranks (SIGTERM, SIGKILL after {} "
      "s)\n",
      ::getpid(), grace_s);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  TANDEM_CHECK(pid >= 0, "tandem launch: fork: {}", std::strerror(errno));
  if (pid == 0) watch(fds[0], groups, notice, grace_s);
  ::close(fds[0]);
  return {pid, fds[1]};
}

void tell_watchdog(const Watchdog& w, pid_t group) {
  const int32_t g = group;
  // A dead watchdog: nothing to do.
  [[maybe_unused]] const ssize_t n = ::send(w.fd, &g, sizeof g, MSG_NOSIGNAL);
}

// The launcher ends normally (every rank reaped): the watchdog has nothing left to watch.
void stand_down(Watchdog& w) {
  if (w.pid > 0) {
    ::kill(w.pid, SIGKILL);
    ::waitpid(w.pid, nullptr, 0);
  }
  ::close(w.fd);
  w = {};
}

}  // namespace

int launch(const LaunchOptions& o) {
  TANDEM_CHECK(o.nproc >= 1, "tandem launch: --nproc {} must be at least 1", o.nproc);
  TANDEM_CHECK(o.nnodes >= 1, "tandem launch: --nnodes {} must be at least 1", o.nnodes);
  TANDEM_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes,
               "tandem launch: --node-rank {} is out of range for --nnodes {} (0..{})", o.node_rank,
               o.nnodes, o.nnodes - 1);
  TANDEM_CHECK(o.nnodes == 1 || !o.master.empty(),
               "tandem launch: --nnodes {} needs --master HOST:PORT, the address of node 0 that "
               "every node reaches (the same on every node)",
               o.nnodes);
  TANDEM_CHECK(!o.command.empty(),
               "tandem launch: give the command after --: tandem launch --nproc 2 -- tandem train "
               "job.toml");
  TANDEM_CHECK(o.grace_s >= 0, "tandem launch: --grace-s must be >= 0");
  auto [host, port] = rendezvous::split_host_port(o.master);
  if (host.empty()) host = "127.0.0.1";
  if (port == 0) port = o.nnodes == 1 ? free_port() : rendezvous::kDefaultMasterPort;
  const int world = o.nproc * o.nnodes;

  // Before the signal pipe and the ranks' pipes, so the watchdog holds none of them.
  Watchdog watchdog = start_watchdog(o.nproc, o.grace_s);
  const pid_t launcher = ::getpid();
  TANDEM_CHECK(::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, "tandem launch: pipe: {}",
               std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<Rank> ranks(static_cast<size_t>(o.nproc));
  // The node's CPUs shared among its ranks, as torchrun does with OMP_NUM_THREADS: N ranks of a
  // thread pool as wide as the machine each would oversubscribe it N times over (OpenMP's
  // spinning threads then slow every rank down). A value the user set is kept.
  std::vector<std::string> thread_env;
  if (std::getenv("TANDEM_NUM_THREADS") == nullptr) {
    cpu_set_t set;
    const int cpus = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    const int per_rank = std::max(1, cpus / o.nproc);
    thread_env.push_back(fmt::format("TANDEM_NUM_THREADS={}", per_rank));
    if (std::getenv("OMP_NUM_THREADS") == nullptr)
      thread_env.push_back(fmt::format("OMP_NUM_THREADS={}", per_rank));
    std::fprintf(stderr,
                 "tandem launch: %d threads per rank (%d CPUs / %d ranks; set TANDEM_NUM_THREADS "
                 "to choose)\n",
                 per_rank, cpus, o.nproc);
  }
  for (int local = 0; local < o.nproc; ++local) {
    Rank& r = ranks[static_cast<size_t>(local)];
    r.rank = o.node_rank * o.nproc + local;
    // The child's environment, built before fork: ours plus the launcher's variables.
    std::vector<std::string> env_text;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      const std::string name = kv.substr(0, kv.find('='));
      if (name != "RANK" && name != "WORLD_SIZE" && name != "LOCAL_RANK" &&
          name != "LOCAL_WORLD_SIZE" && name != "GROUP_RANK" && name != "MASTER_ADDR" &&
          name != "MASTER_PORT")
        env_text.push_back(kv);
    }
    env_text.push_back(fmt::format("RANK={}", r.rank));
    env_text.push_back(fmt::format("WORLD_SIZE={}", world));
    env_text.push_back(fmt::format("LOCAL_RANK={}", local));
    env_text.push_back(fmt::format("LOCAL_WORLD_SIZE={}", o.nproc));
    env_text.push_back(fmt::format("GROUP_RANK={}", o.node_rank));
    env_text.push_back(fmt::format("MASTER_ADDR={}", host));
    env_text.push_back(fmt::format("MASTER_PORT={}", port));
    for (const std::string& kv : thread_env) env_text.push_back(kv);
    std::vector<char*> envp, argv;
    for (auto& kv : env_text) envp.push_back(kv.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o.command;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    int out[2], err[2];
    TANDEM_CHECK(::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0,
                 "tandem launch: pipe: {}", std::strerror(errno));
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    TANDEM_CHECK(pid >= 0, "tandem launch: fork: {}", std::strerror(errno));
    if (pid == 0) {
      // Its own process group: a Ctrl-C at the terminal reaches the launcher only, which forwards
      // it once; stopping a rank stops what it started too.
      ::setpgid(0, 0);
      // The rank ends with the launcher even if the watchdog is gone too: SIGTERM when the launcher
      // dies, as if it had passed one on. A launcher that died before this call is no longer our
      // parent.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) ::_exit(128 + SIGTERM);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigaction(SIGINT, &dfl, nullptr);
      sigaction(SIGTERM, &dfl, nullptr);
      ::execvpe(argv[0], argv.data(), envp.data());
      const std::string msg =
          fmt::format("tandem launch: cannot run '{}': {}\n", argv[0], std::strerror(errno));
      [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, msg.data(), msg.size());
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    tell_watchdog(watchdog, pid);
    ::close(out[1]);
    ::close(err[1]);
    r.pid = pid;
    r.out = {out[0], stdout, ""};
    r.err = {err[0], stderr, ""};
  }

  std::optional<size_t> failed;  // the first rank that failed
  std::optional<Clock::time_point> kill_at;
  auto stop_all = [&](int sig) {
    for (auto& r : ranks)
      if (!r.status) ::kill(-r.pid, sig);
    if (!kill_at)
      kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_s * 1000));
  };

  for (;;) {
    std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Rank*, Stream*>> owners{{nullptr, nullptr}};
    for (auto& r : ranks)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.emplace_back(&r, s);
        }
    bool running = false;
    for (auto& r : ranks) running = running || !r.status;
    if (!running && fds.size() == 1) break;
    const int ready = ::poll(fds.data(), fds.size(), running ? 100 : 1000);
    if (ready == 0 && !running) break;  // a grandchild keeps a pipe open: stop reading it
    if (fds[0].revents & POLLIN) {
      unsigned char sig = 0;
      while (::read(signal_pipe[0], &sig, 1) == 1) {
        std::fprintf(stderr, "tandem launch: %s: passing it to the ranks\n", strsignal(sig));
        stop_all(sig);
      }
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(*owners[i].first, *owners[i].second);

    int ws = 0;
    for (pid_t pid; (pid = ::waitpid(-1, &ws, WNOHANG)) > 0;) {
      if (pid == watchdog.pid) watchdog.pid = -1;  // killed by someone: nothing to stand down
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i].pid != pid) continue;
        ranks[i].status = exit_code(ws);
        if (*ranks[i].status != 0 && !failed && !kill_at) {
          failed = i;
          std::fprintf(stderr, "tandem launch: rank %d %s; stopping the other ranks\n",
                       ranks[i].rank, describe_status(*ranks[i].status).c_str());
          stop_all(SIGTERM);
        }
      }
    }
    if (kill_at && Clock::now() >= *kill_at) {
      for (auto& r : ranks)
        if (!r.status) ::kill(-r.pid, SIGKILL);
      kill_at = Clock::now() + std::chrono::hours(24);
    }
  }
  for (auto& r : ranks)
    for (Stream* s : {&r.out, &r.err})
      if (s->fd >= 0) ::close(s->fd);
  stand_down(watchdog);

  if (failed) {
    const Rank& r = ranks[*failed];
    std::string tail;
    for (const auto& line : r.last_lines) tail += fmt::format("  [rank {}] {}\n", r.rank, line);
    std::fprintf(stderr, "tandem launch: rank %d %s; its last output:\n%s", r.rank,
                 describe_status(*r.status).c_str(), tail.c_str());
    return *r.status;
  }
  for (const auto& r : ranks)
    if (*r.status != 0) return *r.status;
  return 0;
}

namespace {
CLI::App* launch_cmd = nullptr;
LaunchOptions options;
}  // namespace

void add_launch_command(CLI::App& app) {
  launch_cmd = app.add_subcommand(
      "launch", "start the ranks of one node: tandem launch --nproc 2 -- tandem train job.toml");
  launch_cmd->add_option("--nproc", options.nproc, "ranks on this node")->required();
  launch_cmd->add_option("--nnodes", options.nnodes, "nodes of the job (default 1)");
  launch_cmd->add_option("--node-rank", options.node_rank, "this node's index (default 0)");
  launch_cmd->add_option("--master", options.master,
                         "HOST:PORT where rank 0 serves the rendezvous store (default: "
                         "127.0.0.1 and a free port; required with --nnodes > 1)");
  launch_cmd->add_option("--grace-s", options.grace_s,
                         "seconds between SIGTERM and SIGKILL when stopping the ranks");
  launch_cmd->add_option("command", options.command, "the command each rank runs, after --")
      ->expected(-1);
}

int run_launch_command() {
  if (launch_cmd == nullptr || !launch_cmd->parsed()) return -1;
  return launch(options);
}

}  // namespace tandem::apps
