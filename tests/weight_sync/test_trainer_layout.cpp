// The layout of a trainer laid out as data × tensor × pipeline parallel ranks (Layout::grid), and
// plans from it to replicated and tensor-parallel engines: coverage, delivery executed on host
// buffers of global element indices, each replica's share of the sending, and a publish across
// ranks as threads.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "model/shard_layout.h"
#include "model/weights.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "tests/weight_sync/sync_util.h"
#include "trainer/parallel/grid.h"
#include "weight_sync/layout.h"
#include "weight_sync/plan.h"
#include "weight_sync/transfer.h"

using namespace tandem;
using namespace tandem::test;
using weight_sync::LayerRange;
using weight_sync::Layout;
using weight_sync::ParamSpec;
using weight_sync::Piece;
using weight_sync::ReshardPlan;
using weight_sync::Run;
using weight_sync::Shard;

namespace {

// H = 6, D = 4, C = 24, F = 48, V = 96, 6 layers: tp 1, 2 and 3 and pp 1, 2 and 3 all fit.
// kv_heads = 1: the key/value head replicated on every tensor-parallel rank.
model::ModelConfig grid_config(int64_t kv_heads, bool untied) {
  model::ModelConfig c = sync_model_config(untied);
  c.num_heads = 6;
  c.num_kv_heads = kv_heads;
  c.head_dim = 4;
  c.hidden_size = 24;
  c.intermediate_size = 48;
  c.vocab_size = 96;
  c.num_layers = 6;
  return c;
}

// The trainer's own stage rule (trainer/parallel/grid.h).
std::vector<LayerRange> stages_of(int layers, int pp) {
  std::vector<LayerRange> stages;
  for (int s = 0; s < pp; ++s) {
    const trainer::StageLayers r = trainer::stage_layers(layers, s, pp);
    stages.push_back({r.first, r.end});
  }
  return stages;
}

// Position (stage, tensor-parallel rank) of `rank`'s ZeRO split over dp ranks: of the tensors the
// grid layout gives that rank, in parameter order.
model::ShardLayout position_shards(const Layout& grid, int rank, int dp) {
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  for (size_t p = 0; p < grid.params().size(); ++p)
    if (grid.shard(p, rank).held() > 0) {
      names.push_back(grid.params()[p].name);
      numels.push_back(grid.shard(p, rank).shape.numel());
    }
  return model::ShardLayout(names, numels, dp);
}

// Every position's shard layout, [stage tp + tp rank].
std::vector<model::ShardLayout> grid_shards(const Layout& grid, int tp, int pp, int dp) {
  std::vector<model::ShardLayout> shards;
  for (int s = 0; s < pp; ++s)
    for (int t = 0; t < tp; ++t) shards.push_back(position_shards(grid, s * dp * tp + t, dp));
  return shards;
}

bool same_runs(const std::vector<Run>& a, const std::vector<Run>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const Run& x, const Run& y) {
    return x.global == y.global && x.length == y.length && x.local == y.local;
  });
}

// [param][element]: the ranks holding it, one bit each.
std::vector<std::vector<uint64_t>> holders_of(const Layout& l) {
  REQUIRE(l.world() <= 64);
  std::vector<std::vector<uint64_t>> h;
  for (size_t p = 0; p < l.params().size(); ++p) {
    h.emplace_back(static_cast<size_t>(l.params()[p].shape.numel()), 0);
    for (int r = 0; r < l.world(); ++r)
      for (const Run& run : l.shard(p, r).runs)
        for (int64_t i = 0; i < run.length; ++i)
          h.back()[static_cast<size_t>(run.global + i)] |= uint64_t{1} << r;
  }
  return h;
}

