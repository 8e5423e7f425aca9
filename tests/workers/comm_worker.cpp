// The per-rank side of the multi-process tests: one scenario per run (collectives against a plain
// reference, a dying or stuck rank, bootstrap facts, config checks, a failing rank for launch,
// all-gathers over an emulated link, alone and on a CommThread beside compute).
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/comm.h"
#include "core/comm_thread.h"
#include "core/error.h"

namespace {

using tandem::Communicator;
using tandem::DType;
using tandem::ReduceOp;
using tandem::Tensor;

int failures = 0;

// Small integers (exact in every dtype and in any summation order) unique to (seed, rank, i).
double value_of(int seed, int rank, int64_t i) {
  uint64_t h = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull ^
               (static_cast<uint64_t>(rank) + 1) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(i) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<double>(static_cast<int64_t>(h % 41) - 20);
}

void store(const Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::f32:
      static_cast<float*>(t.data())[i] = static_cast<float>(v);
      break;
    case DType::bf16:
      static_cast<tandem::bf16*>(t.data())[i] = tandem::bf16(static_cast<float>(v));
      break;
    case DType::i64:
      static_cast<int64_t*>(t.data())[i] = static_cast<int64_t>(v);
      break;
    default:
      TANDEM_FAIL("worker: dtype not used");
  }
}

double load(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::f32:
      return static_cast<float*>(t.data())[i];
    case DType::bf16:
      return static_cast<float>(static_cast<tandem::bf16*>(t.data())[i]);
    case DType::i64:
      return static_cast<double>(static_cast<int64_t*>(t.data())[i]);
    default:
      TANDEM_FAIL("worker: dtype not used");
  }
}

Tensor filled(int64_t n, DType dtype, int seed, int rank, int64_t first = 0) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) store(t, i, value_of(seed, rank, first + i));
  return t;
}

double reduce_ref(int world, int seed, int64_t i, ReduceOp op, const std::vector<int>& ranks) {
  double acc = op == ReduceOp::sum ? 0 : -1e30;
  for (int r : ranks) {
    const double v = value_of(seed, r, i);
    acc = op == ReduceOp::sum ? acc + v : std::max(acc, v);
  }
  (void)world;
  return acc;
}

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

void check_values(const Tensor& t, const std::string& what,
                  const std::function<double(int64_t)>& ref) {
  int64_t bad = -1;
  for (int64_t i = 0; i < t.numel() && bad < 0; ++i)
    if (load(t, i) != ref(i)) bad = i;
  expect(bad < 0, bad < 0 ? what
                          : fmt::format("{}: element {} is {}, expected {}", what, bad,
                                        load(t, bad), ref(bad)));
}

