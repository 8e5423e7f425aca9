// TensorBoard event files: scalars written and read back, the TFRecord framing's checksums, and a
// resumed run that neither loses nor repeats a step.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/crc32c.h"
#include "tests/testutil.h"
#include "trainer/tensorboard.h"

using namespace tandem::trainer;
namespace fs = std::filesystem;

namespace {

nlohmann::ordered_json line(int64_t step, double loss) {
  return {{"step", step},
          {"loss", loss},
          {"reward/mean", 0.25 * (step - 1)},
          {"note", "text"},
          {"update_skipped", false}};
}

std::string only_event_file(const fs::path& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
      files.push_back(e.path().string());
  REQUIRE(files.size() == 1);
  return files[0];
}

}  // namespace

TEST_CASE("tensorboard writer stores every number of a metrics line at its step", "[unit]") {
  const tandem::test::TempDir tmp("tb-write");
  {
    TensorBoardWriter w(tmp.path.string(), 0);
    for (int64_t s = 1; s <= 3; ++s) w.write(line(s, 1.0 / s), 1000.0 + s);
  }
  const std::vector<Scalar> got = read_scalars(only_event_file(tmp.path));
  REQUIRE(got.size() == 9);  // loss, reward/mean, update_skipped per step; text left out
  CHECK(got[0].step == 1);
  CHECK(got[0].tag == "loss");
  CHECK(got[0].value == 1.0f);
  CHECK(got[0].wall_time == 1001.0);
  CHECK(got[1].tag == "reward/mean");
  CHECK(got[1].value == 0.0f);  // a zero is a value too (TensorBoard skips a value with no kind)
  CHECK(got[4].tag == "reward/mean");
  CHECK(got[4].value == 0.25f);
  CHECK(got[5].tag == "update_skipped");
  CHECK(got[5].value == 0.0f);
  CHECK(got[6].value == static_cast<float>(1.0 / 3));
}

TEST_CASE("tfrecord frames carry masked crc32c checksums of length and data", "[unit]") {
  const std::string r = tfrecord("abc");
  REQUIRE(r.size() == 8 + 4 + 3 + 4);
  CHECK(r.substr(0, 8) == std::string("\x03\0\0\0\0\0\0\0", 8));
  const auto masked = [](uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; };
  const auto le32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
      v |= static_cast<uint32_t>(static_cast<uint8_t>(r[at + i])) << (8 * i);
    return v;
  };
  CHECK(le32(8) == masked(tandem::crc32c(r.substr(0, 8))));
  CHECK(r.substr(12, 3) == "abc");
  CHECK(le32(15) == masked(tandem::crc32c("abc")));
}

TEST_CASE("a resumed run continues its event file without repeating or losing a step", "[unit]") {
  const tandem::test::TempDir tmp("tb-resume");
  {
    // Steps 1..5 were logged, but the last checkpoint is at step 3.
    TensorBoardWriter w(tmp.path.string(), 0);
    for (int64_t s = 1; s <= 5; ++s) w.write(line(s, 10.0 + s), 1000.0 + s);
  }
  const std::string path = only_event_file(tmp.path);
  // A torn last record (killed mid-write) is left behind too.
  std::ofstream(path, std::ios::binary | std::ios::app) << std::string("\x40\0\0\0", 4);
  {
    TensorBoardWriter w(tmp.path.string(), 3);
    CHECK(w.path() == path);
    w.write(line(3, 99.0), 2000.0);  // already there: not written again
    for (int64_t s = 4; s <= 6; ++s) w.write(line(s, 20.0 + s), 2000.0 + s);
  }
  std::map<std::pair<int64_t, std::string>, float> seen;
  for (const Scalar& s : read_scalars(only_event_file(tmp.path))) {
    INFO(s.tag << " at " << s.step);
    CHECK(seen.count({s.step, s.tag}) == 0);
    seen[{s.step, s.tag}] = s.value;
  }
  CHECK(seen.size() == 18);  // steps 1..6, three tags each
  CHECK(seen[{3, "loss"}] == 13.0f);
  CHECK(seen[{4, "loss"}] == 24.0f);
  CHECK(seen[{6, "loss"}] == 26.0f);
}
