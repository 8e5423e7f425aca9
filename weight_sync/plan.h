// ReshardPlan: who sends which elements to whom so that every rank's destination shards hold the
// source layout's values. A pure function of two layouts, computed once per job, printable.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "weight_sync/layout.h"

namespace tandem::weight_sync {

// `length` elements of one parameter: [src_offset, +length) of src_rank's local tensor (source
// layout) go to [dst_offset, +length) of dst_rank's local tensor (destination layout).
struct Piece {
  int src_rank = 0, dst_rank = 0;
  int64_t src_offset = 0, dst_offset = 0, length = 0;
  bool operator==(const Piece&) const = default;
};

class ReshardPlan {
 public:
  // Every element of every destination shard gets exactly one piece. Its source: the destination
  // rank itself where it holds the element (a local copy, none where the memory is the same),
  // else one of the ranks that hold it (its holders: e.g. the data-parallel replicas of a
  // trainer's shard): per set of holders, the one that has sent the fewest elements held by that
  // set so far, ties broken from index dst_rank mod holders on (ascending). So no rank of a set
  // sends more than its share of what the set provides plus one stretch (the elements of one
  // destination run that the same ranks hold): with a data-parallel trainer every replica sends
  // about 1/dp of its shard, whatever the number of destination ranks. Consecutive elements with
  // the same ranks and contiguous offsets on both sides form one piece. Throws tandem::Error
  // (before anything moves) when the layouts differ in world size, parameter names or shapes, or
  // the source does not hold an element the destination needs; dtypes may differ (f32, bf16,
  // f16: cast on the way).
  static ReshardPlan make(const Layout& src, const Layout& dst);

  const Layout& src() const { return src_; }
  const Layout& dst() const { return dst_; }
  int world() const { return src_.world(); }
  size_t size() const { return pieces_.size(); }  // parameters
  // The pieces of parameter i, by destination rank then destination offset.
  std::span<const Piece> pieces(size_t param) const { return pieces_[param]; }
  // Elements and bytes (in the destination dtype) that rank `from` sends to rank `to` (from == to:
  // copied in place).
  int64_t elements(int from, int to) const;
  int64_t bytes(int from, int to) const;
  // A hash of the layouts' names, shapes, dtypes and every piece: equal on ranks that computed
  // the same plan.
  uint64_t digest() const { return digest_; }
  // A summary: bytes between every pair of ranks and pieces per parameter.
  std::string describe() const;

 private:
  ReshardPlan(Layout src, Layout dst) : src_(std::move(src)), dst_(std::move(dst)) {}

  Layout src_, dst_;
  std::vector<std::vector<Piece>> pieces_;  // [param]
  std::vector<int64_t> elements_, bytes_;   // [from * world + to]
  uint64_t digest_ = 0;
};

}  // namespace tandem::weight_sync