// Every collective of `comm` (whose members are the world ranks `members`) against references.
void run_collectives(Communicator& comm, const std::vector<int>& members, int seed0) {
  const int P = comm.size(), r = comm.rank();
  const std::string g = comm.name();
  int seed = seed0;
  for (DType dtype : {DType::f32, DType::bf16, DType::i64}) {
    const std::string dt = tandem::dtype_name(dtype);
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        ++seed;
        Tensor t = filled(n, dtype, seed, members[static_cast<size_t>(r)]);
        comm.all_reduce(t, op);
        check_values(t, fmt::format("{} all_reduce {} {} n={}", g, reduce_op_name(op), dt, n),
                     [&](int64_t i) { return reduce_ref(P, seed, i, op, members); });
      }
    }
    for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{333}}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        ++seed;
        Tensor in = filled(n * P, dtype, seed, members[static_cast<size_t>(r)]);
        Tensor out = Tensor::empty({n}, dtype);
        comm.reduce_scatter(in, out, op);
        check_values(out, fmt::format("{} reduce_scatter {} {} n={}", g, reduce_op_name(op), dt, n),
                     [&](int64_t i) { return reduce_ref(P, seed, r * n + i, op, members); });
      }
    }
    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{4099}}) {
      ++seed;
      Tensor in = filled(n, dtype, seed, members[static_cast<size_t>(r)]);
      Tensor out = Tensor::empty({n * P}, dtype);
      comm.all_gather(in, out);
      check_values(out, fmt::format("{} all_gather {} n={}", g, dt, n), [&](int64_t i) {
        return value_of(seed, members[static_cast<size_t>(i / n)], i % n);
      });
    }
    {
      ++seed;
      std::vector<int64_t> counts, offsets{0};
      for (int q = 0; q < P; ++q) {
        counts.push_back((q * 3 + 1) % 5 * 37);
        offsets.push_back(offsets.back() + counts.back());
      }
      Tensor in =
          filled(counts[static_cast<size_t>(r)], dtype, seed, members[static_cast<size_t>(r)]);
      Tensor out = Tensor::empty({offsets.back()}, dtype);
      comm.all_gather_v(in, out, counts);
      check_values(out, fmt::format("{} all_gather_v {}", g, dt), [&](int64_t i) {
        int q = 0;
        while (i >= offsets[static_cast<size_t>(q) + 1]) ++q;
        return value_of(seed, members[static_cast<size_t>(q)], i - offsets[static_cast<size_t>(q)]);
      });
    }
    for (int root = 0; root < P; ++root) {
      ++seed;
      Tensor t = filled(513, dtype, seed, members[static_cast<size_t>(r)]);
      comm.broadcast(t, root);
      check_values(t, fmt::format("{} broadcast {} root {}", g, dt, root), [&](int64_t i) {
        return value_of(seed, members[static_cast<size_t>(root)], i);
      });
    }
  }
  if (P > 1) {
    // A ring shift and, in the same group of transfers, a star to and from rank 0.
    ++seed;
    const int right = (r + 1) % P, left = (r + P - 1) % P;
    Tensor to_right = filled(300, DType::f32, seed, members[static_cast<size_t>(r)]);
    Tensor from_left = Tensor::empty({300}, DType::f32);
    std::vector<tandem::P2POp> ops{tandem::send_to(right, to_right),
                                   tandem::recv_from(left, from_left)};
    std::vector<Tensor> star;
    if (r == 0) {
      for (int q = 1; q < P; ++q) {
        star.push_back(filled(q * 11, DType::f32, seed + 1, 0, q * 1000));
        ops.push_back(tandem::send_to(q, star.back()));
        star.push_back(Tensor::empty({q * 7}, DType::f32));
        ops.push_back(tandem::recv_from(q, star.back()));
      }
    } else {
      star.push_back(Tensor::empty({r * 11}, DType::f32));
      ops.push_back(tandem::recv_from(0, star.back()));
      star.push_back(filled(r * 7, DType::f32, seed + 2, members[static_cast<size_t>(r)]));
      ops.push_back(tandem::send_to(0, star.back()));
    }
    comm.send_recv(ops);
    check_values(from_left, fmt::format("{} send_recv ring", g),
                 [&](int64_t i) { return value_of(seed, members[static_cast<size_t>(left)], i); });
    if (r == 0) {
      for (int q = 1; q < P; ++q)
        check_values(
            star[static_cast<size_t>(2 * q - 1)], fmt::format("{} send_recv from rank {}", g, q),
            [&](int64_t i) { return value_of(seed + 2, members[static_cast<size_t>(q)], i); });
    } else {
      check_values(star[0], fmt::format("{} send_recv from rank 0", g),
                   [&](int64_t i) { return value_of(seed + 1, 0, r * 1000 + i); });
    }
  }
  comm.barrier();
}

int scenario_collectives(const tandem::CommOptions& options) {
  auto world = Communicator::from_environment(options);
  std::vector<int> all;
  for (int q = 0; q < world->size(); ++q) all.push_back(q);
  run_collectives(*world, all, 100);
  // Sub-groups: the even and the odd ranks, twice under the same name.
  std::vector<int> mine;
  for (int q = world->rank() % 2; q < world->size(); q += 2) mine.push_back(q);
  for (int round = 0; round < 2; ++round) {
    auto half = world->split("half", mine);
    expect(half->size() == static_cast<int>(mine.size()), "split size");
    run_collectives(*half, mine, 1000 + 100 * round);
  }
  world->barrier();
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", world->rank(), world->size());
  return failures == 0 ? 0 : 1;
}

