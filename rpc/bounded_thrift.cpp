// Bounded Thrift: a framed transport that checks the frame header before allocating, a binary
// protocol that checks every size against its limit and the bytes left in the frame.
#include "rpc/bounded_thrift.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <thrift/Thrift.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/protocol/TProtocolException.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TTransportException.h>

#include <algorithm>
#include <future>
#include <mutex>
#include <new>

#include "core/error.h"

namespace tandem {
namespace {

namespace at = apache::thrift;
using at::protocol::TProtocolException;
using at::protocol::TType;
using at::transport::TTransport;
using at::transport::TTransportException;

class BoundedFramedTransport : public at::transport::TFramedTransport {
 public:
  BoundedFramedTransport(std::shared_ptr<TTransport> inner, const ThriftLimits& limits)
      : TFramedTransport(std::move(inner), thrift_configuration(limits)) {}

  // Bytes of the frame being read that are not read yet.
  int64_t frame_left() const { return rBound_ - rBase_; }

 protected:
  // The base class's, with the header checked first and a message of its own.
  bool readFrame() override {
    int32_t size = 0;
    uint32_t got = 0;
    while (got < sizeof size) {
      const uint32_t n =
          transport_->read(reinterpret_cast<uint8_t*>(&size) + got, sizeof size - got);
      if (n == 0) {
        if (got == 0) return false;  // closed between frames
        throw TTransportException(TTransportException::END_OF_FILE,
                                  "the peer closed the connection inside a frame header");
      }
      got += n;
    }
    size = static_cast<int32_t>(ntohl(static_cast<uint32_t>(size)));
    if (size < 0 || static_cast<uint32_t>(size) > maxFrameSize_)
      throw TTransportException(
          TTransportException::CORRUPTED_DATA,
          fmt::format("a frame of {} bytes, over the limit of {} (max_message_bytes)", size,
                      maxFrameSize_));
    if (static_cast<uint32_t>(size) > rBufSize_) {
      rBuf_.reset(new uint8_t[size]);
      rBufSize_ = static_cast<uint32_t>(size);
    }
    transport_->readAll(rBuf_.get(), static_cast<uint32_t>(size));
    setReadBuffer(rBuf_.get(), static_cast<uint32_t>(size));
    // Each frame is a message of its own: back to the configured maximum, then down to this
    // frame. Shrinking alone would refuse a frame bigger than the connection's previous one as
    // "MaxMessageSize reached" (END_OF_FILE: the connection closed without a word).
    resetConsumedMessageSize();
    resetConsumedMessageSize(size);
    return true;
  }
};

using BinaryProtocol = at::protocol::TBinaryProtocolT<TTransport>;

// Reads that would allocate by a size taken from the wire are checked first: the method name, a
// string or binary field, a list, set or map (also when skipped as an unknown field).
class BoundedBinaryProtocol : public BinaryProtocol {
 public:
  BoundedBinaryProtocol(std::shared_ptr<TTransport> transport, const ThriftLimits& limits)
      : BinaryProtocol(transport, limits.max_string_bytes, limits.max_container_elements,
                       /*strict_read=*/true, /*strict_write=*/true),
        frame_(dynamic_cast<BoundedFramedTransport*>(transport.get())),
        max_message_bytes_(limits.max_message_bytes) {}

  uint32_t readMessageBegin_virt(std::string& name, at::protocol::TMessageType& type,
                                 int32_t& seqid) override {
    int32_t version = 0;
    uint32_t n = readI32(version);
    if ((version & VERSION_MASK) != VERSION_1)
      throw TProtocolException(TProtocolException::BAD_VERSION,
                               fmt::format("not a strict binary Thrift message (header {:#010x})",
                                           static_cast<uint32_t>(version)));
    type = static_cast<at::protocol::TMessageType>(version & 0xff);
    n += readString_virt(name);
    return n + readI32(seqid);
  }

  uint32_t readString_virt(std::string& str) override {
    int32_t size = 0;
    const uint32_t n = readI32(size);
    check_size("a string", size, 1, string_limit_);
    return n + readStringBody(str, size);
  }
  uint32_t readBinary_virt(std::string& str) override { return readString_virt(str); }