// Executes the plan on buffers holding each source element's global index (-1 where a rank holds
// none) and checks that every destination element arrives exactly once with its own index (so
// from a rank that holds it) and nothing else is written. Returns the elements each rank sent to
// other ranks.
std::vector<int64_t> check_delivery(const Layout& src, const Layout& dst, const ReshardPlan& plan) {
  const int W = src.world();
  std::vector<int64_t> sent(static_cast<size_t>(W), 0);
  for (size_t p = 0; p < src.params().size(); ++p) {
    std::vector<std::vector<int64_t>> from(static_cast<size_t>(W)), to(static_cast<size_t>(W));
    std::vector<std::vector<int>> writes(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) {
      const auto i = static_cast<size_t>(r);
      from[i].assign(static_cast<size_t>(src.shard(p, r).shape.numel()), -1);
      for (const Run& run : src.shard(p, r).runs)
        for (int64_t k = 0; k < run.length; ++k)
          from[i][static_cast<size_t>(run.local + k)] = run.global + k;
      to[i].assign(static_cast<size_t>(dst.shard(p, r).shape.numel()), -1);
      writes[i].assign(to[i].size(), 0);
    }
    int64_t bad = 0;
    for (const Piece& pc : plan.pieces(p)) {
      const auto s = static_cast<size_t>(pc.src_rank), d = static_cast<size_t>(pc.dst_rank);
      if (pc.src_offset < 0 || pc.dst_offset < 0 ||
          pc.src_offset + pc.length > static_cast<int64_t>(from[s].size()) ||
          pc.dst_offset + pc.length > static_cast<int64_t>(to[d].size())) {
        ++bad;
        continue;
      }
      for (int64_t k = 0; k < pc.length; ++k) {
        to[d][static_cast<size_t>(pc.dst_offset + k)] =
            from[s][static_cast<size_t>(pc.src_offset + k)];
        ++writes[d][static_cast<size_t>(pc.dst_offset + k)];
      }
      if (s != d) sent[s] += pc.length;
    }
    for (int r = 0; r < W; ++r) {
      const auto i = static_cast<size_t>(r);
      int64_t written = 0;
      for (const int w : writes[i]) written += w;
      for (const Run& run : dst.shard(p, r).runs)
        for (int64_t k = 0; k < run.length; ++k) {
          const auto at = static_cast<size_t>(run.local + k);
          bad += to[i][at] != run.global + k || writes[i][at] != 1;
        }
      bad += written != dst.shard(p, r).held();
    }
    INFO(src.params()[p].name << ": " << src.name() << " -> " << dst.name());
    CHECK(bad == 0);
  }
  return sent;
}

// The planner's bound: of the elements that destination ranks lack and the ranks of a set S
// hold (N_S), no member of S sends more than N_S / |S| plus one stretch (at most the longest
// piece between ranks); a rank's bound is the sum over the sets it is in.
void check_spread(const Layout& src, const Layout& dst, const ReshardPlan& plan,
                  const std::vector<int64_t>& sent) {
  const std::vector<std::vector<uint64_t>> holders = holders_of(src);
  std::map<uint64_t, int64_t> needed;
  int64_t longest = 0;
  for (size_t p = 0; p < src.params().size(); ++p) {
    for (int r = 0; r < dst.world(); ++r)
      for (const Run& run : dst.shard(p, r).runs)
        for (int64_t k = 0; k < run.length; ++k)
          if (const uint64_t set = holders[p][static_cast<size_t>(run.global + k)];
              (set >> r & 1) == 0)
            ++needed[set];
    for (const Piece& pc : plan.pieces(p))
      if (pc.src_rank != pc.dst_rank) longest = std::max(longest, pc.length);
  }
  for (int q = 0; q < src.world(); ++q) {
    double bound = 0;
    for (const auto& [set, n] : needed)
      if (set >> q & 1) bound += static_cast<double>(n) / std::popcount(set) + longest;
    INFO(src.name() << " -> " << dst.name() << ": rank " << q << " sends "
                    << sent[static_cast<size_t>(q)] << ", bound " << bound);
    CHECK(static_cast<double>(sent[static_cast<size_t>(q)]) <= bound);
  }
}

}  // namespace

