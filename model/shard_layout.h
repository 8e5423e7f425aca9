// ShardLayout: how a data-parallel trainer splits the parameters of a model::Weights over its
// ranks (ZeRO / FSDP). The storage tensors, flattened one after the other in storage order (P
// elements: "the flat parameters"), form units the trainer gathers and reduces at once: the
// embedding, each layer, and the head (the final norm and an untied lm_head); a pipeline stage's
// table its own in the same order (model::PartUnits numbers them). A unit is cut into
// blocks of kBlock elements from its start, and rank r of N owns blocks [r S, (r + 1) S) of it
// (S = ceil(blocks / N), so the last ranks may own fewer or none). The blocks are also the global
// gradient norm's partial sums, added in unit then block order: the same bits on any number of
// ranks and at every sharding level.
//
// A rank keeps its pieces one after the other in a local buffer of local_size() elements, unit u's
// piece at units()[u].local, padded to S elements: the all-gather of unit u (every rank's S
// elements in rank order) is the unit's flat elements followed by the padding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/weights.h"

namespace tandem::model {

// Elements [begin, end) of the flat parameters.
struct FlatRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const FlatRange&) const = default;
};

struct ShardUnit {
  std::string name;         // "model.embed_tokens", "model.layers.3", "head"
  FlatRange flat;           // the unit in the flat parameters
  size_t first_tensor = 0;  // its storage tensors: [first_tensor, end_tensor)
  size_t end_tensor = 0;
  int64_t shard = 0;  // S: elements of the unit's piece on every rank (whole blocks, padded)
  int64_t local = 0;  // offset of the piece in a rank's local buffer
};

class ShardLayout {
 public:
  static constexpr int64_t kBlock = 4096;

  // The storage tensors' names and element counts, in storage order (model::Weights::storage()),
  // over `world` ranks. A tensor named "model.layers.<i>.*" belongs to layer i's unit,
  // "model.embed_tokens.weight" to the embedding's, the rest (model.norm, lm_head) to the head's.
  ShardLayout(std::span<const std::string> names, std::span<const int64_t> numels, int world);
  ShardLayout(const Weights& weights, int world);

  int world() const { return world_; }
  int64_t total() const { return starts_.back(); }  // P
  std::span<const ShardUnit> units() const { return units_; }
  // Flat offset of each storage tensor, then P.
  std::span<const int64_t> tensor_starts() const { return starts_; }
  size_t unit_of_tensor(size_t tensor) const { return unit_of_[tensor]; }

  // Elements of a rank's local buffer: every unit's S.
  int64_t local_size() const { return local_size_; }
  // Rank r's piece of unit u in the flat parameters (begin == end when it holds none).
  FlatRange range(size_t unit, int rank) const;
  // Every non-empty piece of rank r, in unit order.
  std::vector<FlatRange> ranges(int rank) const;
  // Blocks of unit u (its norm partial sums) and of all units.
  int64_t blocks(size_t unit) const { return (units_[unit].flat.size() + kBlock - 1) / kBlock; }
  int64_t total_blocks() const { return total_blocks_; }
  // Index of unit u's first block among all units' blocks.
  int64_t first_block(size_t unit) const { return first_block_[unit]; }

  // Calls fn(tensor, offset in the tensor, offset in [lo, hi), count) for each piece of the flat
  // range [lo, hi) that lies in one storage tensor.
  template <class Fn>
  void for_each_piece(int64_t lo, int64_t hi, Fn&& fn) const;

  // One line per unit: its name, flat range and every rank's piece, for logs and tests.
  std::string describe() const;

 private:
  int world_ = 1;
  std::vector<int64_t> starts_;
  std::vector<size_t> unit_of_;
  std::vector<ShardUnit> units_;
  std::vector<int64_t> first_block_;
  int64_t local_size_ = 0, total_blocks_ = 0;
};

template <class Fn>
void ShardLayout::for_each_piece(int64_t lo, int64_t hi, Fn&& fn) const {
  hi = std::min(hi, total());
  if (lo >= hi) return;
  size_t t = 0;
  {
    size_t a = 0, b = starts_.size() - 1;  // the last start <= lo
    while (b - a > 1) {
      const size_t mid = (a + b) / 2;
      (starts_[mid] <= lo ? a : b) = mid;
    }
    t = a;
  }
  for (int64_t at = lo; at < hi; ++t) {
    if (starts_[t + 1] <= at) continue;  // empty tensors
    const int64_t len = std::min(hi, starts_[t + 1]) - at;
    fn(t, at - starts_[t], at - lo, len);
    at += len;
  }
}

}  // namespace tandem::model
