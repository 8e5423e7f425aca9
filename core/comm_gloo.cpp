// The Gloo backend: ring all-reduce, reduce-scatter and all-gather, star broadcast, dissemination
// barrier and grouped send/recv, written on Gloo's point-to-point unbound buffers so that every
// wait knows its peer and its deadline.
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/comm_backend.h"
#include "core/error.h"
#include "core/half.h"

namespace tandem::comm_detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

template <class T>
void reduce_into(void* dst, const void* src, size_t n, ReduceOp op) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
    for (size_t i = 0; i < n; ++i) {
      const float a = static_cast<float>(d[i]), b = static_cast<float>(s[i]);
      d[i] = T(op == ReduceOp::sum ? a + b : std::max(a, b));
    }
  } else {
    for (size_t i = 0; i < n; ++i)
      d[i] = op == ReduceOp::sum ? T(d[i] + s[i]) : std::max(d[i], s[i]);
  }
}

void reduce_into(void* dst, const void* src, size_t n, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32:
      return reduce_into<float>(dst, src, n, op);
    case DType::bf16:
      return reduce_into<bf16>(dst, src, n, op);
    case DType::f16:
      return reduce_into<f16>(dst, src, n, op);
    case DType::i32:
      return reduce_into<int32_t>(dst, src, n, op);
    case DType::i64:
      return reduce_into<int64_t>(dst, src, n, op);
    case DType::u8:
      return reduce_into<uint8_t>(dst, src, n, op);
  }
}

// Gloo slots: the kind in the top bits, a per-group sequence number, the step of the algorithm.
constexpr uint64_t kCollectiveSlot = uint64_t{1} << 62;
constexpr uint64_t kP2PSlot = uint64_t{2} << 62;

class GlooBackend : public Backend {
 public:
  GlooBackend(const Group& group, gloo::rendezvous::Store& store,
              std::shared_ptr<gloo::transport::Device> device)
      : group_(group), device_(std::move(device)) {
    context_ = std::make_shared<gloo::rendezvous::Context>(group.rank, group.size);
    context_->setTimeout(group.timeout);
    gloo::rendezvous::PrefixStore prefixed(group.store_prefix, store);
    try {
      context_->connectFullMesh(prefixed, device_);
    } catch (const gloo::Exception& e) {
      TANDEM_FAIL(
          "connecting group '{}' (rank {} of {}): {}; check that every rank can reach "
          "the others' addresses (TANDEM_HOSTNAME sets the address of this one)",
          group.name, group.rank, group.size, e.what());
    }
    learn_peer_addresses(prefixed);
    send_seq_.assign(static_cast<size_t>(group.size), 0);
    recv_seq_.assign(static_cast<size_t>(group.size), 0);
  }

