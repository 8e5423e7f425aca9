// Layouts (tensor-parallel shards against slicing the fused tensors by hand, ZeRO ranges, bad
// sizes), the reshard planner's properties over random layouts, and the one-rank publisher.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/shard_layout.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "tests/testutil.h"
#include "tests/weight_sync/sync_util.h"
#include "weight_sync/layout.h"
#include "weight_sync/plan.h"
#include "weight_sync/transfer.h"

using namespace tandem;
using namespace tandem::test;
using weight_sync::Layout;
using weight_sync::ParamSpec;
using weight_sync::Piece;
using weight_sync::ReshardPlan;
using weight_sync::Run;
using weight_sync::Shard;

namespace {

Tensor cat_rows(const std::vector<Tensor>& parts) {
  int64_t rows = 0;
  for (const Tensor& p : parts) rows += p.shape()[0];
  Shape s = parts[0].shape();
  s[0] = rows;
  Tensor out = Tensor::zeros(s, parts[0].dtype());
  int64_t at = 0;
  for (const Tensor& p : parts) {
    out.narrow(at, p.shape()[0]).copy_from(p);
    at += p.shape()[0];
  }
  return out;
}

// Columns [c0, c0 + n) of a matrix.
Tensor columns(const Tensor& m, int64_t c0, int64_t n) {
  Tensor out = Tensor::zeros({m.shape()[0], n}, m.dtype());
  for (int64_t r = 0; r < m.shape()[0]; ++r)
    out.narrow(r, 1).view({n}).copy_from(m.narrow(r, 1).view({m.shape()[1]}).narrow(c0, n));
  return out;
}

// Rank t's tensor-parallel shard of parameter `name`, sliced by hand from the model's views.
Tensor expected_tp(const model::Weights& w, const std::string& name, int tp, int t) {
  const model::ModelConfig& c = w.config();
  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, F = c.intermediate_size;
  const int64_t V = c.vocab_size;
  // Key/value heads: rank t's own share, or the one head it replicates when Hkv < tp.
  const int64_t kv_first = Hkv >= tp ? t * (Hkv / tp) : t / (tp / Hkv);
  const int64_t kv_count = Hkv >= tp ? Hkv / tp : 1;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const model::LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    const std::string p = model::hf_layer_prefix(l);
    if (name == p + "self_attn.qkv_proj.weight")
      return cat_rows({lw.q.narrow(t * (H / tp) * D, H / tp * D),
                       lw.k.narrow(kv_first * D, kv_count * D),
                       lw.v.narrow(kv_first * D, kv_count * D)});
    if (name == p + "self_attn.qkv_proj.bias")
      return cat_rows({lw.q_bias.narrow(t * (H / tp) * D, H / tp * D),
                       lw.k_bias.narrow(kv_first * D, kv_count * D),
                       lw.v_bias.narrow(kv_first * D, kv_count * D)});
    if (name == p + "mlp.gate_up_proj.weight")
      return cat_rows({lw.gate.narrow(t * F / tp, F / tp), lw.up.narrow(t * F / tp, F / tp)});
    if (name == p + "self_attn.o_proj.weight") return columns(lw.o, t * H * D / tp, H * D / tp);
    if (name == p + "mlp.down_proj.weight") return columns(lw.down, t * F / tp, F / tp);
  }
  if (name == "model.embed_tokens.weight") return w.embed.narrow(t * V / tp, V / tp);
  if (name == "lm_head.weight") return w.lm_head.narrow(t * V / tp, V / tp);
  return w.at(name);
}

// A random layout of `params` over `world` ranks: each parameter cut at random points, each
// stretch held by a random set of ranks (empty sets allowed where `cover` is false), each rank's
// stretches at a random order in its local tensor with gaps between them.
Layout random_layout(std::vector<ParamSpec> params, int world, bool cover, std::mt19937_64& rng) {
  Layout l("random", world, params);
  for (size_t p = 0; p < params.size(); ++p) {
    const int64_t n = params[p].shape.numel();
    std::vector<int64_t> cuts = {0, n};
    const int extra = std::uniform_int_distribution<int>(0, 6)(rng);
    for (int i = 0; i < extra; ++i)
      cuts.push_back(std::uniform_int_distribution<int64_t>(0, n)(rng));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<std::vector<Run>> runs(static_cast<size_t>(world));
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      std::vector<int> holders;
      for (int r = 0; r < world; ++r)
        if (rng() % 2) holders.push_back(r);
      if (holders.empty() && cover) holders.push_back(static_cast<int>(rng() % world));
      for (int r : holders)
        runs[static_cast<size_t>(r)].push_back({cuts[i], cuts[i + 1] - cuts[i], 0});
    }
    for (int r = 0; r < world; ++r) {
      std::vector<Run>& rr = runs[static_cast<size_t>(r)];
      std::vector<size_t> order(rr.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      int64_t local = 0;
      for (size_t i : order) {
        local += static_cast<int64_t>(rng() % 3);  // a gap the rank does not fill
        rr[i].local = local;
        local += rr[i].length;
      }
      l.set_shard(p, r, Shard{Shape{local}, rr});
    }
  }
  return l;
}

