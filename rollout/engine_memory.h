// The memory an engine's options ask for, known before it allocates: the start-up check that
// names the setting to lower (num_blocks or max_batch_tokens, as the caller's config spells it)
// instead of an allocation failing later.
#pragma once

#include <string>

#include "model/config.h"
#include "rollout/engine.h"

namespace tandem::rollout {

// The memory an engine of these options takes on its device beside the weights, known before
// it allocates any: the KV cache (num_blocks blocks, K and V of every layer) and the activation
// arena of a step of max_batch_tokens tokens. `config` is the one the engine runs (a shard's
// under tensor parallelism).
struct EngineMemory {
  double kv_cache_bytes = 0;
  double batch_bytes = 0;
};
EngineMemory engine_memory(const model::ModelConfig& config, const EngineOptions& options);

// What a caller's config calls EngineOptions::num_blocks and max_batch_tokens, each with where
// it was set ("rollout.num_blocks (job.toml:12:14)"): the setting a memory error says to lower.
struct EngineMemoryKeys {
  std::string num_blocks, max_batch_tokens;
};
// The start-up check of an engine's sizes, before anything is allocated: throws a tandem::Error
// when the KV cache and a step's activations together need more than `available` bytes
// (memory_available of the engine's device; 0: unknown, nothing is checked), giving both sizes,
// the bytes available and the key of the larger one to lower.
void check_engine_memory(const model::ModelConfig& config, const EngineOptions& options,
                         double available, const EngineMemoryKeys& keys);

}  // namespace tandem::rollout
