// Weights over the wire, the sender's side: bucket plans, and a push's buckets sent over the
// worker's data channel straight from the weights (cast on the way where the dtypes differ).
#include "rollout/service/weight_push.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "core/socket.h"
#include "core/xxh3.h"
#include "kernels/ops.h"
#include "rollout/service/server.h"
#include "rollout/service/weight_channel.h"
#include "rpc/thrift_client.h"

namespace tandem::rollout {
namespace {

DType dtype_of(rpc::WeightDType::type t) {
  return t == rpc::WeightDType::BF16 ? DType::bf16 : DType::f32;
}

// A chunk is hashed, then handed to the socket while it is still in the cache. 1 MiB, as the
// worker reads: against 256 KiB, 0.83-0.95 of the plain copy to two workers instead of 0.78-0.83
// (docs/serve.md).
constexpr size_t kSendChunkBytes = 1 << 20;

// The worker's answer as the Thrift calls' errors read (client.cpp), thrown unless it is kTaken.
void check_answer(const channel::Answer& a, const std::string& where) {
  if (a.code == channel::kTaken) return;
  if (a.code == channel::kUnauthorized)
    throw CallError(CallFailure::unauthorized,
                    fmt::format("{}: the worker refused the token ({}): set the client's token "
                                "to the worker's",
                                where, a.message));
  if (a.code == channel::kMalformed)
    throw CallError(CallFailure::protocol,
                    fmt::format("{}: the worker refused the channel's data: {}", where, a.message));
  const std::string fault = rpc::to_string(static_cast<rpc::WeightPushFault::type>(a.code));
  throw CallError(CallFailure::weights_refused,
                  fmt::format("{}: the worker refused the weights ({}, it serves v{}): {}", where,
                              fault, a.worker_version, a.message));
}

// `hash` continued over the n bytes at p, or taken from another push of the same source that
// hashed this chunk already.
void checksum(WeightSource& source, const WeightSource::Chunk& chunk, const char* p, size_t n,
              Xxh3& hash) {
  if (std::optional<Xxh3> known = source.hash_after(chunk)) {
    hash = *known;
    return;
  }
  hash.update(p, n);
  source.note_hash_after(chunk, hash);
}

// Sends `n` bytes of the weights from where locate(weights) points, with them added to `hash`:
// the weights are read only inside source->read, by the checksum and by sends that do
// not block (the kernel's copy), so a source withdrawn waits for no network.
void send_from_weights(int fd, WeightSource& source, const WeightSource::Chunk& chunk,
                       const std::function<const char*(const model::Weights&)>& locate, size_t n,
                       Xxh3& hash, int64_t timeout_ms, const std::function<Error()>& withdrawn) {
  size_t done = 0;
  bool summed = false;
  while (done < n) {
    if (!source.read([&](const model::Weights& w) {
          const char* p = locate(w);
          if (!summed) checksum(source, chunk, p, n, hash);
          summed = true;
          while (done < n) {
            const ssize_t r = ::send(fd, p + done, n - done, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (r <= 0)
              throw channel::ChannelError(
                  fmt::format("weight channel: sending a bucket: {}", std::strerror(errno)));
            done += static_cast<size_t>(r);
          }
        }))
      throw withdrawn();
    if (done < n) {
      pollfd p{fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, static_cast<int>(timeout_ms));
      if (r == 0)
        throw channel::ChannelError(fmt::format(
            "weight channel: sending a bucket: the worker took nothing for {} ms", timeout_ms));
      if (r < 0 && errno != EINTR)
        throw channel::ChannelError(
            fmt::format("weight channel: sending a bucket: {}", std::strerror(errno)));
    }
  }
}

// The buckets of `plan` over the worker's data channel, one connection, back to back; the answers
// are read after the last (the worker answers each in order), so no bucket waits for a round trip.
int64_t push_over_channel(RolloutClient& client, const std::shared_ptr<WeightSource>& source,
                          int64_t version, const rpc::WeightPushReady& ready, DType to,
                          int64_t bound, const std::vector<std::vector<rpc::WeightPiece>>& plan,
                          const std::function<Error()>& withdrawn) {
  const ClientOptions& o = client.options();
  const std::string where = fmt::format("rollout worker {}: weight channel", o.address);
  const Endpoint e = parse_endpoint(o.address, "weight push", 9100);
  int64_t sent = 0;
  try {
    std::string why;
    net::Fd fd(net::connect_tcp(e.host, ready.data_port, o.connect_timeout_ms, why));
    if (fd.get() < 0)
      throw channel::ChannelError(
          fmt::format("weight channel: cannot connect to {}:{}: {}", e.host, ready.data_port, why));
    net::set_io_timeouts(fd.get(), o.timeout_ms);
    std::string hello(channel::kHello);
    channel::put_u32(hello, static_cast<uint32_t>(o.token.size()));
    hello += o.token;
    channel::put_i64(hello, version);
    channel::send_all(fd.get(), hello.data(), hello.size(), "sending the hello");
    check_answer(channel::read_answer(fd.get()), where);

    const auto out_bytes = static_cast<int64_t>(dtype_size(to));
    std::vector<char> cast(kSendChunkBytes);
    try {
      for (size_t i = 0; i < plan.size(); ++i) {
        channel::BucketHeader h;
        h.index = static_cast<int32_t>(i);
        h.dtype = to == DType::bf16 ? rpc::WeightDType::BF16 : rpc::WeightDType::F32;
        h.pieces = static_cast<uint32_t>(plan[i].size());
        for (const rpc::WeightPiece& p : plan[i]) h.data_bytes += p.elements * out_bytes;
        std::string head = channel::encode(h);
        for (const rpc::WeightPiece& p : plan[i]) {
          channel::put_u32(head, static_cast<uint32_t>(p.name.size()));
          head += p.name;
          channel::put_i64(head, p.offset);
          channel::put_i64(head, p.elements);
        }
        channel::send_all(fd.get(), head.data(), head.size(), "sending a bucket");
        Xxh3 hash;
        WeightSource::Chunk chunk_id{h.dtype, bound, static_cast<int64_t>(i), 0};
        for (const rpc::WeightPiece& p : plan[i]) {
          DType from = to;
          if (!source->read([&](const model::Weights& w) { from = w.at(p.name).dtype(); }))
            throw withdrawn();
          TANDEM_CHECK(from == to || ((from == DType::f32 || from == DType::bf16) &&
                                      (to == DType::f32 || to == DType::bf16)),
                       "weight push: tensor '{}' is {}, the worker takes {}: push f32 or bf16 "
                       "weights",
                       p.name, dtype_name(from), dtype_name(to));
          const auto in_bytes = static_cast<int64_t>(dtype_size(from));
          const int64_t chunk = static_cast<int64_t>(kSendChunkBytes) / out_bytes;
          for (int64_t first = 0; first < p.elements; first += chunk, ++chunk_id.index) {
            const int64_t n = std::min(chunk, p.elements - first);
            auto locate = [&](const model::Weights& w) {
              return static_cast<const char*>(w.at(p.name).data()) + (p.offset + first) * in_bytes;
            };
            if (from == to) {
              send_from_weights(fd.get(), *source, chunk_id, locate,
                                static_cast<size_t>(n * out_bytes), hash, o.timeout_ms, withdrawn);
              continue;
            }
            // Cast (under the source's lock) into a buffer of our own, then sent from it.
            if (!source->read([&](const model::Weights& w) {
                  ops::cast(Tensor::wrap(const_cast<char*>(locate(w)), {n}, from),
                            Tensor::wrap(cast.data(), {n}, to));
                }))
              throw withdrawn();
            const auto bytes = static_cast<size_t>(n * out_bytes);
            checksum(*source, chunk_id, cast.data(), bytes, hash);
            channel::send_all(fd.get(), cast.data(), bytes, "sending a bucket");
          }
        }
        std::string trailer;
        channel::put_i64(trailer, static_cast<int64_t>(hash.digest()));
        channel::send_all(fd.get(), trailer.data(), trailer.size(), "sending a bucket");
        sent += h.data_bytes;
      }
    } catch (const channel::ChannelError&) {
      // The worker may have said why before it closed the connection (a bucket over its bound).
      for (size_t i = 0; i < plan.size(); ++i) {
        channel::Answer a;
        try {
          a = channel::read_answer(fd.get());
        } catch (const channel::ChannelError&) {
          break;
        }
        check_answer(a, where);
      }
      throw;
    }
    for (size_t i = 0; i < plan.size(); ++i) check_answer(channel::read_answer(fd.get()), where);
  } catch (const channel::ChannelError& err) {
    throw CallError(CallFailure::transport, fmt::format("{}: {}", where, err.what()));
  }
  return sent;
}

}  // namespace

std::vector<std::vector<rpc::WeightPiece>> plan_weight_buckets(const model::Weights& w,
                                                               int64_t element_bytes,
                                                               int64_t max_bucket_bytes) {
  std::vector<std::vector<rpc::WeightPiece>> buckets(1);
  int64_t used = 0;
  for (const model::NamedTensor& t : w.named()) {
    const int64_t piece_bytes = static_cast<int64_t>(t.name.size()) + kWeightPieceBytes;
    TANDEM_CHECK(piece_bytes + element_bytes <= max_bucket_bytes,
                 "weight push: a bucket of {} bytes cannot hold a piece of '{}'; raise the bound",
                 max_bucket_bytes, t.name);
    for (int64_t offset = 0, numel = t.tensor.numel(); offset < numel;) {
      if (used + piece_bytes + element_bytes > max_bucket_bytes) {
        buckets.emplace_back();
        used = 0;
      }
      const int64_t fit = (max_bucket_bytes - used - piece_bytes) / element_bytes;
      rpc::WeightPiece p;
      p.name = t.name;
      p.offset = offset;
      p.elements = std::min(fit, numel - offset);
      buckets.back().push_back(p);
      used += piece_bytes + p.elements * element_bytes;
      offset += p.elements;
    }
  }
  return buckets;
}

bool WeightSource::read(const std::function<void(const model::Weights&)>& fn) {
  std::shared_lock lock(mutex_);
  if (weights_ == nullptr) return false;
  fn(*weights_);
  return true;
}

void WeightSource::withdraw() {
  std::unique_lock lock(mutex_);
  weights_ = nullptr;
}

std::optional<Xxh3> WeightSource::hash_after(const Chunk& chunk) {
  std::lock_guard lock(hash_mutex_);
  const auto it = hashes_.find(chunk);
  if (it == hashes_.end()) return std::nullopt;
  return it->second;
}

void WeightSource::note_hash_after(const Chunk& chunk, const Xxh3& hash) {
  std::lock_guard lock(hash_mutex_);
  hashes_.emplace(chunk, hash);
}

int64_t WeightSource::chunks_checksummed() {
  std::lock_guard lock(hash_mutex_);
  return static_cast<int64_t>(hashes_.size());
}

WeightPushResult push_weights(RolloutClient& client, const model::Weights& w, int64_t version,
                              int64_t max_bucket_bytes, bool partial) {
  return push_weights(client, std::make_shared<WeightSource>(w), version, max_bucket_bytes,
                      partial);
}

WeightPushResult push_weights(RolloutClient& client, const std::shared_ptr<WeightSource>& source,
                              int64_t version, int64_t max_bucket_bytes, bool partial) {
  WeightPushResult r;
  r.version = client.weight_version();
  if (r.version >= version) return r;
  const rpc::WeightPushReady ready = client.begin_weight_push(version);
  const DType to = dtype_of(ready.dtype);
  const int64_t bound = std::min(max_bucket_bytes, ready.max_bucket_bytes);
  auto withdrawn = [&] {
    return Error(fmt::format("weight push of v{} to {}: given up, its weights withdrawn", version,
                             client.options().address));
  };
  std::vector<std::vector<rpc::WeightPiece>> plan;
  if (!source->read([&](const model::Weights& w) {
        plan = plan_weight_buckets(w, static_cast<int64_t>(dtype_size(to)), bound);
      }))
    throw withdrawn();
  if (!ready.__isset.data_port || ready.data_port <= 0)
    throw CallError(CallFailure::protocol,
                    fmt::format("rollout worker {}: begin_weight_push announced no data channel "
                                "(data_port): is the worker of this build?",
                                client.options().address));
  r.bytes = push_over_channel(client, source, version, ready, to, bound, plan, withdrawn);
  r.buckets = static_cast<int64_t>(plan.size());
  r.version = client.commit_weight_push(version, static_cast<int32_t>(plan.size()), partial);
  r.sent = true;
  return r;
}

}  // namespace tandem::rollout