// The ZeRO split of `params` (their names and sizes) over `world` ranks.
model::ShardLayout shards_of(const std::vector<ParamSpec>& params, int world) {
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  for (const ParamSpec& p : params) {
    names.push_back(p.name);
    numels.push_back(p.shape.numel());
  }
  return model::ShardLayout(names, numels, world);
}

// local element -> global element of a shard (-1 where it holds none).
std::vector<int64_t> global_of(const Shard& s) {
  std::vector<int64_t> g(static_cast<size_t>(s.shape.numel()), -1);
  for (const Run& r : s.runs)
    for (int64_t i = 0; i < r.length; ++i) g[static_cast<size_t>(r.local + i)] = r.global + i;
  return g;
}

void check_plan(const Layout& src, const Layout& dst, const ReshardPlan& plan) {
  const int W = src.world();
  std::vector<int64_t> pair_elements(static_cast<size_t>(W * W), 0);
  for (size_t p = 0; p < src.params().size(); ++p) {
    std::vector<std::vector<int64_t>> src_g, dst_g;
    for (int r = 0; r < W; ++r) {
      src_g.push_back(global_of(src.shard(p, r)));
      dst_g.push_back(global_of(dst.shard(p, r)));
    }
    std::vector<std::vector<int>> written(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r)
      written[static_cast<size_t>(r)].assign(dst_g[static_cast<size_t>(r)].size(), 0);
    const Piece* prev = nullptr;
    for (const Piece& pc : plan.pieces(p)) {
      REQUIRE(pc.length > 0);
      const auto& sg = src_g[static_cast<size_t>(pc.src_rank)];
      const auto& dg = dst_g[static_cast<size_t>(pc.dst_rank)];
      REQUIRE(pc.src_offset >= 0);
      REQUIRE(pc.src_offset + pc.length <= static_cast<int64_t>(sg.size()));
      REQUIRE(pc.dst_offset + pc.length <= static_cast<int64_t>(dg.size()));
      for (int64_t i = 0; i < pc.length; ++i) {
        const int64_t g = dg[static_cast<size_t>(pc.dst_offset + i)];
        REQUIRE(g >= 0);
        REQUIRE(sg[static_cast<size_t>(pc.src_offset + i)] == g);
        ++written[static_cast<size_t>(pc.dst_rank)][static_cast<size_t>(pc.dst_offset + i)];
        // The local rank is preferred: a remote source only where the rank does not hold it.
        if (pc.src_rank != pc.dst_rank) {
          const auto& own = src_g[static_cast<size_t>(pc.dst_rank)];
          REQUIRE(std::find(own.begin(), own.end(), g) == own.end());
        }
      }
      pair_elements[static_cast<size_t>(pc.src_rank * W + pc.dst_rank)] += pc.length;
      // Merged: no piece continues its predecessor on both sides between the same ranks.
      if (prev != nullptr && prev->src_rank == pc.src_rank && prev->dst_rank == pc.dst_rank)
        REQUIRE_FALSE((prev->src_offset + prev->length == pc.src_offset &&
                       prev->dst_offset + prev->length == pc.dst_offset));
      if (prev != nullptr)
        REQUIRE((prev->dst_rank < pc.dst_rank ||
                 (prev->dst_rank == pc.dst_rank && prev->dst_offset < pc.dst_offset)));
      prev = &pc;
    }
    // Exactly once: every held destination element written once, no other element written.
    for (int r = 0; r < W; ++r)
      for (size_t i = 0; i < written[static_cast<size_t>(r)].size(); ++i)
        REQUIRE(written[static_cast<size_t>(r)][i] ==
                (dst_g[static_cast<size_t>(r)][i] >= 0 ? 1 : 0));
  }
  for (int a = 0; a < W; ++a)
    for (int b = 0; b < W; ++b)
      REQUIRE(plan.elements(a, b) == pair_elements[static_cast<size_t>(a * W + b)]);
}

}  // namespace

