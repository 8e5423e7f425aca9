// Training checkpoints: <root>/step-<N>/ holding the policy as a Hugging Face directory, the AdamW
// state (moments and counters) as safetensors, and the trainer state as JSON; written into a
// temporary directory and renamed, the last K kept, loaded back bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/weights.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {

// Everything besides weights and optimizer that a resumed job needs to continue bit-exactly.
struct TrainerState {
  int64_t step = 0;            // trainer steps completed
  int64_t weight_version = 0;  // the version last published to the rollout engines
  int64_t data_epoch = 0;      // passes over the prompt data completed
  int64_t data_position = 0;   // prompts consumed in the current pass
  // RNG states by name (e.g. {"sampler": {"seed": "123", "offset": "456"}}); numbers that need
  // all 64 bits are best stored as strings. Must be a JSON object.
  nlohmann::json rng_states = nlohmann::json::object();
  std::string config;  // the job config as given (TOML or JSON text), for the record and checks
  nlohmann::json extra = nlohmann::json::object();  // anything else; must be a JSON object
  bool operator==(const TrainerState&) const = default;
};

struct CheckpointOptions {
  // After the new checkpoint is complete, delete older step-* directories so that only the last
  // keep_last remain; 0 keeps everything.
  int keep_last = 0;
  // Files written into the policy's HF directory (name -> contents), e.g. tokenizer.json.
  std::map<std::string, std::string> extra_files;
  // Called with a stage name ("policy", "optimizer", "trainer_state") after each part is written
  // into the temporary directory; for tests that simulate a failure mid-save by throwing.
  std::function<void(const std::string& stage)> on_stage;
};

// The directory of step N under root: <root>/step-<N>.
std::string checkpoint_dir(const std::string& root, int64_t step);

// Writes <root>/step-<step>/ (policy/, optimizer.safetensors, trainer_state.json) into
// <root>/.tmp-step-<step>-<pid>, then renames it into place (replacing an existing step-<step>);
// a failure removes the temporary directory and leaves every existing checkpoint as it was.
// Returns the checkpoint's directory.
std::string save_checkpoint(const std::string& root, int64_t step, const model::Weights& policy,
                            const AdamW& optimizer, const TrainerState& state,
                            const CheckpointOptions& options = {});

// Cleans up after saves that were killed mid-way: removes every <root>/.tmp-step-<N>-<pid>
// directory, and every .old-step-<N>-<pid> whose step-<N> is in place (one whose step-<N> is
// missing holds the only copy, from a save killed between its two renames: it is renamed back).
// Only for a caller that holds root's lock, so that no save is running. Returns one line per
// directory removed or restored, naming it and its writer's pid.
std::vector<std::string> recover_interrupted_saves(const std::string& root);

// The complete checkpoint with the highest step under root (a step-<N> directory with its
// trainer_state.json), or nullopt when there is none (or root does not exist).
std::optional<std::string> latest_checkpoint(const std::string& root);

// Restores policy (f32 master weights), the optimizer's moments and counters and the trainer
// state from dir, bitwise. Everything is read and checked into temporaries first: a missing or
// truncated file, a malformed field or a checkpoint of another model (the differing config field
// is named) throws tandem::Error naming the file and field, and leaves all three untouched.
void load_checkpoint(const std::string& dir, model::Weights& policy, AdamW& optimizer,
                     TrainerState& state);

}  // namespace tandem::trainer
