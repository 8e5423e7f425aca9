// Whole-file writes through a temporary file: the new contents on success; on a failed write or
// rename, the old file as it was and no temporary file.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/atomic_file.h"
#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {}  // namespace

TEST_CASE("write_file_atomically replaces a file whole and removes its temporary on failure",
          "[unit]") {
  const tandem::test::TempDir tmp("atomic-file");
  const std::string path = tmp.file("a.txt");
  tandem::write_file_atomically(path, "first", "do something");
  CHECK(tandem::test::read_text(path) == "first");
  tandem::write_file_atomically(path, "second, longer", "do something");
  CHECK(tandem::test::read_text(path) == "second, longer");
  CHECK(!fs::exists(path + ".tmp"));

  // The rename fails: the target is a directory that holds a file.
  const std::string dir = tmp.file("d");
  fs::create_directory(dir);
  tmp.write("d/x", "x");
  CHECK_THROWS_WITH(tandem::write_file_atomically(dir, "text", "free space"),
                    Catch::Contains(dir + ": write failed") && Catch::Contains("free space"));
  CHECK(!fs::exists(dir + ".tmp"));
  CHECK(tandem::test::read_text(tmp.file("d/x")) == "x");

  // The write fails: the temporary file is a link to /dev/full (no space left on device).
  if (fs::exists("/dev/full")) {
    fs::create_symlink("/dev/full", path + ".tmp");
    CHECK_THROWS_WITH(tandem::write_file_atomically(path, "third", "free space"),
                      Catch::Contains("No space left on device"));
    CHECK(!fs::exists(fs::symlink_status(path + ".tmp")));
    CHECK(tandem::test::read_text(path) == "second, longer");
  }
}
