// Checkpoints: saving through a temporary directory (one rank, or every rank its optimizer range
// and rank 0 the rest and the commit marker), pruning, finding the latest committed one, loading
// into temporaries (reading the pieces of the saved ranges that overlap this rank's) and copying
// only once everything checked out.
#include "trainer/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "core/crc32c.h"
#include "core/error.h"
#include "model/hf.h"
#include "model/safetensors.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "tandem-checkpoint";
// Version 2: COMMITTED marker, optimizer state per rank. Version 1 (no marker, one
// optimizer.safetensors) is still read.
constexpr int kVersion = 2;
constexpr int kVersionUnmarked = 1;
constexpr const char* kPolicyDir = "policy";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kMarkerFile = "COMMITTED";

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

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), "{}: cannot open checkpoint file", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A checkpoint directory counts once committed: it holds COMMITTED, or it was written before
// markers existed (trainer_state.json of version 1, renamed into place complete).
bool committed(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_regular_file(dir / kMarkerFile, ec)) return true;
  if (!fs::is_regular_file(dir / kStateFile, ec)) return false;
  try {
    const json j = json::parse(read_text(dir / kStateFile));
    return j.is_object() && j.value("version", json()) == kVersionUnmarked;
  } catch (const std::exception&) {
    return false;
  }
}

// Committed checkpoints under root, by step.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const int64_t n = step_of(e.path().filename().string());
    if (n >= 0 && e.is_directory(ec) && committed(e.path())) out.emplace_back(n, e.path());
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

// A file's size and CRC-32C, as COMMITTED records them.
struct FileSum {
  int64_t bytes = 0;
  uint32_t crc = 0;
};

