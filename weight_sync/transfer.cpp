// Publisher: the per-pair wire streams of a plan, their rounds, packing (cast on the way) on a
// helper thread while the previous round is in flight, staging, checksums and the final agreement;
// the pieces within the rank, straight from source to destination on SyncOptions::threads threads.
#include "weight_sync/transfer.h"

#include <fmt/format.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>

#include "core/clock.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "weight_sync/cast.h"

namespace tandem::weight_sync {
namespace {

constexpr int64_t kAlign = 8;  // wire offsets of pieces; chunk sizes are multiples of it
// The pieces within a rank are cast or copied by SyncOptions::threads threads from this many bytes
// written, and with streaming stores from kStreamBytes (beyond any cache).
constexpr int64_t kParallelBytes = int64_t{4} << 20;
constexpr int64_t kStreamBytes = int64_t{64} << 20;
constexpr int64_t kLocalBlock = int64_t{1} << 18;  // elements a thread takes at a time

// CPU seconds of the calling thread (time it spent running, not waiting for a core).
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// n elements from s (dtype sd) into d (dtype dd) on the CPU, rounding as the kernels' cast does,
// on the calling thread (no thread pool of its own to contend with). stream: see f32_to_bf16.
void convert(const void* s, DType sd, void* d, DType dd, int64_t n, bool stream) {
  if (n <= 0) return;
  if (sd == dd) {
    std::memcpy(d, s, static_cast<size_t>(n) * dtype_size(sd));
  } else if (sd == DType::f32 && dd == DType::bf16) {
    f32_to_bf16(static_cast<const float*>(s), static_cast<uint16_t*>(d), n, stream);
  } else {
    ops::cast(Tensor::wrap(const_cast<void*>(s), {n}, sd), Tensor::wrap(d, {n}, dd));
  }
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The order-independent checksum of n elements (destination dtype) at destination offsets
// [offset, offset + n) of a parameter.
uint64_t checksum(const char* data, DType dtype, int64_t offset, int64_t n) {
  uint64_t sum = 0;
  const size_t es = dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) {
    uint64_t bits = 0;
    std::memcpy(&bits, data + static_cast<size_t>(i) * es, es);
    sum += splitmix(splitmix(static_cast<uint64_t>(offset + i)) ^ bits);
  }
  return sum;
}

const char* data_at(const Tensor& t, int64_t element) {
  return static_cast<const char*>(t.data()) + static_cast<size_t>(element) * dtype_size(t.dtype());
}

// The pieces of `s` that overlap stream bytes [lo, hi): calls fn(piece, first element, count,
// byte offset of that element from lo).
template <class Fn>
void overlaps(const Publisher::Stream& s, const std::vector<size_t>& esize, int64_t lo, int64_t hi,
              Fn&& fn) {
  auto it = std::upper_bound(s.pieces.begin(), s.pieces.end(), lo,
                             [](int64_t v, const Publisher::WirePiece& p) { return v < p.wire; });
  if (it != s.pieces.begin()) --it;
  for (; it != s.pieces.end() && it->wire < hi; ++it) {
    const auto es = static_cast<int64_t>(esize[it->param]);
    const int64_t a = std::max(lo, it->wire), b = std::min(hi, it->wire + it->length * es);
    if (a >= b) continue;
    fn(*it, (a - it->wire) / es, (b - a) / es, a - lo);
  }
}

}  // namespace

Publisher::Publisher(ReshardPlan plan, Communicator* comm, std::vector<Tensor> src,
                     std::vector<Tensor> dst, SyncOptions options)
    : plan_(std::move(plan)),
      comm_(comm),
      src_(std::move(src)),
      dst_(std::move(dst)),
      options_(std::move(options)) {
  world_ = plan_.world();
  rank_ = comm_ != nullptr ? comm_->rank() : 0;
  TANDEM_CHECK(comm_ == nullptr || comm_->size() == world_,
               "weight_sync: the plan spans {} ranks and the communicator '{}' {}", world_,
               comm_ != nullptr ? comm_->name() : "", comm_ != nullptr ? comm_->size() : 0);
  TANDEM_CHECK(options_.bucket_bytes >= 4096,
               "weight_sync: bucket_bytes must be at least 4096, got {}", options_.bucket_bytes);
  const size_t P = plan_.size();
  TANDEM_CHECK(src_.size() == P && dst_.size() == P,
               "weight_sync: the plan has {} parameters; got {} source and {} destination tensors",
               P, src_.size(), dst_.size());
  esize_.resize(P);
  for (size_t p = 0; p < P; ++p) {
    esize_[p] = dtype_size(plan_.dst().params()[p].dtype);
    for (const auto& [layout, t, side] : {std::tuple{&plan_.src(), &src_[p], "source"},
                                          std::tuple{&plan_.dst(), &dst_[p], "destination"}}) {
      const Shard& sh = layout->shard(p, rank_);
      const ParamSpec& spec = layout->params()[p];
      if (sh.shape.numel() == 0) continue;
      TANDEM_CHECK(t->defined() && t->numel() == sh.shape.numel() && t->dtype() == spec.dtype,
                   "weight_sync: rank {} holds {} elements of {} ({}) in the {} layout '{}', "
                   "given a {} tensor of {}",
                   rank_, sh.shape.numel(), spec.name, dtype_name(spec.dtype), side, layout->name(),
                   t->defined() ? dtype_name(t->dtype()) : "undefined",
                   t->defined() ? t->shape() : Shape{});
    }
  }

  // Every pair's stream length (all ranks compute all of them: the chunk of a pair depends on
  // how many peers both ends have).
  const auto W = static_cast<size_t>(world_);
  std::vector<int64_t> length(W * W, 0);
  out_.assign(W, {});
  in_.assign(W, {});
  for (size_t p = 0; p < P; ++p) {
    for (const Piece& pc : plan_.pieces(p)) {
      if (pc.src_rank == pc.dst_rank) {
        if (pc.src_rank != rank_) continue;
        const bool same = src_[p].dtype() == dst_[p].dtype() &&
                          src_[p].device() == dst_[p].device() &&
                          data_at(src_[p], pc.src_offset) == data_at(dst_[p], pc.dst_offset);
        if (same) {
          ++shared_;
        } else {
          local_.push_back({p, pc});
        }
        continue;
      }
      int64_t& len =
          length[static_cast<size_t>(pc.src_rank) * W + static_cast<size_t>(pc.dst_rank)];
      const WirePiece wp{p, pc.src_offset, pc.dst_offset, pc.length, len};
      if (pc.src_rank == rank_ || pc.dst_rank == rank_) {
        const Tensor& mine = pc.src_rank == rank_ ? src_[p] : dst_[p];
        TANDEM_CHECK(mine.device().is_cpu(),
                     "weight_sync: {} moves from rank {} to rank {}, but rank {}'s tensor is on "
                     "{}: the transfers between ranks carry CPU tensors (Gloo)",
                     plan_.src().params()[p].name, pc.src_rank, pc.dst_rank, rank_,
                     mine.device().str());
      }
      if (pc.src_rank == rank_) out_[static_cast<size_t>(pc.dst_rank)].pieces.push_back(wp);
      if (pc.dst_rank == rank_) in_[static_cast<size_t>(pc.src_rank)].pieces.push_back(wp);
      len = align_up(len + pc.length * static_cast<int64_t>(esize_[p]));
    }
  }
  local_at_.assign(1, 0);
  for (const LocalCopy& c : local_)
    local_at_.push_back(
        local_at_.back() +
        (src_[c.param].device().is_cpu() && dst_[c.param].device().is_cpu() ? c.piece.length : 0));
  std::vector<int64_t> peers_out(W, 0), peers_in(W, 0);
  for (size_t s = 0; s < W; ++s)
    for (size_t d = 0; d < W; ++d)
      if (length[s * W + d] > 0) {
        ++peers_out[s];
        ++peers_in[d];
        remote_ = true;
      }
  TANDEM_CHECK(!remote_ || comm_ != nullptr,
               "weight_sync: the plan {} -> {} moves bytes between ranks: it needs a communicator",
               plan_.src().name(), plan_.dst().name());
  const int64_t B = options_.bucket_bytes;
  auto chunk = [&](size_t s, size_t d) {
    return std::min(B / peers_out[s], B / peers_in[d]) / kAlign * kAlign;
  };
  for (size_t s = 0; s < W; ++s)
    for (size_t d = 0; d < W; ++d)
      if (const int64_t L = length[s * W + d]; L > 0)
        rounds_ = std::max(rounds_, static_cast<int>((L + chunk(s, d) - 1) / chunk(s, d)));
  const auto me = static_cast<size_t>(rank_);
  send_slot_.assign(W, 0);
  recv_slot_.assign(W, 0);
  staging_at_.assign(W, 0);
  int64_t staging = 0;
  for (size_t q = 0; q < W; ++q) {
    if ((out_[q].bytes = length[me * W + q]) > 0) {
      out_[q].chunk = chunk(me, q);
      send_slot_[q] = send_bucket_;
      send_bucket_ += out_[q].chunk;
    }
    if ((in_[q].bytes = length[q * W + me]) > 0) {
      in_[q].chunk = chunk(q, me);
      recv_slot_[q] = recv_bucket_;
      recv_bucket_ += in_[q].chunk;
      staging_at_[q] = staging;
      staging += in_[q].bytes;
    }
  }
  for (Tensor& t : send_) t = Tensor::empty({send_bucket_}, DType::u8);
  if (options_.staged) {
    staging_ = Tensor::empty({staging}, DType::u8);
  } else {
    for (Tensor& t : recv_) t = Tensor::empty({recv_bucket_}, DType::u8);
  }
  // Touched here, so that the first publish does not pay for the pages.
  for (Tensor* t : {&send_[0], &send_[1], &recv_[0], &recv_[1], &staging_})
    if (t->defined() && t->nbytes() > 0) std::memset(t->data(), 0, t->nbytes());
  if (comm_ != nullptr) {
    // Ranks that planned differently would exchange garbage: compare the plans first.
    verify_same_config(*comm_, fmt::format("weight_sync plan {} -> {} digest {:016x} bucket {}",
                                           plan_.src().name(), plan_.dst().name(), plan_.digest(),
                                           options_.bucket_bytes));
  }
}

bool Publisher::zero_copy() const {
  if (!local_.empty()) return false;
  for (size_t q = 0; q < out_.size(); ++q)
    if (out_[q].bytes > 0 || in_[q].bytes > 0) return false;
  return true;
}

int64_t Publisher::added_bytes() const {
  return 2 * send_bucket_ + (options_.staged ? staging_.numel() : 2 * recv_bucket_);
}

void Publisher::pack(int round, char* bucket, std::vector<uint64_t>* sums) {
  for (size_t q = 0; q < out_.size(); ++q) {
    const Stream& s = out_[q];
    const int64_t lo = round * s.chunk, hi = std::min(s.bytes, lo + s.chunk);
    if (lo >= hi) continue;
    char* at = bucket + send_slot_[q];
    const auto& dparams = plan_.dst().params();
    overlaps(s, esize_, lo, hi, [&](const WirePiece& w, int64_t first, int64_t n, int64_t byte) {
      const DType dd = dparams[w.param].dtype;
      convert(data_at(src_[w.param], w.src_offset + first), src_[w.param].dtype(), at + byte, dd, n,
              false);
      if (sums != nullptr)
        (*sums)[q * dparams.size() + w.param] += checksum(at + byte, dd, w.dst_offset + first, n);
    });
  }
}

void Publisher::unpack_stream(int peer, int64_t lo, int64_t hi, const char* at,
                              std::vector<uint64_t>* sums, bool write) const {
  const auto& dparams = plan_.dst().params();
  const Stream& s = in_[static_cast<size_t>(peer)];
  overlaps(s, esize_, lo, hi, [&](const WirePiece& w, int64_t first, int64_t n, int64_t byte) {
    const DType dd = dparams[w.param].dtype;
    if (sums != nullptr)
      (*sums)[static_cast<size_t>(peer) * dparams.size() + w.param] +=
          checksum(at + byte, dd, w.dst_offset + first, n);
    if (write)
      std::memcpy(const_cast<char*>(data_at(dst_[w.param], w.dst_offset + first)), at + byte,
                  static_cast<size_t>(n) * dtype_size(dd));
  });
}

void Publisher::unpack(int round, const char* bucket, const std::vector<char*>& direct,
                       std::vector<uint64_t>* sums) {
  for (size_t q = 0; q < in_.size(); ++q) {
    const Stream& s = in_[q];
    const int64_t lo = round * s.chunk, hi = std::min(s.bytes, lo + s.chunk);
    if (lo >= hi) continue;
    if (direct[q] != nullptr) {
      if (sums != nullptr) unpack_stream(static_cast<int>(q), lo, hi, direct[q], sums, false);
    } else {
      unpack_stream(static_cast<int>(q), lo, hi, bucket + recv_slot_[q], sums, true);
    }
  }
}

char* Publisher::direct_target(int peer, int64_t lo, int64_t hi) const {
  const Stream& s = in_[static_cast<size_t>(peer)];
  auto it = std::upper_bound(s.pieces.begin(), s.pieces.end(), lo,
                             [](int64_t v, const WirePiece& p) { return v < p.wire; });
  if (it == s.pieces.begin()) return nullptr;
  --it;
  const auto es = static_cast<int64_t>(esize_[it->param]);
  if (hi > it->wire + it->length * es) return nullptr;
  // lo and the piece's start are both 8-aligned: lo - wire is whole elements.
  return const_cast<char*>(data_at(dst_[it->param], it->dst_offset + (lo - it->wire) / es));
}

void Publisher::copy_local_cpu(int64_t lo, int64_t hi, bool stream) const {
  auto i = static_cast<size_t>(std::upper_bound(local_at_.begin(), local_at_.end(), lo) -
                               local_at_.begin() - 1);
  for (; i < local_.size() && local_at_[i] < hi; ++i) {
    const int64_t at = local_at_[i], length = local_at_[i + 1] - at;
    if (length == 0) continue;  // not on the CPU
    const Tensor &from = src_[local_[i].param], &to = dst_[local_[i].param];
    const Piece& pc = local_[i].piece;
    const int64_t a = std::max(lo, at), b = std::min(hi, at + length);
    convert(data_at(from, pc.src_offset + a - at), from.dtype(),
            const_cast<char*>(data_at(to, pc.dst_offset + a - at)), to.dtype(), b - a, stream);
  }
}

int64_t Publisher::copy_local() {
  int64_t bytes = 0, cpu_bytes = 0;
  for (size_t i = 0; i < local_.size(); ++i) {
    const Piece& pc = local_[i].piece;
    const Tensor &from = src_[local_[i].param], &to = dst_[local_[i].param];
    const int64_t b = pc.length * static_cast<int64_t>(dtype_size(to.dtype()));
    bytes += b;
    if (local_at_[i + 1] > local_at_[i]) {
      cpu_bytes += b;
      continue;
    }
    Tensor s = from.view({from.numel()}).narrow(pc.src_offset, pc.length);
    Tensor d = to.view({to.numel()}).narrow(pc.dst_offset, pc.length);
    if (s.dtype() == d.dtype())
      d.copy_from(s);
    else
      ops::cast(s, d);
  }
  // The CPU pieces as one run of elements, taken in blocks by `threads` threads from a shared
  // counter (memory-bound: a second core adds bandwidth; a thread without a core on a busy
  // machine holds up no one); more than the caches hold is written with streaming stores.
  const bool stream = cpu_bytes >= kStreamBytes;
  const int threads = cpu_bytes >= kParallelBytes ? std::max(1, options_.threads) : 1;
  const int64_t total = local_at_.back();
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t lo; (lo = next.fetch_add(kLocalBlock)) < total;)
      copy_local_cpu(lo, std::min(total, lo + kLocalBlock), stream);
  };
  std::vector<std::future<void>> helpers;  // waited for on every path (their destructors)
  for (int t = 1; t < threads; ++t) helpers.push_back(std::async(std::launch::async, work));
  work();
  for (std::future<void>& h : helpers) h.get();
  return bytes;
}

