// The benchmark runner: timing, machine ceilings, JSON lines, and `tandem bench kernels`.
#include "bench/bench.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#if TANDEM_HAS_OPENBLAS
#include <cblas.h>
#endif
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/clock.h"
#include "core/comm.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::bench {
namespace {

std::vector<std::pair<std::string, KernelBench>>& kernel_benches() {
  static std::vector<std::pair<std::string, KernelBench>> benches;
  return benches;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// STREAM triad a = b + s*c over arrays far larger than the caches; bytes counted as 3 arrays.
double measure_triad_gbytes(const Options& opt) {
  const int64_t n = opt.quick ? (int64_t{16} << 20) : (int64_t{32} << 20);  // floats per array
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n), 1.0f),
      c(static_cast<size_t>(n), 2.0f);
  auto triad = [&] {
    parallel_for(n, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        a[static_cast<size_t>(i)] = b[static_cast<size_t>(i)] + 3.0f * c[static_cast<size_t>(i)];
    });
  };
  triad();
  double best = 1e30;
  for (int rep = 0; rep < (opt.quick ? 3 : 7); ++rep) {
    const double t0 = now_seconds();
    triad();
    best = std::min(best, now_seconds() - t0);
  }
  return 3.0 * static_cast<double>(n) * sizeof(float) / best / 1e9;
}

#if TANDEM_HAS_OPENBLAS
double measure_openblas_gflops(const Options& opt) {
  openblas_set_num_threads(num_threads());
  const int n = opt.quick ? 512 : 1024;
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(static_cast<size_t>(n) * n, 0.25f),
      c(static_cast<size_t>(n) * n);
  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
  };
  gemm();
  double best = 1e30;
  for (int rep = 0; rep < (opt.quick ? 3 : 7); ++rep) {
    const double t0 = now_seconds();
    gemm();
    best = std::min(best, now_seconds() - t0);
  }
  return 2.0 * n * n * static_cast<double>(n) / best / 1e9;
}
#endif

// Our own GEMM (ops::matmul) on a square problem: f32 on CPU, bf16 inputs on CUDA.
double measure_matmul_gflops(const Options& opt, DType dtype, int64_t n) {
  Tensor x = Tensor::empty({n, n}, dtype, opt.device), w = Tensor::empty({n, n}, dtype, opt.device);
  Tensor y = Tensor::empty({n, n}, DType::f32, opt.device);
  Tensor init = Tensor::empty({n, n}, DType::f32, opt.device);
  ops::random_uniform(init, 1, 0);
  ops::cast(init, x);
  ops::cast(init, w);
  Runner probe(opt, Ceilings{});
  const double t = probe.time([&] { ops::matmul(x, w, y); });
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / t / 1e9;
}

}  // namespace

int add_kernel_bench(const std::string& family, KernelBench fn) {
  kernel_benches().emplace_back(family, std::move(fn));
  return static_cast<int>(kernel_benches().size());
}

bool Runner::wants(const std::string& op, const std::string& case_name) const {
  return opt_.filter.empty() || op.find(opt_.filter) != std::string::npos ||
         case_name.find(opt_.filter) != std::string::npos;
}

double Runner::time(const std::function<void()>& fn) const {
  const Stream sync{opt_.device, nullptr};
  fn();  // warm-up
  sync.synchronize();
  std::vector<double> samples;
  const double start = now_seconds();
  const int min_reps = opt_.quick ? 2 : 5;
  while (static_cast<int>(samples.size()) < min_reps ||
         (now_seconds() - start < opt_.min_seconds && samples.size() < 1000)) {
    const double t0 = now_seconds();
    fn();
    sync.synchronize();
    samples.push_back(now_seconds() - t0);
  }
  std::nth_element(samples.begin(), samples.begin() + static_cast<long>(samples.size() / 2),
                   samples.end());
  return samples[samples.size() / 2];
}

void Runner::measure(const std::string& op, const std::string& case_name, double flops,
                     double bytes, const std::function<void()>& fn, const std::string& peer,
                     const std::function<void()>& peer_fn) {
  if (!wants(op, case_name)) return;
  try {
    Measurement m{"kernels", op, case_name, time(fn), flops, bytes, std::nullopt, 0};
    if (peer_fn) {
      m.peer = peer;
      m.peer_seconds = time(peer_fn);
    }
    emit(m);
  } catch (const Error& e) {  // report the case and go on with the others
    ++errors_;
    nlohmann::ordered_json j;
    j["bench"] = "kernels";
    j["case"] = fmt::format("{} {}", op, case_name);
    j["device"] = opt_.device.str();
    j["error"] = e.what();
    std::printf("%s\n", j.dump().c_str());
  }
}

