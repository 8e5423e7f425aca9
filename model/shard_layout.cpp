// ShardLayout: the units of the flat parameters and every rank's pieces of them.
#include "model/shard_layout.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tandem::model {
namespace {

// "model.layers.12.mlp.down_proj.weight" -> "model.layers.12"; the embedding's and the head's
// units otherwise.
std::string unit_name(const std::string& tensor) {
  static const std::string layers = "model.layers.";
  if (tensor.rfind(layers, 0) == 0) {
    const size_t dot = tensor.find('.', layers.size());
    return tensor.substr(0, dot);
  }
  if (tensor == "model.embed_tokens.weight") return "model.embed_tokens";
  return "head";
}

std::vector<std::string> storage_names(const Weights& w) {
  std::vector<std::string> names;
  for (const NamedTensor& s : w.storage()) names.push_back(s.name);
  return names;
}

std::vector<int64_t> storage_numels(const Weights& w) {
  std::vector<int64_t> numels;
  for (size_t i = 0; i < w.storage().size(); ++i) numels.push_back(w.storage_shape(i).numel());
  return numels;
}

}  // namespace

ShardLayout::ShardLayout(const Weights& weights, int world)
    : ShardLayout(storage_names(weights), storage_numels(weights), world) {}

ShardLayout::ShardLayout(std::span<const std::string> names, std::span<const int64_t> numels,
                         int world)
    : world_(world) {
  TANDEM_CHECK(world >= 1, "shard layout: {} ranks", world);
  TANDEM_CHECK(names.size() == numels.size() && !names.empty(),
               "shard layout: {} names for {} tensors", names.size(), numels.size());
  starts_ = {0};
  for (size_t t = 0; t < names.size(); ++t) {
    const std::string unit = unit_name(names[t]);
    if (units_.empty() || units_.back().name != unit) {
      for (const ShardUnit& u : units_)
        TANDEM_CHECK(u.name != unit,
                     "shard layout: tensor {} belongs to unit {}, which an earlier unit "
                     "interrupted (storage order must keep a unit's tensors together)",
                     names[t], unit);
      ShardUnit u;
      u.name = unit;
      u.flat = {starts_.back(), starts_.back()};
      u.first_tensor = u.end_tensor = t;
      units_.push_back(u);
    }
    starts_.push_back(starts_.back() + numels[t]);
    units_.back().flat.end = starts_.back();
    units_.back().end_tensor = t + 1;
    unit_of_.push_back(units_.size() - 1);
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    ShardUnit& unit = units_[u];
    unit.shard = (blocks(u) + world - 1) / world * kBlock;
    unit.local = local_size_;
    local_size_ += unit.shard;
    first_block_.push_back(total_blocks_);
    total_blocks_ += blocks(u);
  }
}

FlatRange ShardLayout::range(size_t unit, int rank) const {
  const ShardUnit& u = units_[unit];
  const int64_t lo = std::min(u.flat.end, u.flat.begin + rank * u.shard);
  return {lo, std::min(u.flat.end, lo + u.shard)};
}

std::vector<FlatRange> ShardLayout::ranges(int rank) const {
  std::vector<FlatRange> out;
  for (size_t u = 0; u < units_.size(); ++u) {
    const FlatRange r = range(u, rank);
    if (r.size() > 0) out.push_back(r);
  }
  return out;
}

std::string ShardLayout::describe() const {
  std::string s;
  for (size_t u = 0; u < units_.size(); ++u) {
    const ShardUnit& unit = units_[u];
    s += fmt::format("{} [{}, {}) S={}:", unit.name, unit.flat.begin, unit.flat.end, unit.shard);
    for (int r = 0; r < world_; ++r) {
      const FlatRange p = range(u, r);
      s += fmt::format(" r{}[{}, {})", r, p.begin, p.end);
    }
    s += "\n";
  }
  return s;
}

}  // namespace tandem::model
