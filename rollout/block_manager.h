// BlockManager: the paged KV cache of the rollout engine — one K and one V arena per layer cut
// into fixed-size blocks, reference-counted blocks, per-sequence block tables, fork with
// copy-on-write of a shared partial last block, and a prefix cache of full blocks keyed by a
// chained hash of their token ids (see docs/rollout.md).
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "core/tensor.h"
#include "model/config.h"

namespace tandem::rollout {

class BlockManager {
 public:
  using SeqId = int64_t;

  // k_cache()[l] (num_blocks, Hkv, D, P), v_cache()[l] (num_blocks, P, Hkv, D) (kernels/ops.h)
  // f32 on `device`, P = block_size, all in one kv_blocks arena, zeroed.
  BlockManager(const model::ModelConfig& config, int64_t block_size, int64_t num_blocks,
               Device device = Device::cpu());

  // Gives the KV arena back to the device (a colocated job's training phase wants the memory)
  // and forgets the prefix cache; every sequence must have been freed. k_cache() and v_cache()
  // are empty until reserve_memory(), which takes the arena again, zeroed, with every block free
  // in the order of a new manager. Both do nothing when already in that state.
  void release_memory();
  void reserve_memory();
  bool memory_reserved() const { return arena_.reserved(); }

  // Bytes one block takes over all layers (K and V, f32): for sizing num_blocks to a budget.
  static size_t bytes_per_block(const model::ModelConfig& config, int64_t block_size);

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Blocks no sequence holds (including prefix-cache blocks that are kept but evictable).
  int64_t num_free_blocks() const { return num_free_; }
  // Blocks a sequence of n tokens occupies.
  int64_t blocks_for(int64_t n) const { return (n + block_size_ - 1) / block_size_; }
  const std::vector<Tensor>& k_cache() const { return k_cache_; }
  const std::vector<Tensor>& v_cache() const { return v_cache_; }

  // Starts sequence `id` whose tokens will be `tokens`: takes the longest run of full blocks of
  // `tokens` found in the prefix cache (never all of them: at least one token is left to
  // compute, so the caller gets its logits) and returns how many tokens they hold (a multiple
  // of P). Holds no other block yet; append_slots() reserves the rest. max_tokens: the most
  // tokens the sequence will hold, when known (its block table is sized for them once, so that
  // growing it up to there allocates nothing).
  int64_t allocate(SeqId id, std::span<const int32_t> tokens, int64_t max_tokens = 0);
  // Grows sequence `id` to hold `num_tokens` slots (never shrinks). A shared partial last block
  // that the new slots would write into is first copied into a block of its own
  // (copy-on-write). Returns false and changes nothing when too few blocks are free.
  bool append_slots(SeqId id, int64_t num_tokens);
  // Blocks append_slots(id, num_tokens) would take (0 for an unknown id's empty table too).
  int64_t blocks_needed(SeqId id, int64_t num_tokens) const;
  // Child `child` shares every block of `parent` (reference counts go up); no copy. Its block
  // table has the parent's capacity.
  void fork(SeqId parent, SeqId child);
  // Releases every block of `id`; blocks that reach count 0 become free (full blocks in the
  // prefix cache stay findable until they are reused). Unknown ids are ignored.
  void free(SeqId id);
  // Records that the first `num_computed` of `tokens` have their K/V written: every full block
  // among them enters the prefix cache.
  void mark_computed(SeqId id, std::span<const int32_t> tokens, int64_t num_computed);
  // Forgets every prefix-cache entry (after a weight swap the cached K/V are stale).
  void clear_prefix_cache();

  bool has(SeqId id) const { return seqs_.count(id) != 0; }
  const std::vector<int32_t>& block_table(SeqId id) const;
  int64_t num_slots(SeqId id) const;  // tokens the sequence has slots for
  // The cache slot (block * P + offset) of token `pos` of sequence `id`.
  int32_t slot(SeqId id, int64_t pos) const;
  int32_t ref_count(int32_t block) const { return blocks_[static_cast<size_t>(block)].refs; }
  int64_t num_cached_blocks() const { return num_cached_; }

 private:
  struct Block {
    int32_t refs = 0;
    uint64_t free_tick = 0;    // matches the free-list entry that is current
    bool hashed = false;       // in cached_ under `hash`
    uint64_t hash = 0;         // chained hash of the tokens of this and every earlier block
    uint64_t parent_hash = 0;  // checked with the tokens on a hit (no trust in 64 bits alone)
  };
  struct Seq {
    std::vector<int32_t> table;
    int64_t num_slots = 0;
    int64_t num_hashed = 0;  // leading full blocks whose hash is known
    uint64_t last_hash = 0;  // hash of block num_hashed - 1 (kHashSeed when none)
  };

  Seq& seq(SeqId id);
  const Seq& seq(SeqId id) const;
  int32_t take_free_block();
  void release(int32_t block);
  void uncache(int32_t block);
  uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens) const;
  std::span<const int32_t> cached_tokens(int32_t block) const;
  // The prefix cache's table: find (-1 when absent), insert (block.hash set), erase.
  int32_t find_cached(uint64_t hash) const;
  void insert_cached(int32_t block);
  void erase_cached(int32_t block);

  void reset_blocks(int64_t num_blocks);
  // Cuts the reserved arena into the zeroed per-layer caches; every block free.
  void carve();

  int64_t block_size_;
  Arena arena_;        // every layer's K and V; before the shape, as its size checks the arguments
  Shape layer_shape_;  // V's (num_blocks, P, Hkv, D); K's is (num_blocks, Hkv, D, P)
  int64_t num_layers_;
  std::vector<Tensor> k_cache_, v_cache_;  // per layer, in arena_
  std::vector<Block> blocks_;
  std::deque<std::pair<uint64_t, int32_t>>
      free_list_;  // (tick, block), oldest first; stale entries skipped
  uint64_t tick_ = 0;
  int64_t num_free_ = 0;
  // The prefix cache, chained hash -> block, as open addressing over block ids (linear probing;
  // at most num_blocks entries in at least twice as many slots): it allocates nothing once the
  // manager is made, so decode steps that fill blocks allocate nothing.
  std::vector<int32_t> cache_slots_;  // -1: empty, else a block whose `hash` is the key
  int64_t num_cached_ = 0;
  std::vector<int32_t> block_tokens_;  // (num_blocks, P): the tokens of each hashed block
  std::unordered_map<SeqId, Seq> seqs_;
};

}  // namespace tandem::rollout