template <class Fn>
void Publisher::on_comm(uint64_t version, const std::string& what, Fn&& fn) const {
  try {
    fn();
  } catch (const Error& e) {
    throw Error(fmt::format(
        "weight_sync: version {} not published on rank {} ({} of plan {} -> {}): {}; {}", version,
        rank_, what, plan_.src().name(), plan_.dst().name(), e.what(),
        options_.staged ? fmt::format("this rank's destination keeps version {}", version_)
                        : "this rank's destination is partly written (staged = false)"));
  }
}

void Publisher::run_rounds(uint64_t version, SyncStats& st, Sums& sums) {
  const auto W = static_cast<size_t>(world_);
  std::vector<uint64_t>* out = options_.checksums ? &sums.out : nullptr;
  std::vector<uint64_t>* in = options_.checksums ? &sums.in : nullptr;
  auto timed_pack = [&](int round) {
    const double t0 = thread_cpu_seconds();
    pack(round, static_cast<char*>(send_[round % 2].data()), out);
    return thread_cpu_seconds() - t0;
  };
  st.packing_cpu_seconds += timed_pack(0);
  // Unstaged, [round % 2][peer]: where a round's bytes from the peer were received straight into
  // the destination (they lie inside one piece), else null (through the receive bucket).
  std::vector<char*> direct[2] = {std::vector<char*>(W, nullptr), std::vector<char*>(W, nullptr)};
  for (int round = 0; round < rounds_; ++round) {
    if (options_.on_round) options_.on_round(round, rounds_);
    char* sending = static_cast<char*>(send_[round % 2].data());
    std::vector<P2POp> ops;
    for (size_t q = 0; q < W; ++q) {
      const Stream& o = out_[q];
      const int64_t lo = round * o.chunk, hi = std::min(o.bytes, lo + o.chunk);
      if (lo >= hi) continue;
      ops.push_back(send_to(static_cast<int>(q),
                            Tensor::wrap(sending + send_slot_[q], {hi - lo}, DType::u8)));
      st.bytes_sent += hi - lo;
    }
    for (size_t q = 0; q < W; ++q) {
      const Stream& i = in_[q];
      const int64_t lo = round * i.chunk, hi = std::min(i.bytes, lo + i.chunk);
      if (lo >= hi) continue;
      char*& into = direct[round % 2][q];
      into = options_.staged ? nullptr : direct_target(static_cast<int>(q), lo, hi);
      char* to = options_.staged   ? static_cast<char*>(staging_.data()) + staging_at_[q] + lo
                 : into != nullptr ? into
                                   : static_cast<char*>(recv_[round % 2].data()) + recv_slot_[q];
      ops.push_back(recv_from(static_cast<int>(q), Tensor::wrap(to, {hi - lo}, DType::u8)));
      st.bytes_received += hi - lo;
      if (into != nullptr) st.bytes_received_direct += hi - lo;
    }
    if (!ops.empty()) ++st.rounds;
    // While this round is in flight: pack the next one into the other send bucket and
    // (unstaged) unpack the previous one from the other receive bucket.
    double packing = 0;
    auto overlap = std::async(std::launch::async, [&, round] {
      if (round + 1 < rounds_) packing = timed_pack(round + 1);
      if (!options_.staged && round > 0)
        unpack(round - 1, static_cast<const char*>(recv_[(round - 1) % 2].data()),
               direct[(round - 1) % 2], in);
    });
    on_comm(version, fmt::format("round {} of {}", round, rounds_), [&] {
      try {
        comm_->send_recv(ops);
      } catch (...) {
        overlap.wait();
        throw;
      }
    });
    overlap.get();
    st.packing_cpu_seconds += packing;
    if (options_.on_received)
      for (const P2POp& op : ops)
        if (op.kind == P2POp::Kind::recv)
          options_.on_received(round, op.peer,
                               {static_cast<char*>(op.tensor.data()), op.tensor.nbytes()});
  }
  if (options_.staged) {
    if (in != nullptr)
      for (size_t q = 0; q < W; ++q)
        if (in_[q].bytes > 0)
          unpack_stream(static_cast<int>(q), 0, in_[q].bytes,
                        static_cast<const char*>(staging_.data()) + staging_at_[q], in, false);
  } else if (rounds_ > 0) {
    unpack(rounds_ - 1, static_cast<const char*>(recv_[(rounds_ - 1) % 2].data()),
           direct[(rounds_ - 1) % 2], in);
  }
}