  uint32_t readListBegin_virt(TType& element, uint32_t& size) override {
    return read_container_header("a list", element, size);
  }
  uint32_t readSetBegin_virt(TType& element, uint32_t& size) override {
    return read_container_header("a set", element, size);
  }
  uint32_t readMapBegin_virt(TType& key, TType& value, uint32_t& size) override {
    int8_t k = 0, v = 0;
    int32_t count = 0;
    uint32_t n = readByte(k);
    n += readByte(v);
    n += readI32(count);
    key = static_cast<TType>(k);
    value = static_cast<TType>(v);
    check_size("a map", count, min_wire_bytes(key) + min_wire_bytes(value), container_limit_);
    size = static_cast<uint32_t>(count);
    return n;
  }

 private:
  uint32_t read_container_header(const char* what, TType& element, uint32_t& size) {
    int8_t e = 0;
    int32_t count = 0;
    uint32_t n = readByte(e);
    n += readI32(count);
    element = static_cast<TType>(e);
    check_size(what, count, min_wire_bytes(element), container_limit_);
    size = static_cast<uint32_t>(count);
    return n;
  }

  // The fewest bytes an element of this type takes on the wire (an empty struct: its stop byte).
  static int64_t min_wire_bytes(TType type) {
    switch (type) {
      case at::protocol::T_BOOL:
      case at::protocol::T_BYTE:
      case at::protocol::T_STRUCT:
        return 1;
      case at::protocol::T_I16:
        return 2;
      case at::protocol::T_I32:
      case at::protocol::T_STRING:
        return 4;
      case at::protocol::T_I64:
      case at::protocol::T_DOUBLE:
        return 8;
      case at::protocol::T_LIST:
      case at::protocol::T_SET:
        return 5;
      case at::protocol::T_MAP:
        return 6;
      default:
        throw TProtocolException(TProtocolException::INVALID_DATA,
                                 fmt::format("unknown element type {}", static_cast<int>(type)));
    }
  }

  void check_size(const char* what, int32_t count, int64_t bytes_each, int32_t limit) const {
    if (count < 0)
      throw TProtocolException(TProtocolException::NEGATIVE_SIZE,
                               fmt::format("{} of negative size {}", what, count));
    if (count > limit)
      throw TProtocolException(TProtocolException::SIZE_LIMIT,
                               fmt::format("{} of {}, over the limit of {}", what, count, limit));
    const int64_t left = frame_ != nullptr ? frame_->frame_left() : max_message_bytes_;
    if (count * bytes_each > left)
      throw TProtocolException(
          TProtocolException::SIZE_LIMIT,
          fmt::format("{} of {} needs {} bytes or more, {} left in the message", what, count,
                      count * bytes_each, left));
  }

  BoundedFramedTransport* frame_;  // nullptr over another transport
  int64_t max_message_bytes_;
};

class BoundedFramedTransportFactory : public at::transport::TTransportFactory {
 public:
  explicit BoundedFramedTransportFactory(const ThriftLimits& limits) : limits_(limits) {}
  std::shared_ptr<TTransport> getTransport(std::shared_ptr<TTransport> inner) override {
    return bounded_framed_transport(std::move(inner), limits_);
  }

 private:
  ThriftLimits limits_;
};

class BoundedBinaryProtocolFactory : public at::protocol::TProtocolFactory {
 public:
  explicit BoundedBinaryProtocolFactory(const ThriftLimits& limits) : limits_(limits) {}
  std::shared_ptr<at::protocol::TProtocol> getProtocol(
      std::shared_ptr<TTransport> transport) override {
    return bounded_binary_protocol(std::move(transport), limits_);
  }

 private:
  ThriftLimits limits_;
};

class ReportingProcessor : public at::TProcessor {
 public:
  ReportingProcessor(std::shared_ptr<at::TProcessor> inner,
                     std::function<void(const std::string&, const std::string&)> on_refused)
      : inner_(std::move(inner)), on_refused_(std::move(on_refused)) {}

  bool process(std::shared_ptr<at::protocol::TProtocol> in,
               std::shared_ptr<at::protocol::TProtocol> out, void* context) override {
    try {
      return inner_->process(in, out, context);
    } catch (const TProtocolException& e) {
      report(*in, e.what());
      throw;
    } catch (const TTransportException& e) {
      if (e.getType() == TTransportException::CORRUPTED_DATA) report(*in, e.what());
      throw;
    } catch (const std::bad_alloc&) {  // a limit too generous for this machine
      report(*in, "out of memory while reading the request");
      throw TTransportException(TTransportException::CORRUPTED_DATA, "out of memory");
    }
  }

 private:
  void report(at::protocol::TProtocol& in, const std::string& why) {
    std::string peer = "?";
    try {
      peer = in.getTransport()->getOrigin();
    } catch (...) {  // a closed socket has no address to name
    }
    on_refused_(peer, why);
  }