void Runner::emit(const Measurement& m) {
  ++emitted_;
  const bool compute = m.flops > 0;
  const double work = compute ? m.flops : m.bytes;
  const double value = work > 0 ? work / m.seconds / 1e9 : 1e3 * m.seconds;
  const double limit = compute ? ceilings_.gflops : ceilings_.gbytes;
  nlohmann::ordered_json j;
  j["bench"] = m.bench;
  j["case"] = fmt::format("{} {}", m.op, m.case_name);
  j["op"] = m.op;
  j["device"] = opt_.device.str();
  add_machine(opt_, j);
  j["metric"] = compute ? "gflops" : (m.bytes > 0 ? "gbytes_per_s" : "time");
  j["unit"] = compute ? "GFLOP/s" : (m.bytes > 0 ? "GB/s" : "ms");
  j["value"] = value;
  j["time_ms"] = 1e3 * m.seconds;
  if (m.peer) {
    j["peer"] = *m.peer;
    j["peer_value"] = work > 0 ? work / m.peer_seconds / 1e9 : 1e3 * m.peer_seconds;
    j["ratio"] = m.peer_seconds / m.seconds;  // > 1: tandem is faster
  }
  if (work > 0 && limit > 0) {
    j["limit"] = limit;
    j["fraction_of_limit"] = value / limit;
  }
  if (opt_.json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "%-14s %-52s %10.3f ms %10.1f %-8s%s%s\n", m.op.c_str(), m.case_name.c_str(),
        1e3 * m.seconds, value, j["unit"].get<std::string>().c_str(),
        j.contains("fraction_of_limit")
            ? fmt::format(" {:5.1f}% of limit", 100 * j["fraction_of_limit"].get<double>()).c_str()
            : "",
        m.peer ? fmt::format("  {} {:.2f}x", *m.peer, j["ratio"].get<double>()).c_str() : "");
  }
  std::fflush(stdout);
}

#if TANDEM_HAS_OPENBLAS
std::string openblas_peer() {
  const std::string core = openblas_get_corename();
  static const bool warned = [&] {
    if (core == "Prescott" && __builtin_cpu_supports("avx512f"))
      spdlog::warn(
          "bench: OpenBLAS does not know this CPU model and runs its SSE3 (Prescott) kernels; "
          "for a fair peer run with OPENBLAS_CORETYPE=SkylakeX");
    return true;
  }();
  (void)warned;
  return "openblas " + core;
}
#endif

std::pair<double, std::string> measure_cpu_gemm_ceiling(const Options& opt) {
  const int64_t n = opt.quick ? 512 : 1024;
  double gflops = measure_matmul_gflops(opt, DType::f32, n);
  std::string source = fmt::format("tandem matmul f32 {}^3", n);
#if TANDEM_HAS_OPENBLAS
  if (const double blas = measure_openblas_gflops(opt); blas > gflops) {
    gflops = blas;
    source = fmt::format("OpenBLAS sgemm f32 {}^3 ({})", n, openblas_peer());
  }
#endif
  return {gflops, source};
}

std::string Options::precision_suffix() const {
  return cpu_matmul == ops::MatmulPrecision::f32 ? "" : " " + bf16_compute_name();
}

std::string cpu_model() {
  static const std::string model = [] {
    std::ifstream in("/proc/cpuinfo");
    std::string name = "unknown", family, number;
    const auto value = [](const std::string& line) {
      const size_t colon = line.find(':');
      return colon != std::string::npos && colon + 2 <= line.size() ? line.substr(colon + 2)
                                                                    : std::string();
    };
    for (std::string line; std::getline(in, line) && line != "";) {
      if (line.rfind("model name", 0) == 0) name = value(line);
      if (line.rfind("cpu family", 0) == 0) family = value(line);
      if (line.rfind("model\t", 0) == 0) number = value(line);
    }
    return family.empty() ? name : fmt::format("{} (family {} model {})", name, family, number);
  }();
  return model;
}

std::string cpu_isa() {
  return fmt::format("f32 {}, bf16 {}", ops::matmul_f32_path_name(),
                     ops::matmul_bf16_path_name(ops::matmul_bf16_path()));
}

void add_machine(const Options& opt, nlohmann::ordered_json& j) {
  if (!opt.device.is_cpu()) return;
  j["cpu"] = cpu_model();
  j["isa"] = cpu_isa();
}