TEST_CASE(
    "grid layout gives each rank its stage's tensor parallel shards and every replica every "
    "element",
    "[unit]") {
  for (const int64_t kv : {6, 1})
    for (const bool untied : {false, true}) {
      const model::ModelConfig c = grid_config(kv, untied);
      model::Weights w(c, DType::f32);
      const std::vector<ParamSpec> specs = param_specs(w);
      for (const int tp : {1, 2, 3})
        for (const int pp : {1, 2, 3})
          for (const int dp : {1, 2}) {
            INFO("kv " << kv << " untied " << untied << " tp " << tp << " pp " << pp << " dp "
                       << dp);
            const std::vector<LayerRange> stages = stages_of(6, pp);
            const Layout l = Layout::grid(tp_dims(c), specs, tp, dp, stages);
            const Layout tensor = Layout::tensor_parallel(tp_dims(c), specs, tp, 1);
            const trainer::ParallelGrid grid(tp * pp * dp, tp, pp);
            REQUIRE(l.world() == grid.world());
            for (size_t p = 0; p < specs.size(); ++p) {
              const std::string& name = specs[p].name;
              // The stages holding p, by its name alone.
              std::vector<int> want;
              for (int s = 0; s < pp; ++s) {
                const trainer::StageLayers r = trainer::stage_layers(6, s, pp);
                bool holds = s == pp - 1 && name.rfind("model.layers.", 0) != 0;
                if (name == "model.embed_tokens.weight") holds = s == 0 || (s == pp - 1 && !untied);
                for (int layer = r.first; layer < r.end; ++layer)
                  holds = holds || name.rfind(model::hf_layer_prefix(layer), 0) == 0;
                if (holds) want.push_back(s);
              }
              for (int r = 0; r < l.world(); ++r) {
                const trainer::GridCoord at = grid.coord(r);
                const bool holds = std::find(want.begin(), want.end(), at.pp) != want.end();
                const Shard& s = l.shard(p, r);
                const Shard& t = tensor.shard(p, at.tp);
                CHECK(s.shape == (holds ? t.shape : Shape{0}));
                CHECK(same_runs(s.runs, holds ? t.runs : std::vector<Run>{}));
              }
              // Every replica and stage holding p holds each element on as many ranks as the
              // split replicates it: tp for norms, tp / Hkv for key/value rows when Hkv < tp,
              // else once.
              const int64_t n = specs[p].shape.numel(), cols = n / specs[p].shape[0];
              const bool norm = name.find("norm") != std::string::npos;
              const bool qkv = name.find("qkv_proj") != std::string::npos;
              for (int d = 0; d < dp; ++d)
                for (const int s : want) {
                  std::vector<int> count(static_cast<size_t>(n), 0);
                  for (int t = 0; t < tp; ++t)
                    for (const Run& run : l.shard(p, grid.rank({d, t, s})).runs)
                      for (int64_t k = 0; k < run.length; ++k)
                        ++count[static_cast<size_t>(run.global + k)];
                  int64_t bad = 0;
                  for (int64_t e = 0; e < n; ++e) {
                    const bool kv_row = qkv && e / cols >= c.num_heads * c.head_dim;
                    const int64_t times = norm                            ? tp
                                          : kv_row && c.num_kv_heads < tp ? tp / c.num_kv_heads
                                                                          : 1;
                    bad += count[static_cast<size_t>(e)] != times;
                  }
                  INFO(name << " replica " << d << " stage " << s);
                  CHECK(bad == 0);
                }
            }
          }
    }
}