// The CUDA path (NCCL): each collective once on device copies, checked on the host.
int scenario_cuda(const tandem::CommOptions& options) {
  auto comm = Communicator::from_environment(options);
  const tandem::Device dev = options.device;
  const int P = comm->size(), r = comm->rank();
  std::vector<int> all;
  for (int q = 0; q < P; ++q) all.push_back(q);
  for (DType dtype : {DType::f32, DType::bf16}) {
    const std::string dt = tandem::dtype_name(dtype);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      Tensor t = filled(100003, dtype, 1, r).to(dev);
      comm->all_reduce(t, op);
      check_values(t.to(tandem::Device::cpu()),
                   fmt::format("nccl all_reduce {} {}", reduce_op_name(op), dt),
                   [&](int64_t i) { return reduce_ref(P, 1, i, op, all); });
    }
    Tensor in = filled(333 * P, dtype, 2, r).to(dev), out = Tensor::empty({333}, dtype, dev);
    comm->reduce_scatter(in, out);
    check_values(out.to(tandem::Device::cpu()), "nccl reduce_scatter " + dt,
                 [&](int64_t i) { return reduce_ref(P, 2, r * 333 + i, ReduceOp::sum, all); });
    std::vector<int64_t> counts, offsets{0};
    for (int q = 0; q < P; ++q) {
      counts.push_back((q * 3 + 1) % 5 * 37);
      offsets.push_back(offsets.back() + counts.back());
    }
    Tensor piece = filled(counts[static_cast<size_t>(r)], dtype, 3, r).to(dev);
    Tensor gathered = Tensor::empty({offsets.back()}, dtype, dev);
    comm->all_gather_v(piece, gathered, counts);
    check_values(gathered.to(tandem::Device::cpu()), "nccl all_gather_v " + dt, [&](int64_t i) {
      int q = 0;
      while (i >= offsets[static_cast<size_t>(q) + 1]) ++q;
      return value_of(3, q, i - offsets[static_cast<size_t>(q)]);
    });
    Tensor b = filled(513, dtype, 4, r).to(dev);
    comm->broadcast(b, P - 1);
    check_values(b.to(tandem::Device::cpu()), "nccl broadcast " + dt,
                 [&](int64_t i) { return value_of(4, P - 1, i); });
  }
  if (P > 1) {
    Tensor to_right = filled(300, DType::f32, 5, r).to(dev);
    Tensor from_left = Tensor::empty({300}, DType::f32, dev);
    std::vector<tandem::P2POp> ops{tandem::send_to((r + 1) % P, to_right),
                                   tandem::recv_from((r + P - 1) % P, from_left)};
    comm->send_recv(ops);
    check_values(from_left.to(tandem::Device::cpu()), "nccl send_recv ring",
                 [&](int64_t i) { return value_of(5, (r + P - 1) % P, i); });
  }
  comm->barrier();
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", r, P);
  return failures == 0 ? 0 : 1;
}

int scenario_die(const tandem::CommOptions& options, int victim, bool stuck) {
  auto comm = Communicator::from_environment(options);
  comm->barrier();
  if (comm->rank() == victim) {
    if (stuck) std::this_thread::sleep_for(std::chrono::hours(1));
    ::kill(::getpid(), SIGKILL);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    Tensor t = filled(4096, DType::f32, 1, comm->rank()).to(options.device);
    for (int i = 0; i < 100; ++i) comm->all_reduce(t);
  } catch (const tandem::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("error after %.2f s: %s\n", s, e.what());
    // The communicator refuses further use, naming the first failure.
    try {
      comm->barrier();
    } catch (const tandem::Error& again) {
      std::printf("then: %s\n", again.what());
    }
    std::fflush(stdout);
    // Stay a moment before exiting: a survivor that exits at once closes its connections, and a
    // slower survivor could then see that loss first and name this rank instead of the killed one.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    std::_Exit(3);
  }
  std::printf("no error\n");
  return 0;
}

int scenario_info(const tandem::CommOptions& options) {
  const auto info = tandem::rendezvous::detect_rank_info_from_environment(options.master);
  auto comm = Communicator::create(info, options);
  Tensor t = Tensor::empty({1}, DType::i64);
  t.data_as<int64_t>()[0] = comm->rank() + 1;
  comm->all_reduce(t);
  std::printf("rank %d world %d local %d node %d launcher %s master %s sum %lld\n", info.rank,
              info.world_size, info.local_rank, info.node_rank, info.launcher.c_str(),
              info.master().c_str(), static_cast<long long>(t.data_as<int64_t>()[0]));
  return 0;
}

