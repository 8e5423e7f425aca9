// Plain TCP sockets with every wait bounded: the byte loops, the connect with a deadline and the
// owned descriptor that the rendezvous store (core/rendezvous.cpp) and the weight push's data
// channel (rollout/service/weight_channel.h) share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tandem::net {

// All `n` bytes, retrying after EINTR: true, or false with errno set (0 where the peer closed the
// connection; EAGAIN where a timeout of set_io_timeouts passed). *done (when given): the bytes
// moved, also after a failure.
bool send_all(int fd, const void* data, size_t n, size_t* done = nullptr);
bool recv_all(int fd, void* data, size_t n, size_t* done = nullptr);

// What errno after a failed send_all or recv_all means, for a message: "the peer closed the
// connection", "timed out" or strerror.
std::string io_failure(int error);

// Connects to host:port within timeout_ms, trying each address getaddrinfo gives: the descriptor
// (blocking, close-on-exec, TCP_NODELAY), or -1 with `why` saying what failed last.
int connect_tcp(const std::string& host, int port, int64_t timeout_ms, std::string& why);

// SO_RCVTIMEO and SO_SNDTIMEO of fd: a blocked recv or send fails after `ms` (errno EAGAIN).
void set_io_timeouts(int fd, int64_t ms);

// A file descriptor closed with its owner.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace tandem::net
