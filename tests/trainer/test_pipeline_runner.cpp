// The pipeline runner (trainer/parallel/pipeline_runner.h) on ranks as threads: a toy stack of
// stages trained under 1F1B and GPipe gets the gradients of one thread running the micro-batches
// one after another, bitwise; 1F1B holds at most P - s micro-batches on stage s; a stage that
// fails or hangs makes its neighbours fail within the timeout naming it.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"
#include "trainer/parallel/grid.h"
#include "trainer/parallel/pipeline_runner.h"

namespace tandem::trainer {
namespace {

constexpr int64_t kC = 6;
// Micro-batch i has kLengths[i] tokens: every boundary's activation is (T_i, C).
constexpr int64_t kLengths[] = {3, 5, 2, 4, 1};

// Stage s computes h_out = tanh(h_in · W_s); the last stage's loss is sum(h_out^2) / 2.
struct ToyModel {
  int stages;
  std::vector<Tensor> w;  // per stage (C, C), h_in's column k to h_out's column j at [k, j]
  std::vector<Tensor> x;  // per micro-batch (T_i, C): stage 0's input

  ToyModel(int P, int m) : stages(P) {
    for (int s = 0; s < P; ++s) w.push_back(test::random_tensor({kC, kC}, DType::f32, 10 + s));
    for (int i = 0; i < m; ++i) x.push_back(test::random_tensor({kLengths[i], kC}, DType::f32, i));
  }
};

// (T, C) = tanh((T, C) · (C, C)).
Tensor layer_forward(const Tensor& h_in, const Tensor& w) {
  const int64_t T = h_in.size(0);
  Tensor h_out = Tensor::empty({T, kC}, DType::f32);
  const float *a = h_in.data_as<float>(), *b = w.data_as<float>();
  float* y = h_out.data_as<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < kC; ++j) {
      float sum = 0;
      for (int64_t k = 0; k < kC; ++k) sum += a[t * kC + k] * b[k * kC + j];
      y[t * kC + j] = std::tanh(sum);
    }
  return h_out;
}

// dw (C, C) = h_in^T · dpre, with dpre = g_out * (1 - h_out^2); returns g_in (T, C) = dpre · w^T
// when asked for it.
Tensor layer_backward(const Tensor& h_in, const Tensor& h_out, const Tensor& g_out, const Tensor& w,
                      const Tensor& dw, bool want_g_in) {
  const int64_t T = h_in.size(0);
  std::vector<float> dpre(static_cast<size_t>(T * kC));
  const float *y = h_out.data_as<float>(), *g = g_out.data_as<float>();
  for (int64_t e = 0; e < T * kC; ++e) dpre[static_cast<size_t>(e)] = g[e] * (1 - y[e] * y[e]);
  const float* a = h_in.data_as<float>();
  float* d = dw.data_as<float>();
  for (int64_t k = 0; k < kC; ++k)
    for (int64_t j = 0; j < kC; ++j) {
      float sum = 0;
      for (int64_t t = 0; t < T; ++t) sum += a[t * kC + k] * dpre[static_cast<size_t>(t * kC + j)];
      d[k * kC + j] = sum;
    }
  if (!want_g_in) return Tensor();
  Tensor g_in = Tensor::empty({T, kC}, DType::f32);
  const float* b = w.data_as<float>();
  float* gi = g_in.data_as<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < kC; ++k) {
      float sum = 0;
      for (int64_t j = 0; j < kC; ++j) sum += dpre[static_cast<size_t>(t * kC + j)] * b[k * kC + j];
      gi[t * kC + k] = sum;
    }
  return g_in;
}

// Sum of the micro-batches' gradients in micro-batch order, whatever order they were computed in.
std::vector<float> sum_in_order(const std::vector<Tensor>& per_micro_batch) {
  std::vector<float> out(static_cast<size_t>(kC * kC), 0.0f);
  for (const Tensor& d : per_micro_batch)
    for (size_t e = 0; e < out.size(); ++e) out[e] += d.data_as<float>()[e];
  return out;
}

