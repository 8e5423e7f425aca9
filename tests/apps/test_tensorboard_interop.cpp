// TensorBoard event files as TensorBoard reads them: a short `tandem train` run's event file, read
// by TensorBoard's own EventAccumulator (tests/apps/read_tensorboard.py), holds every number of
// metrics.jsonl, eval included, at its step, once.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

const fs::path kRepo = TANDEM_SOURCE_DIR;

}  // namespace

TEST_CASE("tensorboard reads every metric of a tandem train run from its event file", "[interop]") {
  if (tandem::test::run_shell("python3 -c 'import tensorboard' 2>&1").status != 0)
    FAIL(
        "python3 cannot import tensorboard: run scripts/setup (it installs tensorboard from PyPI "
        "for this test)");
  REQUIRE(fs::exists(kRepo / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"));
  const tandem::test::TempDir tmp("tensorboard");
  const auto run = tandem::test::run_tandem(tandem::test::short_default_train_args(tmp), true, 300);
  INFO(run.out);
  REQUIRE(run.status == 0);

  const auto read = tandem::test::run_shell("timeout 120 python3 " +
                                            (kRepo / "tests/apps/read_tensorboard.py").string() +
                                            " " + tmp.file("run") + " 2>&1");
  INFO(read.out);
  REQUIRE(read.status == 0);
  const nlohmann::json tb = nlohmann::json::parse(read.out);

  // Every number of every metrics line, at its step, as the float32 TensorBoard stores.
  std::ifstream in(tmp.file("run/metrics.jsonl"));
  std::string line;
  std::map<std::string, int> expected_points;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    const nlohmann::json m = nlohmann::json::parse(line);
    const int64_t step = m["step"].get<int64_t>();
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (it.key() == "step" || !it->is_number()) continue;
      INFO(it.key() << " at step " << step);
      REQUIRE(tb.contains(it.key()));
      ++expected_points[it.key()];
      bool found = false;
      for (const auto& point : tb[it.key()])
        if (point[0].get<int64_t>() == step)
          found = point[1].get<double>() == static_cast<double>(it->get<float>()) ||
                  (std::isnan(point[1].get<double>()) && std::isnan(it->get<double>()));
      CHECK(found);
    }
  }
  CHECK(lines == 5);  // eval at steps 0, 1, 2 and two step lines
  CHECK(expected_points.count("eval/pass@1") == 1);
  CHECK(expected_points.count("loss") == 1);
  // Each tag holds one point per line that had it: nothing written twice.
  for (const auto& [tag, n] : expected_points) {
    INFO(tag);
    CHECK(tb[tag].size() == static_cast<size_t>(n));
  }
}
