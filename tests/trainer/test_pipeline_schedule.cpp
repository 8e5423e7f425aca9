// Pipeline schedules (trainer/parallel/pipeline_schedule.h): 1F1B's order per stage, its bubble
// equal to (P - 1) / (m + P - 1) and its in-flight micro-batches at most P - s (GPipe's: m), and
// the simulator's refusal of a schedule that deadlocks or skips a pass.
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "trainer/parallel/pipeline_schedule.h"

using namespace tandem::trainer;

namespace {

std::vector<std::vector<PipeAction>> all_stages(int P, int m, bool one_f) {
  std::vector<std::vector<PipeAction>> s;
  for (int i = 0; i < P; ++i) s.push_back(one_f ? one_f_one_b(i, P, m) : gpipe(i, P, m));
  return s;
}

}  // namespace

TEST_CASE("1F1B warms up with P - 1 - s forwards then alternates", "[unit]") {
  using enum PipePass;
  CHECK(one_f_one_b(0, 3, 4) == std::vector<PipeAction>{{forward, 0},
                                                        {forward, 1},
                                                        {forward, 2},
                                                        {backward, 0},
                                                        {forward, 3},
                                                        {backward, 1},
                                                        {backward, 2},
                                                        {backward, 3}});
  CHECK(one_f_one_b(2, 3, 4) == std::vector<PipeAction>{{forward, 0},
                                                        {backward, 0},
                                                        {forward, 1},
                                                        {backward, 1},
                                                        {forward, 2},
                                                        {backward, 2},
                                                        {forward, 3},
                                                        {backward, 3}});
  // Fewer micro-batches than stages: every forward first.
  CHECK(one_f_one_b(0, 4, 2) ==
        std::vector<PipeAction>{{forward, 0}, {forward, 1}, {backward, 0}, {backward, 1}});
}

TEST_CASE(
    "1F1B and GPipe have the bubble (P - 1) / (m + P - 1) and 1F1B holds at most P - s "
    "micro-batches",
    "[unit]") {
  for (int P : {1, 2, 3, 4})
    for (int m : {1, 2, 3, 4, 8, 16}) {
      INFO("P = " << P << ", m = " << m);
      const PipeTiming a = simulate_pipeline(all_stages(P, m, true), 1.0, 2.0);
      const PipeTiming g = simulate_pipeline(all_stages(P, m, false), 1.0, 2.0);
      CHECK(a.makespan == 3.0 * (m + P - 1));
      CHECK(a.bubble_fraction() == Approx(pipeline_bubble_theory(P, m)).margin(1e-12));
      CHECK(g.bubble_fraction() == Approx(pipeline_bubble_theory(P, m)).margin(1e-12));
      for (int s = 0; s < P; ++s) {
        CHECK(a.peak_inflight[static_cast<size_t>(s)] == std::min(P - s, m));
        CHECK(g.peak_inflight[static_cast<size_t>(s)] == m);
      }
    }
}

TEST_CASE("the pipeline simulator refuses a schedule that deadlocks or leaves a pass out",
          "[unit]") {
  using enum PipePass;
  // Stage 0 waits for a backward stage 1 only runs after a forward stage 0 has not sent.
  std::vector<std::vector<PipeAction>> bad = {
      {{forward, 0}, {backward, 0}, {forward, 1}, {backward, 1}},
      {{forward, 1}, {backward, 1}, {forward, 0}, {backward, 0}}};
  CHECK_THROWS_WITH(simulate_pipeline(bad, 1, 1),
                    Catch::Contains("deadlocks: stage 0 waits to run the backward of "
                                    "micro-batch 0"));
  std::vector<std::vector<PipeAction>> missing = {{{forward, 0}, {forward, 1}, {backward, 1}}};
  CHECK_THROWS_WITH(simulate_pipeline(missing, 1, 1),
                    Catch::Contains("stage 0 never runs the backward of micro-batch 0"));
  CHECK_THROWS_WITH(one_f_one_b(3, 3, 2), Catch::Contains("stage 3 of 3"));
}
