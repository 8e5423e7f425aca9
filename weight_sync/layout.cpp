// Layout builders (replicated, ZeRO ranges, tensor-parallel shards) and their checks.
#include "weight_sync/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "model/shard_layout.h"
#include "model/tensor_parallel.h"

namespace tandem::weight_sync {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

void check_rows(const ParamSpec& p, int64_t rows, const char* formula) {
  TANDEM_CHECK(p.shape.ndim() >= 1 && p.shape[0] == rows,
               "weight_sync: {} has shape {}, but the model dimensions give {} = {} rows: build "
               "the layout with the model's own dimensions",
               p.name, p.shape, formula, rows);
}

void check_cols(const ParamSpec& p, int64_t cols, const char* formula) {
  TANDEM_CHECK(p.shape.ndim() == 2 && p.shape[1] == cols,
               "weight_sync: {} has shape {}, but the model dimensions give {} = {} columns: build "
               "the layout with the model's own dimensions",
               p.name, p.shape, formula, cols);
}

// The model the dimensions describe, as far as its tensor-parallel split goes: the split itself
// (who holds which heads, MLP rows and vocabulary rows) is model::tp_split and model::tp_slice's,
// defined once there.
model::ModelConfig config_of(const TpDims& d) {
  model::ModelConfig c;
  c.num_heads = d.heads;
  c.num_kv_heads = d.kv_heads;
  c.head_dim = d.head_dim;
  c.intermediate_size = d.intermediate;
  c.vocab_size = d.vocab;
  return c;
}

// A dimension a parameter is split along.
enum class Split { query_heads, kv_heads, intermediate, vocab };

// Throws naming the parameter when model::tp_split refuses tp for dimension `split` of d (the
// other dimensions given a size every tp fits), with the model's reason and the sizes that fit.
void check_fits(const TpDims& d, Split split, const char* what, const ParamSpec& p, int tp) {
  model::ModelConfig c;
  c.num_heads = c.num_kv_heads = c.intermediate_size = c.vocab_size = tp;
  int64_t units = 0;
  switch (split) {
    case Split::query_heads:
      units = c.num_heads = d.heads;
      break;
    case Split::kv_heads:
      units = c.num_kv_heads = d.kv_heads;
      break;
    case Split::intermediate:
      units = c.intermediate_size = d.intermediate;
      break;
    case Split::vocab:
      units = c.vocab_size = d.vocab;
      break;
  }
  try {
    model::tp_split(c, 0, tp);
  } catch (const Error& e) {
    TANDEM_FAIL(
        "weight_sync: tensor parallel tp = {} does not divide the {} {} of {} (shape {}): {}", tp,
        units, what, p.name, p.shape, e.what());
  }
}

// How a parameter is cut, by its storage name: row segments, each `first_row` rows into the
// parameter and cut as the unfused HF parameter `part` is (fused q/k/v and gate/up have several),
// or columns cut as `part` is; or replicated (no parts).
struct Cut {
  struct Part {
    int64_t first_row;
    std::string_view part;  // an HF name model::tp_slice knows
  };
  std::vector<Part> parts;
  bool columns = false;
};

constexpr std::string_view kQ = "model.layers.0.self_attn.q_proj.weight";
constexpr std::string_view kK = "model.layers.0.self_attn.k_proj.weight";
constexpr std::string_view kV = "model.layers.0.self_attn.v_proj.weight";
constexpr std::string_view kO = "model.layers.0.self_attn.o_proj.weight";
constexpr std::string_view kGate = "model.layers.0.mlp.gate_proj.weight";
constexpr std::string_view kUp = "model.layers.0.mlp.up_proj.weight";
constexpr std::string_view kDown = "model.layers.0.mlp.down_proj.weight";
constexpr std::string_view kEmbed = "model.embed_tokens.weight";
constexpr std::string_view kLmHead = "lm_head.weight";

// Checks p's shape against the dimensions and tp against the dimensions p is split along (naming
// p), and says how p is cut.
Cut cut_of(const TpDims& d, const ParamSpec& p, int tp) {
  const int64_t H = d.heads, Hkv = d.kv_heads, D = d.head_dim, F = d.intermediate, V = d.vocab;
  const std::string_view n = p.name;
  if (ends_with(n, "self_attn.qkv_proj.weight") || ends_with(n, "self_attn.qkv_proj.bias")) {
    check_rows(p, (H + 2 * Hkv) * D, "(H + 2 Hkv) D");
    check_fits(d, Split::query_heads, "query heads", p, tp);
    check_fits(d, Split::kv_heads, "key/value heads", p, tp);
    return {{{0, kQ}, {H * D, kK}, {(H + Hkv) * D, kV}}};
  }
  if (ends_with(n, "self_attn.q_proj.weight") || ends_with(n, "self_attn.q_proj.bias")) {
    check_rows(p, H * D, "H D");
    check_fits(d, Split::query_heads, "query heads", p, tp);
    return {{{0, kQ}}};
  }
  for (const char* kv : {"self_attn.k_proj.weight", "self_attn.k_proj.bias",
                         "self_attn.v_proj.weight", "self_attn.v_proj.bias"})
    if (ends_with(n, kv)) {
      check_rows(p, Hkv * D, "Hkv D");
      check_fits(d, Split::kv_heads, "key/value heads", p, tp);
      return {{{0, kK}}};
    }
  if (ends_with(n, "mlp.gate_up_proj.weight")) {
    check_rows(p, 2 * F, "2 F");
    check_fits(d, Split::intermediate, "gate rows", p, tp);
    return {{{0, kGate}, {F, kUp}}};
  }
  if (ends_with(n, "mlp.gate_proj.weight") || ends_with(n, "mlp.up_proj.weight")) {
    check_rows(p, F, "F");
    check_fits(d, Split::intermediate, "rows (intermediate size)", p, tp);
    return {{{0, kGate}}};
  }
  if (ends_with(n, "embed_tokens.weight") || ends_with(n, "lm_head.weight")) {
    check_rows(p, V, "V");
    check_fits(d, Split::vocab, "vocabulary rows", p, tp);
    return {{{0, kEmbed}}};
  }
  if (ends_with(n, "self_attn.o_proj.weight")) {
    check_cols(p, H * D, "H D");
    check_fits(d, Split::query_heads, "query heads", p, tp);
    return {{{0, kO}}, true};
  }
  if (ends_with(n, "mlp.down_proj.weight")) {
    check_cols(p, F, "F");
    check_fits(d, Split::intermediate, "columns (intermediate size)", p, tp);
    return {{{0, kDown}}, true};
  }
  return {};
}

// The shard of p that `split`'s rank holds, cut as `cut` says.
Shard shard_of(const model::ModelConfig& model, const model::TpSplit& split, const ParamSpec& p,
               const Cut& cut) {
  if (cut.parts.empty()) return Shard{p.shape, {{0, p.shape.numel(), 0}}};
  Shard s;
  if (cut.columns) {
    const model::TpSlice c = model::tp_slice(model, split, cut.parts[0].part);
    const int64_t R = p.shape[0], K = p.shape[1];
    s.shape = {R, c.length};
    s.runs.reserve(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) s.runs.push_back({r * K + c.begin, c.length, r * c.length});
    return s;
  }
  const int64_t cols = p.shape.numel() / p.shape[0];
  int64_t local_rows = 0;
  for (const Cut::Part& part : cut.parts) {
    const model::TpSlice rows = model::tp_slice(model, split, part.part);
    s.runs.push_back({(part.first_row + rows.begin) * cols, rows.length * cols, local_rows * cols});
    local_rows += rows.length;
  }
  s.shape = p.shape;
  s.shape[0] = local_rows;
  return s;
}

// Every tensor-parallel rank's shard of every parameter, [t][p]: the one split that engines and
// the trainer's grid share. Every parameter is checked (naming it) before the model's split of
// any rank.
std::vector<std::vector<Shard>> tp_shards(const TpDims& dims, const std::vector<ParamSpec>& params,
                                          int tp) {
  TANDEM_CHECK(tp >= 1, "weight_sync: tensor parallel needs tp >= 1, got {}", tp);
  TANDEM_CHECK(dims.heads > 0 && dims.kv_heads > 0 && dims.head_dim > 0 && dims.intermediate > 0 &&
                   dims.vocab > 0,
               "weight_sync: tensor parallel needs the model's heads, key/value heads, head size, "
               "intermediate size and vocabulary, got {}, {}, {}, {}, {}",
               dims.heads, dims.kv_heads, dims.head_dim, dims.intermediate, dims.vocab);
  std::vector<Cut> cuts;
  for (const ParamSpec& p : params) cuts.push_back(cut_of(dims, p, tp));
  const model::ModelConfig model = config_of(dims);
  std::vector<std::vector<Shard>> shards(static_cast<size_t>(tp));
  for (int t = 0; t < tp; ++t) {
    const model::TpSplit split = model::tp_split(model, t, tp);
    for (size_t p = 0; p < params.size(); ++p)
      shards[static_cast<size_t>(t)].push_back(shard_of(model, split, params[p], cuts[p]));
  }
  return shards;
}

// The layer of "model.layers.<i>.*", or -1 for a parameter outside the layers.
int64_t layer_of(std::string_view name) {
  constexpr std::string_view kLayers = "model.layers.";
  if (name.substr(0, kLayers.size()) != kLayers) return -1;
  int64_t layer = 0;
  size_t i = kLayers.size();
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i)
    layer = layer * 10 + (name[i] - '0');
  return i > kLayers.size() && i < name.size() && name[i] == '.' ? layer : -1;
}

