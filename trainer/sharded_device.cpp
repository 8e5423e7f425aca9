// ShardDevice: nothing to order on the CPU; CUDA events on the default stream and a non-blocking
// side stream on CUDA.
#include "trainer/sharded_device.h"

#include <cstring>

#include "core/error.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "core/cuda_check.h"
#endif

namespace tandem::trainer {

ShardDevice::ShardDevice(Device device) : device_(device) {
  if (device_.is_cpu()) return;
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaSetDevice(device_.index));
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  side_ = s;
#else
  TANDEM_FAIL("sharded optimizer on {}: this build has no CUDA", device_.str());
#endif
}

ShardDevice::~ShardDevice() {
#if TANDEM_HAS_CUDA
  if (side_ != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(side_));
#endif
}

ShardDevice::Mark ShardDevice::mark() {
  if (device_.is_cpu()) return nullptr;
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaSetDevice(device_.index));
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  Mark m(e, [](void* p) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
  CUDA_CHECK(cudaEventRecord(e, nullptr));  // the legacy default stream: the compute's
  ++marks_;
  return m;
#else
  return nullptr;
#endif
}

void ShardDevice::wait(const Mark& m) {
  if (!m) return;
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(m.get())));
#endif
}

bool ShardDevice::done(const Mark& m) {
  if (!m) return true;
#if TANDEM_HAS_CUDA
  const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(m.get()));
  if (q == cudaErrorNotReady) return false;
  CUDA_CHECK(q);
#endif
  return true;
}

void ShardDevice::copy(void* dst, const void* src, int64_t bytes) const {
  if (bytes <= 0) return;
  if (device_.is_cpu()) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaSetDevice(device_.index));  // the calling thread's device may be another
  const auto s = static_cast<cudaStream_t>(side_);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
#endif
}

void ShardDevice::zero(void* dst, int64_t bytes) const {
  if (bytes <= 0) return;
  if (device_.is_cpu()) {
    std::memset(dst, 0, static_cast<size_t>(bytes));
    return;
  }
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaSetDevice(device_.index));
  const auto s = static_cast<cudaStream_t>(side_);
  CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<size_t>(bytes), s));
  CUDA_CHECK(cudaStreamSynchronize(s));
#endif
}

void ShardDevice::add(const Tensor& x, const Tensor& out) const {
  if (device_.is_cpu()) {
    // A plain loop on this thread: the communication thread stays off the compute's pool.
    const float* a = x.data_as<float>();
    float* p = out.data_as<float>();
    for (int64_t i = 0; i < out.numel(); ++i) p[i] += a[i];
    return;
  }
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaSetDevice(device_.index));
#endif
  const Stream side{device_, side_};
  ops::add(x, out, side);
  side.synchronize();
}

}  // namespace tandem::trainer
