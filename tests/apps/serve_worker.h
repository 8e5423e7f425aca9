// `tandem serve` workers of a tiny model for the tests of the disaggregated job and of the
// served worker.
#pragma once

#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "tests/testutil.h"

namespace tandem::test {

// `tandem serve` of the worker config file `config`, with `token` in WORKER_TOKEN when it is not
// empty; its port once it listens.
inline int serve(std::unique_ptr<Subprocess>& worker, const std::string& config,
                 const std::string& token = "") {
  std::vector<std::string> argv{std::string(TANDEM_BIN_DIR) + "/tandem", "serve", config};
  if (!token.empty()) argv.insert(argv.begin(), {"/usr/bin/env", "WORKER_TOKEN=" + token});
  worker = std::make_unique<Subprocess>(argv);
  const std::string line = worker->wait_for_line("listening on ", 30000);
  INFO("worker: " << worker->output());
  REQUIRE(!line.empty());
  return std::stoi(line.substr(13));
}

// `tandem serve` of `model` (its weights in `dtype`) on loopback port `port` (0: a free one),
// requiring `token` when it is not empty; its port.
inline int start_worker(std::unique_ptr<Subprocess>& worker, const TempDir& tmp,
                        const std::string& model, const std::string& dtype = "f32",
                        const std::string& token = "", int port = 0) {
  const std::string config =
      tmp.write("serve-" + dtype + ".toml",
                fmt::format(R"([model]
path = "{}"
dtype = "{}"
[engine]
num_blocks = 256
max_context = 256
[server]
port = {}
token_env = "{}"
[limits]
max_prompt_tokens = 128
max_new_tokens = 64
max_n = 8
)",
                            model, dtype, port, token.empty() ? "" : "WORKER_TOKEN"));
  return serve(worker, config, token);
}

// The keys of a disaggregated job on the workers at ports port0 and port1 of loopback.
inline std::string disaggregated(int port0, int port1) {
  return fmt::format(
      "placement.mode=disaggregated 'placement.workers=[\"127.0.0.1:{}\", \"127.0.0.1:{}\"]' "
      "placement.request_timeout_ms=30000",
      port0, port1);
}

}  // namespace tandem::test
