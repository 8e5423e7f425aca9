// Weights over the wire, the sender's side: one weight version of a model pushed to a rollout
// worker in bounded buckets (rollout.thrift: begin_weight_push and commit_weight_push for control,
// the buckets over the worker's data channel, rollout/service/weight_channel.h), cast to the
// worker's dtype on the way, each bucket with its CRC-32C.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <vector>

#include "core/xxh3.h"
#include "model/weights.h"
#include "rollout/service/client.h"

namespace tandem::rollout {

// The pieces of each bucket of a push: the tensors of `w` in Weights::named() order, packed until
// a bucket's data and pieces reach max_bucket_bytes (a piece counts its name's bytes and
// kWeightPieceBytes); a tensor larger than what is left of a bucket goes on in the next ones.
// Throws tandem::Error when max_bucket_bytes cannot hold one element and its piece.
std::vector<std::vector<rpc::WeightPiece>> plan_weight_buckets(const model::Weights& w,
                                                               int64_t element_bytes,
                                                               int64_t max_bucket_bytes);

struct WeightPushResult {
  int64_t version = 0;  // the worker's after the push
  bool sent = false;    // false: it held this version, or a newer one, already
  int64_t bytes = 0;    // of bucket data sent
  int64_t buckets = 0;
};

// The weights a push reads, which their owner withdraws before it changes them: a push given up
// on (its worker set aside) may go on in the background, and must not read them after that.
// The pushes of one source to several workers share the checksums of its chunks: each chunk is
// hashed by the first push that reaches it, and the others take the bucket's hash state from here.
class WeightSource {
 public:
  explicit WeightSource(const model::Weights& w) : weights_(&w) {}
  // Runs fn(weights) and returns true, unless they were withdrawn (false). Reads of several
  // pushes run at once.
  bool read(const std::function<void(const model::Weights&)>& fn);
  // No read runs after it returns (one in progress is waited for).
  void withdraw();

  // A chunk of a push: the dtype its data is sent in and the bucket bound (which fix the plan),
  // the bucket and the chunk's place in it.
  struct Chunk {
    int32_t dtype = 0;
    int64_t bound = 0;
    int64_t bucket = 0;
    int64_t index = 0;
    auto operator<=>(const Chunk&) const = default;
  };
  // The bucket's running XXH3-64 after `chunk`, when a push computed it already.
  std::optional<Xxh3> hash_after(const Chunk& chunk);
  void note_hash_after(const Chunk& chunk, const Xxh3& hash);
  // The chunks checksummed so far (each once, whatever the pushes of this source).
  int64_t chunks_checksummed();

 private:
  std::shared_mutex mutex_;
  const model::Weights* weights_;
  std::mutex hash_mutex_;
  std::map<Chunk, Xxh3> hashes_;
};

// Brings the worker behind `client` to `version` of `w` (f32 or bf16): nothing when it holds that
// version or a newer one; else begin_weight_push, every bucket of plan_weight_buckets (at most
// max_bucket_bytes and the worker's bound, data in the worker's dtype: f32 rounded to bf16 or bf16
// widened where they differ) back to back over one data channel connection, each checksummed a
// chunk at a time and handed to the socket from the weights, then the commit. Throws CallError as
// the calls do (transport: the channel failed or timed out after the client's timeout_ms); a push
// that fails midway leaves the worker on the weights it had.
// partial: the commit's (rollout.thrift, WeightPushCommit): samples already started go on under
// the new weights (true) or finish under the old (false).
WeightPushResult push_weights(RolloutClient& client, const model::Weights& w, int64_t version,
                              int64_t max_bucket_bytes, bool partial = true);
// The same from weights that may be withdrawn midway: then it stops before its commit, throwing
// tandem::Error.
WeightPushResult push_weights(RolloutClient& client, const std::shared_ptr<WeightSource>& source,
                              int64_t version, int64_t max_bucket_bytes, bool partial = true);

}  // namespace tandem::rollout
