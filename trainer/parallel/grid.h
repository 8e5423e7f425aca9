// How a trainer's ranks form a data x tensor x pipeline parallel grid (3D parallelism): the
// tensor-parallel rank varies fastest, so a tensor-parallel group is consecutive ranks (one node,
// its fast links carrying the per-layer all-reduces), then the data-parallel rank, then the
// pipeline stage (stages may sit on different nodes: they exchange only activations at the stage
// boundaries). rank = (pp * dp_size + dp) * tp_size + tp, Megatron-LM's default order.
#pragma once

#include <string>
#include <vector>

namespace tandem::trainer {

struct GridCoord {
  int dp = 0, tp = 0, pp = 0;
  bool operator==(const GridCoord&) const = default;
};

class ParallelGrid {
 public:
  // world ranks as tp x pp x (world / (tp pp)); throws naming trainer.tp and trainer.pp when
  // their product does not divide the world.
  ParallelGrid(int world, int tp, int pp);

  int world() const { return dp_ * tp_ * pp_; }
  int dp_size() const { return dp_; }
  int tp_size() const { return tp_; }
  int pp_size() const { return pp_; }

  GridCoord coord(int rank) const;
  int rank(const GridCoord& c) const;
  // The ranks, in increasing order, that share this rank's coordinates but the one named:
  // its tensor-parallel group, its data-parallel group and its pipeline (stage 0 first).
  std::vector<int> tp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;
  std::vector<int> pp_group(int rank) const;
  // One line per rank, "rank 3: dp 1, tp 1, pp 0", after a header naming the sizes: what a job
  // prints at start.
  std::string describe() const;

 private:
  int dp_, tp_, pp_;
};

// The layers [first, end) of pipeline stage `stage` of `stages` for a model of `layers` layers:
// contiguous, the remainder one more layer to each of the first stages. The first stage also
// holds the embedding, the last the final norm and the head. Throws when a stage would hold none.
struct StageLayers {
  int first = 0, end = 0;
};
StageLayers stage_layers(int layers, int stage, int stages);

}  // namespace tandem::trainer