std::string Publisher::compare_checksums(uint64_t version, SyncStats& st, const Sums& sums,
                                         int64_t& mismatched) {
  const auto W = static_cast<size_t>(world_);
  const size_t P = plan_.size();
  const auto n = static_cast<int64_t>(P);
  // Each sender's sums go to its receivers, which compare.
  std::vector<Tensor> theirs(W);
  std::vector<P2POp> ops;
  for (size_t q = 0; q < W; ++q) {
    if (out_[q].bytes > 0)
      ops.push_back(
          send_to(static_cast<int>(q),
                  Tensor::wrap(const_cast<uint64_t*>(sums.out.data()) + q * P, {n}, DType::i64)));
    if (in_[q].bytes > 0) {
      theirs[q] = Tensor::empty({n}, DType::i64);
      ops.push_back(recv_from(static_cast<int>(q), theirs[q]));
    }
  }
  on_comm(version, "checksum exchange", [&] { comm_->send_recv(ops); });
  std::string first;
  for (size_t q = 0; q < W; ++q) {
    if (in_[q].bytes == 0) continue;
    for (size_t p = 0; p < P; ++p) {
      ++st.checksums_compared;
      if (static_cast<uint64_t>(theirs[q].data_as<int64_t>()[p]) != sums.in[q * P + p] &&
          mismatched++ == 0)
        first = fmt::format("{} from rank {}", plan_.dst().params()[p].name, q);
    }
  }
  return first;
}