// W_s's gradient for every stage s, one thread running micro-batch after micro-batch.
std::vector<std::vector<float>> sequential_grads(const ToyModel& model) {
  const int P = model.stages, m = static_cast<int>(model.x.size());
  std::vector<std::vector<Tensor>> dw(static_cast<size_t>(P));
  for (int i = 0; i < m; ++i) {
    std::vector<Tensor> h{model.x[static_cast<size_t>(i)]};  // h[s]: stage s's input
    for (int s = 0; s < P; ++s)
      h.push_back(layer_forward(h.back(), model.w[static_cast<size_t>(s)]));
    Tensor g = h.back();
    for (int s = P - 1; s >= 0; --s) {
      const auto us = static_cast<size_t>(s);
      dw[us].push_back(Tensor::empty({kC, kC}, DType::f32));
      g = layer_backward(h[us], h[us + 1], g, model.w[us], dw[us].back(), s > 0);
    }
  }
  std::vector<std::vector<float>> out;
  for (const auto& d : dw) out.push_back(sum_in_order(d));
  return out;
}

// Stage s of the toy model as the runner's callbacks; keeps each micro-batch's activations from
// its forward to its backward.
struct ToyStage {
  const ToyModel& model;
  int s;
  std::vector<Tensor> h_in, h_out, dw;  // per micro-batch

  ToyStage(const ToyModel& mo, int stage, int m)
      : model(mo),
        s(stage),
        h_in(static_cast<size_t>(m)),
        h_out(static_cast<size_t>(m)),
        dw(static_cast<size_t>(m)) {}

  PipeStage callbacks() {
    PipeStage st;
    st.activation_shape = [](int i) { return Shape{kLengths[i], kC}; };
    st.forward = [this](int i, const Tensor& input) {
      const auto ui = static_cast<size_t>(i);
      REQUIRE(input.defined() == (s > 0));
      h_in[ui] = s == 0 ? model.x[ui] : input;
      h_out[ui] = layer_forward(h_in[ui], model.w[static_cast<size_t>(s)]);
      return s + 1 < model.stages ? h_out[ui] : Tensor();
    };
    st.backward = [this](int i, const Tensor& grad_output) {
      const auto ui = static_cast<size_t>(i);
      const bool last = s + 1 == model.stages;
      REQUIRE(grad_output.defined() == !last);
      dw[ui] = Tensor::empty({kC, kC}, DType::f32);
      Tensor g_in = layer_backward(h_in[ui], h_out[ui], last ? h_out[ui] : grad_output,
                                   model.w[static_cast<size_t>(s)], dw[ui], s > 0);
      h_in[ui] = h_out[ui] = Tensor();
      return g_in;
    };
    return st;
  }
};

// The pipeline group of world rank r in a data x pipeline grid of `world` ranks and P stages.
std::unique_ptr<Communicator> pipeline_group(Communicator& world, int P) {
  const ParallelGrid grid(world.size(), 1, P);
  return world.split("pipe", grid.pp_group(world.rank()));
}

// Runs the stages' plans with Gloo's rendezvous transfers (a send completes when the peer's
// matching receive is posted, and a send_recv returns when all of its transfers completed); returns
// "" when every stage reaches its plan's end, else the stuck stages' steps.
std::string stuck_steps(const std::vector<std::vector<PipeStep>>& plans) {
  const size_t P = plans.size();
  std::vector<size_t> at(P, 0);
  std::vector<std::vector<bool>> done(P);
  for (size_t s = 0; s < P; ++s)
    if (!plans[s].empty()) done[s].assign(plans[s][0].transfers.size(), false);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t s = 0; s < P; ++s) {
      if (at[s] == plans[s].size()) continue;
      const PipeStep& step = plans[s][at[s]];
      for (size_t k = 0; k < step.transfers.size(); ++k) {
        const PipeTransfer& t = step.transfers[k];
        const auto p = static_cast<size_t>(t.peer);
        if (done[s][k] || at[p] == plans[p].size()) continue;
        const std::vector<PipeTransfer>& theirs = plans[p][at[p]].transfers;
        for (size_t c = 0; c < theirs.size(); ++c)
          if (!done[p][c] && theirs[c].kind != t.kind && theirs[c].peer == static_cast<int>(s) &&
              theirs[c].what == t.what && theirs[c].micro_batch == t.micro_batch) {
            done[s][k] = done[p][c] = true;
            progress = true;
          }
      }
      if (std::all_of(done[s].begin(), done[s].end(), [](bool d) { return d; })) {
        ++at[s];
        done[s].assign(at[s] < plans[s].size() ? plans[s][at[s]].transfers.size() : 0, false);
        progress = true;
      }
    }
  }
  std::string stuck;
  for (size_t s = 0; s < P; ++s)
    if (at[s] < plans[s].size())
      stuck += fmt::format("stage {} at: {}", s, describe_pipe_plan({plans[s][at[s]]}));
  return stuck;
}

