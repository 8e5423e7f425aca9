// The serve config's schema, its reading into ServeConfig and the checks across keys.
#include "rollout/service/serve_config.h"

#include <cstdlib>

#include "core/error.h"

namespace tandem::rollout {
namespace {

using config::boolean;
using config::integer;
using config::real;
using config::text;

std::shared_ptr<const config::Schema> make_schema() {
  auto s = std::make_shared<config::Schema>();
  const EngineOptions e;
  const ServerOptions v;
  s->describe("model", "The model the worker serves.");
  s->add(text("model.path", "", "A GGUF file or a Hugging Face model directory.")).must_set();
  s->add(text("model.chat_template", "auto",
              "How chat messages are rendered: \"auto\" (the model's own), \"none\", \"chatml\", "
              "\"llama3\", \"plain\", or a ChatML or Llama 3 Jinja template file."));
  s->add(text("model.system_prompt", "",
              "Inserted first into a conversation that has no system message (\"\": the "
              "template's default)."));
  s->add(text("model.dtype", "f32", "The engine's weights.")).one_of({"f32", "bf16"});
  s->add(integer("model.tp_size", 1,
                 "Devices one replica spans (tensor parallel); 1 is the only size served now."))
      .range(1, 1);
  s->describe("engine", "The rollout engine (docs/rollout.md).");
  s->add(integer("engine.block_size", e.block_size, "Tokens per KV block.")).range(1, 1024);
  s->add(integer("engine.num_blocks", e.num_blocks, "KV blocks in the cache.")).range(1, 1e8);
  s->add(integer("engine.max_batch_tokens", e.max_batch_tokens,
                 "Tokens computed per engine step (prefill chunks and decodes)."))
      .range(1, 1e7);
  s->add(integer("engine.max_seqs", e.max_seqs, "Sequences per engine step.")).range(1, 1e6);
  s->add(integer("engine.max_context", e.max_context,
                 "Prompt and new tokens of one sample at most (at most the model's positions)."))
      .range(1, 1e8);
  s->add(boolean("engine.prefix_cache", e.prefix_cache,
                 "Keep computed prompt blocks for later prompts that start alike."));
  s->describe("server", "Where and how the worker listens.");
  s->add(text("server.host", v.host,
              "The address to bind; any address but a loopback one requires a token."));
  s->add(integer("server.port", 9100, "The port; 0 picks a free one (printed at start)."))
      .range(0, 65535);
  s->add(text("server.token_env", "",
              "The environment variable holding the shared token every call must carry (\"\": "
              "no token; only on a loopback address)."));
  s->add(text("server.name", v.name, "The worker's name in info() and in the log."));
  s->add(integer("server.max_connections", v.max_connections,
                 "Connections served at once; further clients wait to be accepted."))
      .range(1, 65536);
  s->add(integer("server.idle_timeout_ms", v.idle_timeout_ms,
                 "A connection silent this long is closed."))
      .range(1, 2147483647);
  s->add(integer("server.log_interval_s", v.log_interval_s,
                 "One log line per this many seconds that saw work."))
      .range(1, 1e7);
  s->describe("limits",
              "Bounds of one request; a request over one is refused (InvalidRequest), "
              "a call over max_in_flight is refused with Overloaded.");
  s->add(integer("limits.max_in_flight", v.max_in_flight, "Generate calls admitted at once."))
      .range(1, 1 << 20);
  s->add(integer("limits.max_prompt_tokens", v.max_prompt_tokens, "Prompt tokens of a request."))
      .range(1, 1 << 24);
  s->add(integer("limits.max_new_tokens", v.max_new_tokens, "max_tokens of a request."))
      .range(1, 1 << 24);
  s->add(integer("limits.max_n", v.max_n, "Samples of one request.")).range(1, 65536);
  s->add(integer("limits.max_stop", v.max_stop, "Stop strings, and stop ids, of one request."))
      .range(0, 1024);
  s->add(integer("limits.max_message_bytes", v.max_message_bytes,
                 "One request frame; a bigger one closes its connection."))
      .range(1024, 2147483647);
  s->add(real("limits.weight_update_timeout_s", v.weight_update_timeout_s,
              "A weight update whose commit does not come within this many seconds of its "
              "begin is abandoned: the worker generates under the weights it had "
              "(stats().weight_updates_abandoned)."))
      .range(std::nullopt, 86400)
      .above(0);
  return s;
}

ServeConfig from_config(config::Config c) {
  ServeConfig s;
  s.model_path = c.get_string("model.path");
  s.chat_template = c.get_string("model.chat_template");
  s.system_prompt = c.get_string("model.system_prompt");
  s.dtype = c.get_string("model.dtype");
  s.tp_size = c.get_int("model.tp_size");
  s.engine.block_size = c.get_int("engine.block_size");
  s.engine.num_blocks = c.get_int("engine.num_blocks");
  s.engine.max_batch_tokens = c.get_int("engine.max_batch_tokens");
  s.engine.max_seqs = c.get_int("engine.max_seqs");
  s.engine.max_context = c.get_int("engine.max_context");
  s.engine.prefix_cache = c.get_bool("engine.prefix_cache");
  ServerOptions& v = s.server;
  v.host = c.get_string("server.host");
  v.port = static_cast<int>(c.get_int("server.port"));
  v.name = c.get_string("server.name");
  v.max_connections = c.get_int("server.max_connections");
  v.idle_timeout_ms = c.get_int("server.idle_timeout_ms");
  v.log_interval_s = c.get_int("server.log_interval_s");
  v.max_in_flight = c.get_int("limits.max_in_flight");
  v.max_prompt_tokens = c.get_int("limits.max_prompt_tokens");
  v.max_new_tokens = c.get_int("limits.max_new_tokens");
  v.max_n = c.get_int("limits.max_n");
  v.max_stop = c.get_int("limits.max_stop");
  v.max_message_bytes = c.get_int("limits.max_message_bytes");
  v.weight_update_timeout_s = c.get_float("limits.weight_update_timeout_s");
  s.token_env = c.get_string("server.token_env");
  if (!s.token_env.empty()) {
    // The token stays out of the config file (and of --print-config and the logs).
    const char* token = std::getenv(s.token_env.c_str());
    if (token == nullptr || *token == '\0')
      c.fail("server.token_env",
             fmt::format("the environment variable {} is not set; export it with the token",
                         s.token_env));
    v.token = token;
  }
  if (v.token.empty() && !is_loopback_host(v.host))
    c.fail("server.host",
           fmt::format("'{}' is not a loopback address and no token is set: a worker reachable "
                       "from other machines requires one (set server.token_env), or bind "
                       "127.0.0.1",
                       v.host));
  if (v.max_prompt_tokens + 1 > s.engine.max_context)
    c.fail("limits.max_prompt_tokens",
           fmt::format("{} prompt tokens leave no room for a new token in engine.max_context {}",
                       v.max_prompt_tokens, s.engine.max_context));
  if (v.max_n > s.engine.max_seqs)
    c.fail("limits.max_n", fmt::format("{} samples of one request exceed engine.max_seqs {}",
                                       v.max_n, s.engine.max_seqs));
  s.resolved = std::move(c);
  return s;
}

}  // namespace

std::shared_ptr<const config::Schema> serve_schema() {
  static const std::shared_ptr<const config::Schema> schema = make_schema();
  return schema;
}

ServeConfig load_serve_config(const std::string& path, std::span<const std::string> overrides) {
  return from_config(config::load(serve_schema(), path, overrides));
}

ServeConfig parse_serve_config(std::string_view text, const std::string& source,
                               std::span<const std::string> overrides) {
  return from_config(config::parse(serve_schema(), text, source, overrides));
}

std::string serve_config_markdown() { return config::markdown(*serve_schema()); }

}  // namespace tandem::rollout
