// Weights over the wire, the sender's side: bucket plans, packing with casts, and the push calls.
#include "rollout/service/weight_push.h"

#include <algorithm>
#include <cstring>
#include <future>
#include <string>

#include <fmt/format.h>

#include "core/crc32c.h"
#include "core/error.h"
#include "core/half.h"
#include "rollout/service/server.h"

namespace tandem::rollout {
namespace {

DType dtype_of(rpc::WeightDType::type t) {
  return t == rpc::WeightDType::BF16 ? DType::bf16 : DType::f32;
}

// The bucket's pieces of `w` into bucket.data, in `to` (f32 or bf16), and its CRC-32C.
void pack(const model::Weights& w, DType to, std::vector<rpc::WeightPiece> pieces,
          rpc::WeightBucket& bucket) {
  const auto out_bytes = static_cast<int64_t>(dtype_size(to));
  int64_t elements = 0;
  for (const rpc::WeightPiece& p : pieces) elements += p.elements;
  bucket.data.resize(static_cast<size_t>(elements * out_bytes));
  char* dst = bucket.data.data();
  for (const rpc::WeightPiece& p : pieces) {
    const Tensor& t = w.at(p.name);
    const auto in_bytes = static_cast<int64_t>(dtype_size(t.dtype()));
    const char* src = static_cast<const char*>(t.data()) + p.offset * in_bytes;
    if (t.dtype() == to) {
      std::memcpy(dst, src, static_cast<size_t>(p.elements * in_bytes));
    } else if (t.dtype() == DType::f32 && to == DType::bf16) {
      const auto* f = reinterpret_cast<const float*>(src);
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < p.elements; ++i) d[i] = f32_to_bf16_bits(f[i]);
    } else if (t.dtype() == DType::bf16 && to == DType::f32) {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
      auto* d = reinterpret_cast<float*>(dst);
      for (int64_t i = 0; i < p.elements; ++i) d[i] = bf16_bits_to_f32(h[i]);
    } else {
      TANDEM_FAIL("weight push: tensor '{}' is {}, the worker takes {}: push f32 or bf16 weights",
                  p.name, dtype_name(t.dtype()), dtype_name(to));
    }
    dst += p.elements * out_bytes;
  }
  bucket.pieces = std::move(pieces);
  bucket.dtype = to == DType::bf16 ? rpc::WeightDType::BF16 : rpc::WeightDType::F32;
  bucket.crc32c = static_cast<int32_t>(crc32c(bucket.data));
}

}  // namespace

std::vector<std::vector<rpc::WeightPiece>> plan_weight_buckets(const model::Weights& w,
                                                               int64_t element_bytes,
                                                               int64_t max_bucket_bytes) {
  std::vector<std::vector<rpc::WeightPiece>> buckets(1);
  int64_t used = 0;
  for (const model::NamedTensor& t : w.named()) {
    const int64_t piece_bytes = static_cast<int64_t>(t.name.size()) + kWeightPieceBytes;
    TANDEM_CHECK(piece_bytes + element_bytes <= max_bucket_bytes,
                 "weight push: a bucket of {} bytes cannot hold a piece of '{}'; raise the bound",
                 max_bucket_bytes, t.name);
    for (int64_t offset = 0, numel = t.tensor.numel(); offset < numel;) {
      if (used + piece_bytes + element_bytes > max_bucket_bytes) {
        buckets.emplace_back();
        used = 0;
      }
      const int64_t fit = (max_bucket_bytes - used - piece_bytes) / element_bytes;
      rpc::WeightPiece p;
      p.name = t.name;
      p.offset = offset;
      p.elements = std::min(fit, numel - offset);
      buckets.back().push_back(p);
      used += piece_bytes + p.elements * element_bytes;
      offset += p.elements;
    }
  }
  return buckets;
}

bool WeightSource::read(const std::function<void(const model::Weights&)>& fn) {
  std::lock_guard lock(mutex_);
  if (weights_ == nullptr) return false;
  fn(*weights_);
  return true;
}

void WeightSource::withdraw() {
  std::lock_guard lock(mutex_);
  weights_ = nullptr;
}

WeightPushResult push_weights(RolloutClient& client, const model::Weights& w, int64_t version,
                              int64_t max_bucket_bytes) {
  return push_weights(client, std::make_shared<WeightSource>(w), version, max_bucket_bytes);
}

WeightPushResult push_weights(RolloutClient& client, const std::shared_ptr<WeightSource>& source,
                              int64_t version, int64_t max_bucket_bytes) {
  WeightPushResult r;
  r.version = client.weight_version();
  if (r.version >= version) return r;
  const rpc::WeightPushReady ready = client.begin_weight_push(version);
  const DType to = dtype_of(ready.dtype);
  const int64_t bound = std::min(max_bucket_bytes, ready.max_bucket_bytes);
  auto withdrawn = [&] {
    return Error(fmt::format("weight push of v{} to {}: given up, its weights withdrawn", version,
                             client.options().address));
  };
  std::vector<std::vector<rpc::WeightPiece>> plan;
  if (!source->read([&](const model::Weights& w) {
        plan = plan_weight_buckets(w, static_cast<int64_t>(dtype_size(to)), bound);
      }))
    throw withdrawn();
  // Two buckets in turn: the next one packed while this one is on the wire.
  rpc::WeightBucket buckets[2];
  auto pack_bucket = [&](size_t i) {
    rpc::WeightBucket& b = buckets[i % 2];
    if (!source->read([&](const model::Weights& w) { pack(w, to, std::move(plan[i]), b); }))
      throw withdrawn();
    b.version = version;
    b.index = static_cast<int32_t>(i);
  };
  pack_bucket(0);
  for (size_t i = 0; i < plan.size(); ++i) {
    std::future<void> next;
    if (i + 1 < plan.size()) next = std::async(std::launch::async, pack_bucket, i + 1);
    try {
      client.push_weight_bucket(buckets[i % 2]);
    } catch (...) {
      if (next.valid()) next.wait();
      throw;
    }
    r.bytes += static_cast<int64_t>(buckets[i % 2].data.size());
    if (next.valid()) next.get();
  }
  if (!source->read([](const model::Weights&) {})) throw withdrawn();
  r.buckets = static_cast<int64_t>(plan.size());
  r.version = client.commit_weight_push(version, static_cast<int32_t>(plan.size()));
  r.sent = true;
  return r;
}

}  // namespace tandem::rollout