void Publisher::agree(uint64_t version, int64_t mismatched, const std::string& first) {
  const auto W = static_cast<size_t>(world_);
  Tensor status = Tensor::empty({static_cast<int64_t>(W)}, DType::i64);
  on_comm(version, "final agreement",
          [&] { comm_->all_gather(Tensor::wrap(&mismatched, {1}, DType::i64), status); });
  std::string bad;
  for (size_t q = 0; q < W; ++q)
    if (const int64_t n = status.data_as<int64_t>()[q]; n > 0)
      bad += fmt::format("{}rank {} ({} shards)", bad.empty() ? "" : ", ", q, n);
  TANDEM_CHECK(bad.empty(),
               "weight_sync: version {} not published: checksums differ after the transfer on "
               "{}{}; {}",
               version, bad, first.empty() ? "" : fmt::format(" (here: {})", first),
               options_.staged
                   ? fmt::format("every destination keeps version {}", version_)
                   : fmt::format("the destinations are partly written (staged = false)"));
}

SyncStats Publisher::publish(uint64_t version) {
  const auto t0 = Clock::now();
  SyncStats st;
  st.version = version;
  if (remote_) {
    const size_t n = options_.checksums ? static_cast<size_t>(world_) * plan_.size() : 0;
    Sums sums{std::vector<uint64_t>(n, 0), std::vector<uint64_t>(n, 0)};
    run_rounds(version, st, sums);
    st.rounds_seconds = seconds_since(t0);
    const auto t1 = Clock::now();
    int64_t mismatched = 0;
    const std::string first =
        options_.checksums ? compare_checksums(version, st, sums, mismatched) : "";
    // Every rank learns whether every rank got everything right before any destination changes.
    agree(version, mismatched, first);
    st.agree_seconds = seconds_since(t1);
    const auto t2 = Clock::now();
    if (options_.staged)
      for (size_t q = 0; q < in_.size(); ++q)
        if (in_[q].bytes > 0)
          unpack_stream(static_cast<int>(q), 0, in_[q].bytes,
                        static_cast<const char*>(staging_.data()) + staging_at_[q], nullptr, true);
    st.unstage_seconds = seconds_since(t2);
  }
  const auto t3 = Clock::now();
  st.bytes_copied = copy_local();
  st.local_seconds = seconds_since(t3);
  st.pieces_shared = shared_;
  version_ = version;
  st.seconds = seconds_since(t0);
  return st;
}