FileSum sum_file(const fs::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  TANDEM_CHECK(f != nullptr, "{}: cannot open: {}", path.string(), std::strerror(errno));
  std::vector<char> buf(size_t{1} << 20);
  FileSum s;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) {
    s.crc = crc32c(std::string_view(buf.data(), n), s.crc);
    s.bytes += static_cast<int64_t>(n);
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  TANDEM_CHECK(!failed, "{}: read failed", path.string());
  return s;
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

std::map<std::string, std::string> counters_metadata(const AdamWCounters& c) {
  return {{"format", kFormat},
          {"step", std::to_string(c.step)},
          {"skipped_total", std::to_string(c.skipped_total)},
          {"consecutive_skips", std::to_string(c.consecutive_skips)}};
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

// The shapes of a model's tensors, bound or not: its storage tensors in the flat parameters, and
// every HF-named tensor (Weights::named()'s order) as a piece of one storage tensor.
struct ModelShape {
  struct Named {
    std::string name;
    Shape shape;
    size_t tensor = 0;   // its storage tensor
    int64_t offset = 0;  // its first element in that storage tensor
  };
  model::ModelConfig config;
  std::vector<std::string> storage_names;
  std::vector<Shape> storage_shapes;
  std::vector<FlatRange> storage;  // each storage tensor's flat range
  std::vector<Named> named;
  int64_t total() const { return storage.empty() ? 0 : storage.back().end; }
};

ModelShape model_shape(const model::Weights& w) {
  ModelShape s;
  s.config = w.config();
  int64_t at = 0, largest = 1;
  for (size_t t = 0; t < w.storage().size(); ++t) {
    const int64_t n = w.storage_shape(t).numel();
    s.storage_names.push_back(w.storage()[t].name);
    s.storage_shapes.push_back(w.storage_shape(t));
    s.storage.push_back({at, at + n});
    at += n;
    largest = std::max(largest, n);
  }
  // Each storage tensor in turn bound to scratch memory in an unbound table shows which named
  // views lie in it, and where (nothing is read or written: untouched pages take no memory).
  const std::unique_ptr<model::Weights> table = model::Weights::unbound(w.config(), DType::f32);
  const Tensor scratch = Tensor::empty({largest}, DType::f32);
  s.named.resize(table->named().size());
  for (size_t t = 0; t < s.storage.size(); ++t) {
    table->bind(t, t + 1, scratch);
    for (size_t i = 0; i < table->named().size(); ++i) {
      const model::NamedTensor& nt = table->named()[i];
      if (nt.tensor.defined())
        s.named[i] = {nt.name, nt.tensor.shape(), t,
                      static_cast<int64_t>(nt.tensor.data_as<float>() - scratch.data_as<float>())};
    }
    table->unbind(t, t + 1);
  }
  return s;
}

// One piece of a rank's: unit `unit`'s elements `range`, at `local` in its local buffer.
struct Piece {
  size_t unit = 0;
  FlatRange range;
  int64_t local = 0;
};

std::vector<Piece> pieces_of(const model::ShardLayout& layout, int rank) {
  std::vector<Piece> out;
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const FlatRange r = layout.range(u, rank);
    if (r.size() > 0) out.push_back({u, r, layout.units()[u].local});
  }
  return out;
}

std::vector<FlatRange> ranges_of(std::span<const Piece> pieces) {
  std::vector<FlatRange> out;
  for (const Piece& p : pieces) out.push_back(p.range);
  return out;
}

json ranges_json(std::span<const FlatRange> ranges) {
  json out = json::array();
  for (const FlatRange& r : ranges) out.push_back(json::array({r.begin, r.end}));
  return out;
}

int rank_of(ShardedAdamW& optimizer) {
  return optimizer.comm() == nullptr ? 0 : optimizer.comm()->rank();
}

std::string shard_file(int rank, int world) {
  return fmt::format("optimizer/rank-{:05d}-of-{:05d}.safetensors", rank, world);
}

// ---- Saving ----

// A save in progress: <root>/.tmp-step-<N>-<pid> until commit() renames it to <root>/step-<N>.
struct PendingSave {
  fs::path root, tmp, target;
  std::string name;  // step-<N>
  int64_t pid = 0;   // of the process that commits
  const CheckpointOptions& options;
  void stage(const char* what) const {
    if (options.on_stage) options.on_stage(what);
  }
};

void check_save_arguments(int64_t step, const TrainerState& state,
                          const CheckpointOptions& options) {
  TANDEM_CHECK(step >= 0, "checkpoint: step {} must be 0 or more", step);
  TANDEM_CHECK(options.keep_last >= 0, "checkpoint: keep_last {} must be 0 or more (0 keeps all)",
               options.keep_last);
  TANDEM_CHECK(state.rng_states.is_object() && state.extra.is_object(),
               "checkpoint: TrainerState rng_states and extra must be JSON objects");
}

void check_policy(const model::Weights& policy) {
  TANDEM_CHECK(policy.dtype() == DType::f32,
               "checkpoint: the policy must be the f32 master weights, got {}", policy.dtype());
  TANDEM_CHECK(policy.whole(),
               "checkpoint: the policy holds a model part ({}); a checkpoint holds the whole "
               "model: copy the stages' parts into whole weights first",
               policy.part().str(policy.config()));
}

fs::path tmp_dir(const fs::path& root, int64_t step, int64_t pid) {
  return root / fmt::format(".tmp-step-{}-{}", step, pid);
}

// Creates root and an empty temporary directory (with optimizer/ for the ranks' files).
void create_tmp(const PendingSave& p, bool rank_files) {
  std::error_code ec;
  fs::create_directories(p.root, ec);
  TANDEM_CHECK(!ec, "{}: cannot create the checkpoint directory: {}", p.root.string(),
               ec.message());
  fs::remove_all(p.tmp, ec);
  fs::create_directories(rank_files ? p.tmp / "optimizer" : p.tmp, ec);
  TANDEM_CHECK(!ec, "{}: cannot create directory: {}", p.tmp.string(), ec.message());
}

void write_policy(const PendingSave& p, const model::Weights& policy) {
  model::SaveOptions hf;
  hf.dtype = DType::f32;
  hf.extra_files = p.options.extra_files;
  model::save_hf(policy, (p.tmp / kPolicyDir).string(), hf);
  p.stage("policy");
}

// ShardLevel::parameters: the policy unit by unit, every rank gathering each unit in the same
// order (collective) and the writer (p non-null: rank 0) writing the unit's named tensors as it
// arrives, so that no rank holds more than one unit. A writer's failure is returned, its
// gathering carried on so that the ranks stay in step; a failed gather throws.
std::exception_ptr write_gathered_policy(const PendingSave* p, ShardedAdamW& optimizer,
                                         const ModelShape& shape) {
  const model::ShardLayout& layout = optimizer.layout();
  std::exception_ptr failed;
  std::unique_ptr<model::HfWriter> writer;
  if (p != nullptr) {
    try {
      std::vector<model::HfWriter::NamedShape> tensors;
      for (const ModelShape::Named& n : shape.named) tensors.push_back({n.name, n.shape});
      model::SaveOptions hf;
      hf.dtype = DType::f32;
      hf.extra_files = p->options.extra_files;
      writer = std::make_unique<model::HfWriter>(shape.config, tensors,
                                                 (p->tmp / kPolicyDir).string(), hf);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  int64_t largest = 1;
  for (const model::ShardUnit& u : layout.units()) largest = std::max(largest, u.flat.size());
  const Tensor buffer = Tensor::empty({largest}, DType::f32);
  size_t next = 0;  // the next named tensor to write
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const model::ShardUnit& unit = layout.units()[u];
    const Tensor gathered = buffer.narrow(0, unit.flat.size());
    optimizer.gather_unit(u, gathered);
    if (!writer || failed) continue;
    try {
      for (; next < shape.named.size() && layout.unit_of_tensor(shape.named[next].tensor) == u;
           ++next) {
        const ModelShape::Named& n = shape.named[next];
        const int64_t at = shape.storage[n.tensor].begin - unit.flat.begin + n.offset;
        writer->append(gathered.narrow(at, n.shape.numel()).view(n.shape));
      }
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (writer && !failed) {
    try {
      TANDEM_CHECK(next == shape.named.size(),
                   "{}: tensor {} of the policy is not in unit order; cannot stream it",
                   p->tmp.string(), shape.named[next].name);
      writer->finish();
      p->stage("policy");
    } catch (...) {
      failed = std::current_exception();
    }
  }
  return failed;
}

void write_state(const PendingSave& p, const TrainerState& state, const AdamWCounters& c,
                 const AdamWConfig& oc) {
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
  write_text(p.tmp / kStateFile, j.dump(2) + "\n");
  p.stage("trainer_state");
}

// The whole optimizer state in one file: "m.<storage name>", "v.<storage name>".
void write_whole_optimizer(const PendingSave& p, std::span<const model::NamedTensor> m,
                           std::span<const model::NamedTensor> v, const AdamWCounters& c) {
  std::vector<model::NamedTensor> tensors;
  for (const auto& [prefix, w] : {std::pair{"m.", m}, std::pair{"v.", v}})
    for (const model::NamedTensor& s : w) tensors.push_back({prefix + s.name, s.tensor});
  model::write_safetensors((p.tmp / kOptimizerFile).string(), tensors, counters_metadata(c));
  p.stage("optimizer");
}

// Writes COMMITTED, renames the directory into place (an existing step-N is moved aside first and
// deleted only after the rename), prunes to keep_last. Returns the checkpoint's directory.
std::string commit(const PendingSave& p, const json& marker) {
  write_text(p.tmp / kMarkerFile, marker.dump(2) + "\n");
  p.stage("committed");
  std::error_code ec;
  const fs::path old = p.root / fmt::format(".old-{}-{}", p.name, p.pid);
  const bool replace = fs::exists(p.target, ec);
  if (replace) {
    fs::remove_all(old, ec);
    fs::rename(p.target, old, ec);
    TANDEM_CHECK(!ec, "{}: cannot move the previous checkpoint aside: {}", p.target.string(),
                 ec.message());
  }
  fs::rename(p.tmp, p.target, ec);
  if (ec) {
    std::error_code ec2;
    if (replace) fs::rename(old, p.target, ec2);
    TANDEM_FAIL("{}: cannot rename {} into place: {}", p.target.string(), p.tmp.string(),
                ec.message());
  }
  if (replace) fs::remove_all(old, ec);
  if (p.options.keep_last > 0) {
    const auto all = list_checkpoints(p.root);
    const size_t keep = static_cast<size_t>(p.options.keep_last);
    for (size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i].second, ec);
  }
  return p.target.string();
}

// The marker's head: what it commits, before the files.
json marker_json(int64_t step, int world, int64_t total, const std::vector<json>& optimizer) {
  return {{"format", kFormat},      {"version", kVersion}, {"step", step},
          {"world_size", world},    {"parameters", total}, {"optimizer", optimizer},
          {"files", json::object()}};
}

// Every file under the temporary directory with its size and CRC-32C, except those in `known`
// (relative path -> sum, e.g. reported by the rank that wrote it), whose sizes are checked.
json list_files(const fs::path& tmp, const std::map<std::string, FileSum>& known) {
  json files = json::object();
  std::vector<std::string> names;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(tmp, ec))
    if (e.is_regular_file(ec)) names.push_back(e.path().lexically_relative(tmp).generic_string());
  TANDEM_CHECK(!ec, "{}: cannot list: {}", tmp.string(), ec.message());
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    FileSum s;
    if (const auto k = known.find(n); k != known.end()) {
      s = k->second;
      const auto bytes = static_cast<int64_t>(fs::file_size(tmp / n, ec));
      TANDEM_CHECK(!ec && bytes == s.bytes,
                   "{}: {} bytes here, its writer wrote {}: checkpoint.dir must be one file "
                   "system that every rank sees (on several nodes, a shared one)",
                   (tmp / n).string(), ec ? -1 : bytes, s.bytes);
    } else {
      s = sum_file(tmp / n);
    }
    files[n] = {{"bytes", s.bytes}, {"crc32c", s.crc}};
  }
  for (const auto& [n, s] : known)
    TANDEM_CHECK(files.contains(n),
                 "{}: not there, though its writer wrote it: checkpoint.dir must be one file "
                 "system that every rank sees (on several nodes, a shared one)",
                 (tmp / n).string());
  return files;
}

// One rank's save: the whole optimizer state (moments in storage tensors m and v) in
// optimizer.safetensors.
// The policy comes from write_policy_fn (into p.tmp/policy); level: a ShardedAdamW's, for the
// marker (null for AdamW).
std::string save_alone(const std::string& root, int64_t step, const ModelShape& shape,
                       const char* level,
                       const std::function<void(const PendingSave&)>& write_policy_fn,
                       std::span<const model::NamedTensor> m, std::span<const model::NamedTensor> v,
                       const AdamWCounters& c, const AdamWConfig& oc, const TrainerState& state,
                       const CheckpointOptions& options) {
  check_save_arguments(step, state, options);
  const auto pid = static_cast<int64_t>(::getpid());
  const std::string name = "step-" + std::to_string(step);
  const PendingSave p{fs::path(root), tmp_dir(root, step, pid), fs::path(root) / name, name, pid,
                      options};
  create_tmp(p, false);
  try {
    write_policy_fn(p);
    write_whole_optimizer(p, m, v, c);
    write_state(p, state, c, oc);
    const int64_t total = shape.total();
    json marker =
        marker_json(step, 1, total, {{{"file", kOptimizerFile}, {"begin", 0}, {"end", total}}});
    if (level != nullptr) marker["shard_level"] = level;
    marker["files"] = list_files(p.tmp, {});
    return commit(p, marker);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(p.tmp, ec);
    throw;
  }
}

// ---- Loading ----

// What a checkpoint holds for one rank's ranges, read and checked, not yet copied anywhere.
struct Restored {
  std::unique_ptr<model::Weights> policy;  // the whole policy, or null
  Tensor params;                           // or the policy's elements of the ranges
  Tensor m, v;  // the f32 moments of the ranges, one range after the other
  AdamWCounters counters;
  TrainerState state;
};

// One saved range of the optimizer state: its moments are tensors m_name and v_name of file.
struct SavedRange {
  FlatRange range;
  std::string file;  // relative to the checkpoint's directory
  std::string m_name, v_name;
  Shape shape;
};

// trainer_state.json, checked field by field; `version` receives its version.
TrainerState read_state(const fs::path& dir, int64_t& version, AdamWCounters& counters) {
  const fs::path state_path = dir / kStateFile;
  require_file(state_path, "the trainer state");
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
  version = get_field<int64_t>(j, "version", where);
  TANDEM_CHECK(version == kVersion || version == kVersionUnmarked,
               "{}: field 'version' is {}, this tandem reads versions {} and {}", where, version,
               kVersionUnmarked, kVersion);
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

  const json oj = get_object(j, "optimizer", where);
  counters.step = get_field<int64_t>(oj, "step", where + " optimizer");
  counters.skipped_total = get_field<int64_t>(oj, "skipped_total", where + " optimizer");
  counters.consecutive_skips = get_field<int64_t>(oj, "consecutive_skips", where + " optimizer");
  TANDEM_CHECK(counters.step >= 0 && counters.skipped_total >= 0 && counters.consecutive_skips >= 0,
               "{}: optimizer counters must be 0 or more", where);
  return s;
}

// COMMITTED, checked against the trainer state, with every file it lists there in its size
// (trainer_state.json only there: it is checked field by field, and may be edited by hand).
json read_marker(const fs::path& dir, const TrainerState& s) {
  const fs::path path = dir / kMarkerFile;
  const std::string where = path.string();
  std::error_code ec;
  TANDEM_CHECK(fs::is_regular_file(path, ec),
               "{}: missing: this checkpoint's save did not complete (a rank failed or was "
               "killed before every part was written); resume from another checkpoint "
               "(checkpoint.resume=auto passes over it)",
               where);
  json j;
  try {
    j = json::parse(read_text(path));
  } catch (const json::exception& e) {
    TANDEM_FAIL("{}: not valid JSON (truncated?): {}", where, e.what());
  }
  TANDEM_CHECK(j.is_object(), "{}: expected a JSON object", where);
  TANDEM_CHECK(get_field<std::string>(j, "format", where) == kFormat,
               "{}: field 'format' must be '{}'", where, kFormat);
  const int64_t step = get_field<int64_t>(j, "step", where);
  TANDEM_CHECK(step == s.step,
               "{}: 'step' is {}, but {} says {}: files of two checkpoints; resume from another "
               "checkpoint",
               where, step, kStateFile, s.step);
  TANDEM_CHECK(get_field<int64_t>(j, "world_size", where) >= 1,
               "{}: 'world_size' must be 1 or more", where);
  for (const auto& [name, f] : get_object(j, "files", where).items()) {
    const fs::path file = dir / name;
    TANDEM_CHECK(fs::is_regular_file(file, ec),
                 "{}: missing, though {} lists it: the checkpoint is damaged or was copied in "
                 "part; resume from another checkpoint",
                 file.string(), where);
    if (name == kStateFile) continue;
    const int64_t bytes = get_field<int64_t>(f, "bytes", where + " files." + name);
    const auto size = static_cast<int64_t>(fs::file_size(file, ec));
    TANDEM_CHECK(!ec && size == bytes,
                 "{}: {} bytes, {} records {}: the file is truncated or damaged; resume from "
                 "another checkpoint",
                 file.string(), size, where, bytes);
  }
  return j;
}

// The saved ranges of the optimizer state in flat order: the marker's ranks' files (one range
// each, tensors m and v, as one ShardedAdamW range per rank saved them; or several, tensors named
// in the marker), or (one rank, and checkpoints from before markers) optimizer.safetensors's
// storage tensors.
std::vector<SavedRange> saved_ranges(const fs::path& dir, const json* marker,
                                     const ModelShape& shape) {
  const int64_t total = shape.total();
  auto whole_file = [&] {
    std::vector<SavedRange> out;
    for (size_t t = 0; t < shape.storage.size(); ++t) {
      const std::string& name = shape.storage_names[t];
      out.push_back(
          {shape.storage[t], kOptimizerFile, "m." + name, "v." + name, shape.storage_shapes[t]});
    }
    return out;
  };
  if (marker == nullptr) {
    require_file(dir / kOptimizerFile, "the optimizer state");
    return whole_file();
  }
  const std::string where = (dir / kMarkerFile).string();
  const json& list = marker->contains("optimizer") ? marker->at("optimizer") : json();
  TANDEM_CHECK(list.is_array() && !list.empty(),
               "{}: field 'optimizer' must be a list of the saved ranges", where);
  std::vector<SavedRange> out;
  for (const json& e : list) {
    const std::string file = get_field<std::string>(e, "file", where + " optimizer");
    TANDEM_CHECK(marker->at("files").contains(file),
                 "{}: the optimizer file {} is not among its files", where, file);
    if (!e.contains("ranges")) {
      const FlatRange r{get_field<int64_t>(e, "begin", where + " optimizer"),
                        get_field<int64_t>(e, "end", where + " optimizer")};
      out.push_back({r, file, "m", "v", {r.end - r.begin}});
      continue;
    }
    const std::string at = where + " optimizer " + file;
    TANDEM_CHECK(e.at("ranges").is_array(), "{}: field 'ranges' must be a list", at);
    for (const json& x : e.at("ranges")) {
      const FlatRange r{get_field<int64_t>(x, "begin", at), get_field<int64_t>(x, "end", at)};
      TANDEM_CHECK(r.begin < r.end,
                   "{}: range [{}, {}) is empty or reversed: the file is "
                   "damaged; resume from another checkpoint",
                   at, r.begin, r.end);
      out.push_back({r,
                     file,
                     get_field<std::string>(x, "m", at),
                     get_field<std::string>(x, "v", at),
                     {r.end - r.begin}});
    }
  }
  TANDEM_CHECK(!out.empty(), "{}: field 'optimizer' lists no range", where);
  std::stable_sort(out.begin(), out.end(), [](const SavedRange& a, const SavedRange& b) {
    return a.range.begin < b.range.begin;
  });
  TANDEM_CHECK(out.front().range.begin == 0 && out.back().range.end == total,
               "{}: the optimizer ranges cover parameters [{}, {}), the model has {}: the file is "
               "damaged; resume from another checkpoint",
               where, out.front().range.begin, out.back().range.end, total);
  if (out.size() == 1 && out.front().file == kOptimizerFile) return whole_file();
  return out;
}

// Checks a file of the optimizer state that is read: every tensor of its ranges (and nothing
// else) in f32 and its shape, the metadata's counters and range.
void check_optimizer_file(const model::SafetensorsFile& file,
                          const std::vector<const SavedRange*>& ranges,
                          const AdamWCounters& counters, const std::string& state_where) {
  const std::string& where = file.path();
  for (const SavedRange* r : ranges) {
    for (const std::string& name : {r->m_name, r->v_name}) {
      const model::SafetensorsEntry& e = file.at(name);
      TANDEM_CHECK(e.dtype == DType::f32 && e.shape == r->shape,
                   "{}: tensor {} is {} {}, expected F32 {}", where, name,
                   model::safetensors_dtype_name(e.dtype), e.shape, r->shape);
    }
  }
  TANDEM_CHECK(file.tensors().size() == 2 * ranges.size(),
               "{}: holds {} tensors, expected {} (the moments m and v of {})", where,
               file.tensors().size(), 2 * ranges.size(),
               ranges.size() == 1 ? "its range" : "each of its ranges");
  const auto meta = file.metadata().find("step");
  TANDEM_CHECK(meta != file.metadata().end() && meta->second == std::to_string(counters.step),
               "{}: metadata 'step' does not match {}'s optimizer.step {} (files from different "
               "checkpoints?)",
               where, state_where, counters.step);
  auto check_meta = [&](const char* key, const std::string& value) {
    const auto it = file.metadata().find(key);
    TANDEM_CHECK(it != file.metadata().end() && it->second == value,
                 "{}: metadata '{}' is {}, the checkpoint's COMMITTED says {}", where, key,
                 it == file.metadata().end() ? std::string("missing") : it->second, value);
  };
  if (ranges.size() == 1 && ranges.front()->m_name == "m") {
    const FlatRange& r = ranges.front()->range;
    check_meta("begin", std::to_string(r.begin));
    check_meta("end", std::to_string(r.end));
  } else if (file.metadata().contains("ranges")) {
    std::vector<FlatRange> mine;
    for (const SavedRange* r : ranges) mine.push_back(r->range);
    check_meta("ranges", ranges_json(mine).dump());
  }
}

// The policy's elements of the wanted ranges (one after the other) from its HF directory, each
// tensor checked (present, F32, its shape); the files are mapped, so only the pages holding them
// are read.
Tensor read_policy_pieces(const fs::path& policy_dir, const ModelShape& shape,
                          std::span<const FlatRange> want) {
  const model::SafetensorsCheckpoint ckpt(policy_dir.string());
  int64_t n = 0;
  for (const FlatRange& w : want) n += w.size();
  Tensor out = Tensor::empty({n}, DType::f32);
  float* into = out.data_as<float>();
  int64_t copied = 0;
  for (const ModelShape::Named& t : shape.named) {
    const model::SafetensorsEntry* e = ckpt.find(t.name);
    TANDEM_CHECK(e != nullptr, "{}: the policy lacks tensor '{}'", ckpt.path(), t.name);
    TANDEM_CHECK(e->dtype == DType::f32 && e->shape == t.shape,
                 "{}: tensor '{}' is {} {}, a checkpoint's policy holds F32 {}",
                 ckpt.file_of(t.name).path(), t.name, model::safetensors_dtype_name(e->dtype),
                 e->shape, t.shape);
    const int64_t begin = shape.storage[t.tensor].begin + t.offset, end = begin + t.shape.numel();
    Tensor from;
    int64_t at = 0;  // into out
    for (const FlatRange& w : want) {
      const int64_t lo = std::max(begin, w.begin), hi = std::min(end, w.end);
      if (lo < hi) {
        if (!from.defined()) from = ckpt.view(t.name);
        std::memcpy(into + at + (lo - w.begin), from.data_as<float>() + (lo - begin),
                    static_cast<size_t>(hi - lo) * sizeof(float));
        copied += hi - lo;
      }
      at += w.size();
    }
  }
  TANDEM_CHECK(copied == n, "{}: the policy's tensors hold {} of the {} elements wanted",
               policy_dir.string(), copied, n);
  return out;
}

// Reads and checks everything for the wanted ranges: the moments, and the whole policy
// (whole_policy) or its elements of the ranges.
Restored restore(const std::string& dir_path, const ModelShape& shape,
                 std::span<const FlatRange> want, bool whole_policy) {
  const fs::path dir(dir_path);
  std::error_code ec;
  TANDEM_CHECK(fs::is_directory(dir, ec), "{}: checkpoint directory does not exist", dir.string());
  Restored out;
  int64_t version = 0;
  out.state = read_state(dir, version, out.counters);
  const std::string state_where = (dir / kStateFile).string();
  std::optional<json> marker;
  if (version != kVersionUnmarked) marker = read_marker(dir, out.state);
  const fs::path policy_dir = dir / kPolicyDir;
  require_file(policy_dir / "config.json", "the policy's config");

  // Policy: the config first, so that another model is named by its field.
  const model::ModelConfig got = model::config_from_hf_file((policy_dir / "config.json").string());
  check_same_config(shape.config, got, (policy_dir / "config.json").string());
  const std::vector<SavedRange> saved = saved_ranges(dir, marker ? &*marker : nullptr, shape);
  if (whole_policy) {
    out.policy = model::load_hf(policy_dir.string(), DType::f32);
  } else {
    out.params = read_policy_pieces(policy_dir, shape, want);
  }

  // Optimizer: the pieces of the saved ranges that overlap `want`, file by file.
  std::vector<FlatRange> ranges;
  for (const SavedRange& r : saved) ranges.push_back(r.range);
  const std::vector<ShardRead> plan = plan_shard_reads(ranges, want);
  spdlog::debug("{}: {} ranges of the optimizer state from\n{}", dir.string(), want.size(),
                describe(plan));
  int64_t n = 0;
  for (const FlatRange& w : want) n += w.size();
  out.m = Tensor::zeros({n}, DType::f32);
  out.v = Tensor::zeros({n}, DType::f32);
  std::map<std::string, std::unique_ptr<model::SafetensorsFile>> files;
  for (const ShardRead& read : plan) {
    const SavedRange& r = saved[read.source];
    std::unique_ptr<model::SafetensorsFile>& file = files[r.file];
    if (!file) {
      file = std::make_unique<model::SafetensorsFile>((dir / r.file).string());
      std::vector<const SavedRange*> in_file;
      for (const SavedRange& x : saved)
        if (x.file == r.file) in_file.push_back(&x);
      check_optimizer_file(*file, in_file, out.counters, state_where);
    }
    for (auto [name, into] : {std::pair{&r.m_name, &out.m}, std::pair{&r.v_name, &out.v}}) {
      const Tensor from = file->view(*name);
      std::memcpy(into->data_as<float>() + read.offset, from.data_as<float>() + read.source_offset,
                  static_cast<size_t>(read.count) * sizeof(float));
    }
  }
  return out;
}

}  // namespace