// Ranks 0 and 1 exchange point-to-point transfers that the other ranks take no part in, then every
// rank joins one all-gather: a send_recv is no collective, so it must not shift the collectives'
// sequence on the ranks that made it.
int scenario_p2p_then_collective(const tandem::CommOptions& options) {
  auto comm = Communicator::from_environment(options);
  const int rank = comm->rank(), world = comm->size();
  if (rank < 2) {
    for (int i = 0; i < 3; ++i) {
      Tensor out = Tensor::empty({4}, DType::i64), in = Tensor::empty({4}, DType::i64);
      for (int64_t k = 0; k < 4; ++k) out.data_as<int64_t>()[k] = 100 * rank + 10 * i + k;
      const tandem::P2POp ops[] = {tandem::send_to(1 - rank, out), tandem::recv_from(1 - rank, in)};
      comm->send_recv(ops);
      for (int64_t k = 0; k < 4; ++k)
        if (in.data_as<int64_t>()[k] != 100 * (1 - rank) + 10 * i + k) {
          std::printf("rank %d: transfer %d element %lld is %lld\n", rank, i,
                      static_cast<long long>(k), static_cast<long long>(in.data_as<int64_t>()[k]));
          return 1;
        }
    }
  }
  Tensor mine = Tensor::empty({1}, DType::i64), all = Tensor::empty({world}, DType::i64);
  mine.data_as<int64_t>()[0] = rank + 1;
  comm->all_gather(mine, all);
  for (int r = 0; r < world; ++r)
    if (all.data_as<int64_t>()[r] != r + 1) {
      std::printf("rank %d: all_gather gave %lld from rank %d\n", rank,
                  static_cast<long long>(all.data_as<int64_t>()[r]), r);
      return 1;
    }
  std::printf("ok rank %d of %d\n", rank, world);
  return 0;
}

