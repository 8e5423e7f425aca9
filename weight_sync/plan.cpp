// ReshardPlan: the walk over each destination run, choosing a source rank per stretch of elements
// that the same ranks hold (balancing each set of holders' load), and merging contiguous pieces.
#include "weight_sync/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "core/error.h"

namespace tandem::weight_sync {
namespace {

bool castable(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// FNV-1a over 64-bit words.
void mix(uint64_t& h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
}

void mix(uint64_t& h, const std::string& s) {
  for (char c : s) mix(h, static_cast<uint64_t>(static_cast<unsigned char>(c)));
}

// Where element x stands in one rank's runs: the run holding it (or none), and where the set of
// holders may change next (the end of that run, or the start of the next one).
struct Lookup {
  const Run* run = nullptr;
  int64_t next = std::numeric_limits<int64_t>::max();
};

Lookup lookup(const std::vector<Run>& runs, int64_t x) {
  auto it = std::upper_bound(runs.begin(), runs.end(), x,
                             [](int64_t v, const Run& r) { return v < r.global; });
  Lookup l;
  if (it != runs.end()) l.next = it->global;
  if (it != runs.begin()) {
    const Run& r = *(it - 1);
    if (x < r.global + r.length) {
      l.run = &r;
      l.next = r.global + r.length;
    }
  }
  return l;
}

}  // namespace

ReshardPlan ReshardPlan::make(const Layout& src, const Layout& dst) {
  TANDEM_CHECK(src.world() == dst.world(),
               "weight_sync: layout '{}' spans {} ranks and '{}' {}: place both in one world "
               "(Layout::placed)",
               src.name(), src.world(), dst.name(), dst.world());
  TANDEM_CHECK(src.params().size() == dst.params().size(),
               "weight_sync: layout '{}' has {} parameters and '{}' {}", src.name(),
               src.params().size(), dst.name(), dst.params().size());
  const int W = src.world();
  ReshardPlan plan(src, dst);
  plan.pieces_.resize(src.params().size());
  plan.elements_.assign(static_cast<size_t>(W * W), 0);
  plan.bytes_.assign(static_cast<size_t>(W * W), 0);
  uint64_t h = 0xcbf29ce484222325ull;
  mix(h, static_cast<uint64_t>(W));

  std::vector<Lookup> at(static_cast<size_t>(W));
  std::vector<int> holders;
  // Elements each member of a set of holders has sent for that set, over all parameters.
  std::map<std::vector<int>, std::vector<int64_t>> sent;
  for (size_t p = 0; p < src.params().size(); ++p) {
    const ParamSpec& s = src.params()[p];
    const ParamSpec& d = dst.params()[p];
    TANDEM_CHECK(s.name == d.name,
                 "weight_sync: parameter {} is '{}' in layout '{}' and '{}' in '{}'", p, s.name,
                 src.name(), d.name, dst.name());
    TANDEM_CHECK(s.shape == d.shape, "weight_sync: {} is {} in layout '{}' and {} in '{}'", s.name,
                 s.shape, src.name(), d.shape, dst.name());
    TANDEM_CHECK(s.dtype == d.dtype || (castable(s.dtype) && castable(d.dtype)),
                 "weight_sync: {} is {} in layout '{}' and {} in '{}': only f32, bf16 and f16 cast",
                 s.name, dtype_name(s.dtype), src.name(), dtype_name(d.dtype), dst.name());
    mix(h, s.name);
    mix(h, static_cast<uint64_t>(s.dtype) << 8 | static_cast<uint64_t>(d.dtype));
    std::vector<Piece>& out = plan.pieces_[p];
    for (int r = 0; r < W; ++r) {
      for (const Run& run : dst.shard(p, r).runs) {
        for (int64_t x = run.global; x < run.global + run.length;) {
          int64_t end = run.global + run.length;
          holders.clear();
          for (int q = 0; q < W; ++q) {
            at[static_cast<size_t>(q)] = lookup(src.shard(p, q).runs, x);
            end = std::min(end, at[static_cast<size_t>(q)].next);
            if (at[static_cast<size_t>(q)].run != nullptr) holders.push_back(q);
          }
          TANDEM_CHECK(!holders.empty(),
                       "weight_sync: rank {} of layout '{}' needs elements [{}, {}) of {} (shape "
                       "{}), which no rank of layout '{}' holds: the source layout must cover "
                       "every parameter",
                       r, dst.name(), x, end, s.name, s.shape, src.name());
          int from = r;
          if (std::find(holders.begin(), holders.end(), r) == holders.end()) {
            std::vector<int64_t>& load = sent.try_emplace(holders, holders.size(), 0).first->second;
            size_t pick = static_cast<size_t>(r) % holders.size();
            for (size_t k = 1; k < holders.size(); ++k) {
              const size_t i = (static_cast<size_t>(r) + k) % holders.size();
              if (load[i] < load[pick]) pick = i;
            }
            load[pick] += end - x;
            from = holders[pick];
          }
          const Run& sr = *at[static_cast<size_t>(from)].run;
          const Piece piece{from, r, sr.local + (x - sr.global), run.local + (x - run.global),
                            end - x};
          out.push_back(piece);
          const auto pair = static_cast<size_t>(from * W + r);
          plan.elements_[pair] += piece.length;
          plan.bytes_[pair] += piece.length * static_cast<int64_t>(dtype_size(d.dtype));
          x = end;
        }
      }
    }
    // By destination offset within a rank (a shard's runs may lie out of local order), then merged.
    std::stable_sort(out.begin(), out.end(), [](const Piece& a, const Piece& b) {
      return a.dst_rank != b.dst_rank ? a.dst_rank < b.dst_rank : a.dst_offset < b.dst_offset;
    });
    size_t kept = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      Piece* last = kept > 0 ? &out[kept - 1] : nullptr;
      if (last != nullptr && last->src_rank == out[i].src_rank &&
          last->dst_rank == out[i].dst_rank &&
          last->src_offset + last->length == out[i].src_offset &&
          last->dst_offset + last->length == out[i].dst_offset)
        last->length += out[i].length;
      else
        out[kept++] = out[i];
    }
    out.resize(kept);
    for (const Piece& pc : out) {
      mix(h, static_cast<uint64_t>(pc.src_rank) << 32 | static_cast<uint64_t>(pc.dst_rank));
      mix(h, static_cast<uint64_t>(pc.src_offset));
      mix(h, static_cast<uint64_t>(pc.dst_offset));
      mix(h, static_cast<uint64_t>(pc.length));
    }
  }
  plan.digest_ = h;
  return plan;
}

int64_t ReshardPlan::elements(int from, int to) const {
  return elements_[static_cast<size_t>(from * world() + to)];
}

int64_t ReshardPlan::bytes(int from, int to) const {
  return bytes_[static_cast<size_t>(from * world() + to)];
}

std::string ReshardPlan::describe() const {
  std::string out =
      fmt::format("plan {} -> {} ({} ranks, digest {:016x})\nbytes from \\ to:", src_.name(),
                  dst_.name(), world(), digest_);
  for (int to = 0; to < world(); ++to) out += fmt::format(" {:>12}", to);
  for (int from = 0; from < world(); ++from) {
    out += fmt::format("\n{:>13}", from);
    for (int to = 0; to < world(); ++to) out += fmt::format(" {:>12}", bytes(from, to));
  }
  out += "\n";
  for (size_t p = 0; p < pieces_.size(); ++p)
    out += fmt::format("{}: {} pieces\n", src_.params()[p].name, pieces_[p].size());
  return out;
}

}  // namespace tandem::weight_sync