TEST_CASE(
    "grid layout refuses stages that do not cut the model's layers and a tp the model refuses",
    "[unit]") {
  const model::ModelConfig c = grid_config(6, false);
  model::Weights w(c, DType::f32);
  const std::vector<ParamSpec> specs = param_specs(w);
  const std::vector<LayerRange> gap = {{0, 2}, {3, 6}}, empty = {{0, 0}, {0, 6}},
                                short_ = {{0, 2}, {2, 5}};
  CHECK_THROWS_WITH(Layout::grid(tp_dims(c), specs, 1, 1, gap),
                    Catch::Contains("pipeline stage 1 of 2 holds layers [3, 6)"));
  CHECK_THROWS_WITH(Layout::grid(tp_dims(c), specs, 1, 1, empty),
                    Catch::Contains("pipeline stage 0 of 2 holds layers [0, 0)"));
  CHECK_THROWS_WITH(Layout::grid(tp_dims(c), specs, 1, 1, short_),
                    Catch::Contains("stages hold layers [0, 5), the parameters name 6 layers"));
  CHECK_THROWS_WITH(Layout::grid(tp_dims(c), specs, 4, 1, stages_of(6, 2)),
                    Catch::Contains("tp = 4 does not divide the 6 query heads"));
  CHECK_THROWS_WITH(Layout::grid(tp_dims(c), specs, 1, 0, stages_of(6, 2)),
                    Catch::Contains("dp = 0"));
}

TEST_CASE(
    "grid layout with parameters sharded gives each data parallel rank its shard layout's blocks "
    "of its position's tensor parallel shards",
    "[unit]") {
  for (const bool untied : {false, true}) {
    const model::ModelConfig c = grid_config(6, untied);
    model::Weights w(c, DType::f32);
    const std::vector<ParamSpec> specs = param_specs(w);
    for (const int tp : {1, 2, 3})
      for (const int pp : {1, 2, 3})
        for (const int dp : {1, 2, 3}) {
          INFO("untied " << untied << " tp " << tp << " pp " << pp << " dp " << dp);
          const std::vector<LayerRange> stages = stages_of(6, pp);
          const Layout whole = Layout::grid(tp_dims(c), specs, tp, dp, stages);
          const std::vector<model::ShardLayout> shards = grid_shards(whole, tp, pp, dp);
          const Layout l = Layout::grid_zero(tp_dims(c), specs, tp, stages, shards);
          REQUIRE(l.world() == whole.world());
          for (int s = 0; s < pp; ++s)
            for (int t = 0; t < tp; ++t) {
              const model::ShardLayout& sl = shards[static_cast<size_t>(s * tp + t)];
              const int first = s * dp * tp + t;
              // The position's flat shard as (parameter, element) pairs, read from its tensors.
              std::vector<std::pair<size_t, int64_t>> flat;
              for (size_t p = 0; p < specs.size(); ++p) {
                const Shard& sh = whole.shard(p, first);
                std::vector<int64_t> g(static_cast<size_t>(sh.shape.numel()), -1);
                for (const Run& r : sh.runs)
                  for (int64_t k = 0; k < r.length; ++k)
                    g[static_cast<size_t>(r.local + k)] = r.global + k;
                for (const int64_t e : g) flat.emplace_back(p, e);
              }
              REQUIRE(static_cast<int64_t>(flat.size()) == sl.total());
              std::map<std::pair<size_t, int64_t>, int> count;
              int64_t bad = 0;
              for (int d = 0; d < dp; ++d) {
                const int rank = (s * dp + d) * tp + t;
                std::vector<std::pair<size_t, int64_t>> buffer(static_cast<size_t>(sl.local_size()),
                                                               {specs.size(), -1});
                for (size_t u = 0; u < sl.units().size(); ++u) {
                  const model::FlatRange r = sl.range(u, d);
                  std::copy(flat.begin() + r.begin, flat.begin() + r.end,
                            buffer.begin() + sl.units()[u].local);
                }
                for (size_t p = 0; p < specs.size(); ++p) {
                  const Shard& sh = l.shard(p, rank);
                  bad += sh.shape != Shape{sh.runs.empty() ? 0 : sl.local_size()};
                  for (const Run& r : sh.runs)
                    for (int64_t k = 0; k < r.length; ++k) {
                      bad += buffer[static_cast<size_t>(r.local + k)] !=
                             std::pair<size_t, int64_t>{p, r.global + k};
                      ++count[{p, r.global + k}];
                    }
                }
              }
              // Every element of the position's shards on exactly one of its dp ranks.
              for (const auto& e : flat) bad += count[e] != 1;
              bad += count.size() != flat.size();
              INFO("stage " << s << " tp rank " << t);
              CHECK(bad == 0);
            }
        }
  }
  const model::ModelConfig c = grid_config(6, false);
  model::Weights w(c, DType::f32);
  const std::vector<ParamSpec> specs = param_specs(w);
  const Layout whole = Layout::grid(tp_dims(c), specs, 2, 2, stages_of(6, 2));
  std::vector<model::ShardLayout> shards = grid_shards(whole, 2, 2, 2);
  CHECK_THROWS_WITH(
      Layout::grid_zero(tp_dims(c), specs, 2, stages_of(6, 2), std::span(shards).first(3)),
      Catch::Contains("has 4 positions, given 3 shard layouts"));
  std::swap(shards[0], shards[2]);  // stage 1's tensors given for stage 0
  CHECK_THROWS_WITH(Layout::grid_zero(tp_dims(c), specs, 2, stages_of(6, 2), shards),
                    Catch::Contains("the shard layout of stage 0 tensor-parallel rank 0"));
}

