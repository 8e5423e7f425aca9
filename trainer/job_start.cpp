// A job's start: directory checks and locks, leftovers of interrupted saves, the resumed
// checkpoint's config, the synthetic data's memory.
#include "trainer/job_start.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/memory_available.h"
#include "trainer/checkpoint.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLockFile = ".tandem.lock";

// The memory one synthetic example takes in a job at its peak (the examples, the split, the prompt
// stream's copy and order): the peak RSS of a one-step job on configs/default.toml grew by about
// 1.1 KiB per example from data.synthetic_size = 1000 to 1000000; rounded up.
constexpr double kBytesPerSyntheticExample = 1536;

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "unknown";
  return host;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

// The holder recorded in a lock file, for the refused job's message.
std::string describe_holder(const std::string& text) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    return fmt::format("pid {} on host {}, started {}", j.at("pid").get<int64_t>(),
                       j.at("host").get<std::string>(), j.at("started").get<std::string>());
  } catch (const std::exception&) {
    return "a job that has not written its name yet";
  }
}

// Creates dir (key's value) or names why it cannot be; returns its canonical path.
fs::path make_dir(const std::string& dir, const std::string& key, const JobConfig& job) {
  std::error_code ec;
  TANDEM_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
               "{} '{}' is not a directory: set {} to a directory ({})", key, dir, key,
               job.where(key));
  fs::create_directories(dir, ec);
  TANDEM_CHECK(!ec, "{} '{}' cannot be created: {}: set {} to a directory you can write ({})", key,
               dir, ec.message(), key, job.where(key));
  return fs::canonical(dir);
}

// Flattens a TOML table into "a.b.c" -> value text; arrays of tables as "rewards[0].name".
void flatten(const toml::table& t, const std::string& prefix,
             std::map<std::string, std::string>& out) {
  for (const auto& [k, v] : t) {
    const std::string name(k.str());
    const std::string key = prefix.empty() ? name : prefix + "." + name;
    if (const toml::table* sub = v.as_table()) {
      flatten(*sub, key, out);
    } else if (const toml::array* arr = v.as_array(); arr && arr->is_array_of_tables()) {
      for (size_t i = 0; i < arr->size(); ++i)
        flatten(*arr->get(i)->as_table(), fmt::format("{}[{}]", key, i), out);
    } else if (const toml::value<double>* d = v.as_floating_point()) {
      // The shortest text that reads back the same (toml++ would print 0.1 as 0.10000000000000001).
      std::string text = fmt::format("{}", d->get());
      if (text.find_first_of(".eni") == std::string::npos) text += ".0";
      out[key] = text;
    } else {
      std::ostringstream ss;
      ss << toml::toml_formatter{v};
      out[key] = ss.str();
    }
  }
}

bool counts_on_resume(const std::string& key) {
  if (key.starts_with("checkpoint.") || key.starts_with("logging.") ||
      key.starts_with("distributed.") || key.starts_with("weight_sync."))
    return false;
  // placement.ranks: a checkpoint resumes on any world size (its optimizer ranges are resharded);
  // trainer.shard and its collectives' settings: at any level (the checkpoint is the same);
  // trainer.tp and trainer.pp: under any layout (trainer/checkpoint_grid.h).
  for (const char* k :
       {"trainer.steps", "eval.every", "eval.max_prompts", "eval.pass_k", "eval.temperature",
        "placement.release_memory", "placement.ranks", "trainer.shard", "trainer.overlap_comm",
        "trainer.comm_bucket_mb", "trainer.tp", "trainer.pp"})
    if (key == k) return false;
  return true;
}

// Whether trainer.schedule.total_steps follows trainer.steps on both sides (its default is
// steps × epochs × minibatches): then extending the run changes it, and that does not count.
bool total_steps_follow_steps(const std::map<std::string, std::string>& before,
                              const std::map<std::string, std::string>& after) {
  auto number = [](const std::map<std::string, std::string>& m, const char* key) -> int64_t {
    const auto it = m.find(key);
    if (it == m.end()) return 0;
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      return 0;
    }
  };
  const int64_t s0 = number(before, "trainer.steps"), s1 = number(after, "trainer.steps");
  const int64_t t0 = number(before, "trainer.schedule.total_steps"),
                t1 = number(after, "trainer.schedule.total_steps");
  return s0 > 0 && s1 > 0 && t0 % s0 == 0 && t1 % s1 == 0 && t0 / s0 == t1 / s1;
}

// The checkpoint this job resumes from, as run_job resolves checkpoint.resume; "" when none.
std::string resume_dir(const JobConfig& job) {
  const std::string& r = job.checkpoint.resume;
  if (r == "none") return "";
  if (r == "auto") return latest_checkpoint(job.checkpoint.dir).value_or("");
  return r;
}

