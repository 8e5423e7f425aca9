// The unit numbering of a model part and the unit calls of one pass without computing.
#include "model/unit_hooks.h"

namespace tandem::model {

PartUnits::PartUnits(const ModelConfig& config, const ModelPart& part) {
  if (part.embedding) embed = count++;
  first_layer_ = count;
  count += static_cast<size_t>(part.num_layers);
  if (part.head) {
    head = count++;
    if (config.tie_word_embeddings) head_embed = part.embedding ? embed : count++;
  }
}

void walk_unit_calls(const ModelConfig& config, const ModelPart& part, UnitPass pass,
                     UnitHooks& hooks) {
  const UnitCalls units(&hooks, config, part);
  const PartUnits& u = units.units();
  if (pass != UnitPass::backward) {
    if (part.embedding) {
      units.acquire(u.embed);
      units.release(u.embed);
    }
    for (int64_t l = 0; l < part.num_layers; ++l) {
      units.acquire(units.layer(l));
      units.release(units.layer(l));
    }
    if (part.head) {
      units.acquire_head();
      units.release_head();
    }
  }
  if (pass == UnitPass::forward) return;
  if (part.head) {
    units.begin_head_gradients();
    units.acquire_head();
    units.release_head();
    units.end_head_gradients();
  }
  for (int64_t l = part.num_layers - 1; l >= 0; --l) {
    units.acquire(units.layer(l));
    units.begin_gradients(units.layer(l));
    units.end_gradients(units.layer(l));
    units.release(units.layer(l));
  }
  if (part.embedding) {
    units.begin_embed_gradients();
    units.end_embed_gradients();
  }
}

}  // namespace tandem::model
