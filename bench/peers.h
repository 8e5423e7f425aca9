// What the model benchmarks (generate, rollout) share: running a peer's Python script from the
// bench venv (scripts/bench-peers), GGUFs of the same weights at another precision, and printing
// a result line.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/bench.h"
#include "core/dtype.h"

namespace tandem::bench {

// The repository root: the tandem binary lives in <root>/build*/bin/.
std::filesystem::path repo_root();
// The Python interpreter of the peers, for the whole run (`tandem bench --peer-python`); empty:
// the bench venv's, <repo>/.venv-bench/bin/python (made by scripts/bench-peers).
void set_peer_python(const std::string& path);
// Runs bench/peers/<script> with args under the peers' Python and returns the JSON object it
// prints, or {"error": why}.
nlohmann::json run_peer_script(const std::string& script, const std::string& args);
// models/peers/<stem>.F32.gguf or .BF16.gguf: the weights of `gguf` at that precision, written
// once by bench/peers/requant_gguf.py. Empty when it cannot be made.
std::string precision_gguf(const std::string& gguf, DType dtype);
// One result line: JSON with --json, else a readable row.
void print_line(const Options& opt, const nlohmann::ordered_json& j);

}  // namespace tandem::bench
