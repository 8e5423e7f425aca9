// The plain TCP helpers: every byte over a loopback connection, a peer that closes or goes silent
// named as such, a connect to a port nobody listens on refused within its deadline.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "core/socket.h"

using namespace tandem;

namespace {

// A loopback listener on a free port.
struct Listener {
  net::Fd fd{::socket(AF_INET, SOCK_STREAM, 0)};
  int port = 0;
  Listener() {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd.get(), 4) == 0);
    socklen_t n = sizeof a;
    REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &n) == 0);
    port = ntohs(a.sin_port);
  }
};

}  // namespace

TEST_CASE("socket helpers move every byte and name a closed or silent peer", "[unit]") {
  Listener l;
  std::string why;
  net::Fd client(net::connect_tcp("127.0.0.1", l.port, 2000, why));
  REQUIRE(client.get() >= 0);
  net::Fd server(::accept(l.fd.get(), nullptr, nullptr));
  REQUIRE(server.get() >= 0);

  std::vector<char> out(3 << 20), in(out.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 31 + 7);
  std::thread sender([&] { CHECK(net::send_all(client.get(), out.data(), out.size())); });
  size_t got = 0;
  CHECK(net::recv_all(server.get(), in.data(), in.size(), &got));
  sender.join();
  CHECK(got == out.size());
  CHECK(in == out);

  // Silent: the receive timeout passes.
  net::set_io_timeouts(server.get(), 100);
  char byte = 0;
  CHECK_FALSE(net::recv_all(server.get(), &byte, 1, &got));
  CHECK(got == 0);
  CHECK(net::io_failure(errno) == "timed out");
  // Closed after 2 of 4 bytes: false, the 2 bytes read, "closed".
  CHECK(net::send_all(client.get(), "ab", 2));
  client = net::Fd();
  char four[4];
  CHECK_FALSE(net::recv_all(server.get(), four, 4, &got));
  CHECK(got == 2);
  CHECK(net::io_failure(errno) == "the peer closed the connection");
}

TEST_CASE("a connect to a port nobody listens on fails with the reason", "[unit]") {
  int port = 0;
  {
    Listener l;
    port = l.port;
  }  // closed: nothing listens there now
  std::string why;
  CHECK(net::connect_tcp("127.0.0.1", port, 1000, why) == -1);
  CHECK(why.find("refused") != std::string::npos);
  CHECK(net::connect_tcp("no-such-host.invalid", port, 1000, why) == -1);
  CHECK(why.find("cannot resolve") != std::string::npos);
}
