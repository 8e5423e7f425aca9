// The pipeline runner: one stage's plan of transfers and passes, run over the pipeline group with
// each pass and each send_recv timed.
#include "trainer/parallel/pipeline_runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <optional>

#include "core/clock.h"
#include "core/comm.h"
#include "core/error.h"

namespace tandem::trainer {
namespace {

const char* pass_name(PipePass p) { return p == PipePass::forward ? "forward" : "backward"; }
const char* carried(PipePass p) { return p == PipePass::forward ? "activation" : "gradient"; }

std::string stage_name(const Communicator& pipe, int stage) {
  return fmt::format("stage {} (world rank {})", stage, pipe.world_rank(stage));
}

// What a failed send_recv means from this stage's side: each transfer's peer did not do its part.
std::string failed_transfers(const Communicator& pipe, const PipeStep& step, int stage,
                             const std::string& cause) {
  // "stage 1 (world rank 3) took no activation of micro-batch 3 or sent no gradient of
  // micro-batch 1": each peer named once, before what it did not do.
  std::string peers;
  for (size_t i = 0; i < step.transfers.size(); ++i) {
    const PipeTransfer& t = step.transfers[i];
    const bool same_peer = i > 0 && step.transfers[i - 1].peer == t.peer;
    if (i > 0) peers += " or ";
    if (!same_peer) peers += stage_name(pipe, t.peer) + " ";
    peers += fmt::format("{} no {} of micro-batch {}",
                         t.kind == PipeTransfer::Kind::recv ? "sent" : "took", carried(t.what),
                         t.micro_batch);
  }
  const std::string at = step.has_pass
                             ? fmt::format("its {} of micro-batch {}", pass_name(step.pass.pass),
                                           step.pass.micro_batch)
                             : std::string("its last send");
  const double timeout_s = std::chrono::duration<double>(pipe.timeout()).count();
  return fmt::format(
      "pipeline {} within {} s (distributed.timeout_s), while {} waited before {}; that stage "
      "failed, hung or died (its own error says why), or runs another schedule or micro-batch "
      "plan ({})",
      peers, timeout_s, stage_name(pipe, stage), at, cause);
}

void check_output(const Tensor& t, const Shape& want, const Communicator& pipe, int stage,
                  const PipeAction& a) {
  TANDEM_CHECK(t.defined() && t.dtype() == DType::f32 && t.device().is_cpu() && t.shape() == want,
               "pipeline {}: its {} of micro-batch {} returned {}, the next transfer needs an f32 "
               "CPU tensor of the micro-batch's activation shape {}",
               stage_name(pipe, stage), pass_name(a.pass), a.micro_batch,
               t.defined() ? t.str() : std::string("an undefined tensor"), want.str());
}

int64_t nanoseconds(double s) { return std::llround(s * 1e9); }
double seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

}  // namespace

const char* pipe_schedule_name(PipeSchedule schedule) {
  return schedule == PipeSchedule::one_f_one_b ? "1f1b" : "gpipe";
}

std::vector<PipeAction> pipe_actions(PipeSchedule schedule, int stage, int stages,
                                     int micro_batches) {
  return schedule == PipeSchedule::one_f_one_b ? one_f_one_b(stage, stages, micro_batches)
                                               : gpipe(stage, stages, micro_batches);
}

std::vector<PipeStep> pipe_plan(PipeSchedule schedule, int stage, int stages, int micro_batches) {
  using Kind = PipeTransfer::Kind;
  std::vector<PipeStep> plan;
  std::optional<PipeTransfer> pending_send;
  for (const PipeAction& a : pipe_actions(schedule, stage, stages, micro_batches)) {
    PipeStep step;
    if (pending_send) step.transfers.push_back(*pending_send);
    pending_send.reset();
    const bool forward = a.pass == PipePass::forward;
    if (forward && stage > 0)
      step.transfers.push_back({Kind::recv, a.pass, a.micro_batch, stage - 1});
    if (!forward && stage + 1 < stages)
      step.transfers.push_back({Kind::recv, a.pass, a.micro_batch, stage + 1});
    step.has_pass = true;
    step.pass = a;
    plan.push_back(std::move(step));
    if (forward && stage + 1 < stages)
      pending_send = PipeTransfer{Kind::send, a.pass, a.micro_batch, stage + 1};
    if (!forward && stage > 0)
      pending_send = PipeTransfer{Kind::send, a.pass, a.micro_batch, stage - 1};
  }
  if (pending_send) plan.push_back({{*pending_send}, false, {}});
  return plan;
}

std::string describe_pipe_plan(const std::vector<PipeStep>& plan) {
  std::string out;
  for (const PipeStep& step : plan) {
    std::string line;
    for (const PipeTransfer& t : step.transfers) {
      if (!line.empty()) line += ", ";
      const bool send = t.kind == PipeTransfer::Kind::send;
      line += fmt::format("{} {} {} {} {}", send ? "send" : "recv",
                          t.what == PipePass::forward ? "act" : "grad", t.micro_batch,
                          send ? "->" : "<-", t.peer);
    }
    if (step.has_pass)
      line += fmt::format("{}{} {}", line.empty() ? "" : " | ",
                          step.pass.pass == PipePass::forward ? 'F' : 'B', step.pass.micro_batch);
    out += line + "\n";
  }
  return out;
}

double PipeStageReport::bubble_fraction() const {
  return step_wall_s > 0 ? 1.0 - busy_s / step_wall_s : 0.0;
}

double PipeStageReport::pipeline_bubble_fraction() const {
  return step_wall_s > 0 ? 1.0 - pipeline_busy_s / (stages * step_wall_s) : 0.0;
}

PipeStageReport run_pipeline(Communicator& pipe, PipeSchedule schedule, int micro_batches,
                             const PipeStage& stage) {
  const int s = pipe.rank(), P = pipe.size();
  TANDEM_CHECK(stage.activation_shape && stage.forward && stage.backward,
               "pipeline {}: run_pipeline needs the stage's activation_shape, forward and backward",
               stage_name(pipe, s));
  const int real = stage.real < 0 ? micro_batches : std::min(stage.real, micro_batches);
  // The plan's transfers of micro-batches that cross the boundaries (an idle one carries none).
  std::vector<PipeStep> plan = pipe_plan(schedule, s, P, micro_batches);
  for (PipeStep& step : plan)
    std::erase_if(step.transfers, [&](const PipeTransfer& t) { return t.micro_batch >= real; });
  PipeStageReport report;
  report.stage = s;
  report.stages = P;
  report.micro_batches = micro_batches;

  // Received activations by micro-batch, held until their forward; outputs until they are sent.
  std::vector<Tensor> inputs(static_cast<size_t>(micro_batches));
  std::vector<Tensor> grads(static_cast<size_t>(micro_batches));
  std::vector<Tensor> outputs(static_cast<size_t>(micro_batches));
  auto slot = [](std::vector<Tensor>& v, int i) -> Tensor& { return v[static_cast<size_t>(i)]; };
  int inflight = 0;

  pipe.barrier();
  const Clock::time_point start = Clock::now();
  for (const PipeStep& step : plan) {
    std::vector<P2POp> ops;
    for (const PipeTransfer& t : step.transfers) {
      if (t.kind == PipeTransfer::Kind::send) {
        ops.push_back(send_to(t.peer, slot(outputs, t.micro_batch)));
        continue;
      }
      Tensor& into = slot(t.what == PipePass::forward ? inputs : grads, t.micro_batch);
      into = Tensor::empty(stage.activation_shape(t.micro_batch), DType::f32);
      ops.push_back(recv_from(t.peer, into));
    }
    const Clock::time_point wait_start = Clock::now();
    try {
      // Each send of the previous pass's output paired with this pass's receive: one call.
      pipe.send_recv(ops);
    } catch (const std::exception& e) {
      TANDEM_FAIL("{}", failed_transfers(pipe, step, s, e.what()));
    }
    const double wait_s = seconds_since(wait_start);
    for (const PipeTransfer& t : step.transfers)
      if (t.kind == PipeTransfer::Kind::send) slot(outputs, t.micro_batch) = Tensor();
    if (!step.has_pass) {
      report.final_send_s = wait_s;
      continue;
    }

    const PipeAction a = step.pass;
    const Clock::time_point compute_start = Clock::now();
    Tensor out;
    try {
      if (a.pass == PipePass::forward) {
        out = stage.forward(a.micro_batch, slot(inputs, a.micro_batch));
        slot(inputs, a.micro_batch) = Tensor();
      } else {
        out = stage.backward(a.micro_batch, slot(grads, a.micro_batch));
        slot(grads, a.micro_batch) = Tensor();
      }
    } catch (const std::exception& e) {
      TANDEM_FAIL("pipeline {}: its {} of micro-batch {} failed: {}", stage_name(pipe, s),
                  pass_name(a.pass), a.micro_batch, e.what());
    }
    const double compute_s = seconds_since(compute_start);
    const bool sends = (a.pass == PipePass::forward ? s + 1 < P : s > 0) && a.micro_batch < real;
    if (sends) {
      check_output(out, stage.activation_shape(a.micro_batch), pipe, s, a);
      slot(outputs, a.micro_batch) = out;
    }
    inflight += a.pass == PipePass::forward ? 1 : -1;
    report.peak_inflight = std::max(report.peak_inflight, inflight);
    report.ops.push_back({a, compute_s, wait_s});
    report.busy_s += compute_s;
    report.wait_s += wait_s;
  }
  report.wait_s += report.final_send_s;
  // Every stage's busy and wall seconds in whole nanoseconds (this stage's own as it sends them,
  // so that its wall is one of those the step's is the longest of): all_gather of 2 x i64 per
  // stage over the pipeline group.
  report.wall_s = seconds(nanoseconds(seconds_since(start)));
  Tensor mine = Tensor::empty({2}, DType::i64), all = Tensor::empty({2 * P}, DType::i64);
  mine.data_as<int64_t>()[0] = nanoseconds(report.busy_s);
  mine.data_as<int64_t>()[1] = nanoseconds(report.wall_s);
  pipe.all_gather(mine, all);
  for (int r = 0; r < P; ++r) {
    report.pipeline_busy_s += seconds(all.data_as<int64_t>()[2 * r]);
    report.step_wall_s = std::max(report.step_wall_s, seconds(all.data_as<int64_t>()[2 * r + 1]));
  }
  return report;
}

}  // namespace tandem::trainer
