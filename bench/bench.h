// Benchmarks behind `tandem bench <what> --json`: one JSON object per measurement, in the format
// of DESIGN.md (bench, case, metric, unit, value; peer, peer_value, ratio; limit,
// fraction_of_limit).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "kernels/ops.h"

namespace tandem {
class Communicator;
}  // namespace tandem

namespace tandem::bench {

// What the machine can do at best, measured at the start of a run.
#if TANDEM_HAS_OPENBLAS
// The OpenBLAS peer's name with the kernels it picked ("openblas SkylakeX"). OpenBLAS falls back
// to its SSE3 "Prescott" kernels on a CPU model it does not know; then this warns once in
// the log, naming OPENBLAS_CORETYPE, since such a peer is far below the machine's sgemm rate.
std::string openblas_peer();
#endif

struct Ceilings {
  double gflops = 0;  // f32 sgemm peak on CPU (the best of the measured GEMMs); bf16 cuBLAS on CUDA
  double gbytes = 0;  // memory bandwidth (triad on CPU; device-to-device copy on CUDA)
  std::string gflops_source, gbytes_source;
};

struct Options {
  bool json = false;
  bool quick = false;        // fewer repetitions and shapes (CI smoke runs)
  double min_seconds = 0.3;  // time spent per measurement
  std::string filter;        // only cases whose op or case contains this
  Device device = Device::cpu();
  // generate, rollout: the CPU matmul precision they run in (train and step measure both
  // themselves, kernels has its own bf16 cases). Named in each case as " bf16 compute <path>"
  // (bf16_compute_name) when not f32.
  ops::MatmulPrecision cpu_matmul = ops::MatmulPrecision::f32;
  // Every bench: the CPU matmuls' inner kernel and f32 backward products (ops::set_matmul_kernel,
  // ops::set_matmul_backward; a job's placement.cpu_matmul_kernel and _backward in bench step).
  ops::MatmulKernel cpu_matmul_kernel = ops::MatmulKernel::automatic;
  ops::MatmulBackward cpu_matmul_backward = ops::MatmulBackward::outer;
  // train: data-parallel ranks (threads of this process) training at every sharding level; 0:
  // the one-rank step beside PyTorch. link_gbps, link_latency_us: the emulated link of the second
  // set of rows (0 gbps: loopback only).
  int ranks = 0;
  double link_gbps = 10, link_latency_us = 50;
  std::string precision_suffix() const;
};

// "bf16 compute amx", "bf16 compute avx512bf16" or "bf16 compute f32-kernel": the bf16 precision
// with the hardware its CPU products take now (ops::matmul_bf16_path).
std::string bf16_compute_name();
// The CPU's model name as Linux reports it, with its family and model numbers (/proc/cpuinfo:
// "Intel(R) Xeon(R) Processor (family 6 model 207)"), for the "cpu" field of rows.
std::string cpu_model();
// The ISA paths the CPU matmuls take in this process: "f32 avx512, bf16 amx" (see
// ops::matmul_f32_path_name, ops::matmul_bf16_path_name), for the "isa" field of rows.
std::string cpu_isa();
// Adds "cpu" and "isa" to a row measured on the CPU (every bench's rows carry them).
void add_machine(const Options& opt, nlohmann::ordered_json& j);

// One measured case: median seconds of `run` over repetitions.
struct Measurement {
  std::string bench;      // "kernels"
  std::string op;         // "matmul"
  std::string case_name;  // "smollm2 qkv (512, 576)x(960, 576) f32"
  double seconds = 0;
  double flops = 0;  // work of one run (0: not a compute-bound op)
  double bytes = 0;  // bytes one run must move at least (0: not counted)
  std::optional<std::string> peer;
  double peer_seconds = 0;
};

class Runner {
 public:
  Runner(Options opt, Ceilings ceilings) : opt_(std::move(opt)), ceilings_(std::move(ceilings)) {}
  const Options& options() const { return opt_; }
  const Ceilings& ceilings() const { return ceilings_; }
  Device device() const { return opt_.device; }

  // Whether a case is selected by --filter.
  bool wants(const std::string& op, const std::string& case_name) const;
  // Median seconds per call of fn (synchronised with the device after each call).
  double time(const std::function<void()>& fn) const;
  // Times fn (and the peer's function, if given) and prints the result lines.
  void measure(const std::string& op, const std::string& case_name, double flops, double bytes,
               const std::function<void()>& fn, const std::string& peer = "",
               const std::function<void()>& peer_fn = {});
  void emit(const Measurement& m);
  int emitted() const { return emitted_; }
  int errors() const { return errors_; }

