// Publisher: executes a ReshardPlan on this rank, every time the trainer publishes a version. The
// bytes between two ranks travel through the Communicator in rounds of flattened buckets (one send
// and one receive per peer per round, whatever the number of tensors), cast to the destination
// dtype by the sender; pieces within the rank are copied (or cast) directly, and nothing moves
// where source and destination are the same memory and dtype. One entry point for every
// placement: one rank (zero-copy or f32 -> bf16), a data-parallel trainer to replicated or
// tensor-parallel engines.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/tensor.h"
#include "weight_sync/plan.h"

namespace tandem::weight_sync {

// One parameter as the two sides name it (HF names; storage tensors, e.g. a fused qkv).
struct Param {
  std::string name;
  Tensor tensor;
};

struct SyncOptions {
  // Bound of the bytes a rank sends in one round, and of the bytes it receives in one round (each
  // peer's share of it sized so that neither side exceeds it). At least 4096.
  int64_t bucket_bytes = int64_t{64} << 20;
  // Receive into a staging buffer (the bytes this rank receives from other ranks, once) and write
  // the destination only once every rank has received everything and the checksums (if on)
  // match: a failed sync leaves every destination on the old version. Off: receive a round's
  // bytes from a peer straight into the destination where they lie inside one piece, else
  // through two bucket buffers (less memory and no staging copy; a failed sync leaves the
  // destination partly written, and publish says so).
  bool staged = true;
  // A checksum of every piece stream (per parameter and pair of ranks, keyed by destination
  // offset: order-independent sums of a 64-bit hash per element, in the destination dtype),
  // computed by the sender while packing and by the receiver on arrival, compared before the
  // destination is written. Costs one hash per element on both sides.
  bool checksums = false;
  // Threads (the caller's included) that cast and copy the pieces within this rank when they
  // write at least 4 MiB (memory-bound: a second core adds bandwidth). The packing for other
  // ranks stays on one helper thread.
  int threads = 2;
  // Called before each round with its index and the number of rounds (progress, tests).
  std::function<void(int round, int rounds)> on_round;
  // Called after each round with the bytes received from each peer, before anything reads them
  // (to inspect them; tests corrupt one to see the checksums catch it).
  std::function<void(int round, int peer, std::span<char> bytes)> on_received;
};

struct SyncStats {
  uint64_t version = 0;
  int rounds = 0;                     // rounds of send/recv this rank took part in
  int64_t bytes_sent = 0;             // to other ranks (destination dtype; padding not counted)
  int64_t bytes_received = 0;         // from other ranks
  int64_t bytes_received_direct = 0;  // of those, unstaged, straight into the destination
  int64_t bytes_copied = 0;           // written by pieces within this rank
  int64_t pieces_shared = 0;          // pieces within this rank that needed no copy (same memory)
  int64_t checksums_compared = 0;
  double seconds = 0;
  // Where `seconds` went: the rounds (sending and receiving, and packing the first round), the
  // checksum exchange and agreement, the copy out of the staging buffer, the pieces within this
  // rank (wall clock). packing_cpu_seconds: the CPU time of the packing (cast) alone, mostly on
  // the helper thread during the rounds.
  double rounds_seconds = 0, agree_seconds = 0, unstage_seconds = 0, local_seconds = 0;
  double packing_cpu_seconds = 0;
};

class Publisher {
 public:
  // plan: the same on every rank (checked: its digest is compared across `comm` at construction,
  // a collective). src[i], dst[i]: this rank's local tensors of the plan's parameter i under the
  // source and destination layouts (see bind()), undefined where the rank holds none of it; their
  // storage must outlive the publisher. comm: the world the layouts' ranks number (may be null
  // when the plan moves nothing between ranks). Buffers are allocated here, once: added_bytes().
  Publisher(ReshardPlan plan, Communicator* comm, std::vector<Tensor> src, std::vector<Tensor> dst,
            SyncOptions options = {});

  // Makes this rank's destination tensors hold the plan's image of the source tensors and stamps
  // `version`. Collective over the ranks the plan moves bytes between. Throws tandem::Error naming
  // the rank and the round when a peer fails or times out (within the communicator's timeout),
  // or naming the parameter and ranks of a checksum mismatch; staged, the destination keeps its
  // previous version then.
  SyncStats publish(uint64_t version);

  uint64_t version() const { return version_; }  // the last version published (0: none yet)
  // Whether publishing moves no bytes at all on this rank (every piece local and shared).
  bool zero_copy() const;
  // Bytes this publisher holds beyond the tensors: two send buckets, and two receive buckets or
  // the staging buffer.
  int64_t added_bytes() const;
  int64_t total_rounds() const { return rounds_; }
  const ReshardPlan& plan() const { return plan_; }
  int rank() const { return rank_; }

