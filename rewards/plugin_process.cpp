// PluginProcess: a forked child that loads a reward plugin and scores batches sent over a socket.
//
// Messages are frames: a u64 length, then the bytes. Integers are in this machine's byte order
// (both ends are the same program). Request: u64 N, then per sample prompt, completion, answer,
// extra_json (each a u64 length and the bytes), i64 completion_tokens, u8 truncated. Reply: u64 N,
// then per result u8 ok, f64 value, the error (u64 length and bytes). After the fork the child
// first sends one frame: u8 loaded, then the error of a failed load.
#include "rewards/plugin_process.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <thread>

#include "core/error.h"
#include "rewards/plugin.h"

namespace tandem::rewards {
namespace {

constexpr uint64_t kMaxErrorBytes = 64 << 10;  // a longer error of the plugin is cut
constexpr uint64_t kMaxFrameBytes = 1ull << 34;

bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool read_all(int fd, void* data, size_t size) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = recv(fd, p, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool send_frame(int fd, const std::string& bytes) {
  const uint64_t size = bytes.size();
  return write_all(fd, &size, sizeof size) && write_all(fd, bytes.data(), bytes.size());
}

// False on end of file, an error, or a frame longer than max_bytes.
bool read_frame(int fd, std::string& bytes, uint64_t max_bytes) {
  uint64_t size = 0;
  if (!read_all(fd, &size, sizeof size) || size > max_bytes) return false;
  bytes.resize(size);
  return read_all(fd, bytes.data(), size);
}

class Writer {
 public:
  template <typename T>
  void put(T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void put_string(std::string_view s) {
    put<uint64_t>(s.size());
    out.append(s);
  }
  std::string out;
};

// Reads what a Writer wrote; any read past the end makes ok() false.
class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  T get() {
    T v{};
    if (!take(sizeof v)) return v;
    std::memcpy(&v, in_.data() + at_ - sizeof v, sizeof v);
    return v;
  }
  std::string get_string(uint64_t max_bytes) {
    const uint64_t size = get<uint64_t>();
    if (size > max_bytes || !take(size)) {
      ok_ = false;
      return {};
    }
    return in_.substr(at_ - size, size);
  }
  bool ok() const { return ok_ && at_ == in_.size(); }

 private:
  bool take(uint64_t n) {
    if (!ok_ || n > in_.size() - at_) return ok_ = false;
    at_ += n;
    return true;
  }
  const std::string& in_;
  size_t at_ = 0;
  bool ok_ = true;
};

// The child: loads the plugin in-process and answers requests until the parent closes the socket.
[[noreturn]] void serve_plugin(int fd, const std::string& name, const std::string& path,
                               const std::string& config) {
  std::unique_ptr<PluginReward> plugin;
  Writer hello;
  try {
    plugin =
        std::make_unique<PluginReward>(name, path, config, PluginReward::Options{.isolate = false});
    hello.put<uint8_t>(1);
  } catch (const std::exception& e) {
    hello.put<uint8_t>(0);
    hello.put_string(e.what());
  }
  if (!send_frame(fd, hello.out) || plugin == nullptr) _exit(0);
  for (std::string request; read_frame(fd, request, kMaxFrameBytes);) {
    Reader r(request);
    std::vector<RewardSample> samples(r.get<uint64_t>());
    for (RewardSample& s : samples) {
      s.prompt = r.get_string(kMaxFrameBytes);
      s.completion = r.get_string(kMaxFrameBytes);
      s.answer = r.get_string(kMaxFrameBytes);
      s.extra = nlohmann::json::parse(r.get_string(kMaxFrameBytes), nullptr, false);
      s.completion_tokens = r.get<int64_t>();
      s.truncated = r.get<uint8_t>() != 0;
    }
    if (!r.ok()) _exit(3);  // cannot happen: the parent wrote it
    std::vector<RewardResult> results = plugin->score(samples);
    Writer reply;
    reply.put<uint64_t>(results.size());
    for (const RewardResult& x : results) {
      reply.put<uint8_t>(x.ok ? 1 : 0);
      reply.put<double>(x.value);
      reply.put_string(std::string_view(x.error).substr(0, kMaxErrorBytes));
    }
    if (!send_frame(fd, reply.out)) break;
  }
  plugin.reset();
  _exit(0);
}

}  // namespace

PluginProcess::PluginProcess(std::string name, std::string path, std::string config)
    : name_(std::move(name)), path_(std::move(path)), config_(std::move(config)) {
  std::lock_guard lock(mutex_);
  start();
}

PluginProcess::~PluginProcess() {
  std::lock_guard lock(mutex_);
  if (fd_ >= 0) close(fd_);  // the child sees the end of its requests and exits
  fd_ = -1;
  if (pid_ <= 0) return;
  for (int waited_ms = 0; waited_ms < 2000; waited_ms += 5) {
    if (waitpid(pid_, nullptr, WNOHANG) != 0) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  reap();  // a plugin whose free() hangs
}

void PluginProcess::start() {
  int fds[2];
  TANDEM_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0,
               "reward '{}': cannot create a socket pair for plugin '{}': {}", name_, path_,
               std::strerror(errno));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close(fds[0]);
    close(fds[1]);
    TANDEM_FAIL("reward '{}': cannot fork a process for plugin '{}': {}", name_, path_,
                std::strerror(e));
  }
  if (pid == 0) {
    // Only this thread lives on in the child: no lock another thread held may be taken here
    // (the plugin loader uses dlopen and malloc, which fork keeps usable; nothing logs).
    // The child ends when the parent closes its socket (also when the parent dies), or within a
    // second of the parent's death while the plugin is busy. (PR_SET_PDEATHSIG would fire when
    // the forking thread ends, and RewardSet calls a function from threads that come and go.)
    std::thread([parent] {
      while (getppid() == parent) std::this_thread::sleep_for(std::chrono::milliseconds(250));
      _exit(0);
    }).detach();
    std::signal(SIGINT, SIG_IGN);
    // A crash ends the child at once, whatever handlers the parent installed (a test framework's,
    // a backtrace printer): the parent reports it.
    sigset_t crashes;
    sigemptyset(&crashes);
    for (int s : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
      std::signal(s, SIG_DFL);
      sigaddset(&crashes, s);
    }
    pthread_sigmask(SIG_UNBLOCK, &crashes, nullptr);
    int fd = fds[1];
    if (fd != 3) {
      dup2(fd, 3);
      fd = 3;
    }
    close_range(4, ~0u, 0);  // sockets and files of the parent stay the parent's
    serve_plugin(fd, name_, path_, config_);
  }
  close(fds[1]);
  fd_ = fds[0];
  pid_ = pid;
  std::string hello;
  if (!read_frame(fd_, hello, kMaxErrorBytes + 64)) {
    const std::string how = reap();
    close(fd_);
    fd_ = -1;
    TANDEM_FAIL("reward '{}': the process loading plugin '{}' {} before it was ready", name_, path_,
                how);
  }
  Reader r(hello);
  if (r.get<uint8_t>() != 1) {
    const std::string why = r.get_string(kMaxErrorBytes);
    reap();
    close(fd_);
    fd_ = -1;
    throw Error(why);  // PluginReward's own message, from the child
  }
}

std::string PluginProcess::reap() {
  if (pid_ <= 0) return "is gone";
  // A dying child closes its socket before it can be waited for: give it a moment to finish.
  int status = 0;
  pid_t done = 0;
  for (int waited_ms = 0; waited_ms < 500 && done == 0; ++waited_ms) {
    done = waitpid(pid_, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (done == 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status, 0);
  }
  pid_ = -1;
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  return fmt::format("exited with status {}", WEXITSTATUS(status));
}

std::vector<RewardResult> PluginProcess::score(std::span<const RewardSample> samples) {
  std::lock_guard lock(mutex_);
  if (pid_ < 0) {  // the last child died in a call
    ++restarts_;
    start();
  }
  Writer w;
  w.put<uint64_t>(samples.size());
  for (const RewardSample& s : samples) {
    w.put_string(s.prompt);
    w.put_string(s.completion);
    w.put_string(s.answer);
    w.put_string(s.extra.is_null() ? std::string("{}") : s.extra.dump());
    w.put<int64_t>(s.completion_tokens);
    w.put<uint8_t>(s.truncated ? 1 : 0);
  }
  std::string reply;
  bool answered =
      send_frame(fd_, w.out) && read_frame(fd_, reply, 8 + samples.size() * (17 + kMaxErrorBytes));
  std::vector<RewardResult> results;
  if (answered) {
    Reader r(reply);
    results.resize(r.get<uint64_t>() == samples.size() ? samples.size() : 0);
    for (RewardResult& x : results) {
      x.ok = r.get<uint8_t>() != 0;
      x.value = r.get<double>();
      x.error = r.get_string(kMaxErrorBytes);
    }
    answered = r.ok() && results.size() == samples.size();
  }
  if (answered) return results;

  const std::string how = reap();
  close(fd_);
  fd_ = -1;
  ++crashes_;
  const std::string why = fmt::format(
      "plugin '{}': its process {} while scoring a batch of {} samples (crash {}); a new process "
      "scores the next batch",
      path_, how, samples.size(), crashes_);
  spdlog::warn("reward '{}': {}", name_, why);
  return std::vector<RewardResult>(samples.size(), RewardResult::failure(why));
}

int64_t PluginProcess::crashes() const {
  std::lock_guard lock(mutex_);
  return crashes_;
}

int64_t PluginProcess::restarts() const {
  std::lock_guard lock(mutex_);
  return restarts_;
}

int PluginProcess::pid() const {
  std::lock_guard lock(mutex_);
  return pid_;
}

}  // namespace tandem::rewards
