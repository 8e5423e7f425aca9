// The config of `tandem serve`: the schema of a rollout worker's TOML file (model, engine,
// server, limits), its typed form ServeConfig, loading with dotted overrides and the checks
// across keys, and the schema as Markdown for docs/serve.md.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "core/config.h"
#include "rollout/engine.h"
#include "rollout/service/server.h"

namespace tandem::rollout {

struct ServeConfig {
  std::string model_path;              // a GGUF file or an HF model directory (required)
  std::string chat_template = "auto";  // for chat messages: "auto", "none", a format, a file
  std::string system_prompt;           // inserted when a conversation has none
  std::string dtype = "f32";           // the engine's weights
  int64_t tp_size = 1;                 // devices per replica (1 on CPU)
  EngineOptions engine;
  ServerOptions server;     // server.token is read from the environment (token_env)
  std::string token_env;    // the variable holding the token ("" : none)
  config::Config resolved;  // every key with its origin, for --print-config and messages
};

std::shared_ptr<const config::Schema> serve_schema();

// Loads and checks a serve config; every problem in one tandem::Error naming file:line:col or
// the override. Reads the token from the environment variable token_env names.
ServeConfig load_serve_config(const std::string& path, std::span<const std::string> overrides = {});
ServeConfig parse_serve_config(std::string_view text, const std::string& source,
                               std::span<const std::string> overrides = {});

// The schema as the Markdown tables of docs/serve.md.
std::string serve_config_markdown();

}  // namespace tandem::rollout
