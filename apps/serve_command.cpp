// `tandem serve`: load and check the serve config (with overrides), load the model, serve it
// until SIGTERM or SIGINT, then drain the calls in flight and exit.
#include "apps/serve_command.h"

#include <pthread.h>
#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>

#include "core/config.h"
#include "core/error.h"
#include "core/memory_available.h"
#include "model/loader.h"
#include "model/prompt.h"
#include "rollout/engine_memory.h"
#include "rollout/service/serve_config.h"
#include "rollout/service/server.h"

namespace tandem::apps {
namespace {

std::string config_path;
std::vector<std::string> overrides;
bool print_config = false;
CLI::App* serve_cmd = nullptr;

}  // namespace

void add_serve_command(CLI::App& app) {
  serve_cmd =
      app.add_subcommand("serve", "serve the rollout engine over Thrift (a rollout worker)");
  serve_cmd->add_option("config", config_path, "the worker's file (see configs/serve.toml)")
      ->required();
  serve_cmd->add_option("overrides", overrides,
                        "dotted overrides: server.port=9101 limits.max_n=16");
  serve_cmd->add_flag("--print-config", print_config, "print the resolved config and exit");
}

int run_serve_command() {
  if (serve_cmd == nullptr || !serve_cmd->parsed()) return -1;
  const rollout::ServeConfig cfg = rollout::load_serve_config(config_path, overrides);
  if (print_config) {
    std::fputs(config::print_toml(cfg.resolved).c_str(), stdout);
    return 0;
  }
  // SIGTERM and SIGINT are blocked in every thread (the server's inherit the mask) and taken by
  // sigwait below, so the signal always reaches the thread that drains.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  model::LoadedModel m =
      model::load_model(cfg.model_path, cfg.dtype == "bf16" ? DType::bf16 : DType::f32);
  const int64_t positions = m.config().max_position_embeddings;
  if (positions > 0 && cfg.engine.max_context > positions)
    cfg.resolved.fail("engine.max_context", fmt::format("{} exceeds the model's {} positions",
                                                        cfg.engine.max_context, positions));
  rollout::check_engine_memory(
      m.config(), cfg.engine, memory_available(m.weights->device()),
      {fmt::format("engine.num_blocks ({})", cfg.resolved.where("engine.num_blocks")),
       fmt::format("engine.max_batch_tokens ({})", cfg.resolved.where("engine.max_batch_tokens"))});
  const model::PromptFormat format =
      model::prompt_format(m.tok(), cfg.chat_template, cfg.system_prompt);
  const std::string path = m.path;
  rollout::RolloutServer server(std::move(m), format, cfg.engine, cfg.server);
  spdlog::info("rollout server '{}': serving {} on {}:{}{}", cfg.server.name, path, cfg.server.host,
               server.port(), cfg.server.token.empty() ? "" : " (token required)");
  std::printf("listening on %d\n", server.port());
  std::fflush(stdout);

  int signal = 0;
  sigwait(&stop_signals, &signal);
  spdlog::info("rollout server '{}': {}: draining {} calls in flight", cfg.server.name,
               signal == SIGTERM ? "SIGTERM" : "SIGINT", server.stats().in_flight);
  server.drain();
  const rollout::RolloutServer::Stats s = server.stats();
  spdlog::info(
      "rollout server '{}': stopped; {} generate calls accepted, {} answered with samples, {} "
      "overloaded, {} connections refused",
      cfg.server.name, s.accepted, s.generated, s.overloaded, s.refused);
  std::printf("served %lld of %lld accepted\n", static_cast<long long>(s.generated),
              static_cast<long long>(s.accepted));
  std::fflush(stdout);
  return 0;
}

}  // namespace tandem::apps