std::string bf16_compute_name() {
  return fmt::format("bf16 compute {}", ops::matmul_bf16_path_name(ops::matmul_bf16_path()));
}

std::pair<double, std::string> measure_cpu_bf16_gemm_ceiling(const Options& opt) {
  const int64_t n = opt.quick ? 512 : 1024;
  double gflops = 0;
  {
    const ops::ScopedMatmulPrecision precision(ops::MatmulPrecision::bf16);
    gflops = measure_matmul_gflops(opt, DType::f32, n);
  }
  return {gflops, fmt::format("tandem matmul {} {}^3", bf16_compute_name(), n)};
}

Ceilings measure_ceilings(const Options& opt) {
  Ceilings c;
  if (opt.device.is_cpu()) {
    std::tie(c.gflops, c.gflops_source) = measure_cpu_gemm_ceiling(opt);
    c.gbytes = measure_triad_gbytes(opt);
    c.gbytes_source = "triad, 3 arrays counted";
    return c;
  }
  TANDEM_CHECK(cuda_device_count() > 0, "bench on {}: {}", opt.device, gpu_summary());
  // Device-to-device copy bandwidth, read + write counted.
  const int64_t n = int64_t{1} << 28;
  Tensor a = Tensor::zeros({n}, DType::u8, opt.device),
         b = Tensor::zeros({n}, DType::u8, opt.device);
  Runner probe(opt, c);
  const double t = probe.time([&] { b.copy_from(a); });
  c.gbytes = 2.0 * static_cast<double>(n) / t / 1e9;
  c.gbytes_source = "cudaMemcpy device to device, read + write";
  c.gflops = measure_matmul_gflops(opt, DType::bf16, opt.quick ? 4096 : 8192);
  c.gflops_source = "cuBLASLt bf16 GEMM (ops::matmul), square";
  return c;
}

int run_kernel_benches(const Options& opt) {
  Ceilings ceilings = measure_ceilings(opt);
  Runner runner(opt, ceilings);
  const std::string ceiling_line = fmt::format(
      "{{\"bench\":\"kernels\",\"case\":\"ceilings\",\"device\":\"{}\",\"metric\":\"ceilings\","
      "\"unit\":\"GFLOP/s|GB/s\",\"value\":{:.1f},\"gflops\":{:.1f},\"gbytes_per_s\":{:.1f},"
      "\"threads\":{},\"gflops_source\":\"{}\",\"gbytes_source\":\"{}\"}}",
      opt.device.str(), ceilings.gflops, ceilings.gflops, ceilings.gbytes, num_threads(),
      ceilings.gflops_source, ceilings.gbytes_source);
  if (opt.json) {
    std::printf("%s\n", ceiling_line.c_str());
  } else {
    std::printf("ceilings on %s: %.1f GFLOP/s (%s), %.1f GB/s (%s), %d threads\n",
                opt.device.str().c_str(), ceilings.gflops, ceilings.gflops_source.c_str(),
                ceilings.gbytes, ceilings.gbytes_source.c_str(), num_threads());
  }
  auto benches = kernel_benches();
  std::sort(benches.begin(), benches.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [family, fn] : benches) fn(runner);
  return runner.emitted() > 0 && runner.errors() == 0 ? 0 : 1;
}

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  TANDEM_CHECK(ok, "bench: no free loopback port");
  return ntohs(a.sin_port);
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

void on_rank_threads(int ranks, const std::function<void(int rank)>& fn, const std::string& what) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors) TANDEM_CHECK(e.empty(), "{}: {}", what, e);
}

std::vector<std::unique_ptr<Communicator>> loopback_communicators(int ranks, double timeout_s,
                                                                  const std::string& what) {
  const int port = free_loopback_port();
  std::vector<std::unique_ptr<Communicator>> comms(static_cast<size_t>(ranks));
  on_rank_threads(
      ranks,
      [&](int r) {
        rendezvous::RankInfo info;
        info.rank = r;
        info.world_size = ranks;
        info.master_addr = "127.0.0.1";
        info.master_port = port;
        CommOptions o;
        o.timeout_s = timeout_s;
        comms[static_cast<size_t>(r)] = Communicator::create(info, o);
      },
      what);
  return comms;
}

double seconds_of(const std::function<void()>& fn) {
  const Clock::time_point t0 = Clock::now();
  fn();
  return seconds_since(t0);
}

}  // namespace tandem::bench
