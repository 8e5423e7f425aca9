// Sampling over vocabulary shards: ops::sample's definition (kernels/ops.h) for a
// tensor-parallel group whose ranks each hold only their (B, V/tp) logits, with a few small
// collectives per step instead of an all-gather of the (B, V) logits (docs/rollout.md,
// "Tensor-parallel sampling").
//
// A step is a fixed run of local phases with one collective between two of them; every rank runs
// the same phases and the collectives depend only on the settings, which every rank holds:
//  1. maxima: per row the rank's largest logit and its lowest global id. all-gather (tp, B, 2).
//     Greedy rows are decided here: the first rank holding the global maximum.
//  2. stats: z = x / temperature, e = softmax_exp(z - max z) with the global max; per row the
//     rank's sum of e, its local nucleus threshold (the largest t with mass(z >= t) >= top_p *
//     the rank's own sum; nucleus rows) or its last kept token (plain rows), and rank 0's end
//     of the running kept sum (plain rows). all-gather (tp, B, 3); lse = max z + log(the sums
//     added in rank order).
//  2b. chain (only with plain rows): ops::sample draws where the running sum of the kept e, one
//     f32 addition after the other in vocabulary order, passes u * its end. Rank h continues
//     that running sum from rank h - 1's end, exactly, so tp - 1 hops, each an all-reduce (B)
//     sum with zeros from the other ranks, give every rank every rank's end.
//  3. counts (only when a row is a nucleus row): the rank's candidates per row. all-gather
//     (tp, B).
//  4. candidates (only with top-k or nucleus rows): z and global id of each candidate,
//     all-gather-v. Top-k rows (0 < top_k < V): each rank's top min(top_k, V/tp), which hold the
//     global top-k with its ties to the lower ids. Nucleus rows (top_p < 1, top-k off): the
//     tokens with z >= the least of the ranks' local thresholds, which hold the global nucleus
//     (those thresholds' masses add up to top_p of the whole). Every rank then applies the
//     definition to the row's candidates in vocabulary order: top-k, top-p against top_p times
//     the top-k mass (nucleus rows: the global sum), min-p, and the inverse-CDF draw with
//     u = uniform_from_bits(philox_random(seed, 0, offset).v[0]), as ops::sample does on its
//     compacted top-k list.
//  5. draws (only with plain rows: top-k off, top_p = 1): the first rank whose end passes
//     u * (the last end) repeats its part of the running sum and finds the token in its shard.
//     all-reduce (B, 2) sum of [token, logprob], zeros from the other ranks.
// logprob = z(token) - lse, the log-probability under the full temperature-scaled distribution
// (temperature 1 when greedy). Every rank ends with the same tokens and logprobs.
//
// Against ops::sample on the full logits: greedy, top-k and plain rows draw the same token (the
// same sums in the same order); a nucleus row's top-p target is top_p times the ranks' sums
// added in rank order, so a threshold exactly on a boundary may fall differently by rounding;
// logprobs differ in the last bits (the sum of e is added in another order). The chain costs
// latency: its hops run one after the other (a CPU rank folds V/tp values per plain row).
//
// The phases are CPU code on plain arrays: the oracle a CUDA version mirrors phase by phase.
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
  // or their elementwise sum (sum). f32 tensors on the CPU.
  struct Collective {
    enum class Op { gather, sum } op = Op::gather;
    const char* what = "";
    Tensor in, out;
    std::span<const int64_t> counts;
  };

  // Starts a step: logits (B, V/tp) f32 on the CPU, the rows [rank V/tp, (rank + 1) V/tp) of the
  // vocabulary; settings (B) on the CPU as ops::sample takes them (bad ones throw naming the
  // row, as there). Keeps pointers into both until next() returns false.
  void start(const Tensor& logits, const ops::SamplingTensors& settings, int rank, int tp);
  // Runs the local phase the previous collective's result allows and fills c with the next
  // collective; false when tokens() and logprobs() hold the step's results.
  bool next(Collective& c);

  std::span<const int32_t> tokens() const { return {token_.data(), static_cast<size_t>(B_)}; }
  std::span<const float> logprobs() const { return {logprob_.data(), static_cast<size_t>(B_)}; }
  // Bytes the step's collectives delivered to this rank (their outputs): the sampling's traffic.
  int64_t step_bytes() const { return bytes_; }

 private:
  enum class Kind : uint8_t { greedy, top_k, nucleus, plain };
  enum class Stage { maxima, stats, chain, counts, candidates, decide, draws, done };

  Collective gather(const char* what, std::vector<float>& in, std::vector<float>& out,
                    int64_t out_n);
  void phase_stats();       // after maxima: the global max, greedy rows, z and e, the stats
  void phase_candidates();  // after stats: lse, each row's candidates
  void phase_decide();      // after candidates: top-k and nucleus rows drawn, plain rows' owner
  void decide_row(int64_t b, int64_t n);
  // Row b's candidates travel as every rank's whole shard of z (cheaper than [z, id] pairs when
  // they are more than half the vocabulary), and the elements rank r sends for it.
  bool dense(int64_t b) const;
  int64_t row_elements(int r, int64_t b) const;
  void pack_candidates();  // cands_ of this rank, row after row

  // The step's inputs.
  const float* x_ = nullptr;  // (B, Vs)
  const float *temperature_ = nullptr, *top_p_ = nullptr, *min_p_ = nullptr;
  const int32_t* top_k_ = nullptr;
  const int64_t *seed_ = nullptr, *offset_ = nullptr;
  int64_t B_ = 0, Vs_ = 0, v0_ = 0;
  int rank_ = 0, tp_ = 1;
  Stage stage_ = Stage::done;
  int64_t bytes_ = 0;

  // Per row (B), grown to the largest batch seen.
  std::vector<Kind> kind_;
  std::vector<float> tau_, zmax_, lse_;
  std::vector<float> row_th_;      // the rank's candidates: z > th (top-k, with ties) or z >= th
  std::vector<int64_t> row_ties_;  // top-k: the ties at th the rank keeps
  std::vector<int32_t> greedy_;
  std::vector<int32_t> token_;
  std::vector<float> logprob_;
  // The rank's z and e (B, Vs).
  std::vector<float> z_, e_;
  // Collective buffers: what this rank sends and what the group delivers.
  std::vector<float> maxima_, all_maxima_;  // (B, 2) [max, id], (tp, B, 2)
  // (B, 3) [sum of e, rank 0: end of the running kept sum, nucleus threshold or last kept id],
  // (tp, B, 3)
  std::vector<float> stats_, all_stats_;
  std::vector<float> counts_, all_counts_;  // (B), (tp, B)
  std::vector<float> cands_, all_cands_;    // (candidates, 2) [z, id]; every rank's
  std::vector<int64_t> cand_counts_;        // (tp) elements each rank sends
  std::vector<int64_t> cursor_;             // (tp) where a rank's next row starts
  std::vector<float> chain_, all_chain_;    // (B), (B): a hop's end of the running sum
  std::vector<float> ends_;                 // (tp, B): each rank's end of the running sum
  int hop_ = 0;
  std::vector<float> draws_, all_draws_;  // (B, 2) [token, logprob], summed
  std::vector<uint8_t> drawn_;            // (B): a plain row decided without the draws
  // One row's candidates in vocabulary order while it is decided.
  std::vector<float> cz_, ce_, run_;
  std::vector<int32_t> cid_;
};

// One step over `group` (Communicator calls named at the phases): token (B) i32 and logprob (B)
// f32 on the CPU get the same values on every rank.
void sample_over_shards(Communicator& group, TpSampler& sampler, const Tensor& logits,
                        const ops::SamplingTensors& settings, const Tensor& token,
                        const Tensor& logprob);

// The whole (R, V) rows from every rank's (R, V/tp) f32 rows on the CPU, for what needs the
// full distribution (a request's top_logprobs): one all-gather of R V f32, then each row's
// shards laid end to end. Returns a new CPU tensor.
Tensor gather_vocab_rows(Communicator& group, const Tensor& shard_rows);

}  // namespace tandem::model
