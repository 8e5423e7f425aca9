// The weight push's data channel: its wire format and its socket I/O with timeouts.
#include "rollout/service/weight_channel.h"

#include <cerrno>
#include <cstring>

#include "core/socket.h"

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

namespace {

std::string failure(const char* what) {
  return fmt::format("weight channel: {}: {}", what, net::io_failure(errno));
}

}  // namespace

void send_all(int fd, const void* data, size_t n, const char* what) {
  if (!net::send_all(fd, data, n)) throw ChannelError(failure(what));
}

bool recv_all_or_end(int fd, void* data, size_t n, const char* what) {
  size_t got = 0;
  if (net::recv_all(fd, data, n, &got)) return true;
  if (errno == 0 && got == 0) return false;
  throw ChannelError(failure(what));
}

void recv_all(int fd, void* data, size_t n, const char* what) {
  if (!recv_all_or_end(fd, data, n, what))
    throw ChannelError(fmt::format("weight channel: {}: {}", what, net::io_failure(0)));
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

}  // namespace tandem::rollout::channel
