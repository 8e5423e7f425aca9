// Test helpers.
#include "tests/testutil.h"

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <array>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "core/philox.h"

namespace tandem::test {
namespace {

template <class T>
void store(void* p, int64_t i, double v) {
  if constexpr (std::is_same_v<T, float>) {
    static_cast<float*>(p)[i] = static_cast<float>(v);
  } else {
    static_cast<T*>(p)[i] = T(static_cast<float>(v));
  }
}

void store_any(const Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::f32:
      store<float>(t.data(), i, v);
      break;
    case DType::bf16:
      store<bf16>(t.data(), i, v);
      break;
    case DType::f16:
      store<f16>(t.data(), i, v);
      break;
    case DType::i32:
      static_cast<int32_t*>(t.data())[i] = static_cast<int32_t>(v);
      break;
    case DType::i64:
      static_cast<int64_t*>(t.data())[i] = static_cast<int64_t>(v);
      break;
    case DType::u8:
      static_cast<uint8_t*>(t.data())[i] = static_cast<uint8_t>(v);
      break;
  }
}

double uniform01(uint64_t seed, int64_t i) {
  const Philox4x32 r = philox_random(seed, 0x7e57, static_cast<uint64_t>(i) / 2);
  // 53 random bits from two words.
  const uint64_t hi = r.v[(i % 2) * 2], lo = r.v[(i % 2) * 2 + 1];
  return static_cast<double>(((hi << 32) | lo) >> 11) * 0x1.0p-53;
}

}  // namespace

Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, double lo, double hi) {
  TANDEM_CHECK(dtype_is_float(dtype), "random_tensor wants a float dtype, got {}", dtype);
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_any(t, i, lo + (hi - lo) * uniform01(seed, i));
  return t;
}

Tensor random_ints(const Shape& shape, DType dtype, uint64_t seed, int64_t lo, int64_t hi) {
  TANDEM_CHECK(dtype == DType::i32 || dtype == DType::i64, "random_ints wants i32 or i64");
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t v = lo + static_cast<int64_t>(uniform01(seed, i) * static_cast<double>(hi - lo));
    store_any(t, i, static_cast<double>(v < hi ? v : hi - 1));
  }
  return t;
}

Tensor tensor_from(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  TANDEM_CHECK_EQ(static_cast<int64_t>(values.size()), t.numel(), "tensor_from");
  for (int64_t i = 0; i < t.numel(); ++i) store_any(t, i, values[static_cast<size_t>(i)]);
  return t;
}

std::vector<double> to_f64(const Tensor& t_any) {
  const Tensor t = t_any.device().is_cpu() ? t_any : t_any.to(Device::cpu());
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    double v = 0;
    switch (t.dtype()) {
      case DType::f32:
        v = static_cast<const float*>(t.data())[i];
        break;
      case DType::bf16:
        v = static_cast<float>(static_cast<const bf16*>(t.data())[i]);
        break;
      case DType::f16:
        v = static_cast<float>(static_cast<const f16*>(t.data())[i]);
        break;
      case DType::i32:
        v = static_cast<const int32_t*>(t.data())[i];
        break;
      case DType::i64:
        v = static_cast<double>(static_cast<const int64_t*>(t.data())[i]);
        break;
      case DType::u8:
        v = static_cast<const uint8_t*>(t.data())[i];
        break;
    }
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

bool bitwise_equal(const Tensor& a_any, const Tensor& b_any) {
  if (!(a_any.shape() == b_any.shape()) || a_any.dtype() != b_any.dtype()) return false;
  const Tensor a = a_any.device().is_cpu() ? a_any : a_any.to(Device::cpu());
  const Tensor b = b_any.device().is_cpu() ? b_any : b_any.to(Device::cpu());
  return std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double v : a) m = std::max(m, std::fabs(v));
  return m;
}

double nmse(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? num / den : num;
}

bool all_finite(const Tensor& t) {
  for (double v : to_f64(t))
    if (!std::isfinite(v)) return false;
  return true;
}

