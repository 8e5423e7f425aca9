// The per-rank side of the weight_sync multi-process tests: one reshard per run (ZeRO ranges or
// ZeRO-3 local buffers to replicated or tensor-parallel engines, tensor parallel to one rank,
// replicated to tensor parallel) checked against slicing the full tensors, a rank killed in the
// middle of a sync, a corrupted byte, or a job's rollout side publishing from ZeRO-3 pieces.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/comm.h"
#include "core/error.h"
#include "model/shard_layout.h"
#include "model/weights.h"
#include "tests/weight_sync/sync_util.h"
#include "trainer/job_config.h"
#include "trainer/rollout_group.h"
#include "weight_sync/transfer.h"

namespace {

using namespace tandem;
using weight_sync::Layout;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Where a rank's source tensors come from: the full parameters themselves (replicated, ZeRO-1/2),
// a slice of them (a tensor-parallel source), or the rank's ZeRO-3 local buffer of pieces.
enum class Source { full, slice, buffer };

struct Case {
  Layout src, dst;
  Source source;
};

// Cases named "<source>_<destination>": zero<N> (ZeRO-1/2 ranges of full parameters), zero3x<N>
// (ZeRO-3 local buffers), tp<T> or tp<T>x<R> (tensor parallel, bf16 at the destination unless the
// case says f32), replicated (bf16 engines on every rank).
Case make_case(const std::string& name, const model::Weights& w, int world) {
  const auto specs = test::param_specs(w);
  const weight_sync::TpDims dims = test::tp_dims(w.config());
  const model::ShardLayout shards(w, world);
  if (name == "zero4_tp2x2")
    return {Layout::zero(specs, shards),
            Layout::tensor_parallel(dims, specs, 2, 2).with_dtype(DType::bf16), Source::full};
  if (name == "zero2_tp2")
    return {Layout::zero(specs, shards), Layout::tensor_parallel(dims, specs, 2, 1), Source::full};
  if (name == "zero3x2_replicated" || name == "zero3x4_replicated")
    return {Layout::zero(specs, shards, false),
            Layout::replicated(specs, world).with_dtype(DType::bf16), Source::buffer};
  if (name == "zero3x2_tp2")
    return {Layout::zero(specs, shards, false),
            Layout::tensor_parallel(dims, specs, 2, 1).with_dtype(DType::bf16), Source::buffer};
  if (name == "zero3x4_tp2x2")
    return {Layout::zero(specs, shards, false),
            Layout::tensor_parallel(dims, specs, 2, 2).with_dtype(DType::bf16), Source::buffer};
  if (name == "zero3x4_tp4_f32")
    return {Layout::zero(specs, shards, false), Layout::tensor_parallel(dims, specs, 4, 1),
            Source::buffer};
  if (name == "tp2_tp1")
    return {Layout::tensor_parallel(dims, specs, 2, 1),
            Layout::tensor_parallel(dims, specs, 1, 1).placed(0, 2).with_dtype(DType::bf16),
            Source::slice};
  if (name == "replicated_tp2")
    return {Layout::replicated(specs, 2),
            Layout::tensor_parallel(dims, specs, 2, 1).with_dtype(DType::bf16), Source::full};
  if (name == "disaggregated")  // a trainer on rank 0, a TP-2 engine on ranks 1 and 2
    return {Layout::replicated(specs, 1).placed(0, 3),
            Layout::tensor_parallel(dims, specs, 2, 1).placed(1, 3).with_dtype(DType::bf16),
            Source::full};
  TANDEM_FAIL("sync worker: unknown case {}", name);
}

// This rank's local tensor of every parameter under `layout` holding `full`'s values: the full
// tensors themselves, slices of them, or views of the rank's ZeRO-3 buffer `buffer` (allocated on
// the first call, refilled in place after).
void fill_local(const Layout& layout, int rank, const model::Weights& full, Source source,
                Tensor& buffer, std::vector<Tensor>& local) {
  if (source == Source::buffer) {
    const Tensor image = test::zero3_local(model::ShardLayout(full, layout.world()), rank, full);
    if (!buffer.defined()) {
      buffer = Tensor::empty(image.shape(), DType::f32);
      local = weight_sync::bind_local(layout, rank, buffer);
    }
    buffer.copy_from(image);
    return;
  }
  for (size_t p = 0; p < layout.params().size(); ++p) {
    const weight_sync::Shard& s = layout.shard(p, rank);
    if (s.shape.numel() == 0) continue;
    if (source == Source::full) {
      local[p] = full.storage()[p].tensor;
    } else {
      const Tensor image = test::shard_image(s, full.storage()[p].tensor, layout.params()[p].dtype);
      if (!local[p].defined()) local[p] = Tensor::empty(s.shape, image.dtype());
      local[p].copy_from(image);
    }
  }
}

void check_destination(const Layout& dst, int rank, const model::Weights& full,
                       const std::vector<Tensor>& local, const std::string& what) {
  for (size_t p = 0; p < dst.params().size(); ++p) {
    const weight_sync::Shard& s = dst.shard(p, rank);
    if (s.shape.numel() == 0) continue;
    // The slice of the full tensor, rounded to the destination dtype by the kernels' cast.
    expect(
        same_bytes(local[p], test::shard_image(s, full.storage()[p].tensor, dst.params()[p].dtype)),
        fmt::format("{}: rank {} {} differs from the slice of the full tensor", what, rank,
                    dst.params()[p].name));
  }
}

// The destination as a publish from every rank's whole weights (a replicated source: every piece
// within the rank) makes it: bitwise the same.
void check_as_from_whole(const Layout& dst, int rank, const model::Weights& full,
                         const std::vector<Tensor>& got, Communicator& comm,
                         const std::string& what) {
  const Layout whole = Layout::replicated(test::param_specs(full), dst.world());
  std::vector<Tensor> want(got.size());
  for (size_t p = 0; p < got.size(); ++p)
    if (const auto& s = dst.shard(p, rank); s.shape.numel() > 0)
      want[p] = Tensor::zeros(s.shape, dst.params()[p].dtype);
  weight_sync::Publisher pub(weight_sync::ReshardPlan::make(whole, dst), &comm,
                             weight_sync::bind(whole, rank, trainer::params_of(full)), want);
  pub.publish(1);
  for (size_t p = 0; p < got.size(); ++p)
    if (want[p].defined())
      expect(same_bytes(got[p], want[p]),
             fmt::format("{}: rank {} {} differs from a publish of the whole weights", what, rank,
                         dst.params()[p].name));
}

// victim >= 0: that rank is killed (stuck: stalls past the timeout) in round 1 of version 2.
// corrupt: rank 0 flips a byte it received from rank 1 in round 1 of version 2. staged:
// SyncOptions::staged.
int run(const std::string& name, const CommOptions& options, int victim, bool stuck, bool corrupt,
        bool staged) {
  auto comm = Communicator::from_environment(options);
  const int rank = comm->rank(), world = comm->size();
  model::Weights full(test::sync_model_config(), DType::f32);
  test::fill_sync_weights(full, 11);
  const Case c = make_case(victim >= 0 || corrupt ? "zero4_tp2x2" : name, full, world);
  expect(c.src.world() == world, "the case's world is the launched world");

  const size_t P = c.src.params().size();
  std::vector<Tensor> src(P), dst(P);
  Tensor buffer;  // Source::buffer: this rank's ZeRO-3 pieces
  fill_local(c.src, rank, full, c.source, buffer, src);
  for (size_t p = 0; p < P; ++p)
    if (const auto& s = c.dst.shard(p, rank); s.shape.numel() > 0)
      dst[p] = Tensor::zeros(s.shape, c.dst.params()[p].dtype);

  weight_sync::SyncOptions so;
  so.bucket_bytes = 4096;  // many rounds of a tiny model
  so.checksums = true;
  const bool dies = victim >= 0;
  bool armed = false;  // the victim dies or stalls in round 1 of version 2
  so.staged = staged;
  so.on_round = [&](int round, int) {
    if (!armed || rank != victim || round != 1) return;
    if (stuck)
      std::this_thread::sleep_for(std::chrono::duration<double>(options.timeout_s + 3));
    else
      ::kill(::getpid(), SIGKILL);
  };
  so.on_received = [&](int round, int peer, std::span<char> bytes) {
    if (armed && corrupt && rank == 0 && round == 1 && peer == 1) bytes[bytes.size() / 2] ^= 0x10;
  };
  auto plan = weight_sync::ReshardPlan::make(c.src, c.dst);
  weight_sync::Publisher pub(plan, comm.get(), src, dst, so);
  std::printf("plan %s -> %s: %lld rounds, %lld added bytes\n", c.src.name().c_str(),
              c.dst.name().c_str(), static_cast<long long>(pub.total_rounds()),
              static_cast<long long>(pub.added_bytes()));
  const weight_sync::SyncStats st = pub.publish(1);
  check_destination(c.dst, rank, full, dst, name + " version 1");
  if (c.source == Source::buffer) {
    check_as_from_whole(c.dst, rank, full, dst, *comm, name + " version 1");
    // The memory the reshard adds: two send buckets and two receive buckets, or (staged) two
    // send buckets and the bytes this rank receives; never the whole model.
    int64_t in = 0;
    for (int q = 0; q < world; ++q)
      if (q != rank) in += plan.bytes(q, rank);
    const int64_t bound = staged ? 2 * so.bucket_bytes + in : 4 * so.bucket_bytes;
    expect(pub.added_bytes() <= bound,
           fmt::format("the publisher added {} bytes, more than {}", pub.added_bytes(), bound));
    std::printf("added %lld bytes (bound %lld), whole f32 model %lld bytes, local buffer %lld\n",
                static_cast<long long>(pub.added_bytes()), static_cast<long long>(bound),
                static_cast<long long>(full.nbytes()), static_cast<long long>(buffer.nbytes()));
  }
  expect(st.checksums_compared > 0 || st.bytes_received == 0, "checksums compared");
  int64_t expected_in = 0;
  for (int q = 0; q < world; ++q)
    if (q != rank) expected_in += plan.bytes(q, rank);
  expect(st.bytes_received == expected_in,
         fmt::format("received {} bytes, the plan says {}", st.bytes_received, expected_in));
  // Unstaged, both ways of receiving are exercised: straight into the destination (a round's
  // bytes inside one piece) and through the buckets.
  if (!staged && expected_in > 0)
    expect(st.bytes_received_direct > 0 && st.bytes_received_direct < st.bytes_received,
           fmt::format("received {} of {} bytes straight into the destination",
                       st.bytes_received_direct, st.bytes_received));

  // A second version through the same buffers.
  model::Weights old(test::sync_model_config(), DType::f32);
  old.copy_from(full);
  test::fill_sync_weights(full, 12);
  fill_local(c.src, rank, full, c.source, buffer, src);
  if (corrupt) {
    armed = true;
    try {
      pub.publish(2);
      expect(false, "version 2 published although rank 0 received a corrupted byte");
    } catch (const Error& e) {
      std::printf("error: %s\n", e.what());
    }
    check_destination(c.dst, rank, old, dst, "after the corrupted version 2");
    expect(pub.version() == 1, "the publisher's version stays 1");
    std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", rank, world);
    return failures == 0 ? 0 : 1;
  }
  if (dies) {
    armed = true;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      pub.publish(2);
      expect(false, "version 2 published although a rank was killed or stuck");
    } catch (const Error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("error after %.2f s: %s\n", s, e.what());
    }
    // The destination still holds version 1.
    check_destination(c.dst, rank, old, dst, "after the failed version 2");
    // Stay a while, so that a slower survivor sees the killed rank's loss and not this one's exit.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", rank, world);
    return failures == 0 ? 3 : 1;
  }
  const weight_sync::SyncStats st2 = pub.publish(2);
  expect(st2.version == 2 && pub.version() == 2, "version stamped");
  check_destination(c.dst, rank, full, dst, name + " version 2");
  if (c.source == Source::buffer)
    check_as_from_whole(c.dst, rank, full, dst, *comm, name + " version 2");
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", rank, world);
  return failures == 0 ? 0 : 1;
}

