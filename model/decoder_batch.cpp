// PackedBatch (model/decoder.h): whole sequences, or prompt + completion pairs with a shared
// prompt packed once, laid end to end into one training batch.
#include <algorithm>

#include "core/error.h"
#include "model/decoder.h"

namespace tandem::model {

PackedBatch PackedBatch::from_sequences(std::span<const std::vector<int32_t>> sequences) {
  TANDEM_CHECK(!sequences.empty(), "packed batch: no sequences");
  PackedBatch b;
  b.cu_seqlens.push_back(0);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const std::vector<int32_t>& seq = sequences[s];
    TANDEM_CHECK(seq.size() >= 2,
                 "packed batch: sequence {} has {} tokens; a sequence needs at least 2 (an input "
                 "and the target it predicts)",
                 s, seq.size());
    for (size_t j = 0; j + 1 < seq.size(); ++j) {
      b.tokens.push_back(seq[j]);
      b.positions.push_back(static_cast<int32_t>(j));
      b.targets.push_back(seq[j + 1]);
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.tokens.size()));
  }
  return b;
}

PackedBatch PackedBatch::from_prompts(std::span<const PromptCompletion> pairs, bool share_prompts) {
  TANDEM_CHECK(!pairs.empty(), "packed batch: no prompt + completion pairs");
  PackedBatch b;
  b.cu_seqlens.push_back(0);
  // Appends tokens[i] for i in [from, to) as inputs at positions pos0 + ..., each predicting the
  // next token of seq (seq[i + 1]); completion rows go to head_rows.
  auto append = [&](std::span<const int32_t> seq, size_t from, size_t to, int32_t pos0,
                    size_t first_head) {
    for (size_t i = from; i < to; ++i) {
      if (i >= first_head) b.head_rows.push_back(static_cast<int32_t>(b.tokens.size()));
      b.tokens.push_back(seq[i]);
      b.positions.push_back(pos0 + static_cast<int32_t>(i - from));
      b.targets.push_back(seq[i + 1]);
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.tokens.size()));
  };
  for (size_t j = 0; j < pairs.size(); ++j)
    TANDEM_CHECK(!pairs[j].prompt.empty() && !pairs[j].completion.empty(),
                 "packed batch: pair {} has a prompt of {} and a completion of {} tokens; each "
                 "needs at least 1",
                 j, pairs[j].prompt.size(), pairs[j].completion.size());
  std::vector<int32_t> seq;
  for (size_t i = 0; i < pairs.size();) {
    const std::span<const int32_t> prompt = pairs[i].prompt;
    size_t run = 1;
    while (i + run < pairs.size() && std::ranges::equal(pairs[i + run].prompt, prompt)) ++run;
    const size_t np = prompt.size();
    if (!share_prompts || run < 2 || np < 2) run = 1;
    if (run >= 2) {
      // The prompt's first np - 1 tokens once; the pairs prefixed by it.
      const int32_t prefix = static_cast<int32_t>(b.cu_seqlens.size()) - 1;
      append(prompt, 0, np - 1, 0, np);
      b.prefix.resize(static_cast<size_t>(prefix), -1);
      b.prefix.push_back(-1);
      for (size_t j = i; j < i + run; ++j) {
        seq.assign(1, prompt[np - 1]);
        seq.insert(seq.end(), pairs[j].completion.begin(), pairs[j].completion.end());
        append(seq, 0, seq.size() - 1, static_cast<int32_t>(np - 1), 0);
        b.prefix.push_back(prefix);
      }
    } else {
      seq.assign(prompt.begin(), prompt.end());
      seq.insert(seq.end(), pairs[i].completion.begin(), pairs[i].completion.end());
      append(seq, 0, seq.size() - 1, 0, np - 1);
    }
    i += run;
  }
  if (!b.prefix.empty()) b.prefix.resize(static_cast<size_t>(b.num_sequences()), -1);
  return b;
}

int64_t PackedBatch::rows_added(const PromptCompletion& pair, const PromptCompletion* previous,
                                bool share_prompts) {
  // A shared prompt of n tokens costs its first pair n - 1 + completion rows, as the whole pair
  // does; each further pair its completion's. A one-token prompt is not shared, at the same cost.
  if (share_prompts && previous != nullptr && std::ranges::equal(pair.prompt, previous->prompt))
    return static_cast<int64_t>(pair.completion.size());
  return static_cast<int64_t>(pair.prompt.size() + pair.completion.size()) - 1;
}

}  // namespace tandem::model
