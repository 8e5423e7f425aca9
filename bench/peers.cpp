// Peers of the model benchmarks.
#include "bench/peers.h"

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <cstdlib>

namespace tandem::bench {

namespace fs = std::filesystem;

fs::path repo_root() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::current_path() : exe.parent_path().parent_path().parent_path();
}

namespace {

std::string g_peer_python;

std::string peer_python() {
  return !g_peer_python.empty() ? g_peer_python
                                : (repo_root() / ".venv-bench" / "bin" / "python").string();
}

}  // namespace

void set_peer_python(const std::string& path) { g_peer_python = path; }

nlohmann::json run_peer_script(const std::string& script, const std::string& args) {
  const std::string python = peer_python();
  if (!fs::exists(python)) {
    return {{"error", fmt::format("{} not found: run scripts/bench-peers to install "
                                  "llama-cpp-python (or give --peer-python)",
                                  python)}};
  }
  const std::string cmd = fmt::format("'{}' '{}' {} 2>/dev/null", python,
                                      (repo_root() / "bench" / "peers" / script).string(), args);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {{"error", "cannot start " + python}};
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), static_cast<int>(buf.size()), p) != nullptr) out += buf.data();
  const int status = pclose(p);
  try {
    return nlohmann::json::parse(out);
  } catch (const nlohmann::json::exception&) {
    return {{"error", fmt::format("{} exited with {} and printed '{}'", script, status, out)}};
  }
}

std::string precision_gguf(const std::string& gguf, DType dtype) {
  const std::string tag = dtype == DType::bf16 ? "BF16" : "F32";
  std::string stem = fs::path(gguf).stem().string();
  if (const size_t dot = stem.rfind('.'); dot != std::string::npos) stem = stem.substr(0, dot);
  const fs::path out = repo_root() / "models" / "peers" / (stem + "." + tag + ".gguf");
  if (fs::exists(out)) return out.string();
  if (!fs::exists(peer_python())) return "";
  fs::create_directories(out.parent_path());
  const std::string cmd =
      fmt::format("'{}' '{}' '{}' '{}' {} >/dev/null 2>&1", peer_python(),
                  (repo_root() / "bench" / "peers" / "requant_gguf.py").string(), gguf,
                  out.string() + ".tmp", dtype == DType::bf16 ? "bf16" : "f32");
  if (std::system(cmd.c_str()) != 0) return "";
  fs::rename(out.string() + ".tmp", out);
  return out.string();
}

void print_line(const Options& opt, const nlohmann::ordered_json& row) {
  nlohmann::ordered_json j = row;
  if (!j.contains("error")) add_machine(opt, j);
  if (opt.json) {
    std::printf("%s\n", j.dump().c_str());
  } else if (j.contains("error")) {
    std::printf("%s: error: %s\n", j["case"].get<std::string>().c_str(),
                j["error"].get<std::string>().c_str());
  } else {
    std::printf("%-10s %-44s %-22s %10.2f %-9s%s\n", j["bench"].get<std::string>().c_str(),
                j["case"].get<std::string>().c_str(), j["metric"].get<std::string>().c_str(),
                j["value"].get<double>(), j["unit"].get<std::string>().c_str(),
                j.contains("ratio")
                    ? fmt::format("  {} {:.2f} ({:.2f}x)", j["peer"].get<std::string>(),
                                  j["peer_value"].get<double>(), j["ratio"].get<double>())
                          .c_str()
                    : "");
  }
  std::fflush(stdout);
}

}  // namespace tandem::bench