// The pipeline stage holding each parameter: its layer's, the first for the embedding, the last
// for the rest (the final norm, lm_head). Throws naming the stage or parameter when the stages do
// not cut the parameters' layers [0, L) into contiguous non-empty ranges.
std::vector<int> stage_of_params(const std::vector<ParamSpec>& params,
                                 std::span<const LayerRange> stages) {
  const int pp = static_cast<int>(stages.size());
  int64_t layers = 0;
  for (const ParamSpec& p : params) layers = std::max(layers, layer_of(p.name) + 1);
  for (int s = 0; s < pp; ++s) {
    const LayerRange& r = stages[static_cast<size_t>(s)];
    TANDEM_CHECK(
        r.first == (s == 0 ? 0 : stages[static_cast<size_t>(s) - 1].end) && r.end > r.first,
        "weight_sync: pipeline stage {} of {} holds layers [{}, {}): stages must hold "
        "contiguous non-empty ranges from layer 0 on (trainer::stage_layers)",
        s, pp, r.first, r.end);
  }
  TANDEM_CHECK(stages.back().end == layers,
               "weight_sync: the pipeline stages hold layers [0, {}), the parameters name {} "
               "layers: build both from the same model",
               stages.back().end, layers);
  std::vector<int> stage;
  for (const ParamSpec& p : params) {
    const int64_t layer = layer_of(p.name);
    int s = p.name == kEmbed ? 0 : pp - 1;
    if (layer >= 0)
      while (stages[static_cast<size_t>(s)].first > layer) --s;
    stage.push_back(s);
  }
  return stage;
}

}  // namespace

