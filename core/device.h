// Devices, streams and raw device memory: the only place that talks to the CUDA runtime for them.
// Free of fmt, like every header CUDA files include (nvcc cannot compile fmt's checks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tandem {

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static constexpr Device cpu() { return {DeviceKind::cpu, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceKind::cuda, i}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// Whether this build has CUDA (and NCCL) compiled in.
bool cuda_compiled();
bool nccl_compiled();
// Number of visible CUDA devices; 0 when CUDA is not compiled in, no driver or no GPU. Never
// throws.
int cuda_device_count();
// "NVIDIA H200 (sm_90, 139 GiB)" for each visible GPU, or why none is visible.
std::string gpu_summary();

// A queue of work on a device. On CPU, work runs at once on the calling thread (and its pool).
struct Stream {
  Device device = Device::cpu();
  void* handle = nullptr;  // cudaStream_t; nullptr is the device's default stream

  void synchronize() const;
};

// Raw allocation on a device, 256-byte aligned. Not for hot paths: arenas own memory there.
void* device_alloc(Device d, size_t bytes);
void device_free(Device d, void* p);
// Synchronous copy between any two devices.
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
void fill_zero(void* dst, Device d, size_t bytes);

}  // namespace tandem
