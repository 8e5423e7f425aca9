// Sampling over vocabulary shards: ops::sample's definition (kernels/ops.h) for a
// tensor-parallel group whose ranks each hold only their (B, V/tp) logits, with a few small
// collectives per step instead of an all-gather of the (B, V) logits (docs/rollout.md,
// "Tensor-parallel sampling").
//
// A step is a fixed run of local phases, each an op of kernels/ops.h (sample_shard_maxima, _stats,
// _chain, _counts, _candidates, _decide, _draws: their definitions are there), with one collective
// between two of them; every rank runs the same phases and the collectives depend only on the
// settings, which every rank holds:
//  1. maxima: all-gather (tp, B, 2). Greedy rows are decided by it.
//  2. stats: all-gather (tp, B, 3); lse = max z + log(the ranks' sums added in rank order).
//  2b. chain (only with plain rows): ops::sample draws where the running sum of the kept e, one
//     f32 addition after the other in vocabulary order, passes u * its end. Rank h continues
//     that running sum from rank h - 1's end, exactly, so tp - 1 hops, each an all-reduce (B)
//     sum with zeros from the other ranks, give every rank every rank's end.
//  3. counts (only when a row is a nucleus row): the ranks' candidates per row, all-gather (tp,
//     B); without nucleus rows every rank knows them (min(top_k, V/tp) for top-k rows).
//  4. candidates (only with top-k or nucleus rows): all-gather-v of every rank's candidates; then
//     every rank applies ops::sample's definition to each row's candidates in vocabulary order.
//  5. draws (only with plain rows): the rank whose range holds the draw finds the token in its
//     shard; all-reduce (B, 2) sum of [token, logprob], zeros from the other ranks.
// Every rank ends with the same tokens and logprobs, on the CPU or on CUDA (the logits' device;
// the kinds and the counts come to the host to size the collectives).
//
// Against ops::sample on the full logits: greedy, top-k and plain rows draw the same token (the
// same sums in the same order); a nucleus row's top-p target is top_p times the ranks' sums
// added in rank order, so a threshold exactly on a boundary may fall differently by rounding;
// logprobs differ in the last bits (the sum of e is added in another order). The chain costs
// latency: its hops run one after the other (a rank folds V/tp values per plain row).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/comm.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::model {

class TpSampler {
 public:
  // One collective between two phases: out = the ranks' `in` concatenated in rank order
  // (gather; rank r sends counts[r] elements, counts empty when every rank sends in.numel()),
  // or their elementwise sum (sum). f32 tensors on the logits' device.
  struct Collective {
    enum class Op { gather, sum } op = Op::gather;
    const char* what = "";
    Tensor in, out;
    std::span<const int64_t> counts;
  };

  // Starts a step: logits (B, V/tp) f32, the rows [rank V/tp, (rank + 1) V/tp) of the
  // vocabulary; settings (B) on the logits' device as ops::sample takes them (bad ones throw
  // naming the row, as there). Keeps both until next() returns false.
  void start(const Tensor& logits, const ops::SamplingTensors& settings, int rank, int tp);
  // Runs the local phase the previous collective's result allows and fills c with the next
  // collective (its tensors on the logits' device); false when tokens() and logprobs() hold the
  // step's results.
  bool next(Collective& c);

  // On the host.
  std::span<const int32_t> tokens() const { return {token_host_.data(), static_cast<size_t>(B_)}; }
  std::span<const float> logprobs() const {
    return {logprob_host_.data(), static_cast<size_t>(B_)};
  }
  // Bytes the step's collectives delivered to this rank (their outputs): the sampling's traffic.
  int64_t step_bytes() const { return bytes_; }

 private:
  enum class Stage { maxima, stats, chain, counts, candidates, decide, draws, done };

  // A tensor of the step's shape in storage that grows to the largest step seen.
  struct Buffer {
    Tensor storage, t;
    Tensor& fit(const Shape& shape, DType dtype, Device device);
  };
  bool any(ops::SampleRowKind kind) const;
  Collective gather(const char* what, const Tensor& in, Buffer& out, const Shape& shape);
  Collective sum(const char* what, const Tensor& in, const Tensor& out);
  // t's values on the host: t itself on the CPU, else a copy in host.
  const Tensor& on_host(const Tensor& t, Buffer& host);

  Tensor logits_;  // (B, Vs)
  ops::SamplingTensors settings_;
  ops::VocabShard shard_;
  int64_t B_ = 0, Vs_ = 0;
  Stage stage_ = Stage::done;
  int hop_ = 1;
  int64_t bytes_ = 0;

  // The phases' tensors on the logits' device (kernels/ops.h, sample_shard_*).
  Buffer kinds_;                      // (B) u8
  Buffer maxima_, all_maxima_;        // (B, 2), (tp, B, 2)
  Buffer z_, e_;                      // (B, Vs)
  Buffer stats_, all_stats_;          // (B, 3), (tp, B, 3)
  Buffer chain_, hops_;               // (B), (tp - 1, B)
  Buffer counts_, bounds_;            // (B), (B, 2)
  Buffer all_counts_;                 // (tp, B)
  Buffer cands_, all_cands_;          // what this rank sends, every rank's
  Buffer token_, logprob_;            // (B) i32, f32
  Buffer draws_, all_draws_;          // (B, 2)
  std::vector<int64_t> cand_counts_;  // (tp) values each rank sends
  // Host copies: the kinds and the counts size the collectives; the results.
  Buffer kinds_host_, all_counts_host_;
  const uint8_t* kinds_at_ = nullptr;  // (B) on the host
  std::vector<int32_t> token_host_;
  std::vector<float> logprob_host_;
};

// One step over `group` (Communicator calls named at the phases): token (B) i32 and logprob (B)
// f32 (on any device) get the same values on every rank.
void sample_over_shards(Communicator& group, TpSampler& sampler, const Tensor& logits,
                        const ops::SamplingTensors& settings, const Tensor& token,
                        const Tensor& logprob);

// The whole (R, V) rows from every rank's (R, V/tp) f32 rows on the CPU, for what needs the
// full distribution (a request's top_logprobs): one all-gather of R V f32, then each row's
// shards laid end to end. Returns a new CPU tensor.
Tensor gather_vocab_rows(Communicator& group, const Tensor& shard_rows);

}  // namespace tandem::model
