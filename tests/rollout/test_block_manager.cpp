// Tests of rollout/block_manager: allocation and free accounting, fork with copy-on-write of a
// shared partial block, and the prefix cache of full blocks (also under random churn).
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "rollout/block_manager.h"
#include "tests/testutil.h"

namespace tandem::rollout {
namespace {

model::ModelConfig tiny_config() {
  model::ModelConfig c;
  c.vocab_size = 50;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.max_position_embeddings = 128;
  return c;
}

std::vector<int32_t> iota_tokens(int n, int from = 1) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(from + i);
  return t;
}

}  // namespace

TEST_CASE("block manager allocates and frees blocks with exact accounting", "[unit]") {
  BlockManager bm(tiny_config(), 4, 6);
  CHECK(bm.num_free_blocks() == 6);
  CHECK(BlockManager::bytes_per_block(tiny_config(), 4) == 2 * 2 * 4 * 1 * 8 * 4);
  CHECK(bm.k_cache()[1].nbytes() * 2 * 2 == 6 * BlockManager::bytes_per_block(tiny_config(), 4));
  CHECK(bm.allocate(1, iota_tokens(9)) == 0);
  CHECK(bm.append_slots(1, 9));
  CHECK(bm.block_table(1).size() == 3);
  CHECK(bm.num_free_blocks() == 3);
  CHECK(bm.slot(1, 5) == bm.block_table(1)[1] * 4 + 1);
  CHECK(bm.allocate(2, iota_tokens(20, 30)) == 0);
  CHECK_FALSE(bm.append_slots(2, 20));  // needs 5 blocks, 3 are free: nothing changes
  CHECK(bm.num_slots(2) == 0);
  CHECK(bm.num_free_blocks() == 3);
  CHECK(bm.append_slots(2, 12));
  CHECK(bm.num_free_blocks() == 0);
  CHECK_THROWS_AS(bm.slot(2, 12), Error);
  bm.free(1);
  bm.free(2);
  bm.free(3);  // unknown: ignored
  CHECK(bm.num_free_blocks() == 6);
}

TEST_CASE("block manager fork shares blocks and copies a shared partial block on write", "[unit]") {
  const model::ModelConfig c = tiny_config();
  BlockManager bm(c, 4, 8);
  const std::vector<int32_t> tokens = iota_tokens(6);
  bm.allocate(1, tokens);
  REQUIRE(bm.append_slots(1, 6));
  // Fill the sequence's slots with recognisable K/V. Element e of slot s: v_cache[s][e],
  // k_cache[s / P][e][s % P] (keys transposed per block).
  const int64_t row = c.num_kv_heads * c.head_dim, P = 4;
  const auto k_at = [&](int64_t s, int64_t e) { return ((s / P) * row + e) * P + s % P; };
  for (size_t l = 0; l < bm.k_cache().size(); ++l)
    for (int64_t p = 0; p < 6; ++p)
      for (int64_t e = 0; e < row; ++e) {
        bm.k_cache()[l].data_as<float>()[k_at(bm.slot(1, p), e)] = float(100 * l + 10 * p + e);
        bm.v_cache()[l].data_as<float>()[bm.slot(1, p) * row + e] = -float(100 * l + 10 * p + e);
      }
  bm.fork(1, 2);
  bm.fork(1, 3);
  CHECK(bm.num_free_blocks() == 6);
  CHECK(bm.block_table(2) == bm.block_table(1));
  CHECK(bm.ref_count(bm.block_table(1)[1]) == 3);
  CHECK(bm.blocks_needed(2, 7) == 1);
  REQUIRE(bm.append_slots(2, 7));  // writes into the shared partial block: copy it
  CHECK(bm.num_free_blocks() == 5);
  CHECK(bm.block_table(2)[0] == bm.block_table(1)[0]);
  CHECK(bm.block_table(2)[1] != bm.block_table(1)[1]);
  CHECK(bm.ref_count(bm.block_table(1)[1]) == 2);
  for (size_t l = 0; l < bm.k_cache().size(); ++l)
    for (int64_t p = 0; p < 6; ++p)
      for (int64_t e = 0; e < row; ++e) {
        CHECK(bm.k_cache()[l].data_as<float>()[k_at(bm.slot(2, p), e)] ==
              float(100 * l + 10 * p + e));
        CHECK(bm.v_cache()[l].data_as<float>()[bm.slot(2, p) * row + e] ==
              -float(100 * l + 10 * p + e));
      }
  REQUIRE(bm.append_slots(3, 9));  // copy + one new block
  CHECK(bm.num_free_blocks() == 3);
  REQUIRE(bm.append_slots(1, 8));  // the last holder writes in place
  CHECK(bm.ref_count(bm.block_table(1)[1]) == 1);
  CHECK(bm.num_free_blocks() == 3);
  bm.free(1);
  bm.free(2);
  bm.free(3);
  CHECK(bm.num_free_blocks() == 8);
}