  // The element runs of one pair's bytes on the wire.
  struct WirePiece {
    size_t param;
    int64_t src_offset, dst_offset, length;
    int64_t wire;  // byte offset in the pair's stream (8-aligned)
  };
  struct Stream {
    std::vector<WirePiece> pieces;
    int64_t bytes = 0;  // stream length, padding included
    int64_t chunk = 0;  // bytes per round
  };

 private:
  void pack(int round, char* bucket, std::vector<uint64_t>* sums);
  // direct[peer]: where that peer's bytes of the round were received into the destination, else
  // null (in the bucket).
  void unpack(int round, const char* bucket, const std::vector<char*>& direct,
              std::vector<uint64_t>* sums);
  // Unstaged: where in the destination bytes [lo, hi) of the stream from `peer` go, when they lie
  // inside one piece (so they can be received there directly); else null.
  char* direct_target(int peer, int64_t lo, int64_t hi) const;
  // Stream bytes [lo, hi) from `peer`, found at `at`: summed into sums (if given), written into
  // the destination (if write).
  void unpack_stream(int peer, int64_t lo, int64_t hi, const char* at, std::vector<uint64_t>* sums,
                     bool write) const;
  // The pieces within this rank; returns the bytes written.
  int64_t copy_local();
  // Elements [lo, hi) of the CPU pieces within this rank, taken one after the other (local_at_).
  void copy_local_cpu(int64_t lo, int64_t hi, bool stream) const;

  // The checksum tables of one publish, [peer * parameters + parameter]: of what this rank sent
  // to each peer, and of what it received from each.
  struct Sums {
    std::vector<uint64_t> out, in;
  };
  // The phases of a publish that moves bytes between ranks.
  void run_rounds(uint64_t version, SyncStats& st, Sums& sums);
  // Returns the first mismatching shard here ("" if none) and counts them into `mismatched`.
  std::string compare_checksums(uint64_t version, SyncStats& st, const Sums& sums,
                                int64_t& mismatched);
  // Throws on every rank when any rank counted a mismatch.
  void agree(uint64_t version, int64_t mismatched, const std::string& first);
  // Runs a communicator call; its failure becomes an error naming the version, this rank, `what`
  // (the phase) and what the destination holds.
  template <class Fn>
  void on_comm(uint64_t version, const std::string& what, Fn&& fn) const;

  ReshardPlan plan_;
  Communicator* comm_;
  std::vector<Tensor> src_, dst_;
  SyncOptions options_;
  int rank_ = 0, world_ = 1;
  int rounds_ = 0;
  bool remote_ = false;                         // whether any rank sends to another
  std::vector<Stream> out_, in_;                // [peer]: this rank's streams to and from it
  std::vector<int64_t> send_slot_, recv_slot_;  // [peer]: offset in a bucket
  int64_t send_bucket_ = 0, recv_bucket_ = 0;   // bytes of one bucket
  std::vector<int64_t> staging_at_;             // [peer]: offset of its stream in staging_
  struct LocalCopy {
    size_t param;
    Piece piece;
  };
  std::vector<LocalCopy> local_;  // pieces within this rank that copy
  // [i]: CPU elements of local_[0, i) (a piece not on the CPU counts 0); one more than local_.
  std::vector<int64_t> local_at_;
  int64_t shared_ = 0;
  Tensor send_[2], recv_[2], staging_;  // u8
  std::vector<size_t> esize_;           // [param]: destination element bytes
  uint64_t version_ = 0;
};

// This rank's local tensors of a layout, looked up by parameter name in `tensors` (e.g. a
// model::Weights' storage(), or its ZeRO ranges): undefined where the rank holds nothing of a
// parameter. Throws tandem::Error naming a parameter that is missing or whose tensor's shape or
// dtype is not the layout's.
std::vector<Tensor> bind(const Layout& layout, int rank, std::span<const Param> tensors);

// This rank's local tensors of a layout whose every parameter lives in one buffer of the rank
// (Layout::zero without full tensors: the trainer's local buffer of ZeRO-3 pieces): `local` for
// each parameter the rank holds, undefined for the others. Throws tandem::Error naming a
// parameter whose local tensor is not `local`'s size and dtype.
std::vector<Tensor> bind_local(const Layout& layout, int rank, const Tensor& local);

}  // namespace tandem::weight_sync