// The (what, micro-batch) sequence stage `from` sends to stage `to`, or (recv) `to` receives from
// `from`: Gloo pairs a pair's k-th send with its k-th receive.
std::vector<std::pair<PipePass, int>> transfer_order(
    const std::vector<std::vector<PipeStep>>& plans, int from, int to, PipeTransfer::Kind kind) {
  const int self = kind == PipeTransfer::Kind::send ? from : to;
  const int peer = kind == PipeTransfer::Kind::send ? to : from;
  std::vector<std::pair<PipePass, int>> out;
  for (const PipeStep& step : plans[static_cast<size_t>(self)])
    for (const PipeTransfer& t : step.transfers)
      if (t.kind == kind && t.peer == peer) out.emplace_back(t.what, t.micro_batch);
  return out;
}

}  // namespace

TEST_CASE("pipeline plans end without deadlock and pair every send with its receive", "[unit]") {
  for (PipeSchedule schedule : {PipeSchedule::one_f_one_b, PipeSchedule::gpipe})
    for (int P = 1; P <= 6; ++P)
      for (int m = 1; m <= 12; ++m) {
        INFO(pipe_schedule_name(schedule) << ", P = " << P << ", m = " << m);
        std::vector<std::vector<PipeStep>> plans;
        for (int s = 0; s < P; ++s) plans.push_back(pipe_plan(schedule, s, P, m));
        CHECK(stuck_steps(plans).empty());
        for (int s = 0; s + 1 < P; ++s)
          for (auto [from, to] : {std::pair{s, s + 1}, std::pair{s + 1, s}}) {
            const auto sent = transfer_order(plans, from, to, PipeTransfer::Kind::send);
            CHECK(sent.size() == static_cast<size_t>(m));
            CHECK(sent == transfer_order(plans, from, to, PipeTransfer::Kind::recv));
          }
      }
  // The check fails a plan whose stages pair their transfers in opposite orders.
  std::vector<std::vector<PipeStep>> crossed = {pipe_plan(PipeSchedule::gpipe, 0, 2, 2),
                                                pipe_plan(PipeSchedule::one_f_one_b, 1, 2, 2)};
  CHECK_THAT(stuck_steps(crossed),
             Catch::Contains("stage 0 at: send act 1 -> 1, recv grad 1 <- 1 | B 1"));
}

TEST_CASE("a stage's plan pairs its last output's send with its next input's receive", "[unit]") {
  CHECK(describe_pipe_plan(pipe_plan(PipeSchedule::one_f_one_b, 0, 2, 3)) ==
        "F 0\n"
        "send act 0 -> 1 | F 1\n"
        "send act 1 -> 1, recv grad 0 <- 1 | B 0\n"
        "F 2\n"
        "send act 2 -> 1, recv grad 1 <- 1 | B 1\n"
        "recv grad 2 <- 1 | B 2\n");
  CHECK(describe_pipe_plan(pipe_plan(PipeSchedule::one_f_one_b, 1, 2, 3)) ==
        "recv act 0 <- 0 | F 0\n"
        "B 0\n"
        "send grad 0 -> 0, recv act 1 <- 0 | F 1\n"
        "B 1\n"
        "send grad 1 -> 0, recv act 2 <- 0 | F 2\n"
        "B 2\n"
        "send grad 2 -> 0\n");
  CHECK(describe_pipe_plan(pipe_plan(PipeSchedule::gpipe, 1, 3, 2)) ==
        "recv act 0 <- 0 | F 0\n"
        "send act 0 -> 2, recv act 1 <- 0 | F 1\n"
        "send act 1 -> 2, recv grad 1 <- 2 | B 1\n"
        "send grad 1 -> 0, recv grad 0 <- 2 | B 0\n"
        "send grad 0 -> 0\n");
}