std::vector<ShardRead> plan_shard_reads(std::span<const FlatRange> saved, FlatRange want) {
  return plan_shard_reads(saved, std::span<const FlatRange>(&want, 1));
}

std::vector<ShardRead> plan_shard_reads(std::span<const FlatRange> saved,
                                        std::span<const FlatRange> want) {
  for (size_t i = 0; i < saved.size(); ++i) {
    const FlatRange& r = saved[i];
    TANDEM_CHECK(r.begin <= r.end && (i == 0 || saved[i - 1].end == r.begin),
                 "checkpoint: saved range {} [{}, {}) does not follow range {} [{}, {}): the "
                 "ranges must be in order, without gaps or overlaps",
                 i, r.begin, r.end, i == 0 ? 0 : i - 1, i == 0 ? 0 : saved[i - 1].begin,
                 i == 0 ? 0 : saved[i - 1].end);
  }
  std::vector<ShardRead> plan;
  int64_t offset = 0;  // of this wanted range in the buffer read
  for (const FlatRange& w : want) {
    TANDEM_CHECK(w.begin <= w.end, "checkpoint: range [{}, {}) to read is empty the wrong way",
                 w.begin, w.end);
    int64_t at = w.begin;  // the next element to find
    // The first saved range that ends past w.begin.
    auto i = static_cast<size_t>(
        std::upper_bound(saved.begin(), saved.end(), w.begin,
                         [](int64_t x, const FlatRange& r) { return x < r.end; }) -
        saved.begin());
    for (; i < saved.size() && at < w.end; ++i) {
      const FlatRange& r = saved[i];
      const int64_t lo = std::max(at, r.begin), hi = std::min(w.end, r.end);
      if (lo >= hi || lo != at) continue;
      plan.push_back({i, lo - r.begin, offset + lo - w.begin, hi - lo});
      at = hi;
    }
    TANDEM_CHECK(at == w.end,
                 "checkpoint: the saved ranges ({} of them, [{}, {})) do not hold elements [{}, "
                 "{}) of the parameters",
                 saved.size(), saved.empty() ? 0 : saved.front().begin,
                 saved.empty() ? 0 : saved.back().end, at, w.end);
    offset += w.size();
  }
  return plan;
}

