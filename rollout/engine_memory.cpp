// The KV cache and step activations an engine's options ask for, and their check against the
// memory available.
#include "rollout/engine_memory.h"

#include "core/error.h"
#include "model/decoder.h"
#include "rollout/block_manager.h"

namespace tandem::rollout {

EngineMemory engine_memory(const model::ModelConfig& config, const EngineOptions& options) {
  EngineMemory m;
  m.kv_cache_bytes =
      static_cast<double>(BlockManager::bytes_per_block(config, options.block_size)) *
      static_cast<double>(options.num_blocks);
  m.batch_bytes = static_cast<double>(
      model::Decoder::plan_bytes(config, options.max_batch_tokens, /*recompute=*/false));
  return m;
}

void check_engine_memory(const model::ModelConfig& config, const EngineOptions& options,
                         double available, const EngineMemoryKeys& keys) {
  const EngineMemory m = engine_memory(config, options);
  if (available <= 0 || m.kv_cache_bytes + m.batch_bytes <= available) return;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  TANDEM_FAIL(
      "the rollout engine asks for {:.0f} bytes ({:.1f} GiB) of KV cache ({} blocks of {} "
      "bytes) and {:.0f} bytes ({:.1f} GiB) of activations for a step of {} tokens, more than "
      "the {:.0f} bytes ({:.1f} GiB) of memory available: lower {}",
      m.kv_cache_bytes, m.kv_cache_bytes / kGiB, options.num_blocks,
      BlockManager::bytes_per_block(config, options.block_size), m.batch_bytes,
      m.batch_bytes / kGiB, options.max_batch_tokens, available, available / kGiB,
      m.kv_cache_bytes >= m.batch_bytes ? keys.num_blocks : keys.max_batch_tokens);
}

}  // namespace tandem::rollout