TEST_CASE("tensor parallel layout shards are the fused tensors sliced by heads rows and vocabulary",
          "[unit]") {
  for (const bool untied : {false, true}) {
    model::Weights w(sync_model_config(untied), DType::f32);
    fill_sync_weights(w, 5);
    for (const int tp : {1, 2, 4}) {  // tp = 4 > Hkv = 2: key/value heads replicated in pairs
      const Layout l =
          Layout::tensor_parallel(tp_dims(w.config()), param_specs(w), tp, /*replicas=*/2);
      REQUIRE(l.world() == 2 * tp);
      for (size_t p = 0; p < l.params().size(); ++p) {
        const std::string& name = l.params()[p].name;
        for (int r = 0; r < l.world(); ++r) {
          INFO(name << " tp " << tp << " rank " << r);
          const Tensor expected = expected_tp(w, name, tp, r % tp);
          REQUIRE(l.shard(p, r).shape == expected.shape());
          CHECK(bitwise_equal(shard_image(l.shard(p, r), w.storage()[p].tensor, DType::f32),
                              expected));
        }
      }
    }
  }
}

TEST_CASE("tensor parallel layout shards are the model's own tensor parallel shards", "[unit]") {
  // model::cut_tp_shard (model/tensor_parallel.h) is the one definition of the split; the layout
  // derives its ranges from it, for every storage tensor, fused ones included.
  for (const bool untied : {false, true}) {
    model::Weights w(sync_model_config(untied), DType::f32);
    fill_sync_weights(w, 11);
    for (const int tp : {1, 2, 4}) {
      const Layout l = Layout::tensor_parallel(tp_dims(w.config()), param_specs(w), tp, 1);
      for (int t = 0; t < tp; ++t) {
        const auto shard = model::cut_tp_shard(w, t, tp);
        REQUIRE(shard->storage().size() == l.params().size());
        for (size_t p = 0; p < l.params().size(); ++p) {
          INFO(l.params()[p].name << " tp " << tp << " rank " << t);
          REQUIRE(shard->storage()[p].name == l.params()[p].name);
          CHECK(bitwise_equal(shard_image(l.shard(p, t), w.storage()[p].tensor, DType::f32),
                              shard->storage()[p].tensor));
        }
      }
    }
  }
}

TEST_CASE(
    "zero layout gives each rank the shard layout's blocks of every unit whole or at their place "
    "in its local buffer",
    "[unit]") {
  for (const bool untied : {false, true}) {
    model::Weights w(sync_model_config(untied), DType::f32);
    const std::vector<ParamSpec> specs = param_specs(w);
    for (const int world : {1, 2, 3, 4, 7}) {
      const model::ShardLayout shards(w, world);
      for (const bool full : {true, false}) {
        INFO("world " << world << " full " << full << " untied " << untied);
        const Layout l = Layout::zero(specs, shards, full);
        int64_t held = 0;
        for (int r = 0; r < world; ++r) {
          held += l.held(r);
          // Each unit's flat elements, read back from the runs of its tensors: the rank's piece.
          for (size_t u = 0; u < shards.units().size(); ++u) {
            const model::ShardUnit& unit = shards.units()[u];
            const model::FlatRange want = shards.range(u, r);
            int64_t lo = -1, hi = -1, start = unit.flat.begin;
            for (size_t p = unit.first_tensor; p < unit.end_tensor; ++p) {
              const Shard& s = l.shard(p, r);
              REQUIRE(s.runs.size() <= 1);
              CHECK(s.shape ==
                    (full ? specs[p].shape : Shape{s.runs.empty() ? 0 : shards.local_size()}));
              for (const Run& run : s.runs) {
                if (lo < 0) lo = start + run.global;
                CHECK((hi < 0 || hi == start + run.global));
                hi = start + run.global + run.length;
                CHECK(run.local ==
                      (full ? run.global : unit.local + (start + run.global - want.begin)));
              }
              start += specs[p].shape.numel();
            }
            if (want.size() > 0) {
              CHECK(lo == want.begin);
              CHECK(hi == want.end);
            } else {
              CHECK(lo == -1);
            }
          }
        }
        CHECK(held == shards.total());  // every element on exactly one rank
      }
    }
    const std::string d = Layout::zero(specs, model::ShardLayout(w, 2), false).describe();
    INFO(d);
    CHECK(d.find("layout zero2-params (2 ranks)") != std::string::npos);
    // The embedding (6144 elements, unit 0 at the start of the buffer): 2 blocks, one a rank.
    const model::ShardLayout s2(w, 2);
    CHECK(d.find(fmt::format("  rank 1: local ({}), 1 runs [4096, 6144)@0\n", s2.local_size())) !=
          std::string::npos);
  }
  // Parameters of another model than the split's.
  model::Weights tied(sync_model_config(false), DType::f32),
      untied(sync_model_config(true), DType::f32);
  CHECK_THROWS_WITH(Layout::zero(param_specs(untied), model::ShardLayout(tied, 2)),
                    Catch::Contains("the ZeRO split has") &&
                        Catch::Contains("build both from the same model::Weights"));
}

