// `tandem bench tp`: the communication share of a tensor-parallel training step. One training step
// (trainer::PolicyTrainer: forward, backward and the ShardedAdamW update) of a random Llama-shaped
// model on TP = 2 ranks, two processes forked from the bench (one thread, one core each on a
// 2-core machine) over Gloo on loopback, beside the same step of the whole model on one rank
// (tp = 1, one thread: rank 0 runs it while rank 1 waits). The TP group's calls are counted
// (Communicator::set_call_stats): their seconds, count and bytes a step, their share of the step,
// and the bytes all-reduced and all-gathered beside model::tp_training_collectives. A call's
// seconds include the wait for the other rank, so the share is what the step spends in collectives,
// transfer and imbalance together.
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
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/forked_ranks.h"
#include "bench/peers.h"
#include "core/comm.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "trainer/lr_schedule.h"
#include "trainer/optimizer.h"
#include "trainer/train_step.h"

namespace tandem::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kTp = 2;

// The model and the batch: `groups` prompts of `prompt` tokens with G completions of
// `completion` tokens each; a group is one micro-batch (its prompt packed once).
struct Shape {
  int64_t C, F, L, H, Hkv, D, V;
  int groups, G, prompt, completion;
  // A micro-batch's T: the prompt but its last token once, then each pair's last prompt token and
  // completion but its last token (PackedBatch::from_prompts, rows_added).
  int64_t rows() const { return prompt - 1 + int64_t{G} * completion; }
  int64_t head_rows() const { return int64_t{G} * completion; }  // its R
};

Shape shape_for(const Options& opt) {
  if (opt.quick) return {256, 768, 2, 4, 2, 64, 4096, 2, 4, 16, 16};
  return {512, 1536, 4, 8, 2, 64, 8192, 2, 4, 32, 32};
}

model::ModelConfig config_of(const Shape& s) {
  model::ModelConfig c;
  c.arch = model::Architecture::llama;
  c.vocab_size = s.V;
  c.hidden_size = s.C;
  c.intermediate_size = s.F;
  c.num_layers = s.L;
  c.num_heads = s.H;
  c.num_kv_heads = s.Hkv;
  c.head_dim = s.D;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = true;
  return c;
}

// Norms 1, every matrix uniform on [-a, a] with a^2 / 3 = 1 / C: activations of unit scale, no
// denormals to slow the products down.
void fill_weights(model::Weights& w) {
  std::mt19937 gen(29);
  const float a = std::sqrt(3.0f / static_cast<float>(w.config().hidden_size));
  std::uniform_real_distribution<float> u(-a, a);
  for (const model::NamedTensor& n : w.storage()) {
    float* p = n.tensor.data_as<float>();
    const bool norm = n.name.find("norm") != std::string::npos;
    for (int64_t i = 0; i < n.tensor.numel(); ++i) p[i] = norm ? 1.0f : u(gen);
  }
}

std::vector<trainer::TrainSample> batch_of(const Shape& s) {
  std::mt19937 gen(31);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(s.V - 1));
  std::vector<trainer::TrainSample> out;
  for (int g = 0; g < s.groups; ++g) {
    std::vector<int32_t> prompt(static_cast<size_t>(s.prompt));
    for (int32_t& t : prompt) t = token(gen);
    for (int i = 0; i < s.G; ++i) {
      trainer::TrainSample sample;
      sample.prompt = prompt;
      sample.completion.resize(static_cast<size_t>(s.completion));
      for (int32_t& t : sample.completion) t = token(gen);
      sample.rollout_logp.assign(sample.completion.size(), -9.0f);
      sample.advantage = static_cast<float>(i % 3) - 1.0f;
      sample.group = g;
      out.push_back(std::move(sample));
    }
  }
  return out;
}

// Each measured step of one rank: its seconds and the TP group's calls during it.
struct Steps {
  std::vector<double> seconds;
  std::vector<CallStats> calls;
  int64_t packed_tokens = 0;
};