int64_t Shard::held() const {
  int64_t n = 0;
  for (const Run& r : runs) n += r.length;
  return n;
}

Layout::Layout(std::string name, int world, std::vector<ParamSpec> params)
    : name_(std::move(name)), world_(world), params_(std::move(params)) {
  TANDEM_CHECK(world >= 1, "weight_sync: layout '{}' needs at least one rank, got {}", name_,
               world);
  shards_.resize(params_.size(), std::vector<Shard>(static_cast<size_t>(world)));
  for (size_t p = 0; p < params_.size(); ++p) {
    TANDEM_CHECK(params_[p].shape.numel() > 0, "weight_sync: parameter {} has no elements ({})",
                 params_[p].name, params_[p].shape);
    for (size_t q = 0; q < p; ++q)
      TANDEM_CHECK(params_[q].name != params_[p].name,
                   "weight_sync: parameter {} appears twice in layout '{}'", params_[p].name,
                   name_);
  }
}

Layout Layout::replicated(std::vector<ParamSpec> params, int world) {
  Layout l("replicated", world, std::move(params));
  for (size_t p = 0; p < l.params_.size(); ++p)
    for (int r = 0; r < world; ++r) {
      const Shape& s = l.params_[p].shape;
      l.set_shard(p, r, Shard{s, {{0, s.numel(), 0}}});
    }
  return l;
}

