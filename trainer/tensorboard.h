// TensorBoard event files for a run: every number of a metrics line as a scalar at its step, in
// one file per run directory (`tensorboard --logdir runs/`).
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace tandem::trainer {

class TensorBoardWriter {
 public:
  // Writes into <dir>/events.out.tfevents.<unix seconds>.tandem, or, when the directory already
  // holds tandem's event file (a resumed run), continues that one: its events of steps past
  // `resume_step` are dropped first (they belong to steps the run does again), and a tag already
  // written at `resume_step` is not written twice. Throws naming the path when it cannot write.
  TensorBoardWriter(const std::string& dir, int64_t resume_step);

  // One event at metrics["step"] holding every number of `metrics` but "step" (booleans as 0/1)
  // under its key, at this wall time (seconds since the Unix epoch).
  void write(const nlohmann::ordered_json& metrics, double wall_time);

  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event_bytes);

  std::string path_;
  std::ofstream out_;
  int64_t resume_step_;
  std::set<std::string> written_at_resume_step_;
};

struct Scalar {
  int64_t step = 0;
  std::string tag;
  float value = 0;
  double wall_time = 0;
};
// The scalars of an event file, in file order; a torn last record (a run killed mid-write) ends
// the list.
std::vector<Scalar> read_scalars(const std::string& path);

// The TFRecord framing of one record: length, masked CRC-32C of the length, the bytes, masked
// CRC-32C of the bytes (little endian).
std::string tfrecord(const std::string& bytes);

}  // namespace tandem::trainer
