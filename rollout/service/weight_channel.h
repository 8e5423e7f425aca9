// The weight push's data channel: a plain TCP connection from a trainer to a worker's
// WeightReceiver that carries a push's buckets (header, pieces, data, XXH3-64) outside Thrift, so
// that each side copies a bucket's bytes once (docs/serve.md, "Weights over the wire"); its wire
// format and its socket I/O (core/socket.h), every wait bounded by a timeout.
#pragma once

#include <bit>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tandem::rollout::channel {

static_assert(std::endian::native == std::endian::little, "the data channel is little-endian");

// A connection begins with the hello (client -> worker), answered once:
//   "TNDMPSH2", u32 token bytes, token, i64 version of the push (begun by begin_weight_push)
// then carries buckets back to back, each answered in order:
//   u32 kBucketMagic, i32 index, i32 dtype (rpc::WeightDType), u32 pieces, i64 data bytes,
//   per piece: u32 name bytes, name, i64 offset, i64 elements,
//   the data (the pieces' elements one after another), u64 XXH3-64 (seed 0) of the data.
// An answer (worker -> client): i32 code (kTaken, an rpc::WeightPushFault, kUnauthorized or
// kMalformed), i64 the worker's version, u32 bytes + message, u32 bytes + tensor.
// After a malformed frame, or any answer to the hello but kTaken, the worker closes the
// connection; after a refused bucket it reads the next one.
constexpr std::string_view kHello = "TNDMPSH2";
constexpr uint32_t kBucketMagic = 0x32424b54;  // "TKB2"
constexpr int32_t kTaken = 0;
constexpr int32_t kUnauthorized = 100;
constexpr int32_t kMalformed = 101;
constexpr uint32_t kMaxTokenBytes = 4096;
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint32_t kMaxMessageBytes = 1 << 16;
constexpr size_t kBucketHeaderBytes = 24;

struct BucketHeader {
  uint32_t magic = kBucketMagic;
  int32_t index = 0;
  int32_t dtype = 0;
  uint32_t pieces = 0;
  int64_t data_bytes = 0;
};

struct Answer {
  int32_t code = kTaken;
  int64_t worker_version = 0;
  std::string message;
  std::string tensor;
};

// A failure of the connection itself (closed, reset, timed out); what() says which.
class ChannelError : public Error {
 public:
  using Error::Error;
};

// Little-endian fields appended to a buffer, and read back from one.
void put_u32(std::string& out, uint32_t v);
void put_i64(std::string& out, int64_t v);
uint32_t get_u32(const char* p);
int64_t get_i64(const char* p);

std::string encode(const BucketHeader& h);
BucketHeader decode_bucket_header(const char* p);  // kBucketHeaderBytes
std::string encode(const Answer& a);

// The socket I/O of both sides (core/socket.h) with a ChannelError naming `what` (the peer
// closed, a reset, the timeout of net::set_io_timeouts).
void send_all(int fd, const void* data, size_t n, const char* what);
void recv_all(int fd, void* data, size_t n, const char* what);
// As recv_all, but false where the peer closed the connection before the first byte.
bool recv_all_or_end(int fd, void* data, size_t n, const char* what);
// An answer; a message or tensor name over kMaxMessageBytes is a ChannelError.
Answer read_answer(int fd);

}  // namespace tandem::rollout::channel
