// The weight push's data channel: its wire format and its socket I/O with timeouts.
#include "rollout/service/weight_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace tandem::rollout::channel {

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void put_i64(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }

uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return v;
}

int64_t get_i64(const char* p) {
  int64_t v = 0;
  std::memcpy(&v, p, 8);
  return v;
}

std::string encode(const BucketHeader& h) {
  std::string out;
  put_u32(out, h.magic);
  put_u32(out, static_cast<uint32_t>(h.index));
  put_u32(out, static_cast<uint32_t>(h.dtype));
  put_u32(out, h.pieces);
  put_i64(out, h.data_bytes);
  return out;
}

BucketHeader decode_bucket_header(const char* p) {
  BucketHeader h;
  h.magic = get_u32(p);
  h.index = static_cast<int32_t>(get_u32(p + 4));
  h.dtype = static_cast<int32_t>(get_u32(p + 8));
  h.pieces = get_u32(p + 12);
  h.data_bytes = get_i64(p + 16);
  return h;
}

std::string encode(const Answer& a) {
  std::string out;
  put_u32(out, static_cast<uint32_t>(a.code));
  put_i64(out, a.worker_version);
  const std::string_view message(a.message.data(), std::min<size_t>(a.message.size(), 4096));
  put_u32(out, static_cast<uint32_t>(message.size()));
  out.append(message);
  const std::string_view tensor(a.tensor.data(), std::min<size_t>(a.tensor.size(), 4096));
  put_u32(out, static_cast<uint32_t>(tensor.size()));
  out.append(tensor);
  return out;
}

void set_timeouts(int fd, int64_t ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int connect_to(const std::string& host, int port, int64_t timeout_ms) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int e = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); e != 0)
    throw ChannelError(
        fmt::format("weight channel: cannot resolve '{}': {}", host, ::gai_strerror(e)));
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol));
    if (fd.get() < 0) continue;
    int r = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      r = ::poll(&p, 1, static_cast<int>(timeout_ms));
      if (r == 0) {
        why = fmt::format("no connection within {} ms", timeout_ms);
        continue;
      }
      int error = 0;
      socklen_t len = sizeof error;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &len);
      r = error == 0 ? 0 : -1;
      errno = error;
    }
    if (r != 0) {
      why = std::strerror(errno);
      continue;
    }
    ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
    const int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::freeaddrinfo(found);
    return fd.release();
  }
  ::freeaddrinfo(found);
  throw ChannelError(fmt::format("weight channel: cannot connect to {}:{}: {}", host, port, why));
}

namespace {

std::string failure(const char* what, ssize_t r) {
  if (r == 0) return fmt::format("weight channel: {}: the peer closed the connection", what);
  if (errno == EAGAIN || errno == EWOULDBLOCK)
    return fmt::format("weight channel: {}: timed out", what);
  return fmt::format("weight channel: {}: {}", what, std::strerror(errno));
}

}  // namespace

void send_all(int fd, const void* data, size_t n, const char* what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw ChannelError(failure(what, r));
    p += r;
    n -= static_cast<size_t>(r);
  }
}

bool recv_all_or_end(int fd, void* data, size_t n, const char* what) {
  char* p = static_cast<char*>(data);
  const size_t want = n;
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && n == want) return false;
    if (r <= 0) throw ChannelError(failure(what, r));
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void recv_all(int fd, void* data, size_t n, const char* what) {
  if (!recv_all_or_end(fd, data, n, what)) throw ChannelError(failure(what, 0));
}

Answer read_answer(int fd) {
  char head[12];
  recv_all(fd, head, sizeof head, "reading an answer");
  Answer a;
  a.code = static_cast<int32_t>(get_u32(head));
  a.worker_version = get_i64(head + 4);
  for (std::string* s : {&a.message, &a.tensor}) {
    char len[4];
    recv_all(fd, len, 4, "reading an answer");
    const uint32_t n = get_u32(len);
    if (n > kMaxMessageBytes)
      throw ChannelError(
          fmt::format("weight channel: an answer of {} bytes; at most {}", n, kMaxMessageBytes));
    s->resize(n);
    recv_all(fd, s->data(), n, "reading an answer");
  }
  return a;
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace tandem::rollout::channel