TEST_CASE("pipelined gradients equal one thread's bitwise under 1F1B and GPipe", "[unit]") {
  for (int P : {2, 3}) {
    struct Run {
      PipeSchedule schedule;
      int m;
      std::vector<std::vector<float>> grads;  // per stage
      std::vector<PipeStageReport> reports;   // per stage
    };
    std::vector<Run> runs;
    for (PipeSchedule schedule : {PipeSchedule::one_f_one_b, PipeSchedule::gpipe})
      for (int m : {1, 2, 3, 5})
        runs.push_back({schedule, m, std::vector<std::vector<float>>(static_cast<size_t>(P)),
                        std::vector<PipeStageReport>(static_cast<size_t>(P))});
    const test::TempDir tmp("pipeline-runner");
    test::on_ranks(P, tmp.file("store"), [&](int s, Communicator& comm) {
      for (Run& run : runs) {
        const ToyModel model(P, run.m);
        ToyStage stage(model, s, run.m);
        run.reports[static_cast<size_t>(s)] =
            run_pipeline(comm, run.schedule, run.m, stage.callbacks());
        run.grads[static_cast<size_t>(s)] = sum_in_order(stage.dw);
      }
    });
    for (const Run& run : runs) {
      INFO(pipe_schedule_name(run.schedule) << ", P = " << P << ", m = " << run.m);
      const std::vector<std::vector<float>> want = sequential_grads(ToyModel(P, run.m));
      for (int s = 0; s < P; ++s) {
        INFO("stage " << s);
        const auto us = static_cast<size_t>(s);
        CHECK(run.grads[us] == want[us]);
        const PipeStageReport& r = run.reports[us];
        CHECK(r.ops.size() == static_cast<size_t>(2 * run.m));
        CHECK(r.peak_inflight ==
              (run.schedule == PipeSchedule::one_f_one_b ? std::min(P - s, run.m) : run.m));
        CHECK(r.busy_s > 0);
        CHECK(r.busy_s + r.wait_s <= r.wall_s);
        CHECK(r.wall_s <= r.step_wall_s);
        CHECK(r.step_wall_s == run.reports[0].step_wall_s);
        CHECK(r.pipeline_busy_s == run.reports[0].pipeline_busy_s);
        CHECK(r.bubble_fraction() >= 0);
        CHECK(r.bubble_fraction() < 1);
      }
    }
  }
}

TEST_CASE("a pipeline stage that fails makes its neighbours name it and the micro-batch",
          "[unit]") {
  // Two pipelines of 3 stages on 6 ranks ({0, 2, 4} and {1, 3, 5}); stage 1 of the second (world
  // rank 3) fails in its forward of micro-batch 2 under 1F1B with 5 micro-batches. The first
  // pipeline finishes.
  const test::TempDir tmp("pipeline-runner-fail");
  const std::vector<std::string> errors = test::on_ranks(
      6, tmp.file("store"),
      [&](int r, Communicator& world) {
        std::unique_ptr<Communicator> pipe = pipeline_group(world, 3);
        const ToyModel model(3, 5);
        ToyStage stage(model, pipe->rank(), 5);
        PipeStage callbacks = stage.callbacks();
        if (r == 3)
          callbacks.forward = [&](int i, const Tensor& input) {
            if (i == 2) throw std::runtime_error("out of memory in the toy stage");
            return stage.callbacks().forward(i, input);
          };
        run_pipeline(*pipe, PipeSchedule::one_f_one_b, 5, callbacks);
      },
      /*expect_errors=*/true, /*timeout_s=*/2);
  CHECK(errors[0].empty());
  CHECK(errors[2].empty());
  CHECK(errors[4].empty());
  CHECK_THAT(errors[3], Catch::Contains("pipeline stage 1 (world rank 3): its forward of "
                                        "micro-batch 2 failed: out of memory in the toy stage"));
  // Stage 0 had sent activation 2 and received gradient 0; it waits for gradient 1 with
  // activation 3. Stage 2 had sent gradient 1 and waits for activation 2.
  CHECK_THAT(errors[1], Catch::Contains("pipeline stage 1 (world rank 3) took no activation of "
                                        "micro-batch 3 or sent no gradient of micro-batch 1"));
  CHECK_THAT(errors[5], Catch::Contains("pipeline stage 1 (world rank 3) took no gradient of "
                                        "micro-batch 1 or sent no activation of micro-batch 2"));
}

