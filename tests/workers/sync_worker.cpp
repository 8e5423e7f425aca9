// The per-rank side of the weight_sync multi-process tests: one reshard per run (ZeRO to tensor
// parallel, tensor parallel to one rank, replicated to tensor parallel) checked against slicing
// the full tensors, a rank killed in the middle of a sync, or a corrupted byte.
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
#include "model/weights.h"
#include "tests/weight_sync/sync_util.h"
#include "trainer/optimizer.h"
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

struct Case {
  Layout src, dst;
  bool src_full;  // the source's local tensors are the full parameters (replicated, ZeRO-1/2)
};

Case make_case(const std::string& name, const model::Weights& w, int world) {
  const auto specs = test::param_specs(w);
  const weight_sync::TpDims dims = test::tp_dims(w.config());
  if (name == "zero4_tp2x2")
    return {Layout::zero(specs, 4, trainer::ShardedAdamW::kNormBlock),
            Layout::tensor_parallel(dims, specs, 2, 2).with_dtype(DType::bf16), true};
  if (name == "zero2_tp2")
    return {Layout::zero(specs, 2, trainer::ShardedAdamW::kNormBlock),
            Layout::tensor_parallel(dims, specs, 2, 1), true};
  if (name == "tp2_tp1")
    return {Layout::tensor_parallel(dims, specs, 2, 1),
            Layout::tensor_parallel(dims, specs, 1, 1).placed(0, 2).with_dtype(DType::bf16), false};
  if (name == "replicated_tp2")
    return {Layout::replicated(specs, 2),
            Layout::tensor_parallel(dims, specs, 2, 1).with_dtype(DType::bf16), true};
  if (name == "disaggregated")  // a trainer on rank 0, a TP-2 engine on ranks 1 and 2
    return {Layout::replicated(specs, 1).placed(0, 3),
            Layout::tensor_parallel(dims, specs, 2, 1).placed(1, 3).with_dtype(DType::bf16), true};
  TANDEM_CHECK(world < 0, "sync worker: unknown case {}", name);
  return {Layout::replicated(specs, 1), Layout::replicated(specs, 1), true};
}

// This rank's local tensor of every parameter under `layout` holding `full`'s values (the full
// tensors themselves where `full_tensors`).
void fill_local(const Layout& layout, int rank, const model::Weights& full, bool full_tensors,
                std::vector<Tensor>& local) {
  for (size_t p = 0; p < layout.params().size(); ++p) {
    const weight_sync::Shard& s = layout.shard(p, rank);
    if (s.shape.numel() == 0) continue;
    if (full_tensors) {
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

  if (c.src.name().rfind("zero", 0) == 0) {
    // The layout's ranges are the optimizer's.
    trainer::ShardedAdamW opt(full, comm.get());
    int64_t start = 0, lo = -1, hi = -1;
    for (size_t p = 0; p < c.src.params().size(); ++p) {
      for (const weight_sync::Run& r : c.src.shard(p, rank).runs) {
        if (lo < 0) lo = start + r.global;
        hi = start + r.global + r.length;
      }
      start += c.src.params()[p].shape.numel();
    }
    expect(lo == opt.begin() && hi == opt.end(),
           fmt::format("zero range [{}, {}) is the optimizer's [{}, {})", lo, hi, opt.begin(),
                       opt.end()));
  }

  const size_t P = c.src.params().size();
  std::vector<Tensor> src(P), dst(P);
  fill_local(c.src, rank, full, c.src_full, src);
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
  fill_local(c.src, rank, full, c.src_full, src);
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
  std::printf("%s rank %d of %d\n", failures == 0 ? "ok" : "failed", rank, world);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(
        stderr,
        "usage: tandem_sync_worker CASE [unstaged] | die VICTIM | stuck VICTIM | corrupt\n");
    return 2;
  }
  CommOptions options;
  options.timeout_s = 30;
  if (const char* t = std::getenv("TANDEM_TEST_TIMEOUT_S")) options.timeout_s = std::atof(t);
  const std::string what = argv[1];
  const std::string arg = argc > 2 ? argv[2] : "";
  try {
    const bool faulty = what == "die" || what == "stuck";
    return run(what, options, faulty ? std::atoi(arg.c_str()) : -1, what == "stuck",
               what == "corrupt", arg != "unstaged");
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
