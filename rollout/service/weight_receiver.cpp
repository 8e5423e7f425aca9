// WeightReceiver: the worker's side of a weight push, from Thrift calls and from the data channel.
#include "rollout/service/weight_receiver.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/socket.h"
#include "core/utf8.h"
#include "core/xxh3.h"
#include "kernels/ops.h"
#include "rollout/service/server.h"
#include "rollout/service/weight_channel.h"
#include "rpc/bounded_thrift.h"

namespace tandem::rollout {
namespace {

// A chunk of a bucket's data stays in the cache between its arrival and its checksum (and cast).
// 1 MiB: fewer wake-ups than 256 KiB, and measured faster with the bench (docs/serve.md).
constexpr size_t kChunkBytes = 1 << 20;

// Whether [first, end) meets a run of `runs` (first element -> end, disjoint).
bool overlaps(const std::map<int64_t, int64_t>& runs, int64_t first, int64_t end) {
  auto it = runs.lower_bound(first);
  if (it != runs.end() && it->first < end) return true;
  return it != runs.begin() && std::prev(it)->second > first;
}

// A buffer of kChunkBytes per thread: for casts, and data read to be compared or skipped.
char* scratch() {
  thread_local std::vector<char> buffer(kChunkBytes);
  return buffer.data();
}

}  // namespace

void authorize(const std::string& given, const std::string& expected) {
  if (expected.empty() || same_token(given, expected)) return;
  rpc::Unauthorized e;
  e.message = given.empty() ? "this worker requires a token" : "wrong token";
  throw e;
}

// A bucket between open() and its end: the ranges it writes are marked as being written until it
// is taken (finish) or dropped (the destructor), so no other bucket writes them meanwhile.
class WeightReceiver::Bucket {
 public:
  Bucket(WeightReceiver& r, std::string which) : which(std::move(which)), r_(r) {}
  ~Bucket() {
    if (!staging) return;
    std::lock_guard lock(r_.mutex_);
    if (r_.push_ && r_.push_->staging == staging)
      for (const Target& t : targets) r_.push_->writing[t.tensor].erase(t.offset);
  }
  Bucket(const Bucket&) = delete;
  Bucket& operator=(const Bucket&) = delete;

  const std::string which;  // "bucket 3 of v7", for messages
  int32_t index = 0;
  int64_t element_bytes = 0, data_bytes = 0;
  std::shared_ptr<model::Weights> staging;  // null: a bucket taken already, sent again
  uint64_t taken_hash = 0;                  // of that bucket
  std::vector<Target> targets;

 private:
  WeightReceiver& r_;
};

WeightReceiver::WeightReceiver(const model::Weights& served, Options options,
                               const std::atomic<uint64_t>& version,
                               std::function<void(int64_t, const std::string&)> note_abandoned)
    : options_(std::move(options)),
      config_(served.config()),
      dtype_(served.dtype()),
      version_(version),
      note_abandoned_(std::move(note_abandoned)) {
  for (size_t i = 0; i < served.named().size(); ++i) named_[served.named()[i].name] = i;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int e = ::getaddrinfo(options_.host.c_str(), "0", &hints, &found);
  TANDEM_CHECK(e == 0, "rollout server '{}': cannot resolve '{}' for the weight channel: {}",
               options_.name, options_.host, ::gai_strerror(e));
  for (addrinfo* a = found; a != nullptr && listener_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 16) == 0) {
      sockaddr_storage bound{};
      socklen_t n = sizeof bound;
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &n);
      data_port_ =
          ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listener_ = fd;
    } else {
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  TANDEM_CHECK(listener_ >= 0, "rollout server '{}': cannot listen on {} for the weight channel",
               options_.name, options_.host);
  accept_thread_ = std::thread([this] { accept_loop(); });
  spdlog::info("rollout server '{}': weight pushes' data channel on {}:{}", options_.name,
               options_.host, data_port_);
}