  void all_reduce(void* data, size_t count, DType dtype, ReduceOp op) override {
    Call call(*this, "all_reduce", count * dtype_size(dtype));
    if (group_.size == 1 || count == 0) return;
    const auto chunks = split_even(count, group_.size);
    ring_reduce_scatter(call, data, chunks, dtype, op, 0);
    // Rank r now holds the reduced chunk r + 1; pass the reduced chunks around the ring.
    ring_all_gather(call, data, chunks, dtype, 1);
  }

  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    const size_t esize = dtype_size(dtype);
    Call call(*this, "reduce_scatter", count * esize * static_cast<size_t>(group_.size));
    std::vector<size_t> chunks(static_cast<size_t>(group_.size), count);
    work_.resize(count * esize * static_cast<size_t>(group_.size));
    std::memcpy(work_.data(), in, work_.size());
    if (group_.size > 1 && count > 0)
      ring_reduce_scatter(call, work_.data(), chunks, dtype, op, -1);
    std::memcpy(out, work_.data() + static_cast<size_t>(group_.rank) * count * esize,
                count * esize);
  }

  void all_gather_v(const void* in, void* out, std::span<const size_t> counts,
                    DType dtype) override {
    const size_t esize = dtype_size(dtype);
    size_t total = 0, offset = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      if (static_cast<int>(r) == group_.rank) offset = total;
      total += counts[r];
    }
    Call call(*this, "all_gather", total * esize);
    char* dst = static_cast<char*>(out) + offset * esize;
    if (dst != in) std::memmove(dst, in, counts[static_cast<size_t>(group_.rank)] * esize);
    if (group_.size > 1 && total > 0)
      ring_all_gather(call, out, std::vector<size_t>(counts.begin(), counts.end()), dtype, 0);
  }

  void broadcast(void* data, size_t count, DType dtype, int root) override {
    const size_t bytes = count * dtype_size(dtype);
    Call call(*this, "broadcast", bytes);
    if (group_.size == 1 || bytes == 0) return;
    auto buf = context_->createUnboundBuffer(data, bytes);
    const uint64_t slot = call.slot(0);
    if (group_.rank == root) {
      for (int r = 0; r < group_.size; ++r)
        if (r != root) call.send(*buf, r, slot);
      for (int r = 0; r < group_.size; ++r)
        if (r != root) call.wait_send(*buf, r);
    } else {
      call.recv(*buf, root, slot);
      call.wait_recv(*buf, root);
    }
  }

  void send_recv(std::span<const P2POp> ops) override {
    size_t bytes = 0;
    for (const auto& op : ops) bytes += op.tensor.nbytes();
    // Not a collective: the ranks that take no part in it must agree on the next one's slots.
    Call call(*this, "send_recv", bytes, /*collective=*/false);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs;
    for (const auto& op : ops) {
      TANDEM_CHECK(op.peer >= 0 && op.peer < group_.size && op.peer != group_.rank,
                   "{}: peer {} is not another rank of the group", call.what(), op.peer);
      bufs.push_back(context_->createUnboundBuffer(op.tensor.data(), op.tensor.nbytes()));
      if (op.tensor.nbytes() == 0) continue;
      const auto peer = static_cast<size_t>(op.peer);
      if (op.kind == P2POp::Kind::send)
        call.send(*bufs.back(), op.peer, kP2PSlot | send_seq_[peer]++);
      else
        call.recv(*bufs.back(), op.peer, kP2PSlot | recv_seq_[peer]++);
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].tensor.nbytes() == 0) continue;
      if (ops[i].kind == P2POp::Kind::send)
        call.wait_send(*bufs[i], ops[i].peer);
      else
        call.wait_recv(*bufs[i], ops[i].peer);
    }
  }

  void barrier() override {
    Call call(*this, "barrier", 0);
    char token_out = 1, token_in = 0;
    auto out = context_->createUnboundBuffer(&token_out, 1);
    auto in = context_->createUnboundBuffer(&token_in, 1);
    uint64_t round = 0;
    for (int k = 1; k < group_.size; k *= 2, ++round) {
      const int to = (group_.rank + k) % group_.size;
      const int from = (group_.rank - k + group_.size) % group_.size;
      call.send(*out, to, call.slot(round));
      call.recv(*in, from, call.slot(round));
      call.wait_send(*out, to);
      call.wait_recv(*in, from);
    }
  }

 private:
  // One collective in progress: its deadline, its slots and its error messages. A point-to-point
  // call (collective = false: its slots are its own, per peer) takes no collective sequence number.
  class Call {
   public:
    Call(GlooBackend& b, const char* what, size_t bytes, bool collective = true)
        : b_(b),
          what_(what),
          bytes_(bytes),
          deadline_(Clock::now() + b.group_.timeout),
          base_(collective ? kCollectiveSlot | (b.seq_++ << 20) : kCollectiveSlot) {}
    uint64_t slot(uint64_t step) const { return base_ | step; }
    std::string what() const { return b_.group_.call(what_, bytes_); }

    // Posting fails at once when the connection to the peer is already lost.
    void send(gloo::transport::UnboundBuffer& buf, int peer, uint64_t slot, size_t offset = 0,
              size_t bytes = gloo::transport::UnboundBuffer::kUnspecifiedByteCount) {
      wait(peer, "sending to", [&](milliseconds) { buf.send(peer, slot, offset, bytes); });
    }
    void recv(gloo::transport::UnboundBuffer& buf, int peer, uint64_t slot, size_t offset = 0,
              size_t bytes = gloo::transport::UnboundBuffer::kUnspecifiedByteCount) {
      wait(peer, "receiving from", [&](milliseconds) { buf.recv(peer, slot, offset, bytes); });
    }
    void wait_send(gloo::transport::UnboundBuffer& buf, int peer) {
      wait(peer, "sending to", [&](milliseconds t) { buf.waitSend(t); });
    }
    void wait_recv(gloo::transport::UnboundBuffer& buf, int peer) {
      wait(peer, "receiving from", [&](milliseconds t) { buf.waitRecv(t); });
    }

   private:
    template <class Fn>
    void wait(int peer, const char* doing, Fn&& fn) {
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now()) + milliseconds(1);
      try {
        fn(std::max(left, milliseconds(1)));
      } catch (const gloo::Exception& e) {
        const double timeout_s = std::chrono::duration<double>(b_.group_.timeout).count();
        if (Clock::now() >= deadline_)
          TANDEM_FAIL(
              "{}: no progress {} {} within {} s (distributed.timeout_s): that rank is "
              "dead, stuck or in another collective",
              what(), doing, b_.group_.peer(peer), timeout_s);
        // Gloo fails every pending operation of the group when one connection breaks; its
        // message names the address of the broken one, which tells the rank.
        const int lost = b_.rank_of_address(e.what());
        if (lost >= 0 && lost != peer)
          TANDEM_FAIL(
              "{}: the connection to {} was lost while {} {} ({}); that rank died or "
              "gave up",
              what(), b_.group_.peer(lost), doing, b_.group_.peer(peer), e.what());
        TANDEM_FAIL("{}: {} {} failed: the connection was lost ({}); that rank died or gave up",
                    what(), doing, b_.group_.peer(peer), e.what());
      }
    }

    GlooBackend& b_;
    const char* what_;
    size_t bytes_;
    Clock::time_point deadline_;
    uint64_t base_;
  };

  // The addresses every peer's pairs listen at, as gloo's messages print them ("[ip]:port"), from
  // the values the ranks wrote into the store to connect (one address per pair of each rank).
  void learn_peer_addresses(gloo::rendezvous::Store& store) {
    const size_t address_size = gloo::transport::tcp::Address().bytes().size();
    for (int r = 0; r < group_.size; ++r) {
      if (r == group_.rank) continue;
      try {
        const std::vector<char> all = store.get(std::to_string(r));
        for (size_t at = 0; at + address_size <= all.size(); at += address_size) {
          const std::vector<char> one(all.begin() + static_cast<long>(at),
                                      all.begin() + static_cast<long>(at + address_size));
          peer_addresses_.emplace_back(gloo::transport::tcp::Address(one).str(), r);
        }
      } catch (const std::exception&) {  // only for messages: without it they name no address
      }
    }
  }

  int rank_of_address(const std::string& message) const {
    for (const auto& [address, rank] : peer_addresses_)
      if (message.find(address) != std::string::npos) return rank;
    return -1;
  }

  static std::vector<size_t> split_even(size_t count, int parts) {
    std::vector<size_t> sizes(static_cast<size_t>(parts), count / static_cast<size_t>(parts));
    for (size_t i = 0; i < count % static_cast<size_t>(parts); ++i) ++sizes[i];
    return sizes;
  }

  static std::vector<size_t> offsets_of(const std::vector<size_t>& sizes) {
    std::vector<size_t> offsets(sizes.size() + 1, 0);
    for (size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
    return offsets;
  }

  int ring_index(int i) const { return ((i % group_.size) + group_.size) % group_.size; }

  // After size - 1 steps rank r holds the full reduction of chunk r + 1 + shift.
  void ring_reduce_scatter(Call& call, void* data, const std::vector<size_t>& chunks, DType dtype,
                           ReduceOp op, int shift) {
    const size_t esize = dtype_size(dtype);
    const auto offsets = offsets_of(chunks);
    const int right = ring_index(group_.rank + 1), left = ring_index(group_.rank - 1);
    char* base = static_cast<char*>(data);
    auto buf = context_->createUnboundBuffer(data, offsets.back() * esize);
    tmp_.resize(*std::max_element(chunks.begin(), chunks.end()) * esize);
    auto tmp = context_->createUnboundBuffer(tmp_.data(), tmp_.size());
    for (int s = 0; s < group_.size - 1; ++s) {
      const auto send_chunk = static_cast<size_t>(ring_index(group_.rank - s + shift));
      const auto recv_chunk = static_cast<size_t>(ring_index(group_.rank - s - 1 + shift));
      const uint64_t slot = call.slot(static_cast<uint64_t>(s));
      if (chunks[send_chunk] > 0)
        call.send(*buf, right, slot, offsets[send_chunk] * esize, chunks[send_chunk] * esize);
      if (chunks[recv_chunk] > 0) call.recv(*tmp, left, slot, 0, chunks[recv_chunk] * esize);
      if (chunks[recv_chunk] > 0) {
        call.wait_recv(*tmp, left);
        reduce_into(base + offsets[recv_chunk] * esize, tmp_.data(), chunks[recv_chunk], dtype, op);
      }
      if (chunks[send_chunk] > 0) call.wait_send(*buf, right);
    }
  }

  // Rank r starts holding chunk r + shift; after size - 1 steps every rank holds every chunk.
  void ring_all_gather(Call& call, void* data, const std::vector<size_t>& chunks, DType dtype,
                       int shift) {
    const size_t esize = dtype_size(dtype);
    const auto offsets = offsets_of(chunks);
    const int right = ring_index(group_.rank + 1), left = ring_index(group_.rank - 1);
    auto buf = context_->createUnboundBuffer(data, offsets.back() * esize);
    const uint64_t first_step = static_cast<uint64_t>(group_.size);
    for (int s = 0; s < group_.size - 1; ++s) {
      const auto send_chunk = static_cast<size_t>(ring_index(group_.rank - s + shift));
      const auto recv_chunk = static_cast<size_t>(ring_index(group_.rank - s - 1 + shift));
      const uint64_t slot = call.slot(first_step + static_cast<uint64_t>(s));
      if (chunks[send_chunk] > 0)
        call.send(*buf, right, slot, offsets[send_chunk] * esize, chunks[send_chunk] * esize);
      if (chunks[recv_chunk] > 0)
        call.recv(*buf, left, slot, offsets[recv_chunk] * esize, chunks[recv_chunk] * esize);
      if (chunks[recv_chunk] > 0) call.wait_recv(*buf, left);
      if (chunks[send_chunk] > 0) call.wait_send(*buf, right);
    }
  }

  Group group_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint64_t seq_ = 0;
  std::vector<uint64_t> send_seq_, recv_seq_;
  std::vector<char> tmp_, work_;
  std::vector<std::pair<std::string, int>> peer_addresses_;
};

}  // namespace

std::unique_ptr<Backend> make_gloo_backend(const Group& group, gloo::rendezvous::Store& store,
                                           std::shared_ptr<void>& device,
                                           const std::string& hostname) {
  if (!device) {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    try {
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const gloo::Exception& e) {
      TANDEM_FAIL(
          "cannot open a gloo TCP device on '{}': {}; set TANDEM_HOSTNAME to an address "
          "of this host that the other ranks reach",
          hostname, e.what());
    }
  }
  return std::make_unique<GlooBackend>(group, store,
                                       std::static_pointer_cast<gloo::transport::Device>(device));
}

}  // namespace tandem::comm_detail
