// One update of a policy as the training benchmarks time it: the forward of a packed batch, the
// backward of its mean token logprob (the head's rows), then AdamW.
#pragma once

#include <algorithm>

#include "model/decoder.h"
#include "model/weights.h"
#include "trainer/optimizer.h"

namespace tandem::bench {

struct UpdateStep {
  UpdateStep(model::Weights& policy, const model::PackedBatch& batch)
      : batch(batch),
        tokens(batch.num_tokens()),
        dec(policy, model::DecoderOptions{.max_tokens = tokens}),
        grads(policy.config(), DType::f32, Device::cpu(), ArenaClass::gradients),
        adamw(policy,
              [] {
                trainer::AdamWConfig ac;
                ac.max_grad_norm = 1.0f;
                return ac;
              }()),
        lp(Tensor::empty({tokens}, DType::f32)),
        ent(Tensor::empty({tokens}, DType::f32)),
        dlp(Tensor::empty({tokens}, DType::f32)) {
    std::fill_n(dlp.data_as<float>(), tokens, 1.0f / static_cast<float>(tokens));
  }
  void run(float lr) {
    grads.zero();
    dec.forward(batch, lp, ent);
    dec.backward(dlp, Tensor(), grads);
    adamw.step(grads, lr);
  }

  const model::PackedBatch& batch;
  const int64_t tokens;
  model::Decoder dec;
  model::Weights grads;
  trainer::AdamW adamw;
  Tensor lp, ent, dlp;
};

}  // namespace tandem::bench
