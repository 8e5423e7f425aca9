// The unit hooks of sharded training: how a decoder asks a sharded optimizer for the weights of
// one unit of the model at a time and hands it the gradients of each (model::ShardLayout's units,
// numbered by PartUnits for a whole model or a pipeline stage's part), and the order of those
// calls in a pass.
#pragma once

#include <cstddef>
#include <cstdint>

#include "model/config.h"
#include "model/weights.h"

namespace tandem::model {

// A trainer whose weights or gradients are sharded over ranks (trainer::ShardedAdamW) makes them
// whole one unit at a time (model::ShardLayout's units of the part's table, PartUnits). A decoder
// given hooks (training forward and backward, and a pipeline stage's, only) calls acquire(u)
// before it reads unit u's weights and release(u) when done with them (the head: acquire(head),
// then the embedding's or its copy's when tied, released in the reverse order), and in backward
// begin_gradients(u) before it adds to unit u's gradients and end_gradients(u) once it has added
// all of them (a tied embedding's span the whole backward of a part holding the embedding and the
// head). Forward: E, the part's layers, head; backward: head, the layers in reverse, E (gradients
// only). walk_unit_calls makes the same calls without computing.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void acquire(size_t unit) = 0;
  virtual void release(size_t unit) = 0;
  virtual void begin_gradients(size_t unit) = 0;
  virtual void end_gradients(size_t unit) = 0;
};

// The units of a part's weights, numbered as model::ShardLayout numbers its table's (storage
// order): the embedding when the part holds it, each of its layers, the head (the final norm, and
// lm_head when untied), and on a part with the head but not the embedding the tied head's copy of
// the embedding matrix, last.
struct PartUnits {
  static constexpr size_t kNone = SIZE_MAX;
  PartUnits(const ModelConfig& config, const ModelPart& part);
  size_t embed = kNone;       // the embedding (unit 0), when the part holds it
  size_t head = kNone;        // when the part holds the head
  size_t head_embed = kNone;  // what a tied head reads as lm_head: embed, or its copy
  size_t count = 0;           // units of the part
  size_t layer(int64_t l) const { return first_layer_ + static_cast<size_t>(l); }  // the part's l

 private:
  size_t first_layer_ = 0;
};

// One decoder pass's unit calls: a forward, a forward then its backward (forward and backward),
// or a pipeline stage's backward alone (backward_stage; its forward_stage was a pass of its own).
enum class UnitPass { forward, forward_backward, backward };

// The unit calls a decoder over `part` of a model makes in one pass, in its order, computing
// nothing: a rank's part of a pass it has no micro-batch for, and tests that stand in for the
// decoder.
void walk_unit_calls(const ModelConfig& config, const ModelPart& part, UnitPass pass,
                     UnitHooks& hooks);

// The calls of a decoder's unit hooks (none without hooks) on a part's units, in UnitHooks'
// order: the decoder's and walk_unit_calls' one definition of it.
class UnitCalls {
 public:
  UnitCalls(UnitHooks* hooks, const ModelConfig& config, const ModelPart& part)
      : hooks_(hooks), units_(config, part) {}
  const PartUnits& units() const { return units_; }
  size_t layer(int64_t l) const { return units_.layer(l); }
  void acquire(size_t u) const {
    if (hooks_) hooks_->acquire(u);
  }
  void release(size_t u) const {
    if (hooks_) hooks_->release(u);
  }
  // The head reads the final norm and lm_head: the embedding's weights (or their copy) when tied.
  void acquire_head() const {
    acquire(units_.head);
    if (units_.head_embed != PartUnits::kNone) acquire(units_.head_embed);
  }
  void release_head() const {
    if (units_.head_embed != PartUnits::kNone) release(units_.head_embed);
    release(units_.head);
  }
  void begin_gradients(size_t u) const {
    if (hooks_) hooks_->begin_gradients(u);
  }
  void end_gradients(size_t u) const {
    if (hooks_) hooks_->end_gradients(u);
  }
  // A tied head's gradients of lm_head are the embedding's (or its copy's): open with the head's.
  void begin_head_gradients() const {
    begin_gradients(units_.head);
    if (units_.head_embed != PartUnits::kNone) begin_gradients(units_.head_embed);
  }
  // The head's; a copy of the embedding's too, the embedding's own stay open to its backward.
  void end_head_gradients() const {
    end_gradients(units_.head);
    if (units_.head_embed != PartUnits::kNone && units_.head_embed != units_.embed)
      end_gradients(units_.head_embed);
  }
  void begin_embed_gradients() const {
    if (units_.head_embed != units_.embed) begin_gradients(units_.embed);
  }
  void end_embed_gradients() const { end_gradients(units_.embed); }

 private:
  UnitHooks* hooks_;
  PartUnits units_;
};

}  // namespace tandem::model