TEST_CASE(
    "publisher on one rank fills whole bf16 engine weights from a zero3 local buffer bitwise as "
    "from the whole weights",
    "[unit]") {
  model::Weights trainer(sync_model_config(true), DType::f32);
  fill_sync_weights(trainer, 21);
  const auto specs = param_specs(trainer);
  const model::ShardLayout shards(trainer, 1);
  const Tensor local = zero3_local(shards, 0, trainer);
  const Layout zero3 = Layout::zero(specs, shards, false);
  const Layout engine = Layout::replicated(specs, 1).with_dtype(DType::bf16);
  model::Weights from_local(sync_model_config(true), DType::bf16),
      from_whole(sync_model_config(true), DType::bf16);
  from_local.zero();
  from_whole.zero();
  weight_sync::Publisher a(ReshardPlan::make(zero3, engine), nullptr,
                           weight_sync::bind_local(zero3, 0, local),
                           weight_sync::bind(engine, 0, trainer::params_of(from_local)));
  const Layout whole = Layout::replicated(specs, 1);
  weight_sync::Publisher b(ReshardPlan::make(whole, engine), nullptr,
                           weight_sync::bind(whole, 0, trainer::params_of(trainer)),
                           weight_sync::bind(engine, 0, trainer::params_of(from_whole)));
  a.publish(1);
  b.publish(1);
  CHECK(a.added_bytes() == 0);
  for (size_t p = 0; p < specs.size(); ++p) {
    INFO(specs[p].name);
    CHECK(bitwise_equal(from_local.storage()[p].tensor, from_whole.storage()[p].tensor));
  }
  CHECK_THROWS_WITH(weight_sync::bind_local(zero3, 0, Tensor::zeros({7}, DType::f32)),
                    Catch::Contains("holds model.embed_tokens.weight in a local buffer of"));
}

TEST_CASE(
    "tensor parallel layout refuses a tp that does not divide heads or vocabulary naming the "
    "parameter and sizes",
    "[unit]") {
  model::ModelConfig c = sync_model_config();
  c.num_heads = 9;
  c.num_kv_heads = 3;
  c.head_dim = 8;
  c.hidden_size = 72;
  model::Weights w(c, DType::f32);
  // SmolLM2-135M's heads: 9 query and 3 key/value heads; tp = 3 divides them, tp = 2 does not.
  CHECK_NOTHROW(Layout::tensor_parallel({9, 3, 8, 96, 96}, param_specs(w), 3, 1));
  CHECK_THROWS_WITH(Layout::tensor_parallel({9, 3, 8, 96, 96}, param_specs(w), 2, 1),
                    Catch::Contains("tp = 2 does not divide the 9 query heads of "
                                    "model.layers.0.self_attn.qkv_proj.weight"));
  model::Weights w2(sync_model_config(), DType::f32);
  CHECK_THROWS_WITH(Layout::tensor_parallel({4, 2, 16, 96, 96}, param_specs(w2), 8, 1),
                    Catch::Contains("8 does not divide the 4 query heads"));
  // Key/value heads: tp must divide them or be a multiple of them.
  CHECK_THROWS_WITH(Layout::tensor_parallel({4, 2, 16, 96, 96}, param_specs(w2), 3, 1),
                    Catch::Contains("tp = 3 does not divide"));
  model::ModelConfig odd = sync_model_config();
  odd.vocab_size = 97;
  model::Weights w3(odd, DType::f32);
  CHECK_THROWS_WITH(Layout::tensor_parallel(tp_dims(odd), param_specs(w3), 2, 1),
                    Catch::Contains("tp = 2 does not divide the 97 vocabulary rows of "
                                    "model.embed_tokens.weight"));
  // Dimensions that do not match the shapes.
  CHECK_THROWS_WITH(Layout::tensor_parallel({4, 2, 16, 48, 96}, param_specs(w2), 2, 1),
                    Catch::Contains("mlp.gate_up_proj.weight has shape (192, 64)"));
}

