// What a job checks and takes before its first step and before loading the model: usable run and
// checkpoint directories locked for the job's life, checkpoint temporaries of dead writers
// removed, the resumed checkpoint's config compared with the job's, the data within memory.
#pragma once

#include <string>
#include <vector>

#include "trainer/job_config.h"

namespace tandem::trainer {

// An exclusive lock (flock) on <dir>/.tandem.lock, held while the object lives. The file names
// its holder (pid, host, start time) for a job that finds the directory taken; the kernel drops
// the lock when the holder exits, however it exits.
class DirLock {
 public:
  // key: the config key that named dir (its origin is in the messages). Throws tandem::Error
  // naming the holder when another process holds the lock, or when the file cannot be created.
  DirLock(const std::string& dir, const std::string& key, const JobConfig& job);
  ~DirLock();
  DirLock(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  DirLock& operator=(DirLock&&) = delete;

 private:
  int fd_ = -1;
};

// What run_job holds for its life.
struct JobStart {
  std::vector<DirLock> locks;  // logging.dir and checkpoint.dir (one when they are the same)
};

// Creates logging.dir and checkpoint.dir and locks them (a directory that cannot be created or
// written, or that another job holds, throws naming the key, its origin and the holder); removes
// checkpoint temporaries that no running job writes (saying so on stderr); when the job resumes,
// compares the checkpoint's recorded config with this one (resume_config_differences) and throws
// listing the differences unless checkpoint.allow_config_change; refuses a synthetic data set
// larger than the memory available.
JobStart start_job(const JobConfig& job);

// The directory checks of start_job that write nothing, so that a job refuses an unusable
// logging.dir or checkpoint.dir before it loads the model: a path that is not a directory, or
// whose nearest existing ancestor is not one, throws naming the key and its origin.
void check_job_dirs(const JobConfig& job);

// The keys whose values differ between two job configs given as TOML (to_toml's), as lines
// "key: before -> after" in key order; keys absent on one side show as "(unset)". Keys that may
// change on resume without changing what is trained do not count: checkpoint.*, logging.*,
// distributed.*, weight_sync.*, trainer.steps (extending a run; with it
// trainer.schedule.total_steps when that is steps times the same factor on both sides, as its
// default is), eval.every, eval.max_prompts, eval.pass_k, eval.temperature,
// placement.release_memory and the trainer's layout: placement.ranks, trainer.shard,
// trainer.overlap_comm, trainer.comm_bucket_mb, trainer.tp and trainer.pp.
std::vector<std::string> resume_config_differences(const std::string& before_toml,
                                                   const std::string& after_toml);

}  // namespace tandem::trainer
