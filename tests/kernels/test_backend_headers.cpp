// Callers reach the kernels through kernels/ops.h only: no source outside kernels/ includes a
// backend's header (kernels/cpu/*, kernels/cuda/*). tests/kernels/ may, for backend internals.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace fs = std::filesystem;

TEST_CASE("no source outside kernels includes a CPU or CUDA backend header", "[unit]") {
  const fs::path repo = TANDEM_SOURCE_DIR;
  int sources = 0;
  std::string offenders;
  // The whole tree but kernels/, tests/kernels/, build trees, hidden folders and links.
  for (auto it = fs::recursive_directory_iterator(repo); it != fs::recursive_directory_iterator();
       ++it) {
    const fs::path rel = fs::relative(it->path(), repo);
    const std::string name = it->path().filename().string();
    if (it->is_symlink() ||
        (it->is_directory() && (rel == "kernels" || rel == "tests/kernels" ||
                                name.rfind("build", 0) == 0 || name[0] == '.'))) {
      it.disable_recursion_pending();
      continue;
    }
    const std::string ext = it->path().extension().string();
    if (!it->is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".cu")) continue;
    ++sources;
    std::ifstream in(it->path());
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.rfind("#include \"kernels/cpu/", 0) == 0 ||
          line.rfind("#include \"kernels/cuda/", 0) == 0)
        offenders += rel.string() + ":" + std::to_string(n) + ": " + line + "\n";
    }
  }
  INFO("include kernels/ops.h instead of:\n" << offenders);
  CHECK(offenders.empty());
  CHECK(sources > 100);
}
