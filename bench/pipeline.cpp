// `tandem bench pipeline`: the pipeline runner's measured bubble on 2 stages, two processes forked
// from the bench (one thread each, one core each on a 2-core machine) talking over Gloo on
// loopback, under 1F1B and GPipe with m = 1, 2, 4, 8 micro-batches, beside the theory
// (P - 1) / (m + P - 1). Each stage is a chain of (C, C) linear layers sized for ~30 ms a forward;
// its backward runs two products a layer (input and weight gradients), ~2x the forward. The theory
// holds for any forward/backward ratio as long as every stage has the same one (the makespan is
// (m + P - 1)(f + b)), and assumes free transfers: here a (T, C) f32 activation of 256 KiB.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "bench/bench.h"
#include "bench/forked_ranks.h"
#include "bench/peers.h"
#include "core/comm.h"
#include "core/error.h"
#include "core/parallel.h"
#include "trainer/parallel/pipeline_runner.h"

namespace tandem::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using trainer::PipeSchedule;

constexpr int kStages = 2;
constexpr int64_t kT = 128, kC = 512;

// A stage of `layers` linear layers y = x · W^T (no nonlinearity: the products are the cost).
struct MatmulStage {
  bool first, last;
  std::vector<Tensor> w, dw;               // per layer (C, C)
  Tensor x0;                               // (T, C): stage 0's micro-batch
  std::vector<std::vector<Tensor>> saved;  // per micro-batch, each layer's input (T, C)

  MatmulStage(int stage, int layers, int micro_batches)
      : first(stage == 0), last(stage + 1 == kStages), saved(static_cast<size_t>(micro_batches)) {
    // Uniform on [-a, a] with a^2 / 3 = 1 / C keeps the activations' scale through the chain (no
    // denormals to slow the products down).
    std::mt19937 gen(static_cast<uint32_t>(17 + stage));
    const float a = std::sqrt(3.0f / static_cast<float>(kC));
    std::uniform_real_distribution<float> u(-a, a), x(-1, 1);
    for (int l = 0; l < layers; ++l) {
      w.push_back(Tensor::empty({kC, kC}, DType::f32));
      for (int64_t e = 0; e < kC * kC; ++e) w.back().data_as<float>()[e] = u(gen);
      dw.push_back(Tensor::zeros({kC, kC}, DType::f32));
    }
    x0 = Tensor::empty({kT, kC}, DType::f32);
    for (int64_t e = 0; e < kT * kC; ++e) x0.data_as<float>()[e] = x(gen);
  }

  trainer::PipeStage callbacks() {
    trainer::PipeStage st;
    st.activation_shape = [](int) { return Shape{kT, kC}; };
    st.forward = [this](int i, const Tensor& input) {
      Tensor h = first ? x0 : input;
      auto& keep = saved[static_cast<size_t>(i)];
      for (const Tensor& wl : w) {
        keep.push_back(h);
        Tensor y = Tensor::empty({kT, kC}, DType::f32);
        ops::matmul(h, wl, y);
        h = y;
      }
      return last ? Tensor() : h;
    };
    st.backward = [this](int i, const Tensor& grad_output) {
      auto& keep = saved[static_cast<size_t>(i)];
      // The last stage's loss gradient: any (T, C) tensor costs the same; its last layer's input.
      Tensor g = last ? keep.back() : grad_output;
      for (size_t l = w.size(); l-- > 0;) {
        ops::matmul_backward_weight(g, keep[l], dw[l], /*accumulate=*/true);
        Tensor dx = Tensor::empty({kT, kC}, DType::f32);
        ops::matmul_backward_input(g, w[l], dx);
        g = dx;
      }
      keep.clear();
      return first ? Tensor() : g;
    };
    return st;
  }
};

