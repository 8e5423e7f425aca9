// Weights over the wire, the sender's side: bucket plans, packing with casts, and the push calls.
#include "rollout/service/weight_push.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/crc32c.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "rollout/service/server.h"

namespace tandem::rollout {
namespace {

DType dtype_of(rpc::WeightDType::type t) {
  return t == rpc::WeightDType::BF16 ? DType::bf16 : DType::f32;
}

// The data of `pieces` of `w` in dtype `to` (f32 or bf16), to emit in order: straight from the
// weights where the dtypes agree, else cast a chunk at a time into `cast`.
void emit_pieces(const model::Weights& w, DType to, const std::vector<rpc::WeightPiece>& pieces,
                 std::vector<char>& cast, const std::function<void(const char*, size_t)>& emit) {
  const auto out_bytes = static_cast<int64_t>(dtype_size(to));
  for (const rpc::WeightPiece& p : pieces) {
    const Tensor& t = w.at(p.name);
    const auto in_bytes = static_cast<int64_t>(dtype_size(t.dtype()));
    const char* src = static_cast<const char*>(t.data()) + p.offset * in_bytes;
    if (t.dtype() == to) {
      emit(src, static_cast<size_t>(p.elements * in_bytes));
      continue;
    }
    TANDEM_CHECK((t.dtype() == DType::f32 && to == DType::bf16) ||
                     (t.dtype() == DType::bf16 && to == DType::f32),
                 "weight push: tensor '{}' is {}, the worker takes {}: push f32 or bf16 weights",
                 p.name, dtype_name(t.dtype()), dtype_name(to));
    const int64_t chunk = static_cast<int64_t>(cast.size()) / out_bytes;
    for (int64_t first = 0; first < p.elements; first += chunk) {
      const int64_t n = std::min(chunk, p.elements - first);
      ops::cast(Tensor::wrap(const_cast<char*>(src) + first * in_bytes, {n}, t.dtype()),
                Tensor::wrap(cast.data(), {n}, to));
      emit(cast.data(), static_cast<size_t>(n * out_bytes));
    }
  }
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
  // Each bucket is written from the weights straight into its call's frame (cast on the way where
  // the dtypes differ, a chunk at a time through a small buffer), then sent: the weights are read
  // only while no byte of it is on the wire, so that a source withdrawn waits for no network.
  // Two calls are in flight (two connections): the worker checksums and copies one bucket while
  // the next is packed and on the wire.
  const auto out_bytes = static_cast<int64_t>(dtype_size(to));
  std::atomic<size_t> next{0};
  std::atomic<int64_t> sent{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto send = [&] {
    std::vector<char> cast(64 << 10);
    try {
      for (size_t i = next++; i < plan.size(); i = next++) {
        int64_t bytes = 0;
        for (const rpc::WeightPiece& p : plan[i]) bytes += p.elements * out_bytes;
        client.push_weight_bucket(
            version, static_cast<int32_t>(i), ready.dtype, plan[i], bytes, [&](const auto& emit) {
              if (!source->read(
                      [&](const model::Weights& w) { emit_pieces(w, to, plan[i], cast, emit); }))
                throw withdrawn();
            });
        sent += bytes;
      }
    } catch (...) {
      next = plan.size();  // the other stream stops too
      std::lock_guard lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::thread second(send);
  send();
  second.join();
  if (failure) std::rethrow_exception(failure);
  r.bytes = sent;
  r.buckets = static_cast<int64_t>(plan.size());
  r.version = client.commit_weight_push(version, static_cast<int32_t>(plan.size()));
  r.sent = true;
  return r;
}

}  // namespace tandem::rollout