  std::shared_ptr<at::TProcessor> inner_;
  std::function<void(const std::string&, const std::string&)> on_refused_;
};

}  // namespace

void check_thrift_limits(const ThriftLimits& l, const std::string& what) {
  TANDEM_CHECK(l.max_message_bytes >= 1024 && l.max_string_bytes >= 1 &&
                   l.max_container_elements >= 1 && l.max_depth >= 4 && l.max_depth <= 1024,
               "{}: a Thrift limit is out of range (max_message_bytes {} >= 1024, "
               "max_string_bytes {} >= 1, max_container_elements {} >= 1, max_depth {} in "
               "4..1024)",
               what, l.max_message_bytes, l.max_string_bytes, l.max_container_elements,
               l.max_depth);
}

std::shared_ptr<at::TConfiguration> thrift_configuration(const ThriftLimits& limits) {
  return std::make_shared<at::TConfiguration>(limits.max_message_bytes, limits.max_message_bytes,
                                              limits.max_depth);
}

std::shared_ptr<TTransport> bounded_framed_transport(std::shared_ptr<TTransport> inner,
                                                     const ThriftLimits& limits) {
  return std::make_shared<BoundedFramedTransport>(std::move(inner), limits);
}

std::shared_ptr<at::protocol::TProtocol> bounded_binary_protocol(
    std::shared_ptr<TTransport> transport, const ThriftLimits& limits) {
  return std::make_shared<BoundedBinaryProtocol>(std::move(transport), limits);
}

BoundedClientSocket open_bounded_client(const std::string& host, int port, int connect_timeout_ms,
                                        int io_timeout_ms, const ThriftLimits& limits) {
  BoundedClientSocket c;
  c.socket = std::make_shared<at::transport::TSocket>(host, port);
  c.socket->setConnTimeout(connect_timeout_ms);
  c.socket->setSendTimeout(io_timeout_ms);
  c.socket->setRecvTimeout(io_timeout_ms);
  c.socket->setNoDelay(true);
  c.transport = bounded_framed_transport(c.socket, limits);
  c.protocol = bounded_binary_protocol(c.transport, limits);
  c.transport->open();
  return c;
}

std::shared_ptr<at::transport::TTransportFactory> bounded_framed_transport_factory(
    const ThriftLimits& limits) {
  return std::make_shared<BoundedFramedTransportFactory>(limits);
}

std::shared_ptr<at::protocol::TProtocolFactory> bounded_binary_protocol_factory(
    const ThriftLimits& limits) {
  return std::make_shared<BoundedBinaryProtocolFactory>(limits);
}

std::shared_ptr<at::TProcessor> report_refused_requests(
    std::shared_ptr<at::TProcessor> inner,
    std::function<void(const std::string& peer, const std::string& why)> on_refused) {
  return std::make_shared<ReportingProcessor>(std::move(inner), std::move(on_refused));
}

namespace {

class ReadySignal : public at::server::TServerEventHandler {
 public:
  explicit ReadySignal(std::shared_ptr<std::promise<void>> ready) : ready_(std::move(ready)) {}
  void preServe() override { ready_->set_value(); }

 private:
  std::shared_ptr<std::promise<void>> ready_;
};

}  // namespace

std::thread serve_when_listening(std::shared_ptr<at::server::TServer> server,
                                 const std::string& name) {
  auto ready = std::make_shared<std::promise<void>>();
  std::future<void> listening = ready->get_future();
  server->setServerEventHandler(std::make_shared<ReadySignal>(ready));
  std::thread thread([server, ready, name] {
    try {
      server->serve();
    } catch (...) {  // bind or listen failed: before preServe, so the promise is still unset
      try {
        ready->set_exception(std::current_exception());
      } catch (const std::future_error&) {  // failed after it listened: nobody is waiting
        spdlog::error("{}: stopped serving", name);
      }
    }
  });
  try {
    listening.get();
  } catch (...) {
    thread.join();
    throw;
  }
  return thread;
}

void route_thrift_output_to_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    at::GlobalOutput.setOutputFunction([](const char* msg) { spdlog::debug("thrift: {}", msg); });
  });
}

bool same_token(const std::string& given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < std::min(given.size(), expected.size()); ++i)
    diff |= static_cast<unsigned char>(given[i] ^ expected[i]);
  return diff == 0;
}

}  // namespace tandem