WeightReceiver::~WeightReceiver() { stop(); }

void WeightReceiver::authorize(const std::string& token) const {
  rollout::authorize(token, options_.token);
}

rpc::WeightPushRefused WeightReceiver::refusal(rpc::WeightPushFault::type fault,
                                               std::string message, std::string tensor) const {
  rpc::WeightPushRefused e;
  e.message = std::move(message);
  e.fault = fault;
  e.worker_version = static_cast<int64_t>(version_.load());
  e.tensor = std::move(tensor);
  return e;
}

void WeightReceiver::refuse(rpc::WeightPushFault::type fault, std::string message,
                            std::string tensor) const {
  throw refusal(fault, std::move(message), std::move(tensor));
}

void WeightReceiver::note_closed(const std::string& why) {
  // A flood of bad connections must not flood the log: the first ten, then every 1000th.
  const int64_t n = ++closed_;
  if (n <= 10 || n % 1000 == 0)
    spdlog::warn("rollout server '{}': closed a weight channel connection: {} ({} so far)",
                 options_.name, why, n);
}

void WeightReceiver::check_push(int64_t version, const std::string& which) const {
  if (!push_)
    refuse(rpc::WeightPushFault::NO_PUSH,
           fmt::format("{}: no weight push in progress (begin_weight_push first; a push ends at "
                       "its commit, at a newer begin, or after limits.weight_update_timeout_s "
                       "without a call)",
                       which));
  if (push_->version != version)
    refuse(rpc::WeightPushFault::VERSION,
           fmt::format("{}: the push in progress is of v{}", which, push_->version));
}

WeightReceiver::Clock::time_point WeightReceiver::deadline() const {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(options_.update_timeout_s));
}

rpc::WeightPushReady WeightReceiver::begin(const rpc::WeightPushBegin& begin) {
  authorize(begin.token);
  const auto have = static_cast<int64_t>(version_.load());
  if (begin.version <= have)
    refuse(rpc::WeightPushFault::VERSION,
           fmt::format("weight version {} is not newer than the worker's {}", begin.version, have));
  std::shared_ptr<model::Weights> staging;
  std::optional<int64_t> ended;
  {
    std::lock_guard lock(mutex_);
    if (push_) {
      ended = push_->version;
      staging = std::move(push_->staging);
      push_.reset();
    } else {
      staging = std::move(spare_);
    }
  }
  if (ended)
    note_abandoned_(*ended, fmt::format("begin_weight_push of v{} ended it", begin.version));
  // The first push allocates the copy it receives into; later ones reuse the weights swapped out,
  // unless a bucket of the push ended is still being written into them.
  if (staging.use_count() > 1) staging.reset();
  if (!staging) staging = std::make_shared<model::Weights>(config_, dtype_);
  Push p;
  p.version = begin.version;
  p.staging = std::move(staging);
  p.received.resize(named_.size());
  p.writing.resize(named_.size());
  p.deadline = deadline();
  {
    std::lock_guard lock(mutex_);
    push_ = std::move(p);
  }
  rpc::WeightPushReady out;
  out.worker_version = have;
  out.dtype = dtype_ == DType::bf16 ? rpc::WeightDType::BF16 : rpc::WeightDType::F32;
  out.max_bucket_bytes = options_.max_bucket_bytes;
  out.__set_data_port(data_port_);
  spdlog::info("rollout server '{}': weight push of v{} begun; serving v{} meanwhile",
               options_.name, begin.version, have);
  return out;
}

