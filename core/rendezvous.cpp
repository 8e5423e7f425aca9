// Rank bootstrap from the launchers' environment, and the stores ranks meet in: a TCP key-value
// store served by rank 0 (Debian's gloo has none) and gloo's FileStore, both bounded in time.
#include "core/rendezvous.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/store.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/socket.h"

namespace tandem::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::optional<int64_t> parse_int(const std::string& s) {
  int64_t v = 0;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc() || p != end || s.empty()) return std::nullopt;
  return v;
}

// An integer environment variable within [lo, hi]; nullopt when unset.
std::optional<int> env_int(const GetEnv& getenv, const char* name, int64_t lo, int64_t hi) {
  const char* v = getenv(name);
  if (v == nullptr) return std::nullopt;
  const auto n = parse_int(v);
  TANDEM_CHECK(n.has_value(), "{}='{}' is not an integer: fix the launcher's environment", name, v);
  TANDEM_CHECK(*n >= lo && *n <= hi, "{}={} is out of range [{}, {}]", name, *n, lo, hi);
  return static_cast<int>(*n);
}

std::string env_str(const GetEnv& getenv, const char* name) {
  const char* v = getenv(name);
  return v == nullptr ? "" : v;
}

constexpr int64_t kMaxWorld = 1 << 20;

// A launcher's rank and world size (mpirun, srun), once its rank variable is known to be set:
// rank, world_size, local_rank (local_var) and the source that names them.
void read_launcher_rank(const GetEnv& getenv, const char* rank_var, const char* world_var,
                        const char* local_var, RankInfo& info) {
  info.rank = *env_int(getenv, rank_var, 0, kMaxWorld);
  const auto world = env_int(getenv, world_var, 1, kMaxWorld);
  TANDEM_CHECK(world.has_value(), "{} is set but {} is not", rank_var, world_var);
  info.world_size = *world;
  info.local_rank = env_int(getenv, local_var, 0, kMaxWorld).value_or(0);
  info.source = fmt::format("{}={} {}={}", rank_var, info.rank, world_var, info.world_size);
}

// The default coordinator port moved by the launcher's job id (when set), so that two jobs on
// one node meet apart.
int port_of_job(const GetEnv& getenv, const char* job_var, int port) {
  if (const char* job = getenv(job_var))
    port += static_cast<int>(parse_int(job).value_or(0) % 1000);
  return port;
}

}  // namespace

std::string RankInfo::master() const { return fmt::format("{}:{}", master_addr, master_port); }

std::pair<std::string, int> split_host_port(const std::string& text) {
  std::string host = text, port;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    TANDEM_CHECK(close != std::string::npos, "'{}': an IPv6 address needs its closing ']'", text);
    host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      TANDEM_CHECK(text[close + 1] == ':', "'{}': expected [HOST]:PORT", text);
      port = text.substr(close + 2);
    }
  } else if (const size_t colon = text.rfind(':'); colon != std::string::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  int port_number = 0;
  if (!port.empty()) {
    const auto p = parse_int(port);
    TANDEM_CHECK(p && *p >= 1 && *p <= 65535, "'{}': the port must be a number in [1, 65535]",
                 text);
    port_number = static_cast<int>(*p);
  }
  return {host, port_number};
}

