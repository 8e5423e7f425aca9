// The data x tensor x pipeline grid of trainer ranks (trainer/parallel/grid.h): Megatron's order
// (tensor fastest, pipeline slowest), groups that partition the world, the start-up table, the
// layers of each stage, and the refusals naming the keys.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <vector>

#include "trainer/parallel/grid.h"

using namespace tandem::trainer;

TEST_CASE("a parallel grid puts tensor ranks together and every group partitions the world",
          "[unit]") {
  const ParallelGrid g(8, 2, 2);
  CHECK(g.dp_size() == 2);
  CHECK(g.coord(0) == GridCoord{0, 0, 0});
  CHECK(g.coord(1) == GridCoord{0, 1, 0});
  CHECK(g.coord(2) == GridCoord{1, 0, 0});
  CHECK(g.coord(5) == GridCoord{0, 1, 1});
  CHECK(g.tp_group(5) == std::vector<int>{4, 5});
  CHECK(g.dp_group(5) == std::vector<int>{5, 7});
  CHECK(g.pp_group(5) == std::vector<int>{1, 5});
  for (int tp : {1, 2, 3})
    for (int pp : {1, 2, 3})
      for (int dp : {1, 2}) {
        const ParallelGrid h(tp * pp * dp, tp, pp);
        INFO(h.describe());
        for (auto group :
             {&ParallelGrid::tp_group, &ParallelGrid::dp_group, &ParallelGrid::pp_group}) {
          std::set<int> seen;
          for (int r = 0; r < h.world(); ++r) {
            CHECK(h.rank(h.coord(r)) == r);
            const std::vector<int> mine = (h.*group)(r);
            CHECK(std::count(mine.begin(), mine.end(), r) == 1);
            // The same group from each of its members.
            for (int q : mine) CHECK((h.*group)(q) == mine);
            seen.insert(mine.begin(), mine.end());
          }
          CHECK(static_cast<int>(seen.size()) == h.world());
        }
      }
  CHECK(ParallelGrid(4, 2, 2).describe() ==
        "4 ranks = data 1 x tensor 2 x pipeline 2\n  rank 0: dp 0, tp 0, pp 0\n  rank 1: dp 0, "
        "tp 1, pp 0\n  rank 2: dp 0, tp 0, pp 1\n  rank 3: dp 0, tp 1, pp 1");
  CHECK_THROWS_WITH(ParallelGrid(6, 2, 2),
                    Catch::Contains("trainer.tp = 2 x trainer.pp = 2 = 4 ranks does not divide "
                                    "the 6 ranks started"));
}

TEST_CASE("pipeline stages hold contiguous layers, the remainder on the first stages", "[unit]") {
  CHECK(stage_layers(30, 0, 4).first == 0);
  CHECK(stage_layers(30, 0, 4).end == 8);
  CHECK(stage_layers(30, 1, 4).end == 16);
  CHECK(stage_layers(30, 2, 4).end == 23);
  CHECK(stage_layers(30, 3, 4).end == 30);
  for (int layers : {2, 3, 7, 30})
    for (int stages = 1; stages <= std::min(layers, 4); ++stages) {
      int next = 0;
      for (int s = 0; s < stages; ++s) {
        const StageLayers l = stage_layers(layers, s, stages);
        CHECK(l.first == next);
        CHECK(l.end - l.first >= layers / stages);
        next = l.end;
      }
      CHECK(next == layers);
    }
  CHECK_THROWS_WITH(stage_layers(2, 0, 3), Catch::Contains("trainer.pp = 3 does not fit a model "
                                                           "of 2 layers"));
}