std::string describe(std::span<const ShardRead> plan) {
  std::string out;
  for (const ShardRead& r : plan)
    out += fmt::format("range {} [{}, {}) -> [{}, {})\n", r.source, r.source_offset,
                       r.source_offset + r.count, r.offset, r.offset + r.count);
  return out;
}

std::string checkpoint_dir(const std::string& root, int64_t step) {
  return (fs::path(root) / ("step-" + std::to_string(step))).string();
}

std::string save_checkpoint(const std::string& root, int64_t step, const model::Weights& policy,
                            const AdamW& optimizer, const TrainerState& state,
                            const CheckpointOptions& options) {
  check_policy(policy);
  return save_alone(
      root, step, model_shape(policy), nullptr,
      [&](const PendingSave& p) { write_policy(p, policy); }, optimizer.m().storage(),
      optimizer.v().storage(), optimizer.counters(), optimizer.config(), state, options);
}

namespace {

// The model's shape as a sharded optimizer's layout splits it.
ModelShape sharded_shape(ShardedAdamW& optimizer) {
  const ModelShape shape = model_shape(optimizer.compute_weights());
  TANDEM_CHECK(shape.total() == optimizer.layout().total(),
               "checkpoint: the optimizer's layout has {} parameters, its model {}",
               optimizer.layout().total(), shape.total());
  return shape;
}

}  // namespace