Layout Layout::zero(std::vector<ParamSpec> params, const model::ShardLayout& shards,
                    bool full_tensors) {
  const int world = shards.world();
  Layout l(fmt::format("zero{}{}", world, full_tensors ? "" : "-params"), world, std::move(params));
  const std::span<const int64_t> starts = shards.tensor_starts();
  TANDEM_CHECK(starts.size() == l.params_.size() + 1,
               "weight_sync: the ZeRO split has {} storage tensors and layout '{}' {} parameters: "
               "build both from the same model::Weights",
               starts.size() - 1, l.name_, l.params_.size());
  for (size_t p = 0; p < l.params_.size(); ++p)
    TANDEM_CHECK(starts[p + 1] - starts[p] == l.params_[p].shape.numel(),
                 "weight_sync: {} has {} elements ({}), but storage tensor {} of the ZeRO split "
                 "has {}: build both from the same model::Weights",
                 l.params_[p].name, l.params_[p].shape.numel(), l.params_[p].shape, p,
                 starts[p + 1] - starts[p]);
  for (int r = 0; r < world; ++r) {
    for (size_t u = 0; u < shards.units().size(); ++u) {
      const model::ShardUnit& unit = shards.units()[u];
      const model::FlatRange piece = shards.range(u, r);
      for (size_t p = unit.first_tensor; p < unit.end_tensor; ++p) {
        const ParamSpec& spec = l.params_[p];
        const int64_t a = std::max(piece.begin, starts[p]), b = std::min(piece.end, starts[p + 1]);
        Shard s{full_tensors ? spec.shape : Shape{a < b ? shards.local_size() : 0}, {}};
        if (a < b)
          s.runs.push_back({a - starts[p], b - a,
                            full_tensors ? a - starts[p] : unit.local + (a - piece.begin)});
        l.set_shard(p, r, std::move(s));
      }
    }
  }
  return l;
}

Layout Layout::tensor_parallel(const TpDims& dims, std::vector<ParamSpec> params, int tp,
                               int replicas) {
  TANDEM_CHECK(replicas >= 1, "weight_sync: tensor parallel needs replicas >= 1, got {}", replicas);
  const std::vector<std::vector<Shard>> shards = tp_shards(dims, params, tp);
  Layout l(fmt::format("tp{}x{}", tp, replicas), tp * replicas, std::move(params));
  for (int t = 0; t < tp; ++t)
    for (size_t p = 0; p < l.params_.size(); ++p)
      for (int k = 0; k < replicas; ++k)
        l.set_shard(p, k * tp + t, shards[static_cast<size_t>(t)][p]);
  return l;
}

Layout Layout::grid(const TpDims& dims, std::vector<ParamSpec> params, int tp, int dp,
                    std::span<const LayerRange> stages) {
  const int pp = static_cast<int>(stages.size());
  TANDEM_CHECK(dp >= 1 && pp >= 1,
               "weight_sync: a trainer grid needs dp >= 1 and at least one pipeline stage, got "
               "dp = {} and {} stages",
               dp, pp);
  const std::vector<int> stage = stage_of_params(params, stages);
  const std::vector<std::vector<Shard>> shards = tp_shards(dims, params, tp);
  Layout l(fmt::format("grid-tp{}-pp{}-dp{}", tp, pp, dp), tp * pp * dp, std::move(params));
  const bool tied = std::none_of(l.params_.begin(), l.params_.end(),
                                 [](const ParamSpec& p) { return p.name == kLmHead; });
  for (size_t p = 0; p < l.params_.size(); ++p) {
    // The tied embedding is also the last stage's head: the same parameter, held twice.
    std::vector<int> holding = {stage[p]};
    if (tied && l.params_[p].name == kEmbed && pp > 1) holding.push_back(pp - 1);
    for (const int s : holding)
      for (int d = 0; d < dp; ++d)
        for (int t = 0; t < tp; ++t)
          l.set_shard(p, (s * dp + d) * tp + t, shards[static_cast<size_t>(t)][p]);
  }
  return l;
}

