// BlockManager: block allocation, reference counts, copy-on-write and the prefix cache.
#include "rollout/block_manager.h"

#include <algorithm>

#include "core/error.h"

namespace tandem::rollout {
namespace {

constexpr uint64_t kHashSeed = 0xcbf29ce484222325ull;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The KV arena's size: every layer's K and V, each aligned as the arena hands it out. Checks the
// sizes first, so a bad one is named before anything is allocated.
size_t arena_bytes(const model::ModelConfig& config, int64_t block_size, int64_t num_blocks) {
  TANDEM_CHECK(block_size > 0, "block manager: block_size must be positive, got {}", block_size);
  TANDEM_CHECK(num_blocks > 0 && num_blocks <= (int64_t{1} << 31) / block_size,
               "block manager: num_blocks must be in [1, 2^31 / block_size], got {}", num_blocks);
  const size_t layer =
      static_cast<size_t>(num_blocks * block_size * config.num_kv_heads * config.head_dim) *
      sizeof(float);
  const size_t aligned = (layer + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
  return 2 * static_cast<size_t>(config.num_layers) * aligned;
}

}  // namespace

BlockManager::BlockManager(const model::ModelConfig& config, int64_t block_size, int64_t num_blocks,
                           Device device)
    : block_size_(block_size),
      arena_(ArenaClass::kv_blocks, device, arena_bytes(config, block_size, num_blocks)),
      layer_shape_{num_blocks, block_size, config.num_kv_heads, config.head_dim},
      num_layers_(config.num_layers) {
  carve();
}

void BlockManager::reset_blocks(int64_t num_blocks) {
  blocks_.assign(static_cast<size_t>(num_blocks), Block{});
  free_list_.clear();
  for (int64_t b = 0; b < num_blocks; ++b) free_list_.emplace_back(0, static_cast<int32_t>(b));
  num_free_ = num_blocks;
  tick_ = 0;
  size_t slots = 2;
  while (slots < 2 * static_cast<size_t>(num_blocks)) slots *= 2;
  cache_slots_.assign(slots, -1);
  num_cached_ = 0;
  block_tokens_.assign(static_cast<size_t>(num_blocks * block_size_), 0);
}

void BlockManager::release_memory() {
  if (!arena_.reserved()) return;
  TANDEM_CHECK(seqs_.empty(),
               "block manager: cannot release the KV arena while {} sequences hold blocks",
               seqs_.size());
  k_cache_.clear();
  v_cache_.clear();
  arena_.release();
  reset_blocks(layer_shape_[0]);
}

void BlockManager::reserve_memory() {
  if (arena_.reserved()) return;
  arena_.reserve();
  carve();
}

void BlockManager::carve() {
  const Shape k_shape{layer_shape_[0], layer_shape_[2], layer_shape_[3], layer_shape_[1]};
  for (int64_t l = 0; l < num_layers_; ++l) {
    k_cache_.push_back(arena_.alloc(k_shape, DType::f32));
    v_cache_.push_back(arena_.alloc(layer_shape_, DType::f32));
    k_cache_.back().zero();
    v_cache_.back().zero();
  }
  reset_blocks(layer_shape_[0]);
}

size_t BlockManager::bytes_per_block(const model::ModelConfig& config, int64_t block_size) {
  return static_cast<size_t>(2 * config.num_layers * block_size * config.num_kv_heads *
                             config.head_dim) *
         sizeof(float);
}

BlockManager::Seq& BlockManager::seq(SeqId id) {
  auto it = seqs_.find(id);
  TANDEM_CHECK(it != seqs_.end(), "block manager: unknown sequence {}", id);
  return it->second;
}

const BlockManager::Seq& BlockManager::seq(SeqId id) const {
  auto it = seqs_.find(id);
  TANDEM_CHECK(it != seqs_.end(), "block manager: unknown sequence {}", id);
  return it->second;
}

uint64_t BlockManager::block_hash(uint64_t parent, std::span<const int32_t> tokens) const {
  uint64_t h = splitmix64(parent);
  for (int32_t t : tokens) h = splitmix64(h ^ static_cast<uint32_t>(t));
  return h;
}

std::span<const int32_t> BlockManager::cached_tokens(int32_t block) const {
  return std::span<const int32_t>(block_tokens_)
      .subspan(static_cast<size_t>(block * block_size_), static_cast<size_t>(block_size_));
}

// The table holds at most num_blocks entries in at least twice as many slots, so a probe always
// meets an empty slot; the checks turn a broken invariant into an error rather than a hang.
int32_t BlockManager::find_cached(uint64_t hash) const {
  const size_t mask = cache_slots_.size() - 1;
  size_t i = hash & mask;
  for (size_t probes = 0; probes < cache_slots_.size(); ++probes, i = (i + 1) & mask) {
    const int32_t b = cache_slots_[i];
    if (b < 0 || blocks_[static_cast<size_t>(b)].hash == hash) return b;
  }
  TANDEM_CHECK(false, "block manager: the prefix cache table is full (a bug in the manager)");
  return -1;
}

void BlockManager::insert_cached(int32_t block) {
  TANDEM_CHECK(num_cached_ < num_blocks(),
               "block manager: {} prefix cache entries for {} blocks (a bug in the manager)",
               num_cached_ + 1, num_blocks());
  const size_t mask = cache_slots_.size() - 1;
  size_t i = blocks_[static_cast<size_t>(block)].hash & mask;
  while (cache_slots_[i] >= 0) i = (i + 1) & mask;
  cache_slots_[i] = block;
  ++num_cached_;
}

void BlockManager::erase_cached(int32_t block) {
  const size_t mask = cache_slots_.size() - 1;
  size_t i = blocks_[static_cast<size_t>(block)].hash & mask;
  while (cache_slots_[i] != block) {
    if (cache_slots_[i] < 0) return;  // not in the table
    i = (i + 1) & mask;
  }
  // Backward-shift deletion: later entries of the run that may move into the hole do, so every
  // entry stays reachable from its home slot without tombstones.
  for (size_t j = (i + 1) & mask; cache_slots_[j] >= 0; j = (j + 1) & mask) {
    const size_t home = blocks_[static_cast<size_t>(cache_slots_[j])].hash & mask;
    const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    cache_slots_[i] = cache_slots_[j];
    i = j;
  }
  cache_slots_[i] = -1;
  --num_cached_;
}

int32_t BlockManager::take_free_block() {
  while (!free_list_.empty()) {
    const auto [tick, b] = free_list_.front();
    free_list_.pop_front();
    Block& block = blocks_[static_cast<size_t>(b)];
    if (block.refs != 0 || block.free_tick != tick) continue;  // stale entry
    if (block.hashed) uncache(b);
    block.refs = 1;
    --num_free_;
    return b;
  }
  TANDEM_CHECK(false, "block manager: no free block (the caller checks num_free_blocks first)");
  return -1;
}

void BlockManager::release(int32_t b) {
  Block& block = blocks_[static_cast<size_t>(b)];
  TANDEM_CHECK(block.refs > 0, "block manager: block {} released more often than taken", b);
  if (--block.refs > 0) return;
  block.free_tick = ++tick_;
  ++num_free_;
  // Blocks without a prefix-cache entry are reused first; cached ones stay findable longer.
  if (block.hashed) {
    free_list_.emplace_back(block.free_tick, b);
  } else {
    free_list_.emplace_front(block.free_tick, b);
  }
}

void BlockManager::uncache(int32_t b) {
  Block& block = blocks_[static_cast<size_t>(b)];
  if (block.hashed) erase_cached(b);
  block.hashed = false;
}

int64_t BlockManager::allocate(SeqId id, std::span<const int32_t> tokens, int64_t max_tokens) {
  TANDEM_CHECK(!seqs_.count(id), "block manager: sequence {} already exists", id);
  Seq s;
  s.last_hash = kHashSeed;
  const int64_t P = block_size_, n = static_cast<int64_t>(tokens.size());
  s.table.reserve(static_cast<size_t>(blocks_for(std::max(n, max_tokens))));
  for (int64_t j = 0; (j + 1) * P <= n - 1; ++j) {
    const auto chunk = tokens.subspan(static_cast<size_t>(j * P), static_cast<size_t>(P));
    const uint64_t h = block_hash(s.last_hash, chunk);
    const int32_t hit = find_cached(h);
    if (hit < 0) break;
    Block& block = blocks_[static_cast<size_t>(hit)];
    const std::span<const int32_t> held = cached_tokens(hit);
    if (block.parent_hash != s.last_hash || !std::equal(chunk.begin(), chunk.end(), held.begin()))
      break;
    if (block.refs++ == 0) --num_free_;  // its free-list entry is now stale
    s.table.push_back(hit);
    s.last_hash = h;
    ++s.num_hashed;
  }
  s.num_slots = s.num_hashed * P;
  const int64_t cached = s.num_slots;
  seqs_.emplace(id, std::move(s));
  return cached;
}

int64_t BlockManager::blocks_needed(SeqId id, int64_t num_tokens) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return blocks_for(num_tokens);
  const Seq& s = it->second;
  if (num_tokens <= s.num_slots) return 0;
  const bool cow = s.num_slots % block_size_ != 0 && ref_count(s.table.back()) > 1;
  return (cow ? 1 : 0) + blocks_for(num_tokens) - static_cast<int64_t>(s.table.size());
}

bool BlockManager::append_slots(SeqId id, int64_t num_tokens) {
  Seq& s = seq(id);
  if (num_tokens <= s.num_slots) return true;
  if (blocks_needed(id, num_tokens) > num_free_) return false;
  const int64_t used = s.num_slots % block_size_;
  if (used != 0 && ref_count(s.table.back()) > 1) {
    // Copy-on-write: the new tokens would land in a block another sequence still reads. Its
    // used V slots, and its whole K block: a K slot is a column of the transposed keys, and the
    // columns past `used` hold nothing any sequence reads.
    const int32_t old_block = s.table.back(), new_block = take_free_block();
    for (size_t l = 0; l < k_cache_.size(); ++l) {
      const Tensor& k = k_cache_[l];
      k.narrow(new_block, 1).copy_from(k.narrow(old_block, 1));
      const Tensor& v = v_cache_[l];
      const Tensor slots = v.view({v.size(0) * block_size_, v.size(2), v.size(3)});
      slots.narrow(new_block * block_size_, used)
          .copy_from(slots.narrow(old_block * block_size_, used));
    }
    release(old_block);
    s.table.back() = new_block;
  }
  while (static_cast<int64_t>(s.table.size()) < blocks_for(num_tokens))
    s.table.push_back(take_free_block());
  s.num_slots = num_tokens;
  return true;
}

void BlockManager::fork(SeqId parent, SeqId child) {
  TANDEM_CHECK(!seqs_.count(child), "block manager: sequence {} already exists", child);
  const Seq& p = seq(parent);
  Seq s;
  s.table.reserve(p.table.capacity());
  s.table.assign(p.table.begin(), p.table.end());
  s.num_slots = p.num_slots;
  s.num_hashed = p.num_hashed;
  s.last_hash = p.last_hash;
  for (int32_t b : s.table) ++blocks_[static_cast<size_t>(b)].refs;
  seqs_.emplace(child, std::move(s));
}

void BlockManager::free(SeqId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  for (int32_t b : it->second.table) release(b);
  seqs_.erase(it);
}

void BlockManager::mark_computed(SeqId id, std::span<const int32_t> tokens, int64_t num_computed) {
  Seq& s = seq(id);
  const int64_t P = block_size_;
  TANDEM_CHECK(num_computed <= s.num_slots && num_computed <= static_cast<int64_t>(tokens.size()),
               "block manager: sequence {} has {} slots and {} tokens, {} marked computed", id,
               s.num_slots, tokens.size(), num_computed);
  while ((s.num_hashed + 1) * P <= num_computed) {
    const auto chunk =
        tokens.subspan(static_cast<size_t>(s.num_hashed * P), static_cast<size_t>(P));
    const uint64_t h = block_hash(s.last_hash, chunk);
    const int32_t b = s.table[static_cast<size_t>(s.num_hashed)];
    Block& block = blocks_[static_cast<size_t>(b)];
    if (!block.hashed && find_cached(h) < 0) {
      block.hashed = true;
      block.hash = h;
      block.parent_hash = s.last_hash;
      std::copy(chunk.begin(), chunk.end(),
                block_tokens_.begin() + static_cast<std::ptrdiff_t>(b * block_size_));
      insert_cached(b);
    }
    s.last_hash = h;
    ++s.num_hashed;
  }
}

void BlockManager::clear_prefix_cache() {
  for (int32_t& b : cache_slots_) {
    if (b >= 0) blocks_[static_cast<size_t>(b)].hashed = false;
    b = -1;
  }
  num_cached_ = 0;
}

const std::vector<int32_t>& BlockManager::block_table(SeqId id) const { return seq(id).table; }

int64_t BlockManager::num_slots(SeqId id) const { return seq(id).num_slots; }

int32_t BlockManager::slot(SeqId id, int64_t pos) const {
  const Seq& s = seq(id);
  TANDEM_CHECK(pos >= 0 && pos < s.num_slots, "block manager: sequence {} has {} slots, asked {}",
               id, s.num_slots, pos);
  return static_cast<int32_t>(s.table[static_cast<size_t>(pos / block_size_)] * block_size_ +
                              pos % block_size_);
}

}  // namespace tandem::rollout