std::string save_checkpoint(const std::string& root_path, int64_t step, ShardedAdamW& optimizer,
                            const TrainerState& state, const CheckpointOptions& options) {
  const AdamWCounters& c = optimizer.counters();
  Communicator* comm = optimizer.comm();
  const model::ShardLayout& layout = optimizer.layout();
  const bool gathered = optimizer.options().level == ShardLevel::parameters;
  const ModelShape shape = sharded_shape(optimizer);
  if (comm == nullptr) {
    // One rank: every unit whole in its piece, the moments as views of its storage tensors.
    std::vector<model::NamedTensor> m, v;
    for (size_t t = 0; t < shape.storage.size(); ++t) {
      const model::ShardUnit& unit = layout.units()[layout.unit_of_tensor(t)];
      const int64_t at = unit.local + shape.storage[t].begin - unit.flat.begin;
      for (auto [into, from] : {std::pair{&m, &optimizer.m()}, std::pair{&v, &optimizer.v()}})
        into->push_back({shape.storage_names[t],
                         from->narrow(at, shape.storage[t].size()).view(shape.storage_shapes[t])});
    }
    auto policy = [&](const PendingSave& p) {
      if (!gathered) return write_policy(p, optimizer.params());
      if (std::exception_ptr e = write_gathered_policy(&p, optimizer, shape))
        std::rethrow_exception(e);
    };
    return save_alone(root_path, step, shape, shard_level_name(optimizer.options().level), policy,
                      m, v, c, optimizer.config(), state, options);
  }
  check_save_arguments(step, state, options);
  const int rank = comm->rank(), world = comm->size();
  const bool writer = rank == 0;
  const std::string name = "step-" + std::to_string(step);
  PendingSave p{fs::path(root_path), {}, fs::path(root_path) / name, name, 0, options};
  // Each rank's outcome of a phase, all-gathered in rank order (bounded by the communicator's
  // timeout: a dead rank is an error here, not a hang), so that every rank goes on or gives up
  // together. A rank's own failure is rethrown as it was.
  std::exception_ptr failed;
  auto attempt = [&](auto&& fn) {
    if (failed) return;
    try {
      fn();
    } catch (...) {
      failed = std::current_exception();
    }
  };
  auto abandon = [&](const char* phase, const std::exception& e) {
    if (writer && !p.tmp.empty()) {
      std::error_code ec;
      fs::remove_all(p.tmp, ec);
    }
    // Past a commit that went through, the checkpoint is complete all the same.
    const bool done = writer && !failed && std::string_view(phase) == "commit";
    TANDEM_FAIL("checkpoint {} {} at the {} phase: {}", p.target.string(),
                done ? "is complete, but a rank was lost"
                     : "abandoned (the previous checkpoints are as they were)",
                phase, e.what());
  };
  auto agree = [&](const char* phase, std::vector<double> mine) {
    mine.insert(mine.begin(), failed ? 0.0 : 1.0);
    std::vector<double> all;
    try {
      all = gather_doubles(*comm, mine);
    } catch (const std::exception& e) {
      abandon(phase, e);
    }
    const size_t k = mine.size();
    std::vector<int> bad;
    for (int r = 0; r < world; ++r)
      if (all[static_cast<size_t>(r) * k] == 0) bad.push_back(r);
    if (!bad.empty()) {
      if (writer && !p.tmp.empty()) {
        std::error_code ec;
        fs::remove_all(p.tmp, ec);
      }
      if (failed) std::rethrow_exception(failed);
      TANDEM_FAIL(
          "checkpoint {} abandoned at the {} phase: rank {} of {} failed (its own error "
          "says why); the previous checkpoints are as they were",
          p.target.string(), phase, bad.front(), world);
    }
    return all;
  };

  // Rank 0 creates the temporary directory, named after its pid, which every rank learns.
  if (writer) {
    p.pid = static_cast<int64_t>(::getpid());
    p.tmp = tmp_dir(p.root, step, p.pid);
    attempt([&] { create_tmp(p, true); });
  }
  const std::vector<double> pids = agree("create", {static_cast<double>(::getpid())});
  p.pid = static_cast<int64_t>(pids[1]);
  p.tmp = tmp_dir(p.root, step, p.pid);

  // The policy: rank 0 writes it, from the whole weights or as every rank gathers it.
  if (gathered) {
    try {
      if (std::exception_ptr e = write_gathered_policy(writer ? &p : nullptr, optimizer, shape))
        failed = e;
    } catch (const std::exception& e) {
      abandon("policy", e);
    }
  } else if (writer) {
    attempt([&] { write_policy(p, optimizer.params()); });
  }

  // Every rank its pieces; rank 0 the trainer state too.
  const std::string mine = shard_file(rank, world);
  FileSum sum;
  attempt([&] {
    const std::vector<Piece> pieces = pieces_of(layout, rank);
    std::map<std::string, std::string> meta = counters_metadata(c);
    meta["ranges"] = ranges_json(ranges_of(pieces)).dump();
    meta["parameters"] = std::to_string(layout.total());
    meta["rank"] = std::to_string(rank);
    meta["world_size"] = std::to_string(world);
    meta["shard_level"] = shard_level_name(optimizer.options().level);
    std::vector<model::NamedTensor> tensors;
    for (auto [prefix, from] : {std::pair{"m.", &optimizer.m()}, std::pair{"v.", &optimizer.v()}})
      for (const Piece& piece : pieces)
        tensors.push_back({prefix + layout.units()[piece.unit].name,
                           from->narrow(piece.local, piece.range.size())});
    model::write_safetensors((p.tmp / mine).string(), tensors, meta);
    sum = sum_file(p.tmp / mine);
    p.stage("optimizer");
    if (writer) write_state(p, state, c, optimizer.config());
  });
  const std::vector<double> parts =
      agree("write", {static_cast<double>(sum.bytes), static_cast<double>(sum.crc)});

  // Every part is complete: rank 0 commits.
  if (writer) {
    attempt([&] {
      std::vector<json> ranks;
      std::map<std::string, FileSum> known;
      for (int r = 0; r < world; ++r) {
        const double* x = parts.data() + static_cast<size_t>(r) * 3;  // ok, bytes, crc
        json ranges = json::array();
        for (const Piece& piece : pieces_of(layout, r)) {
          const std::string& unit = layout.units()[piece.unit].name;
          ranges.push_back({{"begin", piece.range.begin},
                            {"end", piece.range.end},
                            {"m", "m." + unit},
                            {"v", "v." + unit}});
        }
        ranks.push_back({{"file", shard_file(r, world)}, {"ranges", ranges}});
        known[shard_file(r, world)] = {static_cast<int64_t>(x[1]), static_cast<uint32_t>(x[2])};
      }
      json marker = marker_json(step, world, layout.total(), ranks);
      marker["shard_level"] = shard_level_name(optimizer.options().level);
      marker["files"] = list_files(p.tmp, known);
      commit(p, marker);
    });
  }
  agree("commit", {});
  return p.target.string();
}

