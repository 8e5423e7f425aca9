// Tests of trainer/job_start: which config keys count as a change on resume, the run directory's
// lock naming its holder, and the checked appends of metrics lines.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/testutil.h"
#include "trainer/append_file.h"
#include "trainer/job_config.h"
#include "trainer/job_start.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;

const std::string kJob =
    "[model]\npath = \"m.gguf\"\n[[rewards]]\nname = \"fmt\"\nfunction = \"regex_format\"\n"
    "pattern = 'a.*'\n";

std::string resolved(const std::vector<std::string>& overrides) {
  return to_toml(parse_job_config(kJob, "job.toml", overrides));
}

TEST_CASE("A resume counts the changes of what is trained and not of bookkeeping", "[unit]") {
  const std::string before = resolved({});
  CHECK(resume_config_differences(before, before).empty());
  // Extending the run, logging, checkpointing, eval sizes, the publish's checks and how the ranks
  // split the training state may change on resume.
  CHECK(resume_config_differences(
            before, resolved({"trainer.steps=500", "logging.dir=/tmp/x", "logging.level=debug",
                              "checkpoint.every=3", "checkpoint.resume=none",
                              "checkpoint.allow_config_change=true", "eval.every=7",
                              "eval.pass_k=2", "placement.release_memory=false",
                              "placement.ranks=4", "distributed.timeout_s=60",
                              "weight_sync.canary=true", "weight_sync.checksums=true",
                              "weight_sync.bucket_mb=8", "trainer.shard=parameters",
                              "trainer.overlap_comm=false", "trainer.comm_bucket_mb=4"}))
            .empty());
  const std::vector<std::string> d = resume_config_differences(
      before, resolved({"trainer.lr=0.5", "rollout.n=4", "eval.split_fraction=0.2"}));
  REQUIRE(d.size() == 3);
  CHECK(d[0] == "eval.split_fraction: 0.1 -> 0.2");
  CHECK(d[1] == "rollout.n: 8 -> 4");
  CHECK(d[2] == "trainer.lr: 1e-06 -> 0.5");
  // A schedule length set apart from trainer.steps counts.
  CHECK(resume_config_differences(before, resolved({"trainer.schedule.total_steps=300"})) ==
        std::vector<std::string>{"trainer.schedule.total_steps: 100 -> 300"});
  // Reward functions are compared entry by entry.
  const std::string other_reward = to_toml(parse_job_config(
      "[model]\npath = \"m.gguf\"\n[[rewards]]\nname = \"fmt\"\nfunction = \"regex_format\"\n"
      "pattern = 'b.*'\n",
      "job.toml"));
  const std::vector<std::string> r = resume_config_differences(before, other_reward);
  REQUIRE(r.size() == 1);
  CHECK(r[0] == "rewards[0].pattern: 'a.*' -> 'b.*'");
  // A key one side lacks (a config of an older tandem).
  const std::vector<std::string> added = resume_config_differences("[model]\npath = \"m.gguf\"\n",
                                                                   "[model]\npath = \"m.gguf\"\n"
                                                                   "chat_template = \"none\"\n");
  REQUIRE(added.size() == 1);
  CHECK(added[0] == "model.chat_template: (unset) -> 'none'");
}

TEST_CASE("A locked run directory refuses a second holder naming the first", "[unit]") {
  const test::TempDir dir("job_lock");
  const JobConfig job = parse_job_config(
      kJob, "job.toml", std::vector<std::string>{"logging.dir=" + dir.file("run")});
  fs::create_directories(dir.file("run"));
  {
    const DirLock first(dir.file("run"), "logging.dir", job);
    // flock conflicts between two open files of one process too: the second job is refused.
    try {
      const DirLock second(dir.file("run"), "logging.dir", job);
      FAIL("the directory was locked twice");
    } catch (const Error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("logging.dir '" + dir.file("run") +
                      "' is in use by another tandem job (pid " + std::to_string(::getpid()) +
                      " on host ") != std::string::npos);
      CHECK(what.find("override 'logging.dir=") != std::string::npos);
    }
  }
  // Released with its holder.
  const DirLock again(dir.file("run"), "logging.dir", job);
}

TEST_CASE("A failed append names the file", "[unit]") {
  AppendFile full("/dev/full");
  try {
    full.write_line("{\"step\": 1}");
    FAIL("a write to /dev/full succeeded");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) ==
          "/dev/full: write failed: No space left on device: free space on its file system or "
          "move logging.dir");
  }
  const test::TempDir dir("append");
  {
    AppendFile f(dir.file("m.jsonl"));
    f.write_line("a");
    f.write_line("b");
  }
  CHECK(test::run_shell("cat " + dir.file("m.jsonl")).out == "a\nb\n");
}

}  // namespace
}  // namespace tandem::trainer
