// Raw bytes to a Thrift server on loopback, for the tests of the bounds of its endpoints: pieces
// of the strict binary protocol as they are on the wire (big-endian), a connection, a send.
#pragma once

#include <cstdint>
#include <string>

namespace tandem::test {

std::string wire_i32(int32_t v);
std::string wire_i16(int16_t v);
// The 4-byte size header, then the payload.
std::string framed(const std::string& payload);

// A TCP connection to 127.0.0.1:port (a failed Catch2 REQUIRE when it cannot connect).
int connect_loopback(int port);
// Sends every byte, or stops quietly where the server closed the connection early.
void send_all(int fd, const std::string& bytes);

}  // namespace tandem::test