// The rollout side of a job whose trainer keeps ZeRO-3 pieces (trainer::RolloutGroup's sharded
// constructor) beside one whose trainer keeps whole weights (its first), for two versions: the
// engine weights bitwise the same. mode: colocated or disaggregated (one rank: the whole f32
// weights for the workers, whole_policy()).
int run_group(const CommOptions& options, int tp, const std::string& dtype,
              const std::string& mode) {
  auto comm = Communicator::from_environment(options);
  const int rank = comm->rank(), world = comm->size();
  Communicator* job_comm = world > 1 ? comm.get() : nullptr;  // as the job: null on one rank
  trainer::JobConfig job;
  job.placement.rollout_tp = tp;
  job.placement.mode = mode;
  job.rollout.dtype = dtype;
  job.weight_sync.bucket_mb = 1;
  job.weight_sync.staged = false;
  model::Weights full(test::sync_model_config(), DType::f32);
  test::fill_sync_weights(full, 11);
  const model::ShardLayout shards(full, world);
  Tensor buffer = test::zero3_local(shards, rank, full);
  trainer::RolloutGroup from_pieces(job, full.config(), shards, buffer, job_comm);
  trainer::RolloutGroup from_whole(job, full, job_comm);
  expect(from_pieces.own_weights() != nullptr, "the engine has weights of its own");
  expect(from_pieces.added_bytes() <= 4 << 20,
         fmt::format("the publisher added {} bytes, more than 4 buckets of 1 MiB",
                     from_pieces.added_bytes()));
  for (int version = 0; version <= 2; ++version) {
    if (version == 2) {
      test::fill_sync_weights(full, 12);
      buffer.copy_from(test::zero3_local(shards, rank, full));  // in place, as a step does
    }
    if (version > 0) {
      const trainer::PublishStats st = from_pieces.publish(static_cast<uint64_t>(version));
      from_whole.publish(static_cast<uint64_t>(version));
      expect(world == 1 || st.bytes_sent > 0, "the pieces travel between ranks");
      expect(st.bytes_written > 0, "the engine weights are written");
    }
    const model::Weights &a = from_pieces.weights(), &b = from_whole.weights();
    for (size_t p = 0; p < a.storage().size(); ++p)
      expect(same_bytes(a.storage()[p].tensor, b.storage()[p].tensor),
             fmt::format("version {}: rank {} engine {} differs from the whole weights' publish",
                         version, rank, a.storage()[p].name));
    if (mode == "disaggregated") {
      const model::Weights& w = from_pieces.whole_policy();
      for (size_t p = 0; p < w.storage().size(); ++p)
        expect(same_bytes(w.storage()[p].tensor, full.storage()[p].tensor),
               fmt::format("version {}: the workers' {} differs from the trainer's", version,
                           w.storage()[p].name));
    }
  }
  if (mode != "disaggregated") {
    try {
      from_pieces.whole_policy();
      expect(tp == 1 && dtype == "f32", "whole_policy() refused without a whole f32 copy");
    } catch (const Error& e) {
      std::printf("whole_policy: %s\n", e.what());
    }
  }
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", rank, world);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(
        stderr,
        "usage: tandem_sync_worker CASE [unstaged] | die VICTIM | stuck VICTIM | corrupt | "
        "group TP DTYPE MODE\n");
    return 2;
  }
  CommOptions options;
  options.timeout_s = 30;
  if (const char* t = std::getenv("TANDEM_TEST_TIMEOUT_S")) options.timeout_s = std::atof(t);
  const std::string what = argv[1];
  const std::string arg = argc > 2 ? argv[2] : "";
  try {
    if (what == "group" && argc == 5)
      return run_group(options, std::atoi(argv[2]), argv[3], argv[4]);
    const bool faulty = what == "die" || what == "stuck";
    return run(what, options, faulty ? std::atoi(arg.c_str()) : -1, what == "stuck",
               what == "corrupt", arg != "unstaged");
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