TEST_CASE("a pipeline stage that hangs makes its neighbours fail within the timeout", "[unit]") {
  constexpr double kTimeout = 1;
  using std::chrono::steady_clock;
  std::vector<double> failed_after(3, 0);
  const test::TempDir tmp("pipeline-runner-hang");
  const std::vector<std::string> errors = test::on_ranks(
      3, tmp.file("store"),
      [&](int s, Communicator& pipe) {
        const ToyModel model(3, 3);
        ToyStage stage(model, s, 3);
        PipeStage callbacks = stage.callbacks();
        if (s == 1)
          callbacks.backward = [&](int i, const Tensor& grad_output) {
            if (i == 1) std::this_thread::sleep_for(std::chrono::duration<double>(2 * kTimeout));
            return stage.callbacks().backward(i, grad_output);
          };
        const auto start = steady_clock::now();
        try {
          run_pipeline(pipe, PipeSchedule::gpipe, 3, callbacks);
        } catch (...) {
          failed_after[static_cast<size_t>(s)] =
              std::chrono::duration<double>(steady_clock::now() - start).count();
          throw;
        }
      },
      /*expect_errors=*/true, kTimeout);
  for (int s : {0, 2}) {
    INFO("stage " << s << ": " << errors[static_cast<size_t>(s)]);
    CHECK_THAT(errors[static_cast<size_t>(s)],
               Catch::Contains("pipeline stage 1 (world rank 1)") &&
                   Catch::Contains("within 1 s (distributed.timeout_s)"));
    // Before stage 1 wakes up: the timeout, not the hung stage's return, ended the wait.
    CHECK(failed_after[static_cast<size_t>(s)] > 0);
    CHECK(failed_after[static_cast<size_t>(s)] < 1.8 * kTimeout);
  }
  // GPipe: stage 0 waits for gradient 1 while stage 1 sleeps in its backward of it.
  CHECK_THAT(errors[0], Catch::Contains("sent no gradient of micro-batch 1"));
}

TEST_CASE("a pipeline stage whose output has another shape than the plan's fails naming it",
          "[unit]") {
  const test::TempDir tmp("pipeline-runner-shape");
  const std::vector<std::string> errors = test::on_ranks(
      2, tmp.file("store"),
      [&](int s, Communicator& pipe) {
        const ToyModel model(2, 2);
        ToyStage stage(model, s, 2);
        PipeStage callbacks = stage.callbacks();
        if (s == 0)
          callbacks.forward = [&](int i, const Tensor& input) {
            const Tensor out = stage.callbacks().forward(i, input);
            return i == 1 ? out.view({kLengths[i] * kC}) : out;
          };
        run_pipeline(pipe, PipeSchedule::one_f_one_b, 2, callbacks);
      },
      /*expect_errors=*/true, /*timeout_s=*/2);
  CHECK_THAT(errors[0], Catch::Contains("pipeline stage 0 (world rank 0): its forward of "
                                        "micro-batch 1 returned f32(30)@cpu") &&
                            Catch::Contains("activation shape (5, 6)"));
  CHECK_THAT(errors[1], Catch::Contains("pipeline stage 0 (world rank 0)"));
}

}  // namespace tandem::trainer