void check_within_reference_error(const Tensor& ours, const std::vector<double>& truth,
                                  const std::vector<double>& same_precision,
                                  const std::string& what) {
  const std::vector<double> got = to_f64(ours);
  const double err = max_abs_diff(got, truth);
  const double ref_err = max_abs_diff(same_precision, truth);
  const double floor = 4.0 * FLT_EPSILON * max_abs(truth);
  INFO(what << ": max |ours - f64| = " << err << ", max |f32 reference - f64| = " << ref_err
            << ", floor " << floor);
  CHECK(all_finite(ours));
  CHECK(err <= 2.0 * ref_err + floor);
}

void check_gradient(const Tensor& x, const std::function<double()>& loss, const Tensor& grad,
                    const std::string& what, const FdOptions& opt) {
  REQUIRE(x.dtype() == DType::f32);
  REQUIRE(x.device().is_cpu());
  REQUIRE(grad.numel() == x.numel());
  const std::vector<double> g = to_f64(grad);
  const double scale = std::max(max_abs(g), 1e-6);
  float* p = x.data_as<float>();
  int bad = 0;
  for (int probe = 0; probe < opt.probes; ++probe) {
    const int64_t i =
        static_cast<int64_t>(uniform01(opt.seed, probe) * static_cast<double>(x.numel()));
    const float saved = p[i];
    p[i] = static_cast<float>(saved + opt.eps);
    const double up = loss();
    p[i] = static_cast<float>(saved - opt.eps);
    const double down = loss();
    p[i] = saved;
    const double h = (static_cast<double>(static_cast<float>(saved + opt.eps)) -
                      static_cast<double>(static_cast<float>(saved - opt.eps)));
    const double fd = (up - down) / h;
    const double an = g[static_cast<size_t>(i)];
    if (std::fabs(fd - an) > opt.rtol * scale) {
      ++bad;
      UNSCOPED_INFO(what << ": d/dx[" << i << "] finite difference " << fd << " vs analytic " << an
                         << " (gradient scale " << scale << ")");
    }
  }
  CHECK(bad == 0);
}

