// The memory a device has for new allocations: /proc/meminfo's MemAvailable, cudaMemGetInfo.
#include "core/memory_available.h"

#include <fstream>
#include <string>

#if TANDEM_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace tandem {

double memory_available(Device d) {
  if (d.is_cpu()) {
    std::ifstream in("/proc/meminfo");
    std::string line;
    while (std::getline(in, line))
      if (line.starts_with("MemAvailable:")) return std::stod(line.substr(13)) * 1024;  // kB
    return 0;
  }
#if TANDEM_HAS_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(d.index) != cudaSuccess ||
      cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return static_cast<double>(free_bytes);
#else
  return 0;
#endif
}

}  // namespace tandem
