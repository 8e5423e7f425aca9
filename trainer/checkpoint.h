// Training checkpoints: <root>/step-<N>/ holding the policy as a Hugging Face directory, the AdamW
// state (moments and counters) as safetensors, one file per data-parallel rank that wrote it, the
// trainer state as JSON and a COMMITTED marker; written into a temporary directory and renamed,
// the last K kept, loaded back bit for bit on any number of ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/shard_layout.h"
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
  // Called with a stage name after each part is written into the temporary directory: "policy"
  // and "trainer_state" (rank 0), "optimizer" (every rank, its own part), "committed" (rank 0,
  // the marker written, before the rename); under a grid (save_grid_checkpoint) rank 0 writes
  // every part and alone calls it. For tests that simulate a failure mid-save by throwing, or
  // stop a rank there to kill it.
  std::function<void(const std::string& stage)> on_stage;
};

// A flat range [begin, end) of the parameters: every storage tensor flattened, one after the
// other in storage order (model::ShardLayout's numbering).
using model::FlatRange;

// One copy of a read plan: `count` elements from `source_offset` into saved range `source` go to
// `offset` into the range read (into the wanted ranges one after the other, for several).
struct ShardRead {
  size_t source = 0;
  int64_t source_offset = 0;
  int64_t offset = 0;
  int64_t count = 0;
  bool operator==(const ShardRead&) const = default;
};

// How to read `want` from the saved ranges (in the order of the flat parameters, without gaps or
// overlaps, e.g. the ranges of the ranks that wrote a checkpoint): the intersection of `want` with
// each saved range, in order. Throws tandem::Error when the saved ranges do not cover `want` or
// are not in order.
std::vector<ShardRead> plan_shard_reads(std::span<const FlatRange> saved, FlatRange want);
// The same for several wanted ranges (e.g. a rank's pieces of every unit), read into one buffer
// one after the other in the order given.
std::vector<ShardRead> plan_shard_reads(std::span<const FlatRange> saved,
                                        std::span<const FlatRange> want);
// One line per copy, "range 1 [10, 30) -> [0, 20)" (elements of saved range 1 -> of the range
// read), for messages and logs.
std::string describe(std::span<const ShardRead> plan);

// The directory of step N under root: <root>/step-<N>.
std::string checkpoint_dir(const std::string& root, int64_t step);

// Writes <root>/step-<step>/ (policy/, optimizer.safetensors, trainer_state.json, COMMITTED) into
// <root>/.tmp-step-<step>-<pid>, then renames it into place (replacing an existing step-<step>);
// a failure removes the temporary directory and leaves every existing checkpoint as it was.
// Returns the checkpoint's directory.
std::string save_checkpoint(const std::string& root, int64_t step, const model::Weights& policy,
                            const AdamW& optimizer, const TrainerState& state,
                            const CheckpointOptions& options = {});

// The same from the ranks of optimizer.comm(), collective: every rank calls it with the same
// step, state and options. The ranks share <root>/.tmp-step-<step>-<pid of rank 0>, so root must
// be one file system that every rank sees (on several nodes, a shared one). Each rank writes its
// pieces of the optimizer state (model::ShardLayout's, one per unit it owns elements of) to
// optimizer/rank-<r>-of-<N>.safetensors: tensors "m.<unit>" and "v.<unit>" holding the real
// elements of each piece, in unit order, their flat ranges and the counters in the metadata.
// Rank 0 writes the policy (f32): below ShardLevel::parameters from the whole master weights
// params(); at ShardLevel::parameters unit by unit as every rank gathers it (gather_unit), the
// HF files written tensor by tensor as the units arrive, so that no rank holds more than one
// unit's weights at a time. Once every rank's part is written (each rank's outcome all-gathered,
// bounded by the communicator's timeout), rank 0 writes COMMITTED (world size, shard level,
// step, every rank's ranges and tensor names, every file with its size and CRC-32C) and renames
// the directory into place. A rank that fails or dies makes the others throw; the directory is
// removed (or left as a .tmp-* that the next job removes) and every existing checkpoint stays as
// it was. Without a communicator (one rank) it writes optimizer.safetensors as the AdamW
// overload does.
std::string save_checkpoint(const std::string& root, int64_t step, ShardedAdamW& optimizer,
                            const TrainerState& state, const CheckpointOptions& options = {});
// Either optimizer's save (AdamW's policy: its params()).
std::string save_checkpoint(const std::string& root, int64_t step, Optimizer& optimizer,
                            const TrainerState& state, const CheckpointOptions& options = {});

// Cleans up after saves that were killed mid-way: removes every <root>/.tmp-step-<N>-<pid>
// directory, and every .old-step-<N>-<pid> whose step-<N> is in place (one whose step-<N> is
// missing holds the only copy, from a save killed between its two renames: it is renamed back).
// Only for a caller that holds root's lock, so that no save is running. Returns one line per
// directory removed or restored, naming it and its writer's pid.
std::vector<std::string> recover_interrupted_saves(const std::string& root);

// The committed checkpoint with the highest step under root (a step-<N> directory with its
// COMMITTED marker, or one written before markers: trainer_state.json of version 1), or nullopt
// when there is none (or root does not exist).
std::optional<std::string> latest_checkpoint(const std::string& root);

// Restores policy (f32 master weights), the optimizer's moments and counters and the trainer
// state from dir, bitwise, whatever the number of ranks that wrote it. Everything is read and
// checked into temporaries first: a missing marker, a missing or truncated file (the marker lists
// every file and its size), a malformed field or a checkpoint of another model (the differing
// config field is named) throws tandem::Error naming the file and field, and leaves all three
// untouched.
void load_checkpoint(const std::string& dir, model::Weights& policy, AdamW& optimizer,
                     TrainerState& state);
// The same into this rank's pieces of a sharded optimizer, whatever the world size and shard
// level that saved it: only the pieces of the saved files that overlap this rank's pieces are
// read (plan_shard_reads), and below ShardLevel::parameters the whole policy into params(); at
// ShardLevel::parameters only this rank's pieces of the policy's tensors (the files are mapped:
// only their pages are read) into local_params(). Not collective.
void load_checkpoint(const std::string& dir, ShardedAdamW& optimizer, TrainerState& state);
// Either optimizer's load (AdamW's policy: its params()).
void load_checkpoint(const std::string& dir, Optimizer& optimizer, TrainerState& state);

}  // namespace tandem::trainer