TEST_CASE("block manager prefix cache reuses computed full blocks of a shared prefix", "[unit]") {
  BlockManager bm(tiny_config(), 4, 10);
  std::vector<int32_t> a = iota_tokens(11);
  bm.allocate(1, a);
  REQUIRE(bm.append_slots(1, 11));
  bm.mark_computed(1, a, 11);  // two full blocks enter the cache
  CHECK(bm.num_cached_blocks() == 2);
  // Same first block, different second block.
  std::vector<int32_t> b = iota_tokens(10);
  b[6] = 40;
  CHECK(bm.allocate(2, b) == 4);
  CHECK(bm.block_table(2)[0] == bm.block_table(1)[0]);
  // The whole prompt cached: one token is still left to compute.
  std::vector<int32_t> c(a.begin(), a.begin() + 8);
  CHECK(bm.allocate(3, c) == 4);
  c.push_back(99);
  CHECK(bm.allocate(4, c) == 8);
  bm.free(1);
  bm.free(2);
  bm.free(3);
  bm.free(4);
  CHECK(bm.num_free_blocks() == 10);
  // Freed cached blocks stay findable until reused, and are then forgotten.
  CHECK(bm.allocate(5, c) == 8);
  bm.free(5);
  bm.allocate(6, iota_tokens(40, 5));
  REQUIRE(bm.append_slots(6, 40));  // takes every block
  CHECK(bm.num_cached_blocks() == 0);
  bm.free(6);
  CHECK(bm.allocate(7, c) == 0);
  bm.free(7);
  bm.allocate(8, a);
  REQUIRE(bm.append_slots(8, 11));
  bm.mark_computed(8, a, 11);
  bm.free(8);
  bm.clear_prefix_cache();
  CHECK(bm.allocate(9, a) == 0);
  bm.free(9);
  CHECK(bm.num_free_blocks() == 10);
}

TEST_CASE("block manager prefix cache hits hold the tokens they claim under random churn",
          "[unit]") {
  // Blocks of 2 tokens over a 3-token vocabulary: prompts share prefixes often and the few blocks
  // are cached, evicted and reused all the time, so the cache's table keeps inserting and erasing
  // entries in crowded probe runs. Each computed slot's V holds its token; every hit must too.
  const int64_t P = 2, N = 48, slot_floats = 1 * 8;  // Hkv * D
  BlockManager bm(tiny_config(), P, N);
  std::mt19937 rng(7);
  std::vector<BlockManager::SeqId> live;
  int64_t hits = 0, max_cached = 0;
  for (BlockManager::SeqId id = 1; id <= 3000; ++id) {
    if (!live.empty() && (rng() % 3 == 0 || bm.num_free_blocks() < 8)) {
      const size_t i = rng() % live.size();
      bm.free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
    std::vector<int32_t> tokens(2 + rng() % 9);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 3);
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t cached = bm.allocate(id, tokens);
    float* v = bm.v_cache()[0].data_as<float>();
    for (int64_t p = 0; p < cached; ++p)
      REQUIRE(v[bm.slot(id, p) * slot_floats] ==
              static_cast<float>(tokens[static_cast<size_t>(p)]));
    hits += cached;
    if (!bm.append_slots(id, n)) {
      bm.free(id);
      continue;
    }
    for (int64_t p = cached; p < n; ++p)
      v[bm.slot(id, p) * slot_floats] = static_cast<float>(tokens[static_cast<size_t>(p)]);
    bm.mark_computed(id, tokens, n);
    live.push_back(id);
    max_cached = std::max(max_cached, bm.num_cached_blocks());
  }
  CHECK(hits > 1000);
  CHECK(max_cached > N / 2);
  CHECK(max_cached <= N);
  for (BlockManager::SeqId id : live) bm.free(id);
  CHECK(bm.num_free_blocks() == N);
  bm.clear_prefix_cache();
  CHECK(bm.num_cached_blocks() == 0);
}

TEST_CASE("block manager releases its KV arena and takes it back zeroed with every block free",
          "[unit]") {
  BlockManager bm(tiny_config(), 4, 6);
  CHECK(bm.memory_reserved());
  CHECK(bm.allocate(1, iota_tokens(9)) == 0);
  REQUIRE(bm.append_slots(1, 9));
  bm.mark_computed(1, iota_tokens(9), 9);
  bm.v_cache()[0].data_as<float>()[bm.slot(1, 2) * 8] = 3.5f;  // a written V
  CHECK_THROWS_WITH(bm.release_memory(), Catch::Contains("1 sequences hold blocks"));
  bm.free(1);
  CHECK(bm.num_cached_blocks() == 2);
  bm.release_memory();
  CHECK_FALSE(bm.memory_reserved());
  CHECK(bm.k_cache().empty());
  CHECK(bm.num_cached_blocks() == 0);  // the prefix cache went with the memory
  bm.reserve_memory();
  REQUIRE(bm.k_cache().size() == 2);
  CHECK(bm.num_free_blocks() == 6);
  for (const auto* cache : {&bm.k_cache(), &bm.v_cache()})
    for (const Tensor& t : *cache) {
      CHECK(t.shape() == (cache == &bm.k_cache() ? Shape{6, 1, 8, 4} : Shape{6, 4, 1, 8}));
      const float* p = t.data_as<float>();
      for (int64_t i = 0; i < t.numel(); ++i) REQUIRE(p[i] == 0.0f);
    }
  CHECK(bm.allocate(2, iota_tokens(9)) == 0);  // nothing cached any more
  CHECK(bm.append_slots(2, 9));
}

}  // namespace tandem::rollout