Layout Layout::grid_zero(const TpDims& dims, std::vector<ParamSpec> params, int tp,
                         std::span<const LayerRange> stages,
                         std::span<const model::ShardLayout> shards) {
  const int pp = static_cast<int>(stages.size());
  TANDEM_CHECK(!shards.empty() && static_cast<int64_t>(shards.size()) == int64_t{tp} * pp,
               "weight_sync: a grid of tp = {} and {} stages has {} positions, given {} shard "
               "layouts: one for each (stage, tensor-parallel rank)",
               tp, pp, int64_t{tp} * pp, shards.size());
  const int dp = shards[0].world();
  const Layout whole = grid(dims, std::move(params), tp, dp, stages);
  Layout l(fmt::format("grid-tp{}-pp{}-dp{}-params", tp, pp, dp), whole.world_, whole.params_);
  for (int s = 0; s < pp; ++s)
    for (int t = 0; t < tp; ++t) {
      const model::ShardLayout& sl = shards[static_cast<size_t>(s * tp + t)];
      // The position's tensors as replica 0 holds them (every replica holds the same).
      const int first = s * dp * tp + t;
      std::vector<size_t> held;
      for (size_t p = 0; p < l.params_.size(); ++p)
        if (whole.shard(p, first).held() > 0) held.push_back(p);
      const std::span<const int64_t> starts = sl.tensor_starts();
      TANDEM_CHECK(sl.world() == dp && starts.size() == held.size() + 1,
                   "weight_sync: the shard layout of stage {} tensor-parallel rank {} splits {} "
                   "tensors over {} ranks, the position holds {} over dp = {}: build it from the "
                   "position's tensors (Layout::grid's shards of its first rank)",
                   s, t, starts.size() - 1, sl.world(), held.size(), dp);
      for (size_t i = 0; i < held.size(); ++i)
        TANDEM_CHECK(starts[i + 1] - starts[i] == whole.shard(held[i], first).shape.numel(),
                     "weight_sync: tensor {} of the shard layout of stage {} tensor-parallel rank "
                     "{} has {} elements, the position's {} {}: build it from the position's "
                     "tensors",
                     i, s, t, starts[i + 1] - starts[i], l.params_[held[i]].name,
                     whole.shard(held[i], first).shape);
      for (int d = 0; d < dp; ++d) {
        std::vector<Shard> mine(held.size());
        for (size_t u = 0; u < sl.units().size(); ++u) {
          const model::ShardUnit& unit = sl.units()[u];
          const model::FlatRange piece = sl.range(u, d);
          for (size_t i = unit.first_tensor; i < unit.end_tensor; ++i) {
            // Elements [lo, hi) of the tensor-parallel shard, at `at` of the local buffer; each
            // of the shard's runs maps its part of them to the parameter's elements.
            const int64_t lo = std::max(piece.begin, starts[i]) - starts[i],
                          hi = std::min(piece.end, starts[i + 1]) - starts[i];
            const int64_t at = unit.local + (starts[i] + lo - piece.begin);
            for (const Run& r : whole.shard(held[i], first).runs) {
              const int64_t a = std::max(lo, r.local), b = std::min(hi, r.local + r.length);
              if (a < b) mine[i].runs.push_back({r.global + (a - r.local), b - a, at + (a - lo)});
            }
          }
        }
        for (size_t i = 0; i < held.size(); ++i) {
          Shard& sh = mine[i];
          std::sort(sh.runs.begin(), sh.runs.end(),
                    [](const Run& a, const Run& b) { return a.global < b.global; });
          sh.shape = Shape{sh.runs.empty() ? 0 : sl.local_size()};
          l.set_shard(held[i], (s * dp + d) * tp + t, std::move(sh));
        }
      }
    }
  return l;
}