TEST_CASE(
    "plans from a grid trainer deliver every engine element once and spread the sending over "
    "the data parallel replicas",
    "[unit]") {
  for (const int64_t kv : {6, 1})
    for (const bool untied : {false, true}) {
      const model::ModelConfig c = grid_config(kv, untied);
      model::Weights w(c, DType::f32);
      const std::vector<ParamSpec> specs = param_specs(w);
      for (const int tp : {1, 2, 3})
        for (const int pp : {1, 2, 3})
          for (const int dp : {1, 2}) {
            INFO("kv " << kv << " untied " << untied << " tp " << tp << " pp " << pp << " dp "
                       << dp);
            const Layout whole = Layout::grid(tp_dims(c), specs, tp, dp, stages_of(6, pp));
            const Layout sharded = Layout::grid_zero(tp_dims(c), specs, tp, stages_of(6, pp),
                                                     grid_shards(whole, tp, pp, dp));
            const int W = whole.world();
            // Engines after the trainer's ranks (disaggregated) and over them (colocated).
            std::vector<Layout> engines = {Layout::replicated(specs, 2).placed(W, W + 2)};
            for (const int t : {1, 2, 3}) {
              const Layout e = Layout::tensor_parallel(tp_dims(c), specs, t, 1);
              engines.push_back(e.with_dtype(DType::bf16).placed(W, W + t));
              if (W % t == 0)
                engines.push_back(Layout::tensor_parallel(tp_dims(c), specs, t, W / t));
            }
            for (const Layout* trainer : {&whole, &sharded}) {
              for (const Layout& dst : engines) {
                const Layout src = trainer->placed(0, dst.world());
                const ReshardPlan plan = ReshardPlan::make(src, dst);
                check_spread(src, dst, plan, check_delivery(src, dst, plan));
              }
              // The trainer's own layout: every piece in place, nothing between ranks.
              const ReshardPlan same = ReshardPlan::make(*trainer, *trainer);
              check_delivery(*trainer, *trainer, same);
              int64_t moved = 0;
              for (size_t p = 0; p < specs.size(); ++p)
                for (const Piece& pc : same.pieces(p))
                  moved += pc.src_rank != pc.dst_rank || pc.src_offset != pc.dst_offset;
              CHECK(moved == 0);
            }
          }
    }
}

