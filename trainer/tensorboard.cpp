// TensorBoard event files: protobuf Events in TFRecord framing.
#include "trainer/tensorboard.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <vector>

#include "core/atomic_file.h"
#include "core/crc32c.h"
#include "core/error.h"
#include "trainer/tensorboard_event.pb.h"

namespace tandem::trainer {
namespace {

namespace fs = std::filesystem;
constexpr const char* kSuffix = ".tandem";

uint32_t masked_crc(std::string_view bytes) {
  const uint32_t c = crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t get_le(std::string_view in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[i])) << (8 * i);
  return v;
}

// The events of an existing file, each as its serialized bytes; stops at a torn last record (a
// run killed mid-write).
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> records;
  size_t at = 0;
  while (at + 12 <= all.size()) {
    const std::string_view head(all.data() + at, 12);
    const uint64_t length = get_le(head, 8);
    if (get_le(head.substr(8), 4) != masked_crc(head.substr(0, 8))) break;
    if (at + 12 + length + 4 > all.size()) break;
    const std::string_view data(all.data() + at + 12, length);
    if (get_le(std::string_view(all.data() + at + 12 + length, 4), 4) != masked_crc(data)) break;
    records.emplace_back(data);
    at += 12 + length + 4;
  }
  return records;
}

std::optional<fs::path> existing_event_file(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("events.out.tfevents.", 0) == 0 && e.path().extension() == kSuffix)
      return e.path();
  }
  return std::nullopt;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string tfrecord(const std::string& bytes) {
  std::string out;
  std::string length;
  put_le(length, bytes.size(), 8);
  out += length;
  put_le(out, masked_crc(length), 4);
  out += bytes;
  put_le(out, masked_crc(bytes), 4);
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t resume_step)
    : resume_step_(resume_step) {
  const std::optional<fs::path> existing = existing_event_file(dir);
  std::vector<std::string> kept;
  if (existing) {
    path_ = existing->string();
    for (std::string& r : read_records(path_)) {
      tensorboard::Event e;
      if (!e.ParseFromString(r)) break;
      if (e.step() > resume_step) continue;
      if (e.step() == resume_step && e.has_summary())
        for (const auto& v : e.summary().value()) written_at_resume_step_.insert(v.tag());
      kept.push_back(std::move(r));
    }
  } else {
    path_ = (fs::path(dir) /
             fmt::format("events.out.tfevents.{}{}", static_cast<int64_t>(now_seconds()), kSuffix))
                .string();
    tensorboard::Event version;
    version.set_wall_time(now_seconds());
    version.set_file_version("brain.Event:2");
    kept.push_back(version.SerializeAsString());
  }
  // Rewritten whole (through a temporary file and a rename), so a kill leaves the old file.
  std::string file;
  for (const std::string& r : kept) file += tfrecord(r);
  write_file_atomically(
      path_, file, "cannot rewrite the TensorBoard event file: free space or move logging.dir");
  out_.open(path_, std::ios::binary | std::ios::app);
  TANDEM_CHECK(out_.good(), "cannot write the TensorBoard event file '{}' (logging.dir)", path_);
}

void TensorBoardWriter::write(const nlohmann::ordered_json& metrics, double wall_time) {
  const int64_t step = metrics.at("step").get<int64_t>();
  tensorboard::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  tensorboard::Summary* summary = e.mutable_summary();
  for (auto it = metrics.begin(); it != metrics.end(); ++it) {
    if (it.key() == "step" || !(it->is_number() || it->is_boolean())) continue;
    if (step == resume_step_ && written_at_resume_step_.count(it.key()) > 0) continue;
    tensorboard::SummaryValue* v = summary->add_value();
    v->set_tag(it.key());
    v->set_simple_value(it->is_boolean() ? (it->get<bool>() ? 1.0f : 0.0f) : it->get<float>());
  }
  if (summary->value_size() == 0) return;
  append(e.SerializeAsString());
}

void TensorBoardWriter::append(const std::string& event_bytes) {
  out_ << tfrecord(event_bytes);
  out_.flush();
  TANDEM_CHECK(out_.good(), "writing the TensorBoard event file '{}' failed (disk full?)", path_);
}

std::vector<Scalar> read_scalars(const std::string& path) {
  std::vector<Scalar> out;
  for (const std::string& r : read_records(path)) {
    tensorboard::Event e;
    if (!e.ParseFromString(r)) break;
    if (!e.has_summary()) continue;
    for (const auto& v : e.summary().value())  // as TensorBoard: a value with no kind is skipped
      if (v.value_case() == tensorboard::SummaryValue::kSimpleValue)
        out.push_back({e.step(), v.tag(), v.simple_value(), e.wall_time()});
  }
  return out;
}

}  // namespace tandem::trainer
