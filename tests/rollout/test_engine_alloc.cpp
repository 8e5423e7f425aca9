// Allocation checks of rollout/engine (STYLE.md: no allocation on the decode hot path): steady
// decode steps and a weight swap allocate nothing, counted by this test binary's global operator
// new, which counts only inside an AllocationCount scope.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "kernels/ops.h"
#include "model/weights.h"
#include "rollout/engine.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};

void* counted_alloc(std::size_t n, std::size_t align) {
  if (g_counting.load(std::memory_order_relaxed))
    g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (n == 0) n = 1;
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (n + align - 1) / align * align)
                : std::malloc(n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void* counted_alloc_nothrow(std::size_t n, std::size_t align) noexcept {
  try {
    return counted_alloc(n, align);
  } catch (...) {
    return nullptr;
  }
}

// Counts the operator new calls of every thread from its construction to count().
class AllocationCount {
 public:
  AllocationCount() {
    g_allocations.store(0);
    g_counting.store(true);
  }
  ~AllocationCount() { g_counting.store(false); }
  AllocationCount(const AllocationCount&) = delete;
  AllocationCount& operator=(const AllocationCount&) = delete;
  int64_t count() {
    g_counting.store(false);
    return g_allocations.load();
  }
};

}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 0); }
void* operator new[](std::size_t n) { return counted_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc_nothrow(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc_nothrow(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc_nothrow(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc_nothrow(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace tandem::rollout {
namespace {

std::vector<int32_t> random_prompt(int n, int64_t V, uint64_t seed) {
  const Tensor ids = test::random_ints({n}, DType::i32, seed, 0, V);
  const int32_t* p = ids.data_as<int32_t>();
  return std::vector<int32_t>(p, p + n);
}

// Blocks of 4 tokens, so that decode steps keep filling blocks (and registering them in the
// prefix cache).
EngineOptions small_options() {
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 96;
  o.max_batch_tokens = 64;
  o.max_seqs = 16;
  o.max_context = 64;
  return o;
}

// A group of 3 sampled completions and one greedy completion, 40 tokens each.
std::vector<Request> requests(int64_t V) {
  std::vector<Request> rs(2);
  rs[0] = {"group", random_prompt(6, V, 21), {}};
  rs[0].params.n = 3;
  rs[0].params.seed = 5;
  rs[0].params.temperature = 0.9f;
  rs[0].params.top_k = 40;
  rs[0].params.top_p = 0.95f;
  rs[0].params.max_tokens = 40;
  rs[1] = {"greedy", random_prompt(9, V, 22), {}};
  rs[1].params.temperature = 0.0f;
  rs[1].params.max_tokens = 40;
  return rs;
}

struct Case {
  test::TinyKind kind;
  DType dtype;
  ops::MatmulPrecision precision;
};

const Case kCases[] = {{test::TinyKind::llama_tied, DType::f32, ops::MatmulPrecision::f32},
                       {test::TinyKind::qwen2, DType::bf16, ops::MatmulPrecision::f32},
                       {test::TinyKind::qwen3, DType::f32, ops::MatmulPrecision::bf16}};

}  // namespace

TEST_CASE("engine decode steps allocate nothing once the batch shape has been seen", "[unit]") {
  {
    // The counter sees an allocation (the pointer escapes, so it cannot be elided).
    static const void* volatile escaped = nullptr;
    AllocationCount count;
    std::vector<int64_t> v;
    v.reserve(1000);
    escaped = v.data();
    REQUIRE(count.count() == 1);
    REQUIRE(escaped != nullptr);
  }
  for (const Case& k : kCases) {
    const ops::ScopedMatmulPrecision scope(k.precision);
    INFO(test::tiny_kind_name(k.kind)
         << " bf16 matmuls: " << (k.precision == ops::MatmulPrecision::bf16));
    const model::ModelConfig c = test::tiny_model_config(k.kind);
    model::Weights w(c, k.dtype);
    test::fill_random_weights(w, 31);
    Engine engine(w, small_options());
    for (Request& r : requests(c.vocab_size)) engine.submit(std::move(r));
    // Step 1 prefills both prompts and forks the group; a few decode steps of the 4 samples then
    // set the batch shape (the first also copies the group's shared partial block).
    for (int i = 0; i < 4; ++i) engine.step();
    REQUIRE(engine.stats().forks == 2);
    const int64_t decoded = engine.stats().decode_tokens;
    const int64_t cached = engine.blocks().num_cached_blocks();
    constexpr int kSteps = 24;  // 6 blocks filled per sample
    int64_t allocations = 0;
    {
      AllocationCount count;
      for (int i = 0; i < kSteps; ++i) engine.step();
      allocations = count.count();
    }
    CHECK(allocations == 0);
    CHECK(engine.stats().decode_tokens == decoded + 4 * kSteps);
    CHECK(engine.blocks().num_cached_blocks() > cached);
    while (engine.has_work()) engine.step();
    const std::vector<RequestOutput> outs = engine.poll();
    REQUIRE(outs.size() == 2);
    for (const RequestOutput& o : outs)
      for (const SampleOutput& s : o.samples) CHECK(s.tokens.size() == 40);
  }
}

TEST_CASE("engine weight swap refreshes the decoder in place with a new engine's logprobs",
          "[unit]") {
  for (const Case& k : kCases) {
    const ops::ScopedMatmulPrecision scope(k.precision);
    INFO(test::tiny_kind_name(k.kind)
         << " bf16 matmuls: " << (k.precision == ops::MatmulPrecision::bf16));
    const model::ModelConfig c = test::tiny_model_config(k.kind);
    model::Weights w1(c, k.dtype), w2(c, k.dtype);
    test::fill_random_weights(w1, 41);
    test::fill_random_weights(w2, 42);
    Engine engine(w1, small_options());
    engine.generate(requests(c.vocab_size));
    int64_t allocations = 0;
    {
      AllocationCount count;
      engine.set_weights(w2, 1);  // the decoder and its packed copies stay where they are
      allocations = count.count();
    }
    CHECK(allocations == 0);
    const std::vector<RequestOutput> got = engine.generate(requests(c.vocab_size));
    Engine fresh(w2, small_options());
    const std::vector<RequestOutput> want = fresh.generate(requests(c.vocab_size));
    REQUIRE(got.size() == want.size());
    for (size_t r = 0; r < got.size(); ++r) {
      REQUIRE(got[r].samples.size() == want[r].samples.size());
      for (size_t i = 0; i < got[r].samples.size(); ++i) {
        const SampleOutput &a = got[r].samples[i], &b = want[r].samples[i];
        CHECK(a.weight_version == 1);
        CHECK(a.tokens == b.tokens);
        REQUIRE(a.logprobs.size() == b.logprobs.size());
        CHECK(std::memcmp(a.logprobs.data(), b.logprobs.data(), 4 * a.logprobs.size()) == 0);
      }
    }
  }
}

}  // namespace tandem::rollout
