// The tandem command: the train, serve, launch, generate, score, convert and bench subcommands,
// and --version.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "apps/launch.h"
#include "apps/model_commands.h"
#include "apps/serve_command.h"
#include "apps/train_command.h"
#include "bench/bench.h"
#include "bench/peers.h"
#include "core/build_info.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/ops.h"

namespace {

// An option naming one of an enum's values, by its name table (kernels/ops.h).
template <class E, size_t N>
CLI::Option* add_choice(CLI::App* app, const std::string& flag, E& value,
                        const tandem::NamedValue<E> (&names)[N], const std::string& help) {
  return app
      ->add_option_function<std::string>(
          flag, [&value, &names](const std::string& name) { value = *value_of(names, name); }, help)
      ->check(CLI::IsMember(tandem::names_of(names)))
      ->default_str(std::string(tandem::name_of(names, value)));
}

void print_version() {
  fmt::print("tandem {} (commit {})\n", tandem::version_string(), tandem::git_commit());
  fmt::print("cuda: {}\n", tandem::cuda_compiled() ? "compiled in" : "not compiled in");
  fmt::print("nccl: {}\n", tandem::nccl_compiled() ? "compiled in" : "not compiled in");
  fmt::print("gpu: {}\n", tandem::gpu_summary());
  // The CPU family and the matmul paths it takes: what makes a seed's results the same on two
  // machines (scripts/demo-table keys the README's per-family demo result on this line).
  fmt::print("cpu: {}; matmul {}\n", tandem::bench::cpu_model(), tandem::bench::cpu_isa());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tandem: GRPO post-training of LLMs, rollout and training in tandem"};
  app.require_subcommand(0, 1);
  // Options of the app (--verbose) are accepted after a subcommand too.
  app.fallthrough();
  bool version = false, verbose = false;
  app.add_flag("--version", version,
               "print the version, commit, compiled-in backends, GPUs and the CPU");
  app.add_flag("-v,--verbose", verbose,
               "errors also name the failed check and its place in tandem's source");

  tandem::bench::Options bench_opt;
  std::string bench_what, bench_device = "cpu";
  CLI::App* bench = app.add_subcommand("bench", "measure tandem (and peers side by side)");
  std::string bench_model;
  bench
      ->add_option(
          "what", bench_what,
          "what to measure: kernels, generate, rollout, train, step, comm, sync, serve, pipeline, "
          "tp, overlap")
      ->required()
      ->check(CLI::IsMember({"kernels", "generate", "rollout", "train", "step", "comm", "sync",
                             "serve", "pipeline", "tp", "overlap"}));
  bench->add_option(
      "--model", bench_model,
      "generate, rollout, train, step, serve, overlap: the model (default: bundled SmolLM2)");
  bench->add_flag("--json", bench_opt.json, "one JSON object per measurement");
  bench->add_flag("--quick", bench_opt.quick, "small sizes and few repetitions (smoke test)");
  bench->add_option("--filter", bench_opt.filter, "only cases whose op or case contains this");
  bench->add_option("--device", bench_device, "cpu or cuda[:N]");
  bench->add_option("--min-seconds", bench_opt.min_seconds, "time spent on each measurement");
  bench
      ->add_option("--ranks", bench_opt.ranks,
                   "train: data-parallel ranks (threads of this process) training at every "
                   "sharding level, with and without overlapped communication")
      ->check(CLI::Range(2, 64));
  bench
      ->add_option("--link-gbps", bench_opt.link_gbps,
                   "train --ranks: the emulated link of the second set of rows, Gbit/s (0: "
                   "loopback only)")
      ->check(CLI::NonNegativeNumber);
  bench
      ->add_option("--link-latency-us", bench_opt.link_latency_us,
                   "train --ranks: the emulated link's latency per ring step, microseconds")
      ->check(CLI::NonNegativeNumber);
  std::string bench_peer_python;
  bench->add_option("--peer-python", bench_peer_python,
                    "the Python interpreter of the peers (default: .venv-bench/bin/python of the "
                    "checkout, made by scripts/bench-peers)");
  add_choice(bench, "--cpu-matmul", bench_opt.cpu_matmul, tandem::ops::kMatmulPrecisionNames,
             "generate, rollout: CPU matmul precision, f32 or bf16 (train and step measure both)");
  add_choice(bench, "--cpu-matmul-kernel", bench_opt.cpu_matmul_kernel,
             tandem::ops::kMatmulKernelNames,
             "CPU matmul inner kernel: auto, avx512bf16 (bf16 skips AMX) or portable (the job's "
             "placement.cpu_matmul_kernel)");
  add_choice(bench, "--cpu-matmul-backward", bench_opt.cpu_matmul_backward,
             tandem::ops::kMatmulBackwardNames,
             "f32 CPU backward products: outer or transpose (the job's "
             "placement.cpu_matmul_backward)");

  tandem::apps::add_model_commands(app);
  tandem::apps::add_train_command(app);
  tandem::apps::add_serve_command(app);
  tandem::apps::add_launch_command(app);

  CLI11_PARSE(app, argc, argv);
  if (!version && app.get_subcommands().empty()) {
    std::fputs(app.help().c_str(), stderr);
    return 1;
  }
  try {
    tandem::init_logging();
    if (version) {
      print_version();
      return 0;
    }
    if (const int rc = tandem::apps::run_model_commands(); rc >= 0) return rc;
    if (const int rc = tandem::apps::run_train_command(); rc >= 0) return rc;
    if (const int rc = tandem::apps::run_serve_command(); rc >= 0) return rc;
    if (const int rc = tandem::apps::run_launch_command(); rc >= 0) return rc;
    if (bench->parsed()) {
      if (bench_device.rfind("cuda", 0) == 0) {
        const int index = bench_device.size() > 5 ? std::stoi(bench_device.substr(5)) : 0;
        bench_opt.device = tandem::Device::cuda(index);
      } else {
        TANDEM_CHECK(bench_device == "cpu", "--device '{}': use cpu or cuda[:N]", bench_device);
      }
      tandem::bench::set_peer_python(bench_peer_python);
      // The precision applies to generate and rollout only; the kernels to every bench.
      const bool own_precision = bench_what == "generate" || bench_what == "rollout";
      const tandem::ops::ScopedMatmulSettings matmul(
          {own_precision ? bench_opt.cpu_matmul : tandem::ops::MatmulPrecision::f32,
           bench_opt.cpu_matmul_kernel, bench_opt.cpu_matmul_backward});
      if (bench_what == "comm") return tandem::bench::run_comm_bench(bench_opt);
      if (bench_what == "sync") return tandem::bench::run_sync_bench(bench_opt);
      if (bench_what == "pipeline") return tandem::bench::run_pipeline_bench(bench_opt);
      if (bench_what == "tp") return tandem::bench::run_tp_bench(bench_opt);
      if (bench_what == "serve") return tandem::bench::run_serve_bench(bench_opt, bench_model);
      if (bench_what == "train" && bench_opt.ranks > 0)
        return tandem::bench::run_sharded_train_bench(bench_opt, bench_model);
      if (bench_what == "train") return tandem::bench::run_train_bench(bench_opt, bench_model);
      if (bench_what == "step") return tandem::bench::run_step_bench(bench_opt, bench_model);
      if (bench_what == "overlap") return tandem::bench::run_overlap_bench(bench_opt, bench_model);
      if (bench_what == "rollout") return tandem::bench::run_rollout_bench(bench_opt, bench_model);
      if (bench_what == "generate")
        return tandem::bench::run_generate_bench(bench_opt, bench_model);
      return tandem::bench::run_kernel_benches(bench_opt);
    }
  } catch (...) {
    // Every failure, whatever its type, ends as one line and exit status 1, never an abort.
    std::fprintf(stderr, "tandem: error: %s\n", tandem::current_error_line(verbose).c_str());
    return 1;
  }
  return 0;
}
