// Runs one pipeline stage's part of a schedule (1F1B or GPipe) over a pipeline group: the stage's
// forward and backward passes in the schedule's order, the activations and their gradients sent
// between neighbouring stages, and the time each pass computed and waited.
//
// Transfers. Group rank s is stage s. Before each pass a stage makes one send_recv call holding
// the send of its previous pass's output (the activation to stage s + 1 after a forward, the
// gradient to stage s - 1 after a backward) and the receive of this pass's input (the activation
// from s - 1 before a forward, the gradient from s + 1 before a backward); a last call sends the
// last pass's output. Posting a send and a receive together is what keeps 1F1B's steady state
// (send forward, receive backward) free of an ordering deadlock. Transfers are f32 tensors; their
// shapes do not travel: every stage knows the micro-batch plan, and the activation crossing every
// stage boundary for micro-batch i has the shape PipeStage::activation_shape(i), (T_i, C), its
// gradient the same. Sends between a pair of stages go in the order of the schedule's passes,
// which is micro-batch order for forwards and the schedule's backward order for gradients, the
// same on every stage.
//
// Time. The stages leave a barrier together; each then measures its passes' compute seconds and
// the seconds spent in the send_recv before each, and the step's wall is the longest stage's
// (barrier to its last send; an all_gather over the pipeline group). The bubble of stage s is
// 1 - busy_s / step wall; the pipeline's is 1 - sum_s busy_s / (P * step wall), the share of the
// stages' time not spent computing, as simulate_pipeline defines it. With every stage's forward
// taking f and backward b and free transfers both are (P - 1) / (m + P - 1) for 1F1B and GPipe
// whatever f / b (pipeline_bubble_theory).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "trainer/parallel/pipeline_schedule.h"

namespace tandem {
class Communicator;
}

namespace tandem::trainer {

enum class PipeSchedule { one_f_one_b, gpipe };
const char* pipe_schedule_name(PipeSchedule schedule);  // "1f1b", "gpipe"
// Stage `stage`'s passes under `schedule` (one_f_one_b or gpipe of pipeline_schedule.h).
std::vector<PipeAction> pipe_actions(PipeSchedule schedule, int stage, int stages,
                                     int micro_batches);

// One transfer between neighbouring stages: micro-batch i's activation (forward) or its gradient
// (backward), sent to or received from stage `peer`.
struct PipeTransfer {
  enum class Kind { send, recv } kind;
  PipePass what;  // forward: the activation; backward: its gradient
  int micro_batch;
  int peer;  // the other stage
  bool operator==(const PipeTransfer&) const = default;
};

// One send_recv call, then one pass (none after the last: the call sends the last output).
struct PipeStep {
  std::vector<PipeTransfer> transfers;
  bool has_pass = false;
  PipeAction pass{};
};

// Stage `stage`'s steps: a value computed once from the schedule, printed by describe_pipe_plan.
std::vector<PipeStep> pipe_plan(PipeSchedule schedule, int stage, int stages, int micro_batches);
// One line per step: "recv act 0 <- 0, send grad 1 -> 0 | F 2".
std::string describe_pipe_plan(const std::vector<PipeStep>& plan);

// What a stage computes. Tensors are f32 on the CPU.
struct PipeStage {
  // The activation crossing every stage boundary for micro-batch i, and its gradient: (T_i, C).
  std::function<Shape(int micro_batch)> activation_shape;
  // input (T_i, C): the previous stage's output; undefined on stage 0, which reads its own
  // micro-batch. Returns the output (T_i, C); undefined on the last stage, which computes the loss.
  std::function<Tensor(int micro_batch, const Tensor& input)> forward;
  // grad_output (T_i, C): the next stage's gradient of this stage's output; undefined on the last
  // stage. Returns the gradient of the input (T_i, C); undefined on stage 0.
  std::function<Tensor(int micro_batch, const Tensor& grad_output)> backward;
  // Micro-batches [real, micro_batches) are ones this pipeline lacks while the data-parallel
  // replicas its stages step in lockstep with (a sharded optimizer's collectives) have them:
  // their passes run in the schedule's order with undefined tensors in and out, and nothing
  // crosses a stage boundary for them (every stage of the pipeline has the same real). -1: none.
  int real = -1;
};

struct PipeOpTime {
  PipeAction pass;
  double compute_s = 0;  // the pass
  double wait_s = 0;     // the send_recv before it
};

// One stage's measurements of one run_pipeline call.
struct PipeStageReport {
  int stage = 0, stages = 1, micro_batches = 0;
  std::vector<PipeOpTime> ops;  // in the order run
  double final_send_s = 0;      // the send_recv after the last pass
  double busy_s = 0;            // sum of compute_s
  double wait_s = 0;            // sum of wait_s and final_send_s
  double wall_s = 0;            // this stage: from the barrier to its last send's end
  double step_wall_s = 0;       // the longest stage's wall_s
  double pipeline_busy_s = 0;   // sum of busy_s over the stages
  // The most micro-batches this stage has forwarded and not yet run backward.
  int peak_inflight = 0;
  // 1 - busy_s / step_wall_s.
  double bubble_fraction() const;
  // 1 - pipeline_busy_s / (stages * step_wall_s).
  double pipeline_bubble_fraction() const;
};

// Runs this rank's stage (pipe.rank()) of `schedule` with `micro_batches` micro-batches over the
// pipeline group `pipe`: every stage of the group calls it with the same schedule and
// micro-batch plan. Collective over `pipe` (a barrier, the transfers, one all_gather). Every
// receive is bounded by the group's timeout; a stage that fails, hangs or dies makes its
// neighbours throw naming it, its world rank and the micro-batch they waited for. A pass that
// throws is rethrown naming the stage and the pass.
PipeStageReport run_pipeline(Communicator& pipe, PipeSchedule schedule, int micro_batches,
                             const PipeStage& stage);

}  // namespace tandem::trainer