std::unique_ptr<WeightReceiver::Bucket> WeightReceiver::open(
    int64_t version, int32_t index, int32_t dtype, const std::vector<rpc::WeightPiece>& pieces,
    int64_t data_bytes) {
  auto b = std::make_unique<Bucket>(*this, fmt::format("bucket {} of v{}", index, version));
  const std::string& which = b->which;
  if (dtype == rpc::WeightDType::F32 && (dtype_ == DType::f32 || dtype_ == DType::bf16)) {
    b->element_bytes = 4;
  } else if (dtype == rpc::WeightDType::BF16 && dtype_ == DType::bf16) {
    b->element_bytes = 2;
  } else {
    refuse(rpc::WeightPushFault::DTYPE,
           fmt::format("{}: data of dtype {} for weights of {}: send {} or f32", which, dtype,
                       dtype_name(dtype_), dtype_name(dtype_)));
  }
  if (index < 0)
    refuse(rpc::WeightPushFault::SIZE, fmt::format("{}: a negative bucket index", which));
  int64_t elements = 0;
  for (const rpc::WeightPiece& piece : pieces) {
    if (piece.offset < 0 || piece.elements < 1 || piece.elements > (1ll << 40))
      refuse(rpc::WeightPushFault::SIZE,
             fmt::format("{}: a piece of '{}' at element {} of {} elements", which,
                         to_valid_utf8(piece.name), piece.offset, piece.elements),
             to_valid_utf8(piece.name));
    elements += piece.elements;
  }
  if (elements * b->element_bytes != data_bytes)
    refuse(rpc::WeightPushFault::SIZE,
           fmt::format("{}: {} bytes of data for pieces of {} elements of {} bytes", which,
                       data_bytes, elements, b->element_bytes));
  b->index = index;
  b->data_bytes = data_bytes;

  std::lock_guard lock(mutex_);
  check_push(version, which);
  Push& p = *push_;
  if (auto seen = p.buckets.find(index); seen != p.buckets.end()) {
    b->taken_hash = seen->second;  // compared with the data's once it is read
    return b;
  }
  std::vector<std::map<int64_t, int64_t>> mine(p.received.size());
  for (const rpc::WeightPiece& piece : pieces) {
    const auto it = named_.find(piece.name);
    if (it == named_.end())
      refuse(rpc::WeightPushFault::NAME,
             fmt::format("{}: the model has no tensor '{}'", which, to_valid_utf8(piece.name)),
             to_valid_utf8(piece.name));
    const int64_t numel = p.staging->named()[it->second].tensor.numel();
    if (piece.offset + piece.elements > numel)
      refuse(rpc::WeightPushFault::SIZE,
             fmt::format("{}: elements {}..{} of '{}', which has {}", which, piece.offset,
                         piece.offset + piece.elements, piece.name, numel),
             piece.name);
    for (const auto* runs : {&p.received[it->second], &p.writing[it->second], &mine[it->second]})
      if (overlaps(*runs, piece.offset, piece.offset + piece.elements))
        refuse(rpc::WeightPushFault::OVERLAP,
               fmt::format("{}: elements {}..{} of '{}' arrived already", which, piece.offset,
                           piece.offset + piece.elements, piece.name),
               piece.name);
    mine[it->second][piece.offset] = piece.offset + piece.elements;
    b->targets.push_back({it->second, piece.offset, piece.elements});
  }
  for (const Target& t : b->targets) p.writing[t.tensor][t.offset] = t.offset + t.elements;
  b->staging = p.staging;
  return b;
}

uint64_t WeightReceiver::fill(Bucket& b, const std::function<void(char*, size_t)>& read) {
  Xxh3 hash;
  if (!b.staging) {  // sent again: read to be compared
    for (int64_t done = 0; done < b.data_bytes;) {
      const size_t n = std::min<size_t>(kChunkBytes, static_cast<size_t>(b.data_bytes - done));
      read(scratch(), n);
      hash.update(scratch(), n);
      done += static_cast<int64_t>(n);
    }
    return hash.digest();
  }
  const int64_t eb = b.element_bytes;
  const bool cast = dtype_ == DType::bf16 && eb == 4;  // f32 data for bf16 weights
  const int64_t chunk = static_cast<int64_t>(kChunkBytes) / eb;
  for (const Target& t : b.targets) {
    const Tensor& to = b.staging->named()[t.tensor].tensor;
    for (int64_t first = 0; first < t.elements; first += chunk) {
      const int64_t n = std::min(chunk, t.elements - first);
      const int64_t at = t.offset + first;
      const auto bytes = static_cast<size_t>(n * eb);
      if (!cast) {
        char* dst = static_cast<char*>(to.data()) + at * eb;
        read(dst, bytes);
        hash.update(dst, bytes);
      } else {
        read(scratch(), bytes);
        hash.update(scratch(), bytes);
        ops::cast(Tensor::wrap(scratch(), {n}, DType::f32),
                  Tensor::wrap(static_cast<uint16_t*>(to.data()) + at, {n}, DType::bf16));
      }
    }
  }
  return hash.digest();
}