// A warm-up step, then `reps` measured ones, of `weights` (the whole model, or this rank's shard
// when tp is set) on this process's thread.
Steps train_steps(const model::Weights& weights, int64_t kv_heads, Communicator* tp, int reps,
                  const Shape& s, const std::vector<trainer::TrainSample>& batch) {
  model::Weights w(weights.config(), DType::f32);
  w.copy_from(weights);
  trainer::ShardOptions so;
  so.model_parallel = tp;               // at pp = 1 the model-parallel group is the TP group
  if (tp != nullptr && tp->rank() > 0)  // TP rank 0 counts the replicated norms
    for (const model::NamedTensor& n : w.storage())
      if (n.name.find("norm") != std::string::npos) so.norm_excluded.push_back(n.name);
  trainer::ShardedAdamW optimizer(w, nullptr, {}, so);
  const trainer::LrSchedule lr(trainer::LrScheduleConfig{.lr = 1e-5f});
  trainer::TrainStepConfig tc;
  tc.micro_batch_tokens = s.rows();
  tc.loss.kl_beta = 0;
  trainer::PolicyTrainer trainer(optimizer, nullptr, lr, tc,
                                 trainer::ModelParallel{.tp = tp, .tp_kv_heads = kv_heads});
  trainer.step(batch);  // warm-up: the arenas, the packed weights, the optimizer's state
  Steps out;
  for (int rep = 0; rep < reps; ++rep) {
    CallStats& calls = out.calls.emplace_back();
    if (tp != nullptr) {
      tp->barrier();  // the ranks start together (not counted)
      tp->set_call_stats(&calls);
    }
    const auto t0 = Clock::now();
    const trainer::TrainStepMetrics m = trainer.step(batch);
    out.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (tp != nullptr) tp->set_call_stats(nullptr);
    out.packed_tokens = m.packed_tokens;
  }
  return out;
}

double loadavg_1m() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

// The median over steps of f(step index).
template <class F>
double median_of(size_t steps, F f) {
  std::vector<double> v;
  for (size_t i = 0; i < steps; ++i) v.push_back(f(i));
  return median(v);
}