void check_resume_config(const JobConfig& job) {
  const std::string dir = resume_dir(job);
  if (dir.empty()) return;
  // A checkpoint that cannot be read is load_checkpoint's to report, with its own message.
  std::string recorded;
  try {
    recorded = nlohmann::json::parse(read_all(fs::path(dir) / "trainer_state.json"))
                   .at("config")
                   .get<std::string>();
  } catch (const std::exception&) {
    return;
  }
  std::vector<std::string> diff;
  try {
    diff = resume_config_differences(recorded, to_toml(job));
  } catch (const toml::parse_error&) {
    TANDEM_FAIL(
        "{}/trainer_state.json: the recorded 'config' is not valid TOML: the file is "
        "damaged; resume from another checkpoint or set checkpoint.resume=none",
        dir);
  }
  if (diff.empty()) return;
  std::string list;
  for (const std::string& d : diff) list += "\n  " + d;
  TANDEM_CHECK(job.checkpoint.allow_config_change,
               "the checkpoint {} was written under another config ({}):{}\nresume with the "
               "override checkpoint.allow_config_change=true to train on with these values (the "
               "next checkpoint records them), or start over with checkpoint.resume=none",
               dir, job.where("checkpoint.resume"), list);
  std::fprintf(stderr, "tandem: resuming %s with a changed config:%s\n", dir.c_str(), list.c_str());
}

void check_data_memory(const JobConfig& job) {
  if (job.data.source != "synthetic") return;
  const double need = static_cast<double>(job.data.synthetic_size) * kBytesPerSyntheticExample;
  const double have = memory_available(Device::cpu());
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  TANDEM_CHECK(have <= 0 || need <= 0.5 * have,
               "data.synthetic_size {} needs about {:.1f} GiB of memory for the prompts, more than "
               "half of the {:.1f} GiB available: lower data.synthetic_size ({})",
               job.data.synthetic_size, need / kGiB, have / kGiB, job.where("data.synthetic_size"));
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& key, const JobConfig& job) {
  const fs::path path = fs::path(dir) / kLockFile;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TANDEM_CHECK(fd_ >= 0,
               "{} '{}' is not writable: cannot create {}: {}: set {} to a directory "
               "you can write ({})",
               key, dir, path.string(), std::strerror(errno), key, job.where(key));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    TANDEM_CHECK(err != EWOULDBLOCK,
                 "{} '{}' is in use by another tandem job ({}; lock file {}): wait for it to end "
                 "or give this job another {} ({})",
                 key, dir, describe_holder(read_all(path)), path.string(), key, job.where(key));
    TANDEM_FAIL("{} '{}': cannot lock {}: {}", key, dir, path.string(), std::strerror(err));
  }
  const std::string holder = nlohmann::json{{"pid", static_cast<int64_t>(::getpid())},
                                            {"host", host_name()},
                                            {"started", utc_now()},
                                            {"config", job.source}}
                                 .dump() +
                             "\n";
  const bool ok = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, holder.data(), holder.size(), 0) ==
                                                  static_cast<ssize_t>(holder.size());
  if (!ok) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    TANDEM_FAIL("{} '{}' is not writable: {}: {} (disk full?) ({})", key, dir, path.string(),
                std::strerror(err), job.where(key));
  }
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);
}

DirLock::DirLock(DirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }

void check_job_dirs(const JobConfig& job) {
  for (const auto& [dir, key] : {std::pair{job.logging.dir, "logging.dir"},
                                 std::pair{job.checkpoint.dir, "checkpoint.dir"}}) {
    std::error_code ec;
    TANDEM_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
                 "{} '{}' is not a directory: set {} to a directory ({})", key, dir, key,
                 job.where(key));
    fs::path up = fs::absolute(dir, ec).parent_path();
    while (!up.empty() && !fs::exists(up, ec) && up != up.parent_path()) up = up.parent_path();
    TANDEM_CHECK(up.empty() || fs::is_directory(up, ec),
                 "{} '{}' cannot be created: '{}' is not a directory: set {} to a directory you "
                 "can write ({})",
                 key, dir, up.string(), key, job.where(key));
  }
}

JobStart start_job(const JobConfig& job) {
  JobStart s;
  const fs::path run = make_dir(job.logging.dir, "logging.dir", job);
  const fs::path ckpt = make_dir(job.checkpoint.dir, "checkpoint.dir", job);
  s.locks.emplace_back(run.string(), "logging.dir", job);
  if (ckpt != run) s.locks.emplace_back(ckpt.string(), "checkpoint.dir", job);
  for (const std::string& line : recover_interrupted_saves(ckpt.string()))
    std::fprintf(stderr, "tandem: %s\n", line.c_str());
  check_resume_config(job);
  check_data_memory(job);
  return s;
}

std::vector<std::string> resume_config_differences(const std::string& before_toml,
                                                   const std::string& after_toml) {
  std::map<std::string, std::string> before, after;
  flatten(toml::parse(before_toml), "", before);
  flatten(toml::parse(after_toml), "", after);
  std::map<std::string, std::pair<std::string, std::string>> all;
  for (const auto& [k, v] : before) all[k].first = v;
  for (const auto& [k, v] : after) all[k].second = v;
  std::vector<std::string> out;
  const bool follow = total_steps_follow_steps(before, after);
  for (const auto& [k, v] : all) {
    if (!counts_on_resume(k) || v.first == v.second) continue;
    if (k == "trainer.schedule.total_steps" && follow) continue;
    out.push_back(fmt::format("{}: {} -> {}", k, v.first.empty() ? "(unset)" : v.first,
                              v.second.empty() ? "(unset)" : v.second));
  }
  return out;
}

}  // namespace tandem::trainer
