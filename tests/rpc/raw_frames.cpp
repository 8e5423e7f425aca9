// Raw Thrift frames and loopback connections for the tests of the bounded endpoints.
#include "tests/rpc/raw_frames.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <catch2/catch.hpp>

namespace tandem::test {

std::string wire_i32(int32_t v) {
  const uint32_t u = htonl(static_cast<uint32_t>(v));
  return std::string(reinterpret_cast<const char*>(&u), 4);
}

std::string wire_i16(int16_t v) {
  const uint16_t u = htons(static_cast<uint16_t>(v));
  return std::string(reinterpret_cast<const char*>(&u), 2);
}

std::string framed(const std::string& payload) {
  return wire_i32(static_cast<int32_t>(payload.size())) + payload;
}

int connect_loopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

void send_all(int fd, const std::string& bytes) {
  for (size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace tandem::test