// Layers for ~target_s a forward: one (T, C) x (C, C) product timed here.
int64_t layers_for(double target_s) {
  Tensor x = Tensor::empty({kT, kC}, DType::f32), w = Tensor::empty({kC, kC}, DType::f32),
         y = Tensor::empty({kT, kC}, DType::f32);
  for (int64_t e = 0; e < kT * kC; ++e) x.data_as<float>()[e] = 0.01f * static_cast<float>(e % 97);
  for (int64_t e = 0; e < kC * kC; ++e) w.data_as<float>()[e] = 0.001f * static_cast<float>(e % 89);
  std::vector<double> t;
  for (int rep = 0; rep < 20; ++rep) {
    const auto t0 = Clock::now();
    ops::matmul(x, w, y);
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return std::clamp<int64_t>(static_cast<int64_t>(std::lround(target_s / median(t))), 1, 1000);
}

double loadavg_1m() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

double mean_compute_ms(const trainer::PipeStageReport& r, trainer::PipePass pass) {
  double sum = 0;
  int n = 0;
  for (const trainer::PipeOpTime& op : r.ops)
    if (op.pass.pass == pass) {
      sum += op.compute_s;
      ++n;
    }
  return n > 0 ? 1e3 * sum / n : 0.0;
}

// One stage's part of every case; stage 0 prints the rows.
void run_stage(Communicator& pipe, const Options& opt) {
  const int stage = pipe.rank();

  // Stage 0's calibration, the same on both stages: broadcast of one i64 over the pipeline group.
  Tensor layers = Tensor::empty({1}, DType::i64);
  layers.data_as<int64_t>()[0] = stage == 0 ? layers_for(opt.quick ? 0.01 : 0.03) : 0;
  pipe.broadcast(layers, 0);
  const int L = static_cast<int>(layers.data_as<int64_t>()[0]);
  const int reps = opt.quick ? 1 : 5;
  const std::vector<int> micro_batches =
      opt.quick ? std::vector<int>{1, 2} : std::vector<int>{1, 2, 4, 8};

  for (PipeSchedule schedule : {PipeSchedule::one_f_one_b, PipeSchedule::gpipe}) {
    for (int m : micro_batches) {
      const std::string case_name =
          fmt::format("P={} m={} {} (T {}, C {}, {} layers a stage)", kStages, m,
                      trainer::pipe_schedule_name(schedule), kT, kC, L);
      if (!opt.filter.empty() && case_name.find(opt.filter) == std::string::npos) continue;
      MatmulStage st(stage, L, m);
      const trainer::PipeStage callbacks = st.callbacks();
      trainer::run_pipeline(pipe, schedule, m, callbacks);  // warm-up
      std::vector<double> bubble, stage_bubble, step_ms, fwd_ms, bwd_ms, wait_ms;
      for (int rep = 0; rep < reps; ++rep) {
        const trainer::PipeStageReport r = trainer::run_pipeline(pipe, schedule, m, callbacks);
        bubble.push_back(r.pipeline_bubble_fraction());
        stage_bubble.push_back(r.bubble_fraction());
        step_ms.push_back(1e3 * r.step_wall_s);
        fwd_ms.push_back(mean_compute_ms(r, trainer::PipePass::forward));
        bwd_ms.push_back(mean_compute_ms(r, trainer::PipePass::backward));
        wait_ms.push_back(1e3 * r.wait_s);
      }
      // Every stage's medians: all_gather of 4 f32 per stage over the pipeline group.
      Tensor mine = Tensor::empty({4}, DType::f32), all = Tensor::empty({4 * kStages}, DType::f32);
      const float own[4] = {static_cast<float>(median(stage_bubble)),
                            static_cast<float>(median(fwd_ms)), static_cast<float>(median(bwd_ms)),
                            static_cast<float>(median(wait_ms))};
      std::copy(own, own + 4, mine.data_as<float>());
      pipe.all_gather(mine, all);
      if (stage != 0) continue;
      auto per_stage = [&](int k) {
        std::vector<double> v;
        for (int s = 0; s < kStages; ++s) v.push_back(all.data_as<float>()[4 * s + k]);
        return v;
      };
      const double measured = median(bubble);
      const double theory = trainer::pipeline_bubble_theory(kStages, m);
      nlohmann::ordered_json j{{"bench", "pipeline"},
                               {"case", case_name},
                               {"metric", "bubble_fraction"},
                               {"unit", "fraction"},
                               {"value", measured},
                               {"theory", theory},
                               {"theory_formula", "(P-1)/(m+P-1), equal stages, free transfers"},
                               {"difference_points", 100 * (measured - theory)},
                               {"step_ms", median(step_ms)},
                               {"stage_bubble", per_stage(0)},
                               {"forward_ms", per_stage(1)},
                               {"backward_ms", per_stage(2)},
                               {"wait_ms", per_stage(3)},
                               {"reps", reps},
                               {"stages_as", "processes, 1 thread each"},
                               {"loadavg_1m", loadavg_1m()}};
      print_line(opt, j);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int run_pipeline_bench(const Options& opt) {
  TANDEM_CHECK(opt.device.is_cpu(), "bench pipeline runs on the CPU; drop --device {}",
               opt.device.str());
  return run_forked_ranks("pipeline", "stage", kStages, 120,
                          [&](Communicator& comm) { run_stage(comm, opt); });
}

}  // namespace tandem::bench
