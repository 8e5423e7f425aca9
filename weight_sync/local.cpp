#include "weight_sync/local.h"

#include <chrono>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::weight_sync {

LocalPublisher::LocalPublisher(std::span<const Param> src, std::span<const Param> dst)
    : src_(src), dst_(dst) {
  TANDEM_CHECK(src.size() == dst.size(),
               "weight_sync: the trainer has {} parameter tensors and the engine {}", src.size(),
               dst.size());
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor& s = src[i].tensor;
    const Tensor& d = dst[i].tensor;
    TANDEM_CHECK(src[i].name == dst[i].name,
                 "weight_sync: parameter {} is '{}' on the trainer and '{}' on the engine", i,
                 src[i].name, dst[i].name);
    TANDEM_CHECK(s.shape() == d.shape(),
                 "weight_sync: {} is {} on the trainer and {} on the engine", src[i].name,
                 s.shape(), d.shape());
    Transfer t = Transfer::shared;
    if (s.data() != d.data() || s.device() != d.device() || s.dtype() != d.dtype()) {
      t = s.dtype() == d.dtype() ? Transfer::copy : Transfer::cast;
      TANDEM_CHECK(t == Transfer::copy || s.device() == d.device(),
                   "weight_sync: {} changes dtype ({} to {}) and device ({} to {}) at once: the "
                   "single-rank path casts on one device",
                   src[i].name, s.dtype(), d.dtype(), s.device().str(), d.device().str());
      ++moved_;
    }
    transfers_.push_back(t);
  }
}

PublishStats LocalPublisher::publish(uint64_t version, const Stream& stream) const {
  const auto t0 = std::chrono::steady_clock::now();
  PublishStats st;
  st.version = version;
  for (size_t i = 0; i < transfers_.size(); ++i) {
    const Tensor& s = src_[i].tensor;
    Tensor d = dst_[i].tensor;  // a handle on the engine's storage
    switch (transfers_[i]) {
      case Transfer::shared:
        ++st.shared;
        continue;
      case Transfer::copy:
        d.copy_from(s);
        ++st.copied;
        break;
      case Transfer::cast:
        ops::cast(s, d, stream);
        ++st.cast;
        break;
    }
    st.bytes_written += static_cast<int64_t>(d.nbytes());
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace tandem::weight_sync