int scenario_config(const tandem::CommOptions& options, bool differ) {
  auto comm = Communicator::from_environment(options);
  std::string text = "# job\n[trainer]\nlr = 1e-05\nsteps = 10\n[rollout]\nn = 8\n";
  if (differ && comm->rank() == 1) text = "# job\n[trainer]\nlr = 2e-05\nsteps = 10\n[rollout]\n";
  verify_same_config(*comm, text);
  std::printf("same config\n");
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double cpu_seconds() {  // user + system time of every thread of this process
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// All-gathers of `mib` MiB of f32 from each rank over an emulated link of `gbps`.
constexpr int kLinkGathers = 4;
int64_t link_piece(double mib) { return static_cast<int64_t>(mib * (1 << 20)) / 4; }

// The link's time for kLinkGathers all-gathers into `out`: each rank sends (n - 1) / n of it in
// n - 1 ring steps.
double modeled_gathers(const Communicator& comm, const Tensor& out) {
  const int n = comm.size();
  return kLinkGathers * comm.link().seconds(static_cast<double>(out.nbytes()) * (n - 1) / n, n - 1);
}

// kLinkGathers all-gathers: the wall and CPU time they took, the fastest one, and the link's
// modeled time for all and for one. (Wake-ups late by a busy machine only add time: the fastest
// call shows the emulation's own overshoot.)
int scenario_link_gather(tandem::CommOptions options, double gbps, double mib) {
  const int64_t piece = link_piece(mib);
  options.link.gbps = gbps;
  auto comm = Communicator::from_environment(options);
  Tensor in = filled(piece, DType::f32, 7, comm->rank());
  Tensor out = Tensor::empty({piece * comm->size()}, DType::f32);
  const double modeled = modeled_gathers(*comm, out);
  comm->barrier();
  const double cpu0 = cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  double fastest = 1e30;
  for (int i = 0; i < kLinkGathers; ++i) {
    const auto call = std::chrono::steady_clock::now();
    comm->all_gather(in, out);
    fastest = std::min(fastest, seconds_since(call));
  }
  const double wall = seconds_since(t0), cpu = cpu_seconds() - cpu0;
  check_values(out, "all_gather over the emulated link",
               [&](int64_t i) { return value_of(7, static_cast<int>(i / piece), i % piece); });
  std::printf("wall %.4f modeled %.4f cpu %.4f fastest %.4f modeled_one %.4f\n", wall, modeled, cpu,
              fastest, modeled / kLinkGathers);
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", comm->rank(), comm->size());
  return failures == 0 ? 0 : 1;
}

// The same all-gathers on a CommThread (on a communicator split off for it) while this thread
// computes for the link's modeled time: the total, the compute time, and the thread's stats.
int scenario_link_overlap(tandem::CommOptions options, double gbps, double mib) {
  const int64_t piece = link_piece(mib);
  options.link.gbps = gbps;
  auto world = Communicator::from_environment(options);
  std::vector<int> all;
  for (int q = 0; q < world->size(); ++q) all.push_back(q);
  std::unique_ptr<Communicator> comm = world->split("comm", all);
  Tensor in = filled(piece, DType::f32, 8, comm->rank());
  std::vector<Tensor> outs;
  for (int i = 0; i < kLinkGathers; ++i)
    outs.push_back(Tensor::empty({piece * comm->size()}, DType::f32));
  const double modeled = modeled_gathers(*comm, outs[0]);
  tandem::CommThread thread("comm");
  world->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (const Tensor& out : outs) thread.submit([&comm, &in, out] { comm->all_gather(in, out); });
  // Compute: a dependent chain of multiply-adds for the modeled time.
  const auto compute_start = std::chrono::steady_clock::now();
  double x = 1.0;
  while (seconds_since(compute_start) < modeled)
    for (int i = 0; i < 10000; ++i) x = x * 0.999999 + 1e-6;
  const double compute = seconds_since(compute_start);
  thread.wait_all();
  const double total = seconds_since(t0);
  const tandem::CommThread::Stats stats = thread.take_stats();
  for (const Tensor& out : outs)
    check_values(out, "all_gather on the comm thread",
                 [&](int64_t i) { return value_of(8, static_cast<int>(i / piece), i % piece); });
  expect(stats.closures == kLinkGathers, "every all_gather ran on the comm thread");
  std::printf("total %.4f compute %.4f modeled %.4f busy %.4f waited %.4f (x %.3f)\n", total,
              compute, modeled, stats.busy_s, stats.waited_s, x);
  world->barrier();
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", world->rank(), world->size());
  return failures == 0 ? 0 : 1;
}

int scenario_fail(int victim, int code) {
  const char* rank_text = std::getenv("RANK");
  const int rank = rank_text != nullptr ? std::atoi(rank_text) : 0;
  std::printf("hello from %d\n", rank);
  std::fflush(stdout);
  std::fprintf(stderr, "partial line from %d", rank);
  std::fprintf(stderr, " finished\n");
  if (rank == victim) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::fprintf(stderr, "boom: rank %d gives up\n", rank);
    return code;
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));
  std::printf("rank %d slept to the end\n", rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: tandem_comm_worker collectives|cuda|die K|stuck K|info|config same|differ|"
                 "fail K CODE|link_gather GBPS MIB|"
                 "link_overlap GBPS MIB\n");
    return 2;
  }
  const std::string what = argv[1];
  tandem::CommOptions options;
  if (const char* t = std::getenv("TANDEM_TEST_TIMEOUT_S")) options.timeout_s = std::atof(t);
  if (const char* s = std::getenv("TANDEM_TEST_STORE")) options.store = s;
  if (const char* d = std::getenv("TANDEM_TEST_DEVICE"); d != nullptr && std::string(d) == "cuda") {
    const char* local = std::getenv("LOCAL_RANK");
    options.device = tandem::Device::cuda(local != nullptr ? std::atoi(local) : 0);
  }
  try {
    if (what == "collectives") return scenario_collectives(options);
    if (what == "cuda") return scenario_cuda(options);
    if (what == "die" || what == "stuck")
      return scenario_die(options, std::atoi(argv[2]), what == "stuck");
    if (what == "info") return scenario_info(options);
    if (what == "p2p_then_collective") return scenario_p2p_then_collective(options);
    if (what == "config") return scenario_config(options, std::string(argv[2]) == "differ");
    if (what == "fail") return scenario_fail(std::atoi(argv[2]), std::atoi(argv[3]));
    if (what == "link_gather")
      return scenario_link_gather(options, std::atof(argv[2]), std::atof(argv[3]));
    if (what == "link_overlap")
      return scenario_link_overlap(options, std::atof(argv[2]), std::atof(argv[3]));
  } catch (const tandem::Error& e) {
    std::printf("error: %s\n", e.what());
    std::fflush(stdout);
    return 3;
  }
  std::fprintf(stderr, "unknown scenario %s\n", what.c_str());
  return 2;
}