TEST_CASE("reshard plan covers every destination element exactly once over random layouts",
          "[unit]") {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 300; ++trial) {
    const int world = std::uniform_int_distribution<int>(1, 5)(rng);
    std::vector<ParamSpec> params;
    const int n_params = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int i = 0; i < n_params; ++i) {
      Shape s;
      const int dims = std::uniform_int_distribution<int>(1, 3)(rng);
      for (int d = 0; d < dims; ++d) s.push_back(std::uniform_int_distribution<int64_t>(1, 9)(rng));
      // Each a unit of its own (a layer): ZeRO splits units, not parameters.
      params.push_back(
          {fmt::format("model.layers.{}.p", i), s, rng() % 2 ? DType::f32 : DType::bf16});
    }
    auto pick = [&](bool cover) {
      switch (rng() % 4) {
        case 0:
          return Layout::replicated(params, world);
        case 1:
          return Layout::zero(params, shards_of(params, world), rng() % 2);
        default:
          return random_layout(params, world, cover, rng);
      }
    };
    const Layout src = pick(true);
    const Layout dst = pick(false).with_dtype(rng() % 2 ? DType::bf16 : DType::f32);
    INFO("trial " << trial << "\n" << src.describe() << dst.describe());
    const ReshardPlan plan = ReshardPlan::make(src, dst);
    check_plan(src, dst, plan);
    // Pure: the same layouts give the same plan.
    CHECK(ReshardPlan::make(src, dst).digest() == plan.digest());
  }
}

TEST_CASE(
    "reshard plan between zero and tensor parallel layouts of a model is exact and sends "
    "each rank only what it lacks",
    "[unit]") {
  model::Weights w(sync_model_config(), DType::f32);
  const auto specs = param_specs(w);
  const Layout zero4 = Layout::zero(specs, model::ShardLayout(w, 4));
  const Layout tp2x2 =
      Layout::tensor_parallel(tp_dims(w.config()), specs, 2, 2).with_dtype(DType::bf16);
  const ReshardPlan plan = ReshardPlan::make(zero4, tp2x2);
  check_plan(zero4, tp2x2, plan);
  // From the ranks' local buffers of ZeRO-3: the same traffic between the same ranks.
  const Layout zero4p = Layout::zero(specs, model::ShardLayout(w, 4), false);
  const ReshardPlan from_buffers = ReshardPlan::make(zero4p, tp2x2);
  check_plan(zero4p, tp2x2, from_buffers);
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b) CHECK(from_buffers.bytes(a, b) == plan.bytes(a, b));
  int64_t into = 0;
  for (int from = 0; from < 4; ++from) into += plan.elements(from, 0);
  CHECK(into == tp2x2.held(0));
  CHECK(plan.bytes(1, 0) == 2 * plan.elements(1, 0));
  // Replicated to tensor parallel on the same ranks: everything is already there.
  const ReshardPlan local = ReshardPlan::make(Layout::replicated(specs, 4), tp2x2);
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      if (a != b) CHECK(local.elements(a, b) == 0);
}

