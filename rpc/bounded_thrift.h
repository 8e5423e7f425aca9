// Bounded Thrift: framed transports and binary protocols that refuse a frame, string or container
// larger than a limit before allocating it, for every Thrift server and client of tandem.
//
// Part of tandem_rpc (Thrift and core only, docs/rpc.md); docs/rewards.md and docs/serve.md list
// the limits of each endpoint.
#pragma once

#include <thrift/TConfiguration.h>
#include <thrift/TProcessor.h>
#include <thrift/protocol/TProtocol.h>
#include <thrift/server/TServer.h>
#include <thrift/transport/TSocket.h>
#include <thrift/transport/TTransport.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace tandem {

// What one peer's bytes may cost the other end of a connection. A message is read whole into one
// frame buffer (at most max_message_bytes); a string or a container must also fit in what is left
// of its frame, so a few bytes can never claim gigabytes.
struct ThriftLimits {
  int32_t max_message_bytes = 64 << 20;      // one framed message
  int32_t max_string_bytes = 64 << 20;       // one string or binary field
  int32_t max_container_elements = 1 << 16;  // one list, set or map
  int32_t max_depth = 16;                    // structs and containers nested in one another
};

// Throws tandem::Error naming `what` (the endpoint) and the limit when one is out of range.
void check_thrift_limits(const ThriftLimits& limits, const std::string& what);

// The limits as Thrift's own configuration (message and frame size, recursion limit).
std::shared_ptr<apache::thrift::TConfiguration> thrift_configuration(const ThriftLimits& limits);

// A framed transport over `inner` that refuses a frame over max_message_bytes from its 4-byte
// header, before allocating anything (TTransportException CORRUPTED_DATA).
std::shared_ptr<apache::thrift::transport::TTransport> bounded_framed_transport(
    std::shared_ptr<apache::thrift::transport::TTransport> inner, const ThriftLimits& limits);

// A strict binary protocol over `transport` (best a bounded framed one, whose frame bounds the
// sizes further) that refuses a string, container or nesting over the limits
// (TProtocolException SIZE_LIMIT, NEGATIVE_SIZE, DEPTH_LIMIT or BAD_VERSION).
std::shared_ptr<apache::thrift::protocol::TProtocol> bounded_binary_protocol(
    std::shared_ptr<apache::thrift::transport::TTransport> transport, const ThriftLimits& limits);

// A client's opened connection to host:port: a socket with its connect timeout, send and receive
// timeouts and no Nagle delay, under a bounded framed transport and protocol (the limits bound
// the answers as the servers bound requests).
struct BoundedClientSocket {
  std::shared_ptr<apache::thrift::transport::TSocket> socket;
  std::shared_ptr<apache::thrift::transport::TTransport> transport;
  std::shared_ptr<apache::thrift::protocol::TProtocol> protocol;
};
BoundedClientSocket open_bounded_client(const std::string& host, int port, int connect_timeout_ms,
                                        int io_timeout_ms, const ThriftLimits& limits);

// The two above as factories, for a server.
std::shared_ptr<apache::thrift::transport::TTransportFactory> bounded_framed_transport_factory(
    const ThriftLimits& limits);
std::shared_ptr<apache::thrift::protocol::TProtocolFactory> bounded_binary_protocol_factory(
    const ThriftLimits& limits);

// A server's processor that tells `on_refused` (the peer's address, why) when a request breaks a
// limit or is not framed binary Thrift, then lets the server close that connection as before.
std::shared_ptr<apache::thrift::TProcessor> report_refused_requests(
    std::shared_ptr<apache::thrift::TProcessor> inner,
    std::function<void(const std::string& peer, const std::string& why)> on_refused);

// Starts server->serve() on a new thread and returns the thread once the server listens. When it
// cannot (bind or listen failed) the thread is joined and the server's exception is rethrown. A
// failure after it listened is logged naming `name` ("reward server 'x'").
std::thread serve_when_listening(std::shared_ptr<apache::thrift::server::TServer> server,
                                 const std::string& name);

// A call's token against a server's (every call of the rollout and reward services carries one):
// equal strings, in a time that does not depend on where they first differ.
bool same_token(const std::string& given, const std::string& expected);

// Sends Thrift's own diagnostics (printed to stderr by default) to the log at debug level: the
// clients' and servers' errors already say what failed. Every client and server calls it.
void route_thrift_output_to_log();

}  // namespace tandem