std::vector<std::string> expand_slurm_nodelist(const std::string& list) {
  std::vector<std::string> items;
  int depth = 0;
  std::string cur;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    TANDEM_CHECK(depth >= 0 && depth <= 1, "node list '{}': unbalanced brackets", list);
    if (c == ',' && depth == 0) {
      items.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  TANDEM_CHECK(depth == 0, "node list '{}': unbalanced brackets", list);
  items.push_back(cur);

  std::vector<std::string> hosts;
  std::function<void(const std::string&)> expand = [&](const std::string& item) {
    const size_t open = item.find('[');
    if (open == std::string::npos) {
      TANDEM_CHECK(!item.empty(), "node list '{}': an empty host name", list);
      hosts.push_back(item);
      return;
    }
    const size_t close = item.find(']', open);
    const std::string prefix = item.substr(0, open), suffix = item.substr(close + 1);
    const std::string ranges = item.substr(open + 1, close - open - 1);
    size_t start = 0;
    while (start <= ranges.size()) {
      size_t comma = ranges.find(',', start);
      if (comma == std::string::npos) comma = ranges.size();
      const std::string range = ranges.substr(start, comma - start);
      const size_t dash = range.find('-');
      const std::string lo_text = range.substr(0, dash);
      const std::string hi_text = dash == std::string::npos ? lo_text : range.substr(dash + 1);
      const auto lo = parse_int(lo_text), hi = parse_int(hi_text);
      TANDEM_CHECK(lo && hi && *lo >= 0 && *lo <= *hi && *hi - *lo < 100000,
                   "node list '{}': '{}' is not a range like 1-3 or 5", list, range);
      for (int64_t n = *lo; n <= *hi; ++n)
        expand(fmt::format("{}{:0{}}{}", prefix, n, lo_text.size(), suffix));
      start = comma + 1;
    }
  };
  for (const auto& item : items) expand(item);
  return hosts;
}

RankInfo detect_rank_info(const GetEnv& getenv, const std::string& master) {
  RankInfo info;
  std::string default_addr = "127.0.0.1";
  int default_port = kDefaultMasterPort;
  if (getenv("RANK") != nullptr || getenv("WORLD_SIZE") != nullptr) {
    info.launcher = "torchrun";
    const auto rank = env_int(getenv, "RANK", 0, kMaxWorld);
    const auto world = env_int(getenv, "WORLD_SIZE", 1, kMaxWorld);
    TANDEM_CHECK(rank && world, "set both RANK and WORLD_SIZE (found only {})",
                 rank ? "RANK" : "WORLD_SIZE");
    info.rank = *rank;
    info.world_size = *world;
    info.local_rank = env_int(getenv, "LOCAL_RANK", 0, kMaxWorld).value_or(0);
    info.node_rank = env_int(getenv, "GROUP_RANK", 0, kMaxWorld).value_or(0);
    info.source = fmt::format("RANK={} WORLD_SIZE={}", info.rank, info.world_size);
  } else if (getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
    info.launcher = "mpirun";
    read_launcher_rank(getenv, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK", info);
    const auto local_size = env_int(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxWorld);
    // Open MPI does not tell rank 0's host; on one node it is this one.
    if (local_size != info.world_size) default_addr.clear();
    default_port = port_of_job(getenv, "OMPI_MCA_ess_base_jobid", default_port);
  } else if (getenv("SLURM_PROCID") != nullptr) {
    info.launcher = "srun";
    read_launcher_rank(getenv, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", info);
    info.node_rank = env_int(getenv, "SLURM_NODEID", 0, kMaxWorld).value_or(0);
    std::string nodelist = env_str(getenv, "SLURM_STEP_NODELIST");
    if (nodelist.empty()) nodelist = env_str(getenv, "SLURM_JOB_NODELIST");
    default_addr = nodelist.empty() ? "" : expand_slurm_nodelist(nodelist).front();
    default_port = port_of_job(getenv, "SLURM_JOB_ID", default_port);
  } else {
    info.launcher = "single";
    info.source = "no launcher variables (a single process)";
  }
  TANDEM_CHECK(info.rank < info.world_size,
               "rank {} is out of range for world size {} ({}): ranks are 0..{}", info.rank,
               info.world_size, info.source, info.world_size - 1);
  TANDEM_CHECK(info.local_rank < info.world_size,
               "local rank {} is out of range for world size {} ({})", info.local_rank,
               info.world_size, info.source);

  auto [addr, port] = split_host_port(master);
  if (addr.empty()) addr = env_str(getenv, "MASTER_ADDR");
  if (port == 0) port = env_int(getenv, "MASTER_PORT", 1, 65535).value_or(0);
  if (addr.empty()) addr = default_addr;
  if (port == 0) port = default_port;
  TANDEM_CHECK(!addr.empty() || info.world_size == 1,
               "cannot tell the coordinator's host under {} ({}): set MASTER_ADDR to rank 0's host "
               "(mpirun -x MASTER_ADDR=<host>) or pass --master HOST:PORT",
               info.launcher, info.source);
  info.master_addr = addr.empty() ? "127.0.0.1" : addr;
  info.master_port = port;
  return info;
}

RankInfo detect_rank_info_from_environment(const std::string& master) {
  return detect_rank_info([](const char* name) { return std::getenv(name); }, master);
}

// --- the TCP store -----------------------------------------------------------------------------
//
// Frames: a request is op (1 byte), key length (u32), key, and for kSet a value length (u64) and
// the value; the answer to kSet is one byte (1), to kGet a found byte and, if found, length and
// value, to kCheck a found byte. Lengths are bounded on both sides.
namespace {

enum Op : uint8_t { kSet = 1, kGet = 2, kCheck = 3 };

}  // namespace

struct TcpStoreServer::State {
  int listen_fd = -1;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::mutex mu;
  std::map<std::string, std::vector<char>> data;
  std::vector<int> client_fds;
  std::vector<std::thread> threads;
  std::thread acceptor;

  void serve(int fd) {
    for (;;) {
      uint8_t op = 0;
      uint32_t key_len = 0;
      if (!net::recv_all(fd, &op, 1) || !net::recv_all(fd, &key_len, 4) ||
          key_len > kMaxStoreKeyBytes)
        break;
      std::string key(key_len, '\0');
      if (!net::recv_all(fd, key.data(), key_len)) break;
      if (op == kSet) {
        uint64_t n = 0;
        if (!net::recv_all(fd, &n, 8) || n > kMaxStoreValueBytes) break;
        std::vector<char> value(n);
        if (!net::recv_all(fd, value.data(), n)) break;
        {
          std::lock_guard lock(mu);
          data[key] = std::move(value);
        }
        const uint8_t ok = 1;
        if (!net::send_all(fd, &ok, 1)) break;
      } else if (op == kGet || op == kCheck) {
        std::vector<char> value;
        uint8_t found = 0;
        {
          std::lock_guard lock(mu);
          if (auto it = data.find(key); it != data.end()) {
            found = 1;
            if (op == kGet) value = it->second;
          }
        }
        if (!net::send_all(fd, &found, 1)) break;
        if (found && op == kGet) {
          const uint64_t n = value.size();
          if (!net::send_all(fd, &n, 8) || !net::send_all(fd, value.data(), n)) break;
        }
      } else {
        break;
      }
    }
  }
};

TcpStoreServer::TcpStoreServer(int port) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TANDEM_CHECK(s.listen_fd >= 0, "tcp store: socket(): {}", std::strerror(errno));
  const int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(s.listen_fd, 1024) != 0) {
    const int err = errno;
    ::close(s.listen_fd);
    TANDEM_FAIL("rank 0 cannot serve the tcp store on port {}: {}{}", port, std::strerror(err),
                err == EADDRINUSE
                    ? " (another job or process holds it: pick a free port with MASTER_PORT or "
                      "--master HOST:PORT)"
                    : "");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  s.acceptor = std::thread([&s] {
    for (;;) {
      pollfd p{s.listen_fd, POLLIN, 0};
      const int r = ::poll(&p, 1, 100);
      if (s.stopping) return;
      if (r <= 0) continue;
      const int fd = ::accept4(s.listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      const int nodelay = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof(nodelay));
      std::lock_guard lock(s.mu);
      s.client_fds.push_back(fd);
      s.threads.emplace_back([&s, fd] { s.serve(fd); });
    }
  });
}

TcpStoreServer::~TcpStoreServer() {
  State& s = *state_;
  s.stopping = true;
  s.acceptor.join();
  ::close(s.listen_fd);
  {
    std::lock_guard lock(s.mu);
    for (int fd : s.client_fds) ::shutdown(fd, SHUT_RDWR);
  }
  for (auto& t : s.threads) t.join();
  for (int fd : s.client_fds) ::close(fd);
}

int TcpStoreServer::port() const { return state_->port; }

namespace {

std::string join_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "'" : ", '") + k + "'";
  return s;
}

// A client of the TCP store: one connection, one request at a time.
class TcpStoreClient : public gloo::rendezvous::Store {
 public:
  TcpStoreClient(const std::string& host, int port, milliseconds timeout, std::string who)
      : address_(fmt::format("{}:{}", host, port)), timeout_(timeout), who_(std::move(who)) {
    const auto deadline = Clock::now() + timeout;
    std::string last_error;
    auto pause = milliseconds(10);
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      fd_ = net::connect_tcp(host, port, std::max<int64_t>(1, left.count()), last_error);
      if (fd_ >= 0) break;
      TANDEM_CHECK(Clock::now() + pause < deadline,
                   "{}: cannot reach the coordinator's tcp store at {} within {} s ({}): check "
                   "MASTER_ADDR/MASTER_PORT or --master, and that rank 0 started",
                   who_, address_, timeout.count() / 1000.0, last_error);
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, milliseconds(200));
    }
    net::set_io_timeouts(fd_, timeout.count());
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {};
      if (local.ss_family == AF_INET)
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&local)->sin_addr, buf, sizeof(buf));
      else
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, buf,
                    sizeof(buf));
      local_address_ = buf;
    }
  }
  ~TcpStoreClient() override { ::close(fd_); }

  const std::string& local_address() const { return local_address_; }
  const std::string& address() const { return address_; }

  void set(const std::string& key, const std::vector<char>& value) override {
    TANDEM_CHECK(value.size() <= kMaxStoreValueBytes,
                 "tcp store: the value of '{}' is {} bytes, more than the {} allowed", key,
                 value.size(), kMaxStoreValueBytes);
    std::lock_guard lock(mu_);
    request(kSet, key);
    const uint64_t n = value.size();
    uint8_t ok = 0;
    if (!net::send_all(fd_, &n, 8) || !net::send_all(fd_, value.data(), n) ||
        !net::recv_all(fd_, &ok, 1))
      lost(key);
  }

  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    std::lock_guard lock(mu_);
    request(kGet, key);
    uint8_t found = 0;
    uint64_t n = 0;
    if (!net::recv_all(fd_, &found, 1) || (found && !net::recv_all(fd_, &n, 8))) lost(key);
    TANDEM_CHECK(found && n <= kMaxStoreValueBytes, "tcp store at {}: '{}' vanished", address_,
                 key);
    std::vector<char> value(n);
    if (!net::recv_all(fd_, value.data(), n)) lost(key);
    return value;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    const auto deadline = Clock::now() + std::min(timeout, timeout_);
    auto pause = milliseconds(1);
    std::vector<std::string> missing = keys;
    for (;;) {
      {
        std::lock_guard lock(mu_);
        std::erase_if(missing, [&](const std::string& key) {
          request(kCheck, key);
          uint8_t found = 0;
          if (!net::recv_all(fd_, &found, 1)) lost(key);
          return found == 1;
        });
      }
      if (missing.empty()) return;
      TANDEM_CHECK(Clock::now() < deadline,
                   "{}: waited {} s (distributed.timeout_s) in the tcp store at {} for {}, which "
                   "the other ranks never wrote: a rank did not start or died",
                   who_, std::chrono::duration<double>(std::min(timeout, timeout_)).count(),
                   address_, join_keys(missing));
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, milliseconds(50));
    }
  }

 private:
  void request(uint8_t op, const std::string& key) {
    TANDEM_CHECK(key.size() <= kMaxStoreKeyBytes, "tcp store: key of {} bytes is too long",
                 key.size());
    const uint32_t n = static_cast<uint32_t>(key.size());
    if (!net::send_all(fd_, &op, 1) || !net::send_all(fd_, &n, 4) ||
        !net::send_all(fd_, key.data(), n))
      lost(key);
  }
  [[noreturn]] void lost(const std::string& key) {
    TANDEM_FAIL(
        "{}: lost the tcp store at {} while asking for '{}' ({}): rank 0, which serves it, "
        "died or is stuck",
        who_, address_, key, errno == EAGAIN ? "no answer within the timeout" : "closed");
  }

  int fd_ = -1;
  std::mutex mu_;
  std::string address_, local_address_;
  milliseconds timeout_;
  std::string who_;
};