void WeightReceiver::finish(Bucket& b, uint64_t hash, uint64_t sent_hash) {
  if (!b.staging) {
    if (b.taken_hash == sent_hash && hash == sent_hash) return;  // a retry: taken once
    refuse(rpc::WeightPushFault::OVERLAP,
           fmt::format("{} arrived already, with other data", b.which));
  }
  if (hash != sent_hash)
    refuse(rpc::WeightPushFault::CHECKSUM,
           fmt::format("{}: the data's XXH3-64 is {:#018x}, the bucket says {:#018x}", b.which,
                       hash, sent_hash));
  std::lock_guard lock(mutex_);
  if (!push_ || push_->staging != b.staging)
    refuse(rpc::WeightPushFault::NO_PUSH,
           fmt::format("{}: its push ended while it arrived (a newer begin_weight_push, or "
                       "limits.weight_update_timeout_s)",
                       b.which));
  Push& p = *push_;
  for (const Target& t : b.targets) {
    p.writing[t.tensor].erase(t.offset);
    p.received[t.tensor][t.offset] = t.offset + t.elements;
  }
  p.buckets.emplace(b.index, hash);
  p.bytes += b.data_bytes;
  p.deadline = deadline();
  b.staging.reset();  // taken: nothing to unmark
}

void WeightReceiver::take(const BucketView& v) {
  authorize(v.token);
  std::unique_ptr<Bucket> b =
      open(v.version, v.index, v.dtype, v.pieces, static_cast<int64_t>(v.data.size()));
  const char* src = v.data.data();
  const uint64_t hash = fill(*b, [&](char* dst, size_t n) {
    std::memcpy(dst, src, n);
    src += n;
  });
  finish(*b, hash, static_cast<uint64_t>(v.xxh3));
}

std::shared_ptr<model::Weights> WeightReceiver::complete(const rpc::WeightPushCommit& c,
                                                         int64_t& bytes) {
  authorize(c.token);
  std::lock_guard lock(mutex_);
  // A commit sent again after its answer was lost: the version is in use already.
  if (!push_ && c.version == static_cast<int64_t>(version_.load())) return nullptr;
  const std::string which = fmt::format("commit of v{}", c.version);
  check_push(c.version, which);
  Push& p = *push_;
  for (int32_t i = 0; i < c.buckets; ++i)
    if (!p.buckets.contains(i))
      refuse(rpc::WeightPushFault::INCOMPLETE,
             fmt::format("{}: bucket {} of {} has not arrived ({} have)", which, i, c.buckets,
                         p.buckets.size()));
  if (static_cast<int64_t>(p.buckets.size()) != c.buckets)
    refuse(rpc::WeightPushFault::INCOMPLETE,
           fmt::format("{}: {} buckets arrived, the commit says {}", which, p.buckets.size(),
                       c.buckets));
  for (size_t i = 0; i < p.received.size(); ++i) {
    int64_t have = 0;
    for (const auto& [first, end] : p.received[i]) have += end - first;
    const model::NamedTensor& t = p.staging->named()[i];
    if (have != t.tensor.numel())
      refuse(rpc::WeightPushFault::INCOMPLETE,
             fmt::format("{}: {} of the {} elements of '{}' arrived", which, have, t.tensor.numel(),
                         t.name),
             t.name);
  }
  // Every element received: no bucket writes into the staging copy any more.
  std::shared_ptr<model::Weights> next = std::move(p.staging);
  bytes = p.bytes;
  push_.reset();
  return next;
}

