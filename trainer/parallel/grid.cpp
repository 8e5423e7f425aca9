#include "trainer/parallel/grid.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace tandem::trainer {

ParallelGrid::ParallelGrid(int world, int tp, int pp) : dp_(0), tp_(tp), pp_(pp) {
  TANDEM_CHECK(tp >= 1 && pp >= 1, "trainer.tp = {} and trainer.pp = {} must be at least 1", tp,
               pp);
  TANDEM_CHECK(world >= 1 && world % (tp * pp) == 0,
               "trainer.tp = {} x trainer.pp = {} = {} ranks does not divide the {} ranks started: "
               "start a multiple of {}",
               tp, pp, tp * pp, world, tp * pp);
  dp_ = world / (tp * pp);
}

GridCoord ParallelGrid::coord(int rank) const {
  TANDEM_CHECK(rank >= 0 && rank < world(), "grid: rank {} is not in a world of {}", rank, world());
  return {(rank / tp_) % dp_, rank % tp_, rank / (tp_ * dp_)};
}

int ParallelGrid::rank(const GridCoord& c) const {
  TANDEM_CHECK(c.dp >= 0 && c.dp < dp_ && c.tp >= 0 && c.tp < tp_ && c.pp >= 0 && c.pp < pp_,
               "grid: coordinates dp {}, tp {}, pp {} are outside {} x {} x {}", c.dp, c.tp, c.pp,
               dp_, tp_, pp_);
  return (c.pp * dp_ + c.dp) * tp_ + c.tp;
}

std::vector<int> ParallelGrid::tp_group(int r) const {
  GridCoord c = coord(r);
  std::vector<int> out;
  for (c.tp = 0; c.tp < tp_; ++c.tp) out.push_back(rank(c));
  return out;
}

std::vector<int> ParallelGrid::dp_group(int r) const {
  GridCoord c = coord(r);
  std::vector<int> out;
  for (c.dp = 0; c.dp < dp_; ++c.dp) out.push_back(rank(c));
  return out;
}

std::vector<int> ParallelGrid::pp_group(int r) const {
  GridCoord c = coord(r);
  std::vector<int> out;
  for (c.pp = 0; c.pp < pp_; ++c.pp) out.push_back(rank(c));
  return out;
}

std::string ParallelGrid::describe() const {
  std::string s =
      fmt::format("{} ranks = data {} x tensor {} x pipeline {}", world(), dp_, tp_, pp_);
  for (int r = 0; r < world(); ++r) {
    const GridCoord c = coord(r);
    s += fmt::format("\n  rank {}: dp {}, tp {}, pp {}", r, c.dp, c.tp, c.pp);
  }
  return s;
}

StageLayers stage_layers(int layers, int stage, int stages) {
  TANDEM_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline: stage {} of {} stages",
               stage, stages);
  TANDEM_CHECK(layers >= stages,
               "trainer.pp = {} does not fit a model of {} layers: each stage needs a layer",
               stages, layers);
  const int base = layers / stages, extra = layers % stages;
  const int first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

}  // namespace tandem::trainer
