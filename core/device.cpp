// Devices, streams and raw memory on CPU and (when compiled in) CUDA.
#include "core/device.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/format.h"

#if TANDEM_HAS_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace tandem {

std::string Device::str() const { return is_cpu() ? "cpu" : fmt::format("cuda:{}", index); }

bool cuda_compiled() { return TANDEM_HAS_CUDA != 0; }
bool nccl_compiled() { return TANDEM_HAS_NCCL != 0; }

int cuda_device_count() {
#if TANDEM_HAS_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" / "no device" state
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

std::string gpu_summary() {
#if TANDEM_HAS_CUDA
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("no GPU visible ({})", cudaGetErrorString(err));
  }
  if (n == 0) return "no GPU visible";
  std::string s;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    s += fmt::format("{}cuda:{} {} (sm_{}{}, {:.0f} GiB)", i ? ", " : "", i, p.name, p.major,
                     p.minor, static_cast<double>(p.totalGlobalMem) / (1ull << 30));
  }
  return s;
#else
  return "no GPU visible (built without CUDA)";
#endif
}

void Stream::synchronize() const {
#if TANDEM_HAS_CUDA
  if (device.is_cuda()) CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle)));
#endif
}

namespace {

// Host allocations from this size on are placed on 2 MiB boundaries and offered to the kernel as
// transparent huge pages: the weights (one arena) and other large buffers are streamed once per
// decode step, and with 4 KiB pages every 4 KiB read is a TLB miss (a page walk) beside it.
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHugeMinBytes = size_t{4} << 20;

}  // namespace

void* device_alloc(Device d, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (d.is_cpu()) {
    const bool huge = bytes >= kHugeMinBytes;
    const size_t align = huge ? kHugePage : 256;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    TANDEM_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
    // Advice only: where THP is off (or the call is refused) the pages stay 4 KiB.
    if (huge) (void)madvise(p, rounded, MADV_HUGEPAGE);
    return p;
  }
#if TANDEM_HAS_CUDA
  void* p = nullptr;
  CUDA_CHECK(cudaSetDevice(d.index));
  CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
#else
  TANDEM_FAIL("cannot allocate on {}: this build has no CUDA", d);
#endif
}

void device_free(Device d, void* p) {
  if (p == nullptr) return;
  if (d.is_cpu()) {
    std::free(p);
    return;
  }
#if TANDEM_HAS_CUDA
  (void)cudaFree(p);  // never throws from a destructor path
#endif
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (bytes == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
#else
  TANDEM_FAIL("cannot copy between {} and {}: this build has no CUDA", src_dev, dst_dev);
#endif
}

void fill_zero(void* dst, Device d, size_t bytes) {
  if (bytes == 0) return;
  if (d.is_cpu()) {
    std::memset(dst, 0, bytes);
    return;
  }
#if TANDEM_HAS_CUDA
  CUDA_CHECK(cudaMemset(dst, 0, bytes));
#else
  TANDEM_FAIL("cannot zero memory on {}: this build has no CUDA", d);
#endif
}

}  // namespace tandem
