// `tandem bench sync`: weight publishing through weight_sync. The f32 -> bf16 cast alone by each
// of its paths, and one rank, f32 master weights to bf16 engine weights (SmolLM2-135M and
// Qwen2.5-0.5B shapes, random weights), beside memcpy; and
// ZeRO over 4 ranks to 2 tensor-parallel replicas of 2 over Gloo on loopback (threads of this
// process, each with its own communicator and sockets, as bench comm), beside a raw Gloo
// all-gather of the same bytes in the same run, the bucket size swept, from whole parameters
// (ZeRO-1/2) and from each rank's local buffer of pieces (ZeRO-3).
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "bench/bench.h"
#include "core/clock.h"
#include "core/comm.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "model/shard_layout.h"
#include "model/weights.h"
#include "trainer/rollout_group.h"
#include "weight_sync/cast.h"
#include "weight_sync/transfer.h"

namespace tandem::bench {
namespace {

// CPU seconds of this process so far (all threads; the kernel's socket copies included).
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

model::ModelConfig config_of(const ModelShape& s, int64_t layers, bool bias) {
  model::ModelConfig c;
  c.arch = bias ? model::Architecture::qwen2 : model::Architecture::llama;
  c.vocab_size = s.V;
  c.hidden_size = s.C;
  c.intermediate_size = s.F;
  c.num_layers = layers;
  c.num_heads = s.H;
  c.num_kv_heads = s.Hkv;
  c.head_dim = s.D;
  c.max_position_embeddings = 2048;
  c.attention_bias = bias;
  c.tie_word_embeddings = true;
  return c;
}

constexpr ModelShape kQwen25_05B{"qwen2.5-0.5b", 896, 4864, 14, 2, 64, 151936};

// Seeded values in [-1, 1) (xorshift on this thread: the thread pool's Philox fill of 2 GB took
// longer than the measurements on the loaded development machine).
void fill_random(model::Weights& w) {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (const model::NamedTensor& s : w.storage()) {
    float* p = s.tensor.data_as<float>();
    for (int64_t i = 0; i < s.tensor.numel(); ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      p[i] = static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
    }
  }
}

// Seconds of a memcpy of `bytes` from `from` (median of `reps` after a warm-up), written into a
// ring of 256 MiB: the bytes leave the caches as the destination of a real copy would.
double memcpy_seconds(const char* from, int64_t bytes, int reps) {
  const int64_t ring = std::min<int64_t>(bytes, int64_t{256} << 20);
  std::vector<char> to(static_cast<size_t>(ring), 0);
  std::vector<double> t;
  for (int i = 0; i <= reps; ++i) {
    const auto t0 = Clock::now();
    for (int64_t at = 0; at < bytes; at += ring)
      std::memcpy(to.data(), from + at, static_cast<size_t>(std::min(ring, bytes - at)));
    if (i > 0) t.push_back(seconds_since(t0));
  }
  return median(t);
}

int64_t parameter_bytes(const model::Weights& w) {
  int64_t n = 0;
  for (const model::NamedTensor& s : w.storage()) n += static_cast<int64_t>(s.tensor.nbytes());
  return n;
}

// The publisher's cast alone on one thread over every parameter of `master` (the arena, padding
// included), by each path weight_sync/cast.h has on this CPU, beside memcpy of the f32 bytes.
void cast_paths(const Options& opt, const char* name, const model::Weights& master, int& emitted) {
  const float* from = master.storage()[0].tensor.data_as<float>();
  const int64_t n = parameter_bytes(master) / 4;
  std::vector<uint16_t> to(static_cast<size_t>(n));
  struct Path {
    const char* label;
    std::function<void()> run;
  };
  std::vector<Path> paths = {
      {"portable", [&] { weight_sync::f32_to_bf16_portable(from, to.data(), n); }}};
  if (weight_sync::has_avx512_bf16()) {
    paths.push_back(
        {"avx512-bf16", [&] { weight_sync::f32_to_bf16_avx512_bf16(from, to.data(), n, false); }});
    paths.push_back({"avx512-bf16 streaming stores",
                     [&] { weight_sync::f32_to_bf16_avx512_bf16(from, to.data(), n, true); }});
  }
  const int reps = 3;
  for (const Path& path : paths) {
    const std::string case_name = fmt::format("{} f32->bf16 one thread {}", name, path.label);
    if (!Runner(opt, {}).wants("cast", case_name)) continue;
    std::vector<double> t;
    for (int i = 0; i <= reps; ++i) {
      const auto t0 = Clock::now();
      path.run();
      if (i > 0) t.push_back(seconds_since(t0));
    }
    Runner(opt, {}).emit(Measurement{
        "sync", "cast", case_name, median(t), 0, static_cast<double>(2 * n), "memcpy f32 bytes",
        memcpy_seconds(reinterpret_cast<const char*>(from), 4 * n, reps)});
    ++emitted;
  }
}

// One rank: the publisher's f32 -> bf16 cast of every parameter of `master`, beside memcpy of
// the f32 bytes (what a same-dtype publish copies) as the peer and memcpy of the bf16 bytes it
// writes as the limit.
void one_rank(const Options& opt, const char* name, const model::Weights& master, int& emitted) {
  const std::string case_name = fmt::format("{} one rank f32->bf16", name);
  if (!Runner(opt, {}).wants("publish", case_name)) return;
  model::Weights engine(master.config(), DType::bf16);
  const auto specs = trainer::param_specs(master);
  const weight_sync::Layout src = weight_sync::Layout::replicated(specs, 1);
  const weight_sync::Layout dst = src.with_dtype(DType::bf16);
  const auto mp = trainer::params_of(master), ep = trainer::params_of(engine);
  weight_sync::Publisher pub(weight_sync::ReshardPlan::make(src, dst), nullptr,
                             weight_sync::bind(src, 0, mp), weight_sync::bind(dst, 0, ep));
  const int64_t written = parameter_bytes(engine), read = parameter_bytes(master);
  const int reps = 2;  // after a warm-up: these move gigabytes each
  std::vector<double> t;
  for (int i = 0; i <= reps; ++i) {
    const auto t0 = Clock::now();
    pub.publish(static_cast<uint64_t>(i + 1));
    if (i > 0) t.push_back(seconds_since(t0));
  }
  // The arena holds the parameters one after the other (padding aside).
  const char* from = static_cast<const char*>(master.storage()[0].tensor.data());
  Ceilings limit;
  limit.gbytes = static_cast<double>(written) / memcpy_seconds(from, written, reps) / 1e9;
  limit.gbytes_source = "memcpy of the bf16 bytes written";
  Runner(opt, limit)
      .emit(Measurement{"sync", "publish", case_name, median(t), 0, static_cast<double>(written),
                        "memcpy f32 bytes", memcpy_seconds(from, read, reps)});
  ++emitted;
}

// Rank r's local buffer of ZeRO-3 pieces of `master` (f32, zero padded).
Tensor zero3_buffer(const model::ShardLayout& shards, int r, const model::Weights& master) {
  Tensor local = Tensor::zeros({shards.local_size()}, DType::f32);
  for (size_t u = 0; u < shards.units().size(); ++u) {
    const model::FlatRange piece = shards.range(u, r);
    float* to = local.data_as<float>() + shards.units()[u].local;
    shards.for_each_piece(piece.begin, piece.end,
                          [&](size_t t, int64_t at, int64_t into, int64_t n) {
                            std::memcpy(to + into, master.storage()[t].tensor.data_as<float>() + at,
                                        static_cast<size_t>(n) * sizeof(float));
                          });
  }
  return local;
}

// ZeRO-4 -> TP-2 x 2 over Gloo (4 threads, one communicator each), per bucket size, beside a raw
// all-gather that moves the same bytes between the same ranks.
void zero_to_tp(const Options& opt, const char* name, const model::Weights& master, int& emitted) {
  constexpr int kRanks = 4;
  // Bucket sizes, staged (the default) or not, from whole parameters or ZeRO-3 buffers.
  struct Variant {
    int64_t mib;
    bool staged;
    bool zero3 = false;
    std::string label() const {
      return fmt::format("bucket {} MiB{}{}", mib, staged ? "" : " unstaged",
                         zero3 ? " from zero3 buffers" : "");
    }
  };
  const std::vector<Variant> variants =
      opt.quick
          ? std::vector<Variant>{{16, true}, {16, false, true}}
          : std::vector<Variant>{{4, true}, {16, true}, {64, true}, {4, false}, {4, false, true}};
  std::vector<Variant> wanted;
  for (const Variant& v : variants)
    if (Runner(opt, {}).wants("reshard",
                              fmt::format("{} zero4->tp2x2 f32->bf16 {} gloo", name, v.label())))
      wanted.push_back(v);
  if (wanted.empty()) return;
  // One set of full f32 master weights stands for every rank's (ZeRO-1/2: each rank keeps the
  // full parameters and owns a range of them); each rank sends only its range. ZeRO-3: each rank's
  // local buffer of its pieces (the same elements).
  const model::ModelConfig& c = master.config();
  const auto specs = trainer::param_specs(master);
  const model::ShardLayout shards(master, kRanks);
  const weight_sync::Layout src = weight_sync::Layout::zero(specs, shards);
  const weight_sync::Layout src3 = weight_sync::Layout::zero(specs, shards, false);
  const weight_sync::Layout dst =
      weight_sync::Layout::tensor_parallel(trainer::tp_dims(c), specs, 2, 2)
          .with_dtype(DType::bf16);
  const weight_sync::ReshardPlan plan = weight_sync::ReshardPlan::make(src, dst);
  const weight_sync::ReshardPlan plan3 = weight_sync::ReshardPlan::make(src3, dst);
  std::vector<Tensor> buffers(kRanks);
  int64_t remote = 0;
  for (int a = 0; a < kRanks; ++a)
    for (int b = 0; b < kRanks; ++b)
      if (a != b) remote += plan.bytes(a, b);
  const auto mp = trainer::params_of(master);

  const std::vector<std::unique_ptr<Communicator>> comms =
      loopback_communicators(kRanks, 300, "bench sync");
  auto on_ranks = [&](const std::function<void(int)>& fn) {
    on_rank_threads(kRanks, fn, "bench sync");
  };
  std::vector<std::vector<Tensor>> engine(kRanks);  // [rank]: its TP shard of every parameter
  for (int r = 0; r < kRanks; ++r)
    for (size_t p = 0; p < specs.size(); ++p)
      engine[static_cast<size_t>(r)].push_back(Tensor::empty(dst.shard(p, r).shape, DType::bf16));
  // Per bucket size: a warm-up sync, then `reps` timed ones, each beside a raw all_gather run just
  // before it (the machine's load changes between variants), each moving a gigabyte and more.
  const int reps = 1;
  // The peer: every rank all-gathers remote / (N (N - 1)) bytes of bf16, so that each rank
  // receives (and sends) remote / N bytes, as it does in the reshard; it casts nothing, reads no
  // f32 and writes nothing within a rank.
  const int64_t per_rank = remote / (kRanks * (kRanks - 1)) / 2 * 2;
  std::vector<Tensor> gathered(kRanks);
  // Seconds of the slowest rank and CPU seconds of the process (all ranks) of one call of fn on
  // every rank, started together.
  struct Timed {
    double seconds, cpu_seconds;
  };
  auto timed = [&](const std::function<void(int)>& fn) {
    std::vector<double> t(kRanks);
    const double cpu0 = process_cpu_seconds();
    on_ranks([&](int r) {
      comms[static_cast<size_t>(r)]->barrier();
      const auto t0 = Clock::now();
      fn(r);
      t[static_cast<size_t>(r)] = seconds_since(t0);
    });
    return Timed{*std::max_element(t.begin(), t.end()), process_cpu_seconds() - cpu0};
  };
  auto all_gather = [&](int r) {
    Tensor& out = gathered[static_cast<size_t>(r)];
    if (!out.defined()) out = Tensor::zeros({kRanks * per_rank / 2}, DType::bf16);
    comms[static_cast<size_t>(r)]->all_gather(out.narrow(r * (per_rank / 2), per_rank / 2), out);
  };
  timed(all_gather);  // warm-up
  for (const Variant& v : wanted) {
    std::vector<std::unique_ptr<weight_sync::Publisher>> pubs(kRanks);
    std::vector<weight_sync::SyncStats> last(kRanks);
    on_ranks([&](int r) {
      weight_sync::SyncOptions so;
      so.bucket_bytes = v.mib << 20;
      so.staged = v.staged;
      Tensor& buffer = buffers[static_cast<size_t>(r)];
      if (v.zero3 && !buffer.defined()) buffer = zero3_buffer(shards, r, master);
      pubs[static_cast<size_t>(r)] = std::make_unique<weight_sync::Publisher>(
          v.zero3 ? plan3 : plan, comms[static_cast<size_t>(r)].get(),
          v.zero3 ? weight_sync::bind_local(src3, r, buffer) : weight_sync::bind(src, r, mp),
          engine[static_cast<size_t>(r)], so);
      pubs[static_cast<size_t>(r)]->publish(1);  // warm-up
    });
    std::vector<double> ours, peer;
    Timed mine{}, theirs{};
    for (int i = 0; i < reps; ++i) {
      theirs = timed(all_gather);
      mine = timed([&](int r) {
        last[static_cast<size_t>(r)] =
            pubs[static_cast<size_t>(r)]->publish(static_cast<uint64_t>(i + 2));
      });
      peer.push_back(theirs.seconds);
      ours.push_back(mine.seconds);
    }
    int64_t local = 0;
    for (const weight_sync::SyncStats& st : last) local += st.bytes_copied;
    const std::string case_name = fmt::format(
        "{} zero4->tp2x2 f32->bf16 {} gloo ({} MB of bf16 between ranks, the peer's bytes; the "
        "peer does not read the {} MB of f32 they are cast from, nor cast the {} MB within ranks; "
        "{} MB added on rank 0{})",
        name, v.label(), remote / 1000000, 2 * remote / 1000000, local / 1000000,
        pubs[0]->added_bytes() / 1000000,
        v.zero3 ? fmt::format(", its buffer {} MB", buffers[0].nbytes() / 1000000) : "");
    // Where the time went: CPU seconds of the 4 ranks together (the last sync), and per rank the
    // phases of its last sync.
    fmt::print(stderr,
               "bench sync: {}: {:.0f} ms, {:.2f} CPU s; the all_gather {:.0f} ms, {:.2f} "
               "CPU s\n",
               v.label(), mine.seconds * 1e3, mine.cpu_seconds, theirs.seconds * 1e3,
               theirs.cpu_seconds);
    for (int r = 0; r < kRanks; ++r) {
      const weight_sync::SyncStats& st = last[static_cast<size_t>(r)];
      fmt::print(
          stderr,
          "bench sync: {} rank {}: {:.0f} ms = rounds {:.0f} (packing {:.0f} CPU ms, mostly "
          "overlapped) + agreement {:.0f} + staging copy {:.0f} + local pieces {:.0f}; {} of {} "
          "MB received straight into the destination\n",
          v.label(), r, st.seconds * 1e3, st.rounds_seconds * 1e3, st.packing_cpu_seconds * 1e3,
          st.agree_seconds * 1e3, st.unstage_seconds * 1e3, st.local_seconds * 1e3,
          st.bytes_received_direct / 1000000, st.bytes_received / 1000000);
    }
    Runner(opt, {}).emit(Measurement{"sync", "reshard", case_name, median(ours), 0,
                                     static_cast<double>(remote), "gloo all_gather", median(peer)});
    ++emitted;
  }
}

}  // namespace

int run_sync_bench(const Options& opt) {
  int emitted = 0;
  {
    model::Weights smollm(config_of(kSmolLM2_135M, 30, false), DType::f32);
    fill_random(smollm);
    cast_paths(opt, "smollm2-135m", smollm, emitted);
    one_rank(opt, "smollm2-135m", smollm, emitted);
  }
  // SmolLM2's 9 query heads do not split over tp = 2: the reshard runs on the Qwen2.5 shape
  // (--quick: 2 of its 24 layers and a 32k vocabulary).
  model::ModelConfig qc = config_of(kQwen25_05B, opt.quick ? 2 : 24, true);
  if (opt.quick) qc.vocab_size = 32768;
  const char* qname = opt.quick ? "qwen2.5-0.5b 2 layers 32k vocabulary" : "qwen2.5-0.5b";
  model::Weights qwen(qc, DType::f32);
  fill_random(qwen);
  if (!opt.quick) one_rank(opt, qname, qwen, emitted);
  zero_to_tp(opt, qname, qwen, emitted);
  return emitted > 0 ? 0 : 1;
}

}  // namespace tandem::bench