namespace {

// fn(spec, shard) for every parameter this rank holds some of, undefined tensors for the others.
template <class Fn>
std::vector<Tensor> bind_each(const Layout& layout, int rank, Fn&& fn) {
  std::vector<Tensor> out;
  for (size_t p = 0; p < layout.params().size(); ++p) {
    const Shard& sh = layout.shard(p, rank);
    out.push_back(sh.shape.numel() == 0 ? Tensor() : fn(layout.params()[p], sh));
  }
  return out;
}

}  // namespace

std::vector<Tensor> bind(const Layout& layout, int rank, std::span<const Param> tensors) {
  return bind_each(layout, rank, [&](const ParamSpec& spec, const Shard& sh) {
    auto it = std::find_if(tensors.begin(), tensors.end(),
                           [&](const Param& t) { return t.name == spec.name; });
    TANDEM_CHECK(it != tensors.end(),
                 "weight_sync: rank {} holds {} in layout '{}' but has no "
                 "tensor of that name",
                 rank, spec.name, layout.name());
    TANDEM_CHECK(it->tensor.shape() == sh.shape && it->tensor.dtype() == spec.dtype,
                 "weight_sync: rank {} holds {} as {} {} in layout '{}', given {} {}", rank,
                 spec.name, sh.shape, dtype_name(spec.dtype), layout.name(), it->tensor.shape(),
                 dtype_name(it->tensor.dtype()));
    return it->tensor;
  });
}

std::vector<Tensor> bind_local(const Layout& layout, int rank, const Tensor& local) {
  return bind_each(layout, rank, [&](const ParamSpec& spec, const Shard& sh) {
    TANDEM_CHECK(
        local.defined() && local.numel() == sh.shape.numel() && local.dtype() == spec.dtype,
        "weight_sync: rank {} holds {} in a local buffer of {} {} elements in layout "
        "'{}', given {} {}",
        rank, spec.name, sh.shape.numel(), dtype_name(spec.dtype), layout.name(),
        local.defined() ? dtype_name(local.dtype()) : "an undefined tensor",
        local.defined() ? local.shape() : Shape{});
    return local.view(sh.shape);
  });
}

}  // namespace tandem::weight_sync