 private:
  Options opt_;
  Ceilings ceilings_;
  int emitted_ = 0;
  int errors_ = 0;
};

// The kernel benchmarks of one op family; registered with TANDEM_KERNEL_BENCH.
using KernelBench = std::function<void(Runner&)>;
int add_kernel_bench(const std::string& family, KernelBench fn);

Ceilings measure_ceilings(const Options& opt);
// The CPU sgemm rate alone (the faster of our GEMM and OpenBLAS on a square f32 problem), in
// GFLOP/s, and where it came from; a bench takes it again next to each measured step when the
// machine's speed drifts.
std::pair<double, std::string> measure_cpu_gemm_ceiling(const Options& opt);
// The same for the bf16 precision of the CPU matmul (ops::MatmulPrecision::bf16): our
// matmul on a square problem (AMX where the CPU has it).
std::pair<double, std::string> measure_cpu_bf16_gemm_ceiling(const Options& opt);
// `tandem bench kernels`: every registered family on opt.device; returns the exit code.
int run_kernel_benches(const Options& opt);
// `tandem bench generate`: batch-1 generation with a model file (default: the bundled SmolLM2),
// beside llama.cpp; returns the exit code.
int run_generate_bench(const Options& opt, const std::string& model_path);
// `tandem bench rollout`: the rollout engine at batch 1..64 beside llama.cpp's batched API, and
// group prefix sharing; returns the exit code.
int run_rollout_bench(const Options& opt, const std::string& model_path);
// `tandem bench train`: training tokens/s beside PyTorch and the FLOP ceiling.
int run_train_bench(const Options& opt, const std::string& model_path);
// `tandem bench step`: seconds per GRPO step of the colocated job, by phase, beside TRL's
// GRPOTrainer on the same model, prompts and lengths.
int run_step_bench(const Options& opt, const std::string& model_path);

// `tandem bench overlap`: a rollout and an update of the colocated job one after the other on
// every core, beside the two at once on two threads (cores split, or shared); returns the exit
// code.
int run_overlap_bench(const Options& opt, const std::string& model_path);

// `tandem bench serve`: N concurrent clients of a rollout server on loopback for a bounded time
// beside the in-process engine on the same requests (tokens/s, p50 and p99 latency); returns
// the exit code.
int run_serve_bench(const Options& opt, const std::string& model_path);

// Helpers of the benchmarks that start ranks: a loopback TCP port free now, and the median.
int free_loopback_port();
double median(std::vector<double> v);
// Runs fn(rank) for every rank of `ranks` at once, each on a thread of this process, and waits
// for them all; a rank's tandem::Error then becomes one error "<what>: <message>".
void on_rank_threads(int ranks, const std::function<void(int rank)>& fn, const std::string& what);
// One Communicator per rank of `ranks`, over Gloo on loopback, the ranks threads of this process
// (errors as on_rank_threads).
std::vector<std::unique_ptr<Communicator>> loopback_communicators(int ranks, double timeout_s,
                                                                  const std::string& what);

// `tandem bench comm`: all-reduce and all-gather bandwidth over Gloo on loopback (2 ranks),
// beside memcpy of the same bytes; returns the exit code.

int run_comm_bench(const Options& opt);
// `tandem bench train --ranks N`: a GRPO update on N ranks at every sharding level, with and
// without overlapped communication, over loopback and an emulated link; returns the exit code.
int run_sharded_train_bench(const Options& opt, const std::string& model_path);
// `tandem bench sync`: weight publishing, one rank f32 -> bf16 beside memcpy, and ZeRO-4 ->
// TP-2 x 2 over Gloo beside a raw all-gather of the same bytes, the bucket size swept; returns
// the exit code.
int run_sync_bench(const Options& opt);
// `tandem bench pipeline`: the pipeline runner's bubble on 2 stages (processes) under 1F1B and
// GPipe beside the theory (P - 1) / (m + P - 1); returns the exit code.
int run_pipeline_bench(const Options& opt);
// `tandem bench tp`: a training step on TP = 2 ranks (processes) beside one rank, with the TP
// group's collectives' seconds, count, share of the step and bytes beside the analytic count;
// returns the exit code.
int run_tp_bench(const Options& opt);

// Seconds fn takes, on the wall clock.
double seconds_of(const std::function<void()>& fn);

// The model shapes the kernel benchmarks use.
struct ModelShape {
  const char* name;
  int64_t C, F, H, Hkv, D, V;
};
inline constexpr ModelShape kSmolLM2_135M{"smollm2-135m", 576, 1536, 9, 3, 64, 49152};
inline constexpr ModelShape kQwen25_1_5B{"qwen2.5-1.5b", 1536, 8960, 12, 2, 128, 151936};

}  // namespace tandem::bench

#define TANDEM_KERNEL_BENCH(family)                                             \
  static void tandem_kernel_bench_##family(::tandem::bench::Runner&);           \
  [[maybe_unused]] static const int tandem_kernel_bench_registered_##family =   \
      ::tandem::bench::add_kernel_bench(#family, tandem_kernel_bench_##family); \
  static void tandem_kernel_bench_##family(::tandem::bench::Runner& runner)