void WeightReceiver::keep_spare(std::shared_ptr<model::Weights> old) {
  std::lock_guard lock(mutex_);
  spare_ = std::move(old);
}

void WeightReceiver::expire() {
  std::optional<int64_t> ended;
  {
    std::lock_guard lock(mutex_);
    if (!push_ || Clock::now() < push_->deadline) return;
    ended = push_->version;
    spare_ = std::move(push_->staging);
    push_.reset();
  }
  note_abandoned_(*ended, fmt::format("no call of its push within {} s "
                                      "(limits.weight_update_timeout_s)",
                                      options_.update_timeout_s));
}

// --- the data channel --------------------------------------------------------------------------

void WeightReceiver::accept_loop() {
  while (!stopping_) {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int fd = ::accept(listener_, nullptr, nullptr);
    if (fd < 0) continue;
    std::lock_guard lock(connections_mutex_);
    std::erase_if(connections_, [](Connection& c) {
      if (c.fd >= 0) return false;
      c.thread.join();
      return true;
    });
    if (static_cast<int64_t>(connections_.size()) >= options_.max_connections || stopping_) {
      spdlog::warn("rollout server '{}': a weight channel connection over the {} at once closed",
                   options_.name, options_.max_connections);
      ::close(fd);
      continue;
    }
    // The fd is closed by its thread under connections_mutex_, so stop() never shuts down an fd
    // number reused by another open.
    auto& c = connections_.emplace_back();
    c.fd = fd;
    c.thread = std::thread([this, fd, &fd_slot = c.fd] {
      serve_connection(fd);
      ::shutdown(fd, SHUT_WR);  // the answers written, then the end
      std::lock_guard lock(connections_mutex_);
      ::close(fd);
      fd_slot = -1;
    });
  }
}

void WeightReceiver::stop() {
  if (stopping_.exchange(true)) return;
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listener_ >= 0) ::close(listener_);
  {
    std::lock_guard lock(connections_mutex_);
    for (Connection& c : connections_)
      if (c.fd >= 0) ::shutdown(c.fd, SHUT_RDWR);
  }
  for (Connection& c : connections_) c.thread.join();
  connections_.clear();
}

