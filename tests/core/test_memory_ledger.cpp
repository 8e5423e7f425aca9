// core/memory_ledger.h: the bytes of every arena by class, current and peak, on any thread, and
// the process's cap that refuses a reserve naming the class, the key and what each class holds.
#include <catch2/catch.hpp>

#include <string>
#include <thread>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/memory_ledger.h"

namespace ml = tandem::memory_ledger;
using tandem::Arena;
using tandem::ArenaClass;
using tandem::Device;

namespace {

constexpr size_t kMiB = 1024 * 1024;

}  // namespace

TEST_CASE("the memory ledger counts an arena's capacity by class from reserve to release",
          "[unit]") {
  const ml::Snapshot before = ml::snapshot();
  const auto held = [&](ArenaClass c) { return ml::snapshot()[c].current - before[c].current; };
  {
    Arena grads(ArenaClass::gradients, Device::cpu(), 3 * kMiB);
    Arena kv(ArenaClass::kv_blocks, Device::cpu(), 5 * kMiB);
    CHECK(held(ArenaClass::gradients) == 3 * kMiB);
    CHECK(held(ArenaClass::kv_blocks) == 5 * kMiB);
    CHECK(held(ArenaClass::parameters) == 0);
    CHECK(ml::snapshot().total.current - before.total.current == 8 * kMiB);

    kv.release();
    kv.release();  // twice gives back nothing more
    CHECK(held(ArenaClass::kv_blocks) == 0);
    CHECK(ml::snapshot().total.current - before.total.current == 3 * kMiB);
    // The peaks remember the released arena until they are reset.
    CHECK(ml::snapshot()[ArenaClass::kv_blocks].peak >=
          before[ArenaClass::kv_blocks].current + 5 * kMiB);
    CHECK(ml::snapshot().total.peak >= before.total.current + 8 * kMiB);
    const ml::Snapshot peaks = ml::reset_peaks();
    CHECK(peaks[ArenaClass::kv_blocks].peak >= before[ArenaClass::kv_blocks].current + 5 * kMiB);
    CHECK(peaks[ArenaClass::kv_blocks].current == before[ArenaClass::kv_blocks].current);
    const ml::Snapshot reset = ml::snapshot();
    for (const ArenaClass c : ml::kAllClasses) CHECK(reset[c].peak == reset[c].current);
    CHECK(reset.total.peak == reset.total.current);

    kv.reserve();
    kv.reserve();  // twice counts once
    CHECK(held(ArenaClass::kv_blocks) == 5 * kMiB);
    CHECK(ml::snapshot()[ArenaClass::kv_blocks].peak ==
          reset[ArenaClass::kv_blocks].current + 5 * kMiB);
  }
  // The destructors give everything back.
  const ml::Snapshot after = ml::snapshot();
  for (const ArenaClass c : ml::kAllClasses) CHECK(after[c].current == before[c].current);
  CHECK(after.total.current == before.total.current);
}

TEST_CASE("the memory ledger stays exact under arenas made and freed on several threads",
          "[unit]") {
  const ml::Snapshot before = ml::snapshot();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      const auto cls = ml::kAllClasses[static_cast<size_t>(t)];
      for (int i = 0; i < 500; ++i) {
        Arena a(cls, Device::cpu(), 4096 + static_cast<size_t>(i % 7) * 256);
        a.release();
        a.reserve();
      }
    });
  for (std::thread& t : threads) t.join();
  const ml::Snapshot after = ml::snapshot();
  for (const ArenaClass c : ml::kAllClasses) CHECK(after[c].current == before[c].current);
  CHECK(after.total.current == before.total.current);
}

TEST_CASE("a reserve past the rank memory limit throws naming the class the key and the holdings",
          "[unit]") {
  Arena weights(ArenaClass::parameters, Device::cpu(), 2 * kMiB);
  const size_t base = ml::snapshot().total.current;
  {
    const ml::ScopedLimit cap({base + 3 * kMiB, "placement.rank_memory_limit_gb", "job.toml:7:1"});
    Arena kv(ArenaClass::kv_blocks, Device::cpu(), 2 * kMiB);  // fits: 2 of 3 MiB
    const ml::Snapshot held = ml::snapshot();
    try {
      Arena grads(ArenaClass::gradients, Device::cpu(), 2 * kMiB);
      FAIL("a reserve past the cap succeeded");
    } catch (const tandem::Error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("rank memory limit: reserving 2.0 MiB of gradients would hold") !=
            std::string::npos);
      CHECK(what.find("over placement.rank_memory_limit_gb = ") != std::string::npos);
      CHECK(what.find("job.toml:7:1") != std::string::npos);
      CHECK(what.find("kv_cache 2.0") != std::string::npos);
      CHECK(what.find("weights ") != std::string::npos);
    }
    // The refused reserve holds nothing.
    CHECK(ml::snapshot().total.current == held.total.current);
    CHECK(ml::snapshot()[ArenaClass::gradients].current == held[ArenaClass::gradients].current);
    // A released arena's bytes are free for another class; taking them back is then refused.
    kv.release();
    Arena grads(ArenaClass::gradients, Device::cpu(), 2 * kMiB);
    CHECK_THROWS_WITH(kv.reserve(), Catch::Contains("of kv_cache would hold"));
    CHECK_FALSE(kv.reserved());
  }
  // Without the cap the same reserve passes.
  Arena kv(ArenaClass::kv_blocks, Device::cpu(), 4 * kMiB);
  CHECK(kv.reserved());
}