Layout Layout::placed(int first, int world) const {
  TANDEM_CHECK(first >= 0 && first + world_ <= world,
               "weight_sync: layout '{}' of {} ranks does not fit at rank {} of a world of {}",
               name_, world_, first, world);
  Layout l(fmt::format("{}@{}", name_, first), world, params_);
  for (size_t p = 0; p < params_.size(); ++p) {
    for (int r = 0; r < world_; ++r) l.shards_[p][static_cast<size_t>(first + r)] = shard(p, r);
  }
  return l;
}

Layout Layout::with_dtype(DType dtype) const {
  Layout l = *this;
  for (ParamSpec& p : l.params_) p.dtype = dtype;
  return l;
}

void Layout::set_shard(size_t param, int rank, Shard shard) {
  TANDEM_CHECK(param < params_.size() && rank >= 0 && rank < world_,
               "weight_sync: layout '{}' has {} parameters and {} ranks, asked for parameter {} of "
               "rank {}",
               name_, params_.size(), world_, param, rank);
  const ParamSpec& p = params_[param];
  const int64_t n = p.shape.numel(), local_n = shard.shape.numel();
  int64_t end = 0;
  for (const Run& r : shard.runs) {
    TANDEM_CHECK(r.length > 0 && r.global >= end && r.global + r.length <= n && r.local >= 0 &&
                     r.local + r.length <= local_n,
                 "weight_sync: layout '{}' gives rank {} the run [{}, {}) of {} ({} elements) at "
                 "local [{}, {}) of a local tensor of {}: runs must ascend, not overlap and stay "
                 "inside both",
                 name_, rank, r.global, r.global + r.length, p.name, n, r.local, r.local + r.length,
                 shard.shape);
    end = r.global + r.length;
  }
  std::vector<Run> by_local = shard.runs;
  std::sort(by_local.begin(), by_local.end(),
            [](const Run& a, const Run& b) { return a.local < b.local; });
  for (size_t i = 1; i < by_local.size(); ++i)
    TANDEM_CHECK(by_local[i - 1].local + by_local[i - 1].length <= by_local[i].local,
                 "weight_sync: layout '{}' puts two runs of {} at overlapping local elements of "
                 "rank {} ({} and {})",
                 name_, p.name, rank, by_local[i - 1].local, by_local[i].local);
  shards_[param][static_cast<size_t>(rank)] = std::move(shard);
}

const Shard& Layout::shard(size_t param, int rank) const {
  TANDEM_CHECK(param < params_.size() && rank >= 0 && rank < world_,
               "weight_sync: layout '{}' has {} parameters and {} ranks, asked for parameter {} of "
               "rank {}",
               name_, params_.size(), world_, param, rank);
  return shards_[param][static_cast<size_t>(rank)];
}

int64_t Layout::held(int rank) const {
  int64_t n = 0;
  for (size_t p = 0; p < params_.size(); ++p) n += shard(p, rank).held();
  return n;
}

std::string Layout::describe() const {
  std::string out = fmt::format("layout {} ({} ranks)\n", name_, world_);
  for (size_t p = 0; p < params_.size(); ++p) {
    const ParamSpec& spec = params_[p];
    out += fmt::format("{} {} {}\n", spec.name, spec.shape, dtype_name(spec.dtype));
    for (int r = 0; r < world_; ++r) {
      const Shard& s = shard(p, r);
      out += fmt::format("  rank {}: local {}, {} runs", r, s.shape, s.runs.size());
      for (size_t i = 0; i < s.runs.size() && i < 3; ++i)
        out += fmt::format(" [{}, {})@{}", s.runs[i].global, s.runs[i].global + s.runs[i].length,
                           s.runs[i].local);
      out += s.runs.size() > 3 ? " ...\n" : "\n";
    }
  }
  return out;
}

}  // namespace tandem::weight_sync