// One rank's part; rank 0 also runs the one-rank step first, and prints the rows.
void run_rank(Communicator& tp, const Options& opt) {
  const int rank = tp.rank();

  const Shape s = shape_for(opt);
  const model::ModelConfig cfg = config_of(s);
  model::Weights full(cfg, DType::f32);
  fill_weights(full);
  const std::vector<trainer::TrainSample> batch = batch_of(s);
  const int reps = opt.quick ? 2 : 5;

  Steps one;
  if (rank == 0) one = train_steps(full, 0, nullptr, reps, s, batch);
  tp.barrier();  // rank 1 waits for the one-rank steps
  const std::unique_ptr<model::Weights> shard = model::cut_tp_shard(full, rank, kTp);
  const Steps two = train_steps(*shard, cfg.num_kv_heads, &tp, reps, s, batch);
  TANDEM_CHECK(two.packed_tokens == s.groups * s.rows(),
               "bench tp: the step packed {} rows, the analytic count assumes {} micro-batches of "
               "{}",
               two.packed_tokens, s.groups, s.rows());

  // Per rank, medians over the steps: step seconds, collective seconds, their share; every
  // rank's gathered (all_gather of 3 f32 a rank over the TP group).
  const size_t n = two.seconds.size();
  const double step_s = median(two.seconds);
  const double comm_s = median_of(n, [&](size_t i) { return two.calls[i].total().seconds; });
  const double share =
      median_of(n, [&](size_t i) { return two.calls[i].total().seconds / two.seconds[i]; });
  Tensor mine = Tensor::empty({3}, DType::f32), all = Tensor::empty({3 * kTp}, DType::f32);
  mine.data_as<float>()[0] = static_cast<float>(step_s);
  mine.data_as<float>()[1] = static_cast<float>(comm_s);
  mine.data_as<float>()[2] = static_cast<float>(share);
  tp.all_gather(mine, all);
  if (rank != 0) return;
  auto per_rank = [&](int k) {
    std::vector<double> v;
    for (int r = 0; r < kTp; ++r) v.push_back(all.data_as<float>()[3 * r + k]);
    return v;
  };
  const std::vector<double> steps = per_rank(0), comms = per_rank(1), shares = per_rank(2);
  const double one_s = median(one.seconds);
  const double two_s = *std::max_element(steps.begin(), steps.end());  // the slower rank's
  double mean_share = 0;
  for (double x : shares) mean_share += x / kTp;

  // The calls of a step are the same every step: the last one's.
  const CallStats& calls = two.calls.back();
  nlohmann::ordered_json by_call = nlohmann::ordered_json::object();
  for (const auto& [call, t] : calls.by_call)
    by_call[call] = {{"calls", t.calls},
                     {"bytes", t.bytes},
                     {"seconds", median_of(n, [&](size_t i) {
                        const auto it = two.calls[i].by_call.find(call);
                        return it == two.calls[i].by_call.end() ? 0.0 : it->second.seconds;
                      })}};
  auto tally = [&](const char* call) {
    const auto it = calls.by_call.find(call);
    return it == calls.by_call.end() ? CallStats::Tally{} : it->second;
  };
  const CallStats::Tally all_reduce = tally("all_reduce"), all_gather = tally("all_gather");
  model::TpCollectives analytic;
  for (int g = 0; g < s.groups; ++g) {
    const model::TpCollectives mb =
        model::tp_training_collectives(cfg, s.rows(), s.head_rows(), kTp, false);
    analytic.reduce_calls += mb.reduce_calls;
    analytic.reduce_bytes += mb.reduce_bytes;
    analytic.gather_calls += mb.gather_calls;
    analytic.gather_bytes += mb.gather_bytes;
  }

  const std::string model_name =
      fmt::format("llama C {} F {} L {} H {} Hkv {} V {} tied, {} micro-batches of T {} R {}", s.C,
                  s.F, s.L, s.H, s.Hkv, s.V, s.groups, s.rows(), s.head_rows());
  const std::string step_what = "training step (forward, backward, AdamW) f32";
  auto row = [&](const std::string& case_name, const char* metric, const char* unit, double value) {
    nlohmann::ordered_json j{
        {"bench", "tp"}, {"case", case_name}, {"metric", metric}, {"unit", unit}, {"value", value}};
    return j;
  };
  auto finish = [&](nlohmann::ordered_json& j) {
    j["packed_tokens"] = two.packed_tokens;
    j["reps"] = reps;
    j["ranks_as"] = "processes, 1 thread each, Gloo on loopback";
    j["loadavg_1m"] = loadavg_1m();
    print_line(opt, j);
    std::fflush(stdout);
  };

  nlohmann::ordered_json base =
      row(fmt::format("tp=1 {} ({})", step_what, model_name), "step_s", "s", one_s);
  finish(base);

  nlohmann::ordered_json step =
      row(fmt::format("tp=2 {} ({})", step_what, model_name), "step_s", "s", two_s);
  step["tp1_step_s"] = one_s;
  step["speedup"] = one_s / two_s;
  step["per_rank_step_s"] = steps;
  finish(step);

  nlohmann::ordered_json comm = row(fmt::format("tp=2 TP group collectives ({})", model_name),
                                    "comm_share", "fraction", mean_share);
  comm["per_rank_share"] = shares;
  comm["comm_s_per_step"] = comms;
  comm["collectives_per_step"] = calls.total().calls;
  comm["bytes_per_step"] = calls.total().bytes;
  comm["by_call"] = by_call;
  finish(comm);

  // The bytes a kind of collective carried beside the analytic count.
  auto bytes_row = [&](const char* what, const char* metric, const CallStats::Tally& measured,
                       int64_t analytic_bytes, int64_t analytic_calls, const char* formula) {
    nlohmann::ordered_json j = row(fmt::format("tp=2 {} bytes a step ({})", what, model_name),
                                   metric, "bytes", static_cast<double>(measured.bytes));
    j["analytic"] = analytic_bytes;
    j["analytic_formula"] = formula;
    j["calls"] = measured.calls;
    j["analytic_calls"] = analytic_calls;
    j["ratio_to_analytic"] =
        static_cast<double>(measured.bytes) / static_cast<double>(analytic_bytes);
    finish(j);
  };
  bytes_row("all-reduced", "all_reduce_bytes", all_reduce, analytic.reduce_bytes,
            analytic.reduce_calls,
            "4 (T C (1 + 2 L) + R C) a micro-batch: embedding rows, 2 (T, C) a layer backward, the "
            "head input gradient (R, C)");
  bytes_row("all-gathered", "all_gather_bytes", all_gather, analytic.gather_bytes,
            analytic.gather_calls,
            "4 tp (2 L T C + 5 R) a micro-batch: the heads' and MLP columns' outputs, 2 (T, C) "
            "from each rank a layer forward (added in rank order), the vocabulary row maxima (R) "
            "and sums (R, 4); the gradient norm's 2 all-gathers a step come on top");
}

}  // namespace

int run_tp_bench(const Options& opt) {
  TANDEM_CHECK(opt.device.is_cpu(), "bench tp runs on the CPU; drop --device {}", opt.device.str());
  return run_forked_ranks("tp", "rank", kTp, 300, [&](Communicator& comm) { run_rank(comm, opt); });
}

}  // namespace tandem::bench
