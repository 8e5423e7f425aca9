// Plain TCP sockets with every wait bounded.
#include "core/socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace tandem::net {

bool send_all(int fd, const void* data, size_t n, size_t* done) {
  const char* p = static_cast<const char*>(data);
  size_t sent = 0;
  while (sent < n) {
    const ssize_t r = ::send(fd, p + sent, n - sent, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      if (done != nullptr) *done = sent;
      return false;
    }
    sent += static_cast<size_t>(r);
  }
  if (done != nullptr) *done = sent;
  return true;
}

bool recv_all(int fd, void* data, size_t n, size_t* done) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = 0;
      if (done != nullptr) *done = got;
      return false;
    }
    got += static_cast<size_t>(r);
  }
  if (done != nullptr) *done = got;
  return true;
}

std::string io_failure(int error) {
  if (error == 0) return "the peer closed the connection";
  if (error == EAGAIN || error == EWOULDBLOCK) return "timed out";
  return std::strerror(error);
}

int connect_tcp(const std::string& host, int port, int64_t timeout_ms, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int e = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); e != 0) {
    why = fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(e));
    return -1;
  }
  why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
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
  return -1;
}

void set_io_timeouts(int fd, int64_t ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
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

}  // namespace tandem::net