void WeightReceiver::serve_connection(int fd) {
  using channel::Answer;
  net::set_io_timeouts(fd, options_.idle_timeout_ms);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto answer = [&](const Answer& a) {
    const std::string bytes = channel::encode(a);
    channel::send_all(fd, bytes.data(), bytes.size(), "answering");
  };
  auto answer_of = [&](int32_t code, std::string message = "") {
    Answer a;
    a.code = code;
    a.worker_version = static_cast<int64_t>(version_.load());
    a.message = std::move(message);
    return a;
  };
  auto refused = [&](const rpc::WeightPushRefused& e) {
    Answer a = answer_of(static_cast<int32_t>(e.fault), e.message);
    a.tensor = e.tensor;
    return a;
  };
  auto malformed = [&](const std::string& why) {
    note_closed(why);
    answer(answer_of(channel::kMalformed, why));
  };
  try {
    // The hello: the connection's token and push.
    char hello[12];
    if (!channel::recv_all_or_end(fd, hello, sizeof hello, "reading the hello")) return;
    if (std::string_view(hello, 8) != channel::kHello)
      return malformed("not a weight channel hello");
    const uint32_t token_bytes = channel::get_u32(hello + 8);
    if (token_bytes > channel::kMaxTokenBytes)
      return malformed(fmt::format("a token of {} bytes", token_bytes));
    std::string token(token_bytes, '\0');
    channel::recv_all(fd, token.data(), token.size(), "reading the hello");
    char version_bytes[8];
    channel::recv_all(fd, version_bytes, 8, "reading the hello");
    const int64_t version = channel::get_i64(version_bytes);
    try {
      authorize(token);
      std::lock_guard lock(mutex_);
      check_push(version, fmt::format("a weight channel of v{}", version));
    } catch (const rpc::Unauthorized& e) {
      return answer(answer_of(channel::kUnauthorized, e.message));
    } catch (const rpc::WeightPushRefused& e) {
      return answer(refused(e));
    }
    answer(answer_of(channel::kTaken));

    for (;;) {
      char head[channel::kBucketHeaderBytes];
      if (!channel::recv_all_or_end(fd, head, sizeof head, "reading a bucket")) return;
      const channel::BucketHeader h = channel::decode_bucket_header(head);
      if (h.magic != channel::kBucketMagic) return malformed("not a bucket header");
      const std::string which = fmt::format("bucket {} of v{}", h.index, version);
      // The framing itself over the bound: the bucket cannot be skipped, so the connection ends.
      int64_t bound_left = options_.max_bucket_bytes - std::max<int64_t>(h.data_bytes, 0);
      if (h.data_bytes < 0 || bound_left < 0 ||
          static_cast<int64_t>(h.pieces) * kWeightPieceBytes > bound_left) {
        const rpc::WeightPushRefused e =
            refusal(rpc::WeightPushFault::SIZE,
                    fmt::format("{}: {} bytes of data in {} pieces; a bucket carries at most {}",
                                which, h.data_bytes, h.pieces, options_.max_bucket_bytes));
        note_closed(e.message);
        return answer(refused(e));
      }
      std::vector<rpc::WeightPiece> pieces(h.pieces);
      for (rpc::WeightPiece& p : pieces) {
        char len[4];
        channel::recv_all(fd, len, 4, "reading a bucket");
        const uint32_t name_bytes = channel::get_u32(len);
        bound_left -= static_cast<int64_t>(name_bytes) + kWeightPieceBytes;
        if (name_bytes > channel::kMaxNameBytes || bound_left < 0)
          return malformed(fmt::format("{}: its pieces are over the bound of {} bytes", which,
                                       options_.max_bucket_bytes));
        p.name.resize(name_bytes);
        channel::recv_all(fd, p.name.data(), name_bytes, "reading a bucket");
        char range[16];
        channel::recv_all(fd, range, 16, "reading a bucket");
        p.offset = channel::get_i64(range);
        p.elements = channel::get_i64(range + 8);
      }
      auto read = [&](char* dst, size_t n) { channel::recv_all(fd, dst, n, "reading a bucket"); };
      Answer a = answer_of(channel::kTaken);
      bool consumed = false;
      try {
        std::unique_ptr<Bucket> b = open(version, h.index, h.dtype, pieces, h.data_bytes);
        const uint64_t hash = fill(*b, read);
        char sent[8];
        read(sent, 8);
        consumed = true;
        finish(*b, hash, static_cast<uint64_t>(channel::get_i64(sent)));
      } catch (const rpc::WeightPushRefused& e) {
        a = refused(e);
        // A bucket refused before its data: the data is read past, and the next bucket comes.
        if (!consumed) {
          for (int64_t left = h.data_bytes; left > 0;) {
            const size_t n = std::min<size_t>(kChunkBytes, static_cast<size_t>(left));
            read(scratch(), n);
            left -= static_cast<int64_t>(n);
          }
          char sent[8];
          read(sent, 8);
        }
      }
      answer(a);
    }
  } catch (const channel::ChannelError& e) {
    if (!stopping_)
      spdlog::warn("rollout server '{}': a weight channel connection ended: {}", options_.name,
                   e.what());
  } catch (const std::exception& e) {
    spdlog::error("rollout server '{}': a weight channel connection failed: {}", options_.name,
                  e.what());
  }
}

}  // namespace tandem::rollout
