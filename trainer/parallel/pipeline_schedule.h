// Pipeline-parallel schedules: the order in which each of P stages runs the forward and backward
// passes of m micro-batches, and a simulator of a schedule under given pass times. A stage's
// forward of micro-batch i needs the previous stage's forward of i; its backward of i needs the
// next stage's backward of i and its own forward of i.
//
// 1F1B (PipeDream-Flush; Narayanan et al., SC'21): stage s runs min(P - 1 - s, m) forwards, then
// alternates one forward and one backward until its forwards are done, then the remaining
// backwards. Its bubble is that of GPipe, (P - 1) / (m + P - 1) of the step with equal stages,
// but a stage holds the activations of at most P - s micro-batches instead of m.
#pragma once

#include <string>
#include <vector>

namespace tandem::trainer {

enum class PipePass { forward, backward };

struct PipeAction {
  PipePass pass;
  int micro_batch;
  bool operator==(const PipeAction&) const = default;
};

// Stage `stage` of `stages` under 1F1B with `micro_batches` micro-batches.
std::vector<PipeAction> one_f_one_b(int stage, int stages, int micro_batches);
// Stage `stage` under GPipe: every forward, then every backward (last micro-batch first).
std::vector<PipeAction> gpipe(int stage, int stages, int micro_batches);

struct PipeTiming {
  double makespan = 0;             // from the first pass's start to the last's end
  std::vector<double> busy;        // per stage, the time it computed
  std::vector<int> peak_inflight;  // per stage, the most micro-batches forwarded, not yet backward
  // 1 - sum(busy) / (stages * makespan): the share of the stages' time spent waiting.
  double bubble_fraction() const;
};

// Runs the stages' action lists (schedule[s] is stage s's) with every forward taking `forward_s`
// and every backward `backward_s` on every stage, transfers taking no time. Throws naming the
// stage and its next action when the lists deadlock or do not run every pass of every micro-batch
// once.
PipeTiming simulate_pipeline(const std::vector<std::vector<PipeAction>>& schedule, double forward_s,
                             double backward_s);

// (P - 1) / (m + P - 1): the bubble of 1F1B and GPipe with equal stages.
double pipeline_bubble_theory(int stages, int micro_batches);

}  // namespace tandem::trainer