TEST_CASE(
    "a tp 2 pp 2 dp 2 trainer publishes into tensor parallel 1 and 2 engines across ranks "
    "bitwise",
    "[unit]") {
  const model::ModelConfig c = sync_model_config(true);
  model::Weights full(c, DType::f32);
  fill_sync_weights(full, 31);
  const std::vector<ParamSpec> specs = param_specs(full);
  const Layout whole = Layout::grid(tp_dims(c), specs, 2, 2, stages_of(2, 2));
  const std::vector<model::ShardLayout> shards = grid_shards(whole, 2, 2, 2);
  const Layout sharded = Layout::grid_zero(tp_dims(c), specs, 2, stages_of(2, 2), shards);
  struct Case {
    Layout engine;
    DType dtype;
    bool sharded;
  };
  const std::vector<Case> cases = {
      {Layout::tensor_parallel(tp_dims(c), specs, 1, 1).placed(8, 9), DType::bf16, false},
      {Layout::tensor_parallel(tp_dims(c), specs, 2, 1).placed(8, 10), DType::f32, false},
      {Layout::tensor_parallel(tp_dims(c), specs, 2, 4), DType::bf16, false},
      {Layout::tensor_parallel(tp_dims(c), specs, 2, 1).placed(8, 10), DType::bf16, true}};
  for (const Case& k : cases) {
    const Layout dst = k.engine.with_dtype(k.dtype);
    const Layout src = (k.sharded ? sharded : whole).placed(0, dst.world());
    const ReshardPlan plan = ReshardPlan::make(src, dst);
    INFO(plan.describe());
    const TempDir tmp("grid-publish");
    std::mutex mu;
    on_ranks(dst.world(), tmp.file("store"), [&](int r, Communicator& comm) {
      std::vector<Tensor> from, to;
      // The rank's tensors of its position (none after the trainer's ranks).
      std::vector<float> flat;
      for (size_t p = 0; p < specs.size(); ++p) {
        const Shard& s = r < 8 ? whole.shard(p, r) : Shard{};
        const Tensor image =
            s.held() > 0 ? shard_image(s, full.storage()[p].tensor, DType::f32) : Tensor();
        from.push_back(image);
        if (image.defined())
          flat.insert(flat.end(), image.data_as<float>(), image.data_as<float>() + image.numel());
        const Shard& d = dst.shard(p, r);
        to.push_back(d.held() > 0 ? Tensor::zeros(d.shape, k.dtype) : Tensor());
      }
      // ZeRO-3: the rank's local buffer of its position's flat shard (as ShardedAdamW keeps it).
      Tensor local;
      if (k.sharded && r < 8) {
        const trainer::GridCoord at = trainer::ParallelGrid(8, 2, 2).coord(r);
        const model::ShardLayout& sl = shards[static_cast<size_t>(at.pp * 2 + at.tp)];
        local = Tensor::zeros({sl.local_size()}, DType::f32);
        for (size_t u = 0; u < sl.units().size(); ++u) {
          const model::FlatRange range = sl.range(u, at.dp);
          std::copy(flat.begin() + range.begin, flat.begin() + range.end,
                    local.data_as<float>() + sl.units()[u].local);
        }
        from = weight_sync::bind_local(src, r, local);
      }
      weight_sync::Publisher pub(plan, &comm, from, to);
      const weight_sync::SyncStats st = pub.publish(1);
      const std::lock_guard<std::mutex> lock(mu);
      INFO(src.name() << " -> " << dst.name() << " rank " << r);
      // Engines on other ranks: every trainer rank sends a part (the replicas share the sending).
      if (r < 8 && dst.held(r) == 0) CHECK(st.bytes_sent > 0);
      for (size_t p = 0; p < specs.size(); ++p)
        if (dst.shard(p, r).held() > 0) {
          INFO(specs[p].name);
          CHECK(bitwise_equal(to[p],
                              shard_image(dst.shard(p, r), full.storage()[p].tensor, k.dtype)));
        }
    });
  }
}
