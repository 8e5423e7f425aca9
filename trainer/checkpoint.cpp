// Checkpoints: saving through a temporary directory, pruning, finding the latest, loading into
// temporaries and copying only once everything checked out.
#include "trainer/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "model/hf.h"
#include "model/safetensors.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "tandem-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kPolicyDir = "policy";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "trainer_state.json";

// The N of a directory named step-<N> (digits only), or -1.
int64_t step_of(const std::string& name) {
  constexpr std::string_view prefix = "step-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stoll(digits);
}

// Complete checkpoints under root, by step.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const int64_t n = step_of(e.path().filename().string());
    if (n >= 0 && e.is_directory(ec) && fs::is_regular_file(e.path() / kStateFile, ec)) {
      out.emplace_back(n, e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_text(const fs::path& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  TANDEM_CHECK(f != nullptr, "{}: cannot create: {}", path.string(), std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() &&
                  std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  const bool closed = std::fclose(f) == 0;
  TANDEM_CHECK(ok && closed, "{}: write failed: {}", path.string(), std::strerror(errno));
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), "{}: cannot open checkpoint file", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void require_file(const fs::path& path, const std::string& what) {
  std::error_code ec;
  TANDEM_CHECK(fs::is_regular_file(path, ec), "{}: missing {} (not a complete tandem checkpoint)",
               path.string(), what);
}

json counters_json(const AdamWCounters& c) {
  return {{"step", c.step},
          {"skipped_total", c.skipped_total},
          {"consecutive_skips", c.consecutive_skips}};
}

// The field of j as T, or an error naming the file and field.
template <class T>
T get_field(const json& j, const char* field, const std::string& where) {
  TANDEM_CHECK(j.is_object() && j.contains(field), "{}: missing field '{}'", where, field);
  const json& v = j.at(field);
  if constexpr (std::is_same_v<T, int64_t>) {
    TANDEM_CHECK(v.is_number_integer(), "{}: field '{}' must be an integer, found {}", where, field,
                 v.dump());
  } else if constexpr (std::is_same_v<T, std::string>) {
    TANDEM_CHECK(v.is_string(), "{}: field '{}' must be a string, found {}", where, field,
                 v.dump());
  }
  return v.get<T>();
}

const json& get_object(const json& j, const char* field, const std::string& where) {
  TANDEM_CHECK(j.contains(field) && j.at(field).is_object(), "{}: field '{}' must be a JSON object",
               where, field);
  return j.at(field);
}

// Names the first config field that differs; the policy in the checkpoint must be this model.
void check_same_config(const model::ModelConfig& want, const model::ModelConfig& got,
                       const std::string& where) {
  auto field = [&](const char* name, const auto& a, const auto& b) {
    TANDEM_CHECK(a == b,
                 "{}: the checkpoint is of another model: {} is {} in the checkpoint, {} in the "
                 "model being trained",
                 where, name, b, a);
  };
  field("model_type", std::string(model::architecture_name(want.arch)),
        std::string(model::architecture_name(got.arch)));
  field("vocab_size", want.vocab_size, got.vocab_size);
  field("hidden_size", want.hidden_size, got.hidden_size);
  field("intermediate_size", want.intermediate_size, got.intermediate_size);
  field("num_hidden_layers", want.num_layers, got.num_layers);
  field("num_attention_heads", want.num_heads, got.num_heads);
  field("num_key_value_heads", want.num_kv_heads, got.num_kv_heads);
  field("head_dim", want.head_dim, got.head_dim);
  field("tie_word_embeddings", want.tie_word_embeddings, got.tie_word_embeddings);
  field("attention_bias", want.attention_bias, got.attention_bias);
  field("qk_norm", want.qk_norm, got.qk_norm);
  field("rms_norm_eps", want.rms_norm_eps, got.rms_norm_eps);
  field("rope_theta", want.rope.theta, got.rope.theta);
  field("rope_scaling.factor", want.rope.factor, got.rope.factor);
}

}  // namespace

std::string checkpoint_dir(const std::string& root, int64_t step) {
  return (fs::path(root) / ("step-" + std::to_string(step))).string();
}

std::string save_checkpoint(const std::string& root_path, int64_t step,
                            const model::Weights& policy, const AdamW& optimizer,
                            const TrainerState& state, const CheckpointOptions& options) {
  TANDEM_CHECK(step >= 0, "checkpoint: step {} must be 0 or more", step);
  TANDEM_CHECK(options.keep_last >= 0, "checkpoint: keep_last {} must be 0 or more (0 keeps all)",
               options.keep_last);
  TANDEM_CHECK(state.rng_states.is_object() && state.extra.is_object(),
               "checkpoint: TrainerState rng_states and extra must be JSON objects");
  TANDEM_CHECK(policy.dtype() == DType::f32,
               "checkpoint: the policy must be the f32 master weights, got {}", policy.dtype());
  const fs::path root(root_path);
  std::error_code ec;
  fs::create_directories(root, ec);
  TANDEM_CHECK(!ec, "{}: cannot create the checkpoint directory: {}", root.string(), ec.message());

  const std::string name = "step-" + std::to_string(step);
  const fs::path target = root / name;
  const fs::path tmp = root / (".tmp-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  TANDEM_CHECK(!ec, "{}: cannot create directory: {}", tmp.string(), ec.message());
  auto stage = [&](const char* what) {
    if (options.on_stage) options.on_stage(what);
  };
  try {
    model::SaveOptions hf;
    hf.dtype = DType::f32;
    hf.extra_files = options.extra_files;
    model::save_hf(policy, (tmp / kPolicyDir).string(), hf);
    stage("policy");

    std::vector<model::NamedTensor> tensors;
    for (const auto& [prefix, w] :
         {std::pair{"m.", &optimizer.m()}, std::pair{"v.", &optimizer.v()}}) {
      for (const model::NamedTensor& s : w->storage())
        tensors.push_back({prefix + s.name, s.tensor});
    }
    const AdamWCounters& c = optimizer.counters();
    model::write_safetensors((tmp / kOptimizerFile).string(), tensors,
                             {{"format", kFormat},
                              {"step", std::to_string(c.step)},
                              {"skipped_total", std::to_string(c.skipped_total)},
                              {"consecutive_skips", std::to_string(c.consecutive_skips)}});
    stage("optimizer");

    const AdamWConfig& oc = optimizer.config();
    json j = {{"format", kFormat},
              {"version", kVersion},
              {"step", state.step},
              {"weight_version", state.weight_version},
              {"data_epoch", state.data_epoch},
              {"data_position", state.data_position},
              {"rng_states", state.rng_states},
              {"config", state.config},
              {"extra", state.extra},
              {"optimizer", counters_json(c)},
              {"optimizer_config",
               {{"beta1", oc.beta1},
                {"beta2", oc.beta2},
                {"eps", oc.eps},
                {"weight_decay", oc.weight_decay},
                {"max_grad_norm", oc.max_grad_norm}}}};
    write_text(tmp / kStateFile, j.dump(2) + "\n");
    stage("trainer_state");

    // Commit: an existing step-N is moved aside first and deleted only after the rename.
    const fs::path old = root / (".old-" + name + "-" + std::to_string(::getpid()));
    const bool replace = fs::exists(target, ec);
    if (replace) {
      fs::remove_all(old, ec);
      fs::rename(target, old, ec);
      TANDEM_CHECK(!ec, "{}: cannot move the previous checkpoint aside: {}", target.string(),
                   ec.message());
    }
    fs::rename(tmp, target, ec);
    if (ec) {
      std::error_code ec2;
      if (replace) fs::rename(old, target, ec2);
      TANDEM_FAIL("{}: cannot rename {} into place: {}", target.string(), tmp.string(),
                  ec.message());
    }
    if (replace) fs::remove_all(old, ec);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }

  if (options.keep_last > 0) {
    const auto all = list_checkpoints(root);
    const size_t keep = static_cast<size_t>(options.keep_last);
    for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i].second, ec);
  }
  return target.string();
}

std::vector<std::string> recover_interrupted_saves(const std::string& root_path) {
  std::vector<std::string> done;
  std::error_code ec;
  const fs::path root(root_path);
  if (!fs::is_directory(root, ec)) return done;
  std::vector<fs::path> found;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) found.push_back(e.path());
  std::sort(found.begin(), found.end());
  for (const fs::path& p : found) {
    // .tmp-step-<N>-<pid> or .old-step-<N>-<pid>
    const std::string name = p.filename().string();
    const bool tmp = name.starts_with(".tmp-step-"), old = name.starts_with(".old-step-");
    const size_t dash = name.rfind('-');
    if (!(tmp || old) || dash <= 9 || !fs::is_directory(p, ec)) continue;
    const std::string pid = name.substr(dash + 1);
    const int64_t step = step_of(name.substr(5, dash - 5));
    if (step < 0 || pid.empty() ||
        !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const bool running = pid.size() < 10 && ::kill(std::stoi(pid), 0) == 0;
    const std::string writer =
        fmt::format("process {}, {}", pid,
                    running ? "which does not hold the directory's lock" : "no longer running");
    const fs::path target = root / ("step-" + std::to_string(step));
    if (old && !fs::exists(target, ec)) {
      fs::rename(p, target, ec);
      TANDEM_CHECK(!ec, "{}: cannot rename it back to {} (a save of {} was interrupted): {}",
                   p.string(), target.string(), writer, ec.message());
      done.push_back(fmt::format("restored {} from {} (a save by {} was interrupted)",
                                 target.string(), p.string(), writer));
      continue;
    }
    fs::remove_all(p, ec);
    TANDEM_CHECK(!ec, "{}: cannot remove this leftover of an interrupted save: {}", p.string(),
                 ec.message());
    done.push_back(fmt::format("removed {}, {} checkpoint left by {}", p.string(),
                               tmp ? "an incomplete" : "a replaced", writer));
  }
  return done;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back().second.string();
}

void load_checkpoint(const std::string& dir_path, model::Weights& policy, AdamW& optimizer,
                     TrainerState& state) {
  const fs::path dir(dir_path);
  std::error_code ec;
  TANDEM_CHECK(fs::is_directory(dir, ec), "{}: checkpoint directory does not exist", dir.string());
  const fs::path policy_dir = dir / kPolicyDir;
  const fs::path state_path = dir / kStateFile;
  const fs::path opt_path = dir / kOptimizerFile;
  require_file(state_path, "the trainer state");
  require_file(opt_path, "the optimizer state");
  require_file(policy_dir / "config.json", "the policy's config");
  TANDEM_CHECK(policy.dtype() == DType::f32,
               "checkpoint: the policy must be the f32 master weights, got {}", policy.dtype());

  // Trainer state.
  const std::string where = state_path.string();
  json j;
  try {
    j = json::parse(read_text(state_path));
  } catch (const json::exception& e) {
    TANDEM_FAIL("{}: not valid JSON (truncated?): {}", where, e.what());
  }
  TANDEM_CHECK(j.is_object(), "{}: expected a JSON object", where);
  TANDEM_CHECK(get_field<std::string>(j, "format", where) == kFormat,
               "{}: field 'format' must be '{}'", where, kFormat);
  const int64_t version = get_field<int64_t>(j, "version", where);
  TANDEM_CHECK(version == kVersion, "{}: field 'version' is {}, this tandem reads version {}",
               where, version, kVersion);
  TrainerState s;
  s.step = get_field<int64_t>(j, "step", where);
  s.weight_version = get_field<int64_t>(j, "weight_version", where);
  s.data_epoch = get_field<int64_t>(j, "data_epoch", where);
  s.data_position = get_field<int64_t>(j, "data_position", where);
  s.rng_states = get_object(j, "rng_states", where);
  s.config = get_field<std::string>(j, "config", where);
  s.extra = get_object(j, "extra", where);
  TANDEM_CHECK(s.step >= 0 && s.weight_version >= 0 && s.data_epoch >= 0 && s.data_position >= 0,
               "{}: 'step' {}, 'weight_version' {}, 'data_epoch' {} and 'data_position' {} must "
               "all be 0 or more: the file is damaged; resume from another checkpoint",
               where, s.step, s.weight_version, s.data_epoch, s.data_position);
  fs::path named = dir.lexically_normal();
  if (named.filename().empty()) named = named.parent_path();
  const int64_t dir_step = step_of(named.filename().string());
  TANDEM_CHECK(dir_step < 0 || dir_step == s.step,
               "{}: 'step' is {}, but the checkpoint's directory is {}: the file is damaged or "
               "was copied from another checkpoint; resume from another checkpoint",
               where, s.step, named.filename().string());

  // Policy: the config first, so that another model is named by its field.
  const model::ModelConfig got = model::config_from_hf_file((policy_dir / "config.json").string());
  check_same_config(policy.config(), got, (policy_dir / "config.json").string());
  std::unique_ptr<model::Weights> new_policy = model::load_hf(policy_dir.string(), DType::f32);

  // Optimizer: both moments of every storage tensor, in f32, and the counters.
  const std::string opt_where = opt_path.string();
  model::SafetensorsFile file(opt_where);
  const model::Weights& params = optimizer.params();
  model::Weights m(params.config(), DType::f32, params.device(), ArenaClass::optimizer_states);
  model::Weights v(params.config(), DType::f32, params.device(), ArenaClass::optimizer_states);
  size_t expected = 0;
  for (const auto& [prefix, w] : {std::pair{"m.", &m}, std::pair{"v.", &v}}) {
    for (const model::NamedTensor& t : w->storage()) {
      const std::string name = prefix + t.name;
      const model::SafetensorsEntry& e = file.at(name);
      TANDEM_CHECK(e.dtype == DType::f32 && e.shape == t.tensor.shape(),
                   "{}: tensor {} is {} {}, expected F32 {}", opt_where, name,
                   model::safetensors_dtype_name(e.dtype), e.shape, t.tensor.shape());
      file.read_into(name, t.tensor);
      ++expected;
    }
  }
  TANDEM_CHECK(file.tensors().size() == expected,
               "{}: holds {} tensors, expected {} (m. and v. of every storage tensor)", opt_where,
               file.tensors().size(), expected);
  const json oj = get_object(j, "optimizer", where);
  AdamWCounters c;
  c.step = get_field<int64_t>(oj, "step", where + " optimizer");
  c.skipped_total = get_field<int64_t>(oj, "skipped_total", where + " optimizer");
  c.consecutive_skips = get_field<int64_t>(oj, "consecutive_skips", where + " optimizer");
  TANDEM_CHECK(c.step >= 0 && c.skipped_total >= 0 && c.consecutive_skips >= 0,
               "{}: optimizer counters must be 0 or more", where);
  const auto meta = file.metadata().find("step");
  TANDEM_CHECK(meta != file.metadata().end() && meta->second == std::to_string(c.step),
               "{}: metadata 'step' does not match {}'s optimizer.step {} (files from different "
               "checkpoints?)",
               opt_where, where, c.step);

  // Everything read and checked: now overwrite.
  policy.copy_from(*new_policy);
  optimizer.m().copy_from(m);
  optimizer.v().copy_from(v);
  optimizer.set_counters(c);
  state = std::move(s);
}

}  // namespace tandem::trainer