TEST_CASE("reshard plan refuses layouts whose names shapes or coverage disagree", "[unit]") {
  const std::vector<ParamSpec> a = {{"w", {4, 3}, DType::f32}, {"b", {3}, DType::f32}};
  std::vector<ParamSpec> renamed = a;
  renamed[1].name = "bias";
  CHECK_THROWS_WITH(ReshardPlan::make(Layout::replicated(a, 2), Layout::replicated(renamed, 2)),
                    Catch::Contains("parameter 1 is 'b'") && Catch::Contains("'bias'"));
  std::vector<ParamSpec> reshaped = a;
  reshaped[0].shape = {3, 4};
  CHECK_THROWS_WITH(ReshardPlan::make(Layout::replicated(a, 2), Layout::replicated(reshaped, 2)),
                    Catch::Contains("w is (4, 3)"));
  CHECK_THROWS_WITH(ReshardPlan::make(Layout::replicated(a, 2), Layout::replicated(a, 3)),
                    Catch::Contains("Layout::placed"));
  Layout holey("holey", 2, a);
  holey.set_shard(0, 0, Shard{{4, 3}, {{0, 5, 0}}});
  holey.set_shard(0, 1, Shard{{4, 3}, {{7, 5, 7}}});  // element 5 and 6 held by nobody
  holey.set_shard(1, 0, Shard{{3}, {{0, 3, 0}}});
  CHECK_THROWS_WITH(ReshardPlan::make(holey, Layout::replicated(a, 2)),
                    Catch::Contains("needs elements [5, 7) of w") &&
                        Catch::Contains("no rank of layout 'holey' holds"));
  CHECK_THROWS_WITH(holey.set_shard(1, 1, Shard{{3}, {{1, 2, 0}, {0, 1, 2}}}),
                    Catch::Contains("runs must ascend"));
  // Placed in a larger world, a layout's ranks hold nothing outside it.
  const Layout placed = Layout::replicated(a, 1).placed(2, 3);
  CHECK(placed.held(0) == 0);
  CHECK(placed.held(2) == 15);
}

TEST_CASE(
    "publisher on one rank moves no bytes when the engine reads the trainer's tensors and "
    "casts f32 to bf16 otherwise",
    "[unit]") {
  model::Weights trainer(sync_model_config(), DType::f32);
  fill_sync_weights(trainer, 9);
  // Values whose rounding to bf16 is delicate: NaNs (quiet, signalling, with low payload bits
  // only), infinities, -0, the largest float, ties to even both ways, a subnormal.
  const uint32_t special[] = {0x7fc00001u, 0x7f800001u, 0xffa00000u, 0x7f800000u, 0xff800000u,
                              0x80000000u, 0x7f7fffffu, 0x3f808000u, 0x3f818000u, 0x00000001u};
  std::memcpy(trainer.storage()[0].tensor.data(), special, sizeof special);
  const auto specs = param_specs(trainer);
  std::vector<weight_sync::Param> tensors;
  for (const model::NamedTensor& s : trainer.storage()) tensors.push_back({s.name, s.tensor});
  const Layout one = Layout::replicated(specs, 1);
  {
    weight_sync::Publisher pub(ReshardPlan::make(one, one), nullptr,
                               weight_sync::bind(one, 0, tensors),
                               weight_sync::bind(one, 0, tensors));
    CHECK(pub.zero_copy());
    CHECK(pub.added_bytes() == 0);
    const weight_sync::SyncStats st = pub.publish(4);
    CHECK(st.bytes_copied + st.bytes_sent + st.bytes_received == 0);
    CHECK(st.pieces_shared == static_cast<int64_t>(specs.size()));
    CHECK(pub.version() == 4);
  }
  model::Weights engine(sync_model_config(), DType::bf16);
  engine.zero();
  std::vector<weight_sync::Param> engine_tensors;
  for (const model::NamedTensor& s : engine.storage()) engine_tensors.push_back({s.name, s.tensor});
  const Layout half = one.with_dtype(DType::bf16);
  weight_sync::Publisher pub(ReshardPlan::make(one, half), nullptr,
                             weight_sync::bind(one, 0, tensors),
                             weight_sync::bind(half, 0, engine_tensors));
  CHECK_FALSE(pub.zero_copy());
  const weight_sync::SyncStats st = pub.publish(1);
  CHECK(st.bytes_copied == static_cast<int64_t>(engine.nbytes()) - [&] {
    int64_t pad = static_cast<int64_t>(engine.nbytes());
    for (const model::NamedTensor& s : engine.storage())
      pad -= static_cast<int64_t>(s.tensor.nbytes());
    return pad;
  }());
  for (size_t i = 0; i < specs.size(); ++i) {
    const Tensor expected = Tensor::zeros(trainer.storage()[i].tensor.shape(), DType::bf16);
    ops::cast(trainer.storage()[i].tensor, expected);
    CHECK(bitwise_equal(engine.storage()[i].tensor, expected));
  }
  // Binding checks name the parameter.
  std::vector<weight_sync::Param> missing(tensors.begin() + 1, tensors.end());
  CHECK_THROWS_WITH(
      weight_sync::bind(one, 0, missing),
      Catch::Contains("holds model.embed_tokens.weight in layout 'replicated' but has "
                      "no tensor of that name"));
}