double weighted_sum(const Tensor& y, const Tensor& w) {
  const std::vector<double> a = to_f64(y), b = to_f64(w);
  REQUIRE(a.size() == b.size());
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

bool gpu_available() { return cuda_device_count() > 0; }

void skip_without_gpu() {
  if (gpu_available()) return;
  std::printf("SKIPPED: %s\n", gpu_summary().c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

std::string gpt2_byte_char(int b) {
  const auto printable = [](int k) {
    return (k >= 33 && k <= 126) || (k >= 161 && k <= 172) || k >= 174;
  };
  int cp = b;
  if (!printable(b)) {
    int n = 0;
    for (int k = 0; k < b; ++k)
      if (!printable(k)) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

TempDir::TempDir(const std::string& name)
    : path(std::filesystem::temp_directory_path() /
           ("tandem-test-" + name + "-" + std::to_string(static_cast<long>(::getpid())))) {
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::string TempDir::write(const std::string& name, const std::string& text) const {
  std::ofstream(path / name, std::ios::binary) << text;
  return file(name);
}

CommandResult run_tandem(const std::string& args, bool merge_stderr, int timeout_s,
                         const std::string& env) {
  const std::string limit =
      timeout_s > 0 ? "timeout -k 5 " + std::to_string(timeout_s) + " " : std::string();
  const std::string cmd = (env.empty() ? "" : env + " ") + limit + std::string(TANDEM_BIN_DIR) +
                          "/tandem " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  return run_shell(cmd);
}

CommandResult run_shell(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), static_cast<int>(buf.size()), p) != nullptr) out += buf.data();
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

std::vector<RankResult> run_ranks(int n, const std::function<std::string(int)>& env_of,
                                  const std::string& command, int limit_s) {
  TempDir dir("ranks");
  std::string script = "pids=''; ";
  for (int r = 0; r < n; ++r)
    script += env_of(r) + " timeout -k 2 " + std::to_string(limit_s) + " " + command + " > " +
              dir.file(std::to_string(r)) + " 2>&1 & pids=\"$pids $!\"; ";
  script += "for p in $pids; do wait $p; echo $?; done";
  const auto res = run_shell("bash -c '" + script + "'");
  std::vector<RankResult> results(static_cast<size_t>(n));
  std::istringstream statuses(res.out);
  for (int r = 0; r < n; ++r) {
    RankResult& rr = results[static_cast<size_t>(r)];
    statuses >> rr.status;
    rr.out = read_text(dir.file(std::to_string(r)));
  }
  return results;
}

std::string read_text(const std::filesystem::path& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

std::string torchrun_env(int r, int n, int port) {
  return "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(n) +
         " LOCAL_RANK=" + std::to_string(r) +
         " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port);
}

Subprocess::Subprocess(const std::vector<std::string>& argv) {
  REQUIRE(!argv.empty());
  int fds[2];
  REQUIRE(pipe2(fds, O_CLOEXEC) == 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) close(fds[0]);
  INFO("starting " << argv[0] << ": " << std::strerror(rc));
  REQUIRE(rc == 0);
  pid_ = pid;
  out_fd_ = fds[0];
}

Subprocess::~Subprocess() {
  if (pid_ > 0) stop();
  if (out_fd_ >= 0) close(out_fd_);
}

std::string Subprocess::wait_for_line(const std::string& prefix, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    for (size_t nl = pending_.find('\n'); nl != std::string::npos; nl = pending_.find('\n')) {
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      output_ += line + "\n";
      if (line.rfind(prefix, 0) == 0) return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || out_fd_ < 0) return "";
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(out_fd_, buf, sizeof buf);
    if (n <= 0) {  // the child closed its stdout
      close(out_fd_);
      out_fd_ = -1;
      return "";
    }
    pending_.append(buf, static_cast<size_t>(n));
  }
}

int Subprocess::stop(int signal, int timeout_ms) {
  if (pid_ <= 0) return status_;
  kill(pid_, signal);
  int status = 0;
  pid_t done = 0;
  for (int waited = 0; waited < timeout_ms; waited += 10) {
    done = waitpid(pid_, &status, WNOHANG);
    if (done != 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    kill(pid_, SIGKILL);
    done = waitpid(pid_, &status, 0);
  }
  pid_ = -1;
  status_ = done < 0              ? -1
            : WIFEXITED(status)   ? WEXITSTATUS(status)
            : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                  : -1;
  return status_;
}

std::string python_with_thrift() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TANDEM_PYTHON"); env != nullptr && *env != '\0')
    candidates.emplace_back(env);
  candidates.emplace_back("python3");
  candidates.emplace_back("/usr/bin/python3");
  for (const auto& py : candidates) {
    const std::string cmd = "'" + py + "' -c 'import thrift' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

std::string require_python_with_thrift() {
  const std::string python = python_with_thrift();
  if (python.empty())
    FAIL(
        "no python3 with the thrift package (tried $TANDEM_PYTHON, python3, /usr/bin/python3): "
        "run scripts/setup (it installs python3-thrift and thrift-compiler)");
  return python;
}

int free_port() {
  // Drawn below the kernel's ephemeral range (32768 and up on Linux): a port the kernel handed out
  // and took back could be handed at once to another test's listener (the ranks' Gloo pairs
  // bind ephemeral ports), and a coordinator started there would meet the wrong peers.
  static std::mt19937 rng(
      static_cast<uint32_t>(::getpid()) * 2654435761u ^
      static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 20000 + static_cast<int>(rng() % 12000);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    if (ok) return port;
  }
  FAIL("no free loopback port in 20000-31999");
  return -1;
}

std::string short_default_train_args(const TempDir& tmp) {
  const std::filesystem::path repo = TANDEM_SOURCE_DIR;
  return "train " + (repo / "configs" / "default.toml").string() +
         " model.path=" + (repo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string() +
         " rollout.prompts_per_step=2 rollout.n=2 rollout.max_new_tokens=8 trainer.steps=2"
         " eval.every=1 eval.max_prompts=2 eval.pass_k=2 checkpoint.every=0 logging.dir=" +
         tmp.file("run") + " checkpoint.dir=" + tmp.file("run/ckpt");
}

}  // namespace tandem::test