std::string save_checkpoint(const std::string& root, int64_t step, Optimizer& optimizer,
                            const TrainerState& state, const CheckpointOptions& options) {
  if (auto* sharded = dynamic_cast<ShardedAdamW*>(&optimizer))
    return save_checkpoint(root, step, *sharded, state, options);
  auto& adamw = dynamic_cast<AdamW&>(optimizer);
  return save_checkpoint(root, step, adamw.params(), adamw, state, options);
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

void load_checkpoint(const std::string& dir, model::Weights& policy, AdamW& optimizer,
                     TrainerState& state) {
  check_policy(policy);
  const ModelShape shape = model_shape(optimizer.params());
  const FlatRange whole{0, shape.total()};
  Restored r = restore(dir, shape, std::span<const FlatRange>(&whole, 1), true);
  // Everything read and checked: now overwrite.
  policy.copy_from(*r.policy);
  for (size_t t = 0; t < shape.storage.size(); ++t) {
    const int64_t at = shape.storage[t].begin, len = shape.storage[t].size();
    for (auto [from, into] : {std::pair{&r.m, &optimizer.m()}, std::pair{&r.v, &optimizer.v()}}) {
      Tensor dst = into->storage()[t].tensor;
      dst.copy_from(from->narrow(at, len).view(dst.shape()));
    }
  }
  optimizer.set_counters(r.counters);
  state = std::move(r.state);
}

void load_checkpoint(const std::string& dir, ShardedAdamW& optimizer, TrainerState& state) {
  const model::ShardLayout& layout = optimizer.layout();
  const bool gathered = optimizer.options().level == ShardLevel::parameters;
  const ModelShape shape = sharded_shape(optimizer);
  const std::vector<Piece> pieces = pieces_of(layout, rank_of(optimizer));
  const std::vector<FlatRange> want = ranges_of(pieces);
  Restored r = restore(dir, shape, want, !gathered);
  // Everything read and checked: now overwrite (the pieces' padding zero).
  std::vector<std::pair<const Tensor*, Tensor*>> copies = {{&r.m, &optimizer.m()},
                                                           {&r.v, &optimizer.v()}};
  if (gathered) copies.emplace_back(&r.params, &optimizer.local_params());
  for (auto [from, into] : copies) {
    std::memset(into->data(), 0, into->nbytes());
    int64_t at = 0;
    for (const Piece& piece : pieces) {
      into->narrow(piece.local, piece.range.size()).copy_from(from->narrow(at, piece.range.size()));
      at += piece.range.size();
    }
  }
  if (!gathered) optimizer.params().copy_from(*r.policy);
  optimizer.set_counters(r.counters);
  state = std::move(r.state);
}

void load_checkpoint(const std::string& dir, Optimizer& optimizer, TrainerState& state) {
  if (auto* sharded = dynamic_cast<ShardedAdamW*>(&optimizer))
    return load_checkpoint(dir, *sharded, state);
  auto& adamw = dynamic_cast<AdamW&>(optimizer);
  load_checkpoint(dir, adamw.params(), adamw, state);
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back().second.string();
}

}  // namespace tandem::trainer
