#include "trainer/parallel/pipeline_schedule.h"

#include <algorithm>

#include "core/error.h"

namespace tandem::trainer {
namespace {

void check_shape(const char* what, int stage, int stages, int micro_batches) {
  TANDEM_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1,
               "{}: stage {} of {} with {} micro-batches", what, stage, stages, micro_batches);
}

const char* pass_name(PipePass p) { return p == PipePass::forward ? "forward" : "backward"; }

}  // namespace

std::vector<PipeAction> one_f_one_b(int stage, int stages, int micro_batches) {
  check_shape("one_f_one_b", stage, stages, micro_batches);
  const int warmup = std::min(stages - 1 - stage, micro_batches);
  std::vector<PipeAction> out;
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({PipePass::forward, f});
  for (; f < micro_batches; ++f, ++b) {
    out.push_back({PipePass::forward, f});
    out.push_back({PipePass::backward, b});
  }
  for (; b < micro_batches; ++b) out.push_back({PipePass::backward, b});
  return out;
}

std::vector<PipeAction> gpipe(int stage, int stages, int micro_batches) {
  check_shape("gpipe", stage, stages, micro_batches);
  std::vector<PipeAction> out;
  for (int f = 0; f < micro_batches; ++f) out.push_back({PipePass::forward, f});
  for (int b = micro_batches - 1; b >= 0; --b) out.push_back({PipePass::backward, b});
  return out;
}

double PipeTiming::bubble_fraction() const {
  double sum = 0;
  for (double b : busy) sum += b;
  return makespan > 0 ? 1.0 - sum / (static_cast<double>(busy.size()) * makespan) : 0.0;
}

PipeTiming simulate_pipeline(const std::vector<std::vector<PipeAction>>& schedule, double forward_s,
                             double backward_s) {
  const int P = static_cast<int>(schedule.size());
  TANDEM_CHECK(P >= 1, "simulate_pipeline: no stages");
  int m = 0;
  for (const auto& s : schedule)
    for (const PipeAction& a : s) m = std::max(m, a.micro_batch + 1);
  // done[pass][stage][micro-batch]: the end time of that pass, or -1 while it has not run.
  std::vector<std::vector<std::vector<double>>> done(
      2, std::vector<std::vector<double>>(static_cast<size_t>(P),
                                          std::vector<double>(static_cast<size_t>(m), -1.0)));
  auto end_of = [&](PipePass p, int s, int i) -> double& {
    return done[static_cast<size_t>(p)][static_cast<size_t>(s)][static_cast<size_t>(i)];
  };
  PipeTiming out;
  out.busy.assign(static_cast<size_t>(P), 0.0);
  out.peak_inflight.assign(static_cast<size_t>(P), 0);
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  std::vector<double> free_at(static_cast<size_t>(P), 0.0);
  std::vector<int> inflight(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      const auto us = static_cast<size_t>(s);
      while (next[us] < schedule[us].size()) {
        const PipeAction a = schedule[us][next[us]];
        TANDEM_CHECK(end_of(a.pass, s, a.micro_batch) < 0,
                     "simulate_pipeline: stage {} runs the {} of micro-batch {} twice", s,
                     pass_name(a.pass), a.micro_batch);
        double ready = free_at[us];
        if (a.pass == PipePass::forward) {
          if (s > 0) {
            if (end_of(PipePass::forward, s - 1, a.micro_batch) < 0) break;
            ready = std::max(ready, end_of(PipePass::forward, s - 1, a.micro_batch));
          }
        } else {
          if (end_of(PipePass::forward, s, a.micro_batch) < 0) break;
          if (s + 1 < P) {
            if (end_of(PipePass::backward, s + 1, a.micro_batch) < 0) break;
            ready = std::max(ready, end_of(PipePass::backward, s + 1, a.micro_batch));
          }
        }
        const double cost = a.pass == PipePass::forward ? forward_s : backward_s;
        end_of(a.pass, s, a.micro_batch) = ready + cost;
        free_at[us] = ready + cost;
        out.busy[us] += cost;
        out.makespan = std::max(out.makespan, ready + cost);
        inflight[us] += a.pass == PipePass::forward ? 1 : -1;
        out.peak_inflight[us] = std::max(out.peak_inflight[us], inflight[us]);
        ++next[us];
        progress = true;
      }
    }
  }
  for (int s = 0; s < P; ++s) {
    const auto us = static_cast<size_t>(s);
    TANDEM_CHECK(next[us] == schedule[us].size(),
                 "simulate_pipeline: the schedule deadlocks: stage {} waits to run the {} of "
                 "micro-batch {}",
                 s, pass_name(schedule[us][next[us]].pass), schedule[us][next[us]].micro_batch);
    for (int i = 0; i < m; ++i)
      for (PipePass p : {PipePass::forward, PipePass::backward})
        TANDEM_CHECK(end_of(p, s, i) >= 0,
                     "simulate_pipeline: stage {} never runs the {} of micro-batch {}", s,
                     pass_name(p), i);
  }
  return out;
}

double pipeline_bubble_theory(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

}  // namespace tandem::trainer
