// CUDA_CHECK, CUBLAS_CHECK and NCCL_CHECK: turn a failed CUDA-library status into tandem::Error.
// Free of fmt so that .cu files can include it.
#pragma once

#include <cuda_runtime.h>

namespace tandem::detail {
// Throws tandem::Error "<lib> error <code>: <text>" whose where() is
// "[check failed: <expr>] (file:line)".
[[noreturn]] void throw_status_error(const char* lib, int code, const char* text, const char* expr,
                                     const char* file, int line);
}  // namespace tandem::detail

#define TANDEM_STATUS_CHECK(lib, call, ok, text_of)                                                \
  do {                                                                                             \
    const auto tandem_st_ = (call);                                                                \
    if (tandem_st_ != (ok)) [[unlikely]]                                                           \
      ::tandem::detail::throw_status_error(lib, static_cast<int>(tandem_st_), text_of(tandem_st_), \
                                           #call, __FILE__, __LINE__);                             \
  } while (0)

#define CUDA_CHECK(call) TANDEM_STATUS_CHECK("CUDA", call, cudaSuccess, cudaGetErrorString)
// Checks the launch of the kernel just issued.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#if defined(TANDEM_HAS_CUBLAS) && TANDEM_HAS_CUBLAS
#include <cublasLt.h>
#define CUBLAS_CHECK(call) \
  TANDEM_STATUS_CHECK("cuBLAS", call, CUBLAS_STATUS_SUCCESS, cublasLtGetStatusString)
#endif

#if defined(TANDEM_HAS_NCCL) && TANDEM_HAS_NCCL
#include <nccl.h>
#define NCCL_CHECK(call) TANDEM_STATUS_CHECK("NCCL", call, ncclSuccess, ncclGetErrorString)
#endif