class TcpStore : public Store {
 public:
  TcpStore(const RankInfo& info, milliseconds timeout) {
    if (info.rank == 0) server_ = std::make_unique<TcpStoreServer>(info.master_port);
    client_ =
        std::make_unique<TcpStoreClient>(info.master_addr, info.master_port, timeout,
                                         fmt::format("rank {} of {}", info.rank, info.world_size));
  }
  gloo::rendezvous::Store& gloo() override { return *client_; }
  std::string local_address() const override { return client_->local_address(); }
  std::string describe() const override { return "tcp store at " + client_->address(); }

 private:
  std::unique_ptr<TcpStoreServer> server_;  // rank 0 only; destroyed after the client
  std::unique_ptr<TcpStoreClient> client_;
};

// gloo's FileStore with this job's timeout on every wait and tandem errors.
class FileStore : public Store, public gloo::rendezvous::Store {
 public:
  FileStore(const std::string& dir, milliseconds timeout, std::string who)
      : store_(dir), dir_(dir), timeout_(timeout), who_(std::move(who)) {}
  gloo::rendezvous::Store& gloo() override { return *this; }
  std::string local_address() const override { return ""; }
  std::string describe() const override { return "file store in " + dir_; }

  void set(const std::string& key, const std::vector<char>& value) override {
    translate(key, [&] { store_.set(key, value); });
  }
  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    std::vector<char> v;
    translate(key, [&] { v = store_.get(key); });
    return v;
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    translate(join_keys(keys), [&] { store_.wait(keys, std::min(timeout, timeout_)); });
  }

 private:
  void translate(const std::string& what, const std::function<void()>& fn) {
    try {
      fn();
    } catch (const gloo::Exception& e) {
      TANDEM_FAIL(
          "{}: file store in {}: {} for {} within {} s (distributed.timeout_s): a rank did not "
          "start or died, or the directory is not shared by all ranks",
          who_, dir_, e.what(), what, timeout_.count() / 1000.0);
    }
  }

  gloo::rendezvous::FileStore store_;
  std::string dir_;
  milliseconds timeout_;
  std::string who_;
};

}  // namespace

std::unique_ptr<Store> open_store(const std::string& spec, const RankInfo& info,
                                  milliseconds timeout) {
  if (spec == "tcp") return std::make_unique<TcpStore>(info, timeout);
  if (spec.rfind("file:", 0) == 0) {
    const std::string dir = spec.substr(5);
    TANDEM_CHECK(!dir.empty() && std::filesystem::is_directory(dir),
                 "distributed.store = \"{}\": the directory '{}' does not exist; create a fresh "
                 "directory on a file system every rank sees",
                 spec, dir);
    return std::make_unique<FileStore>(dir, timeout,
                                       fmt::format("rank {} of {}", info.rank, info.world_size));
  }
  TANDEM_FAIL("distributed.store = \"{}\": use \"tcp\" or \"file:/shared/dir\"", spec);
}

}  // namespace tandem::rendezvous
