// Argument checks shared by the ops: every failure names the op, the argument and the shapes.
#pragma once

#include <initializer_list>

#include "core/error.h"
#include "core/tensor.h"

namespace tandem::ops {
struct SamplingTensors;
}

namespace tandem::ops::detail {

inline void check_defined(const char* op, const char* name, const Tensor& t) {
  TANDEM_CHECK(t.defined() && t.data() != nullptr, "{}: {} is not given", op, name);
}

inline void check_shape(const char* op, const char* name, const Tensor& t, const Shape& want) {
  check_defined(op, name, t);
  TANDEM_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", op, name, t.shape().str(),
               want.str());
}

inline void check_ndim(const char* op, const char* name, const Tensor& t, int ndim) {
  check_defined(op, name, t);
  TANDEM_CHECK(t.ndim() == ndim, "{}: {} has shape {}, expected {} dimensions", op, name,
               t.shape().str(), ndim);
}

inline void check_dtype(const char* op, const char* name, const Tensor& t,
                        std::initializer_list<DType> allowed) {
  check_defined(op, name, t);
  for (DType d : allowed)
    if (t.dtype() == d) return;
  std::string names;
  for (DType d : allowed) names += fmt::format("{}{}", names.empty() ? "" : " or ", d);
  TANDEM_FAIL("{}: {} {} has dtype {}, expected {}", op, name, t.shape().str(), t.dtype(), names);
}

// t has the dtype and the shape.
inline void check_tensor(const char* op, const char* name, const Tensor& t, DType dtype,
                         const Shape& shape) {
  check_dtype(op, name, t, {dtype});
  check_shape(op, name, t, shape);
}
inline void check_f32(const char* op, const char* name, const Tensor& t, const Shape& shape) {
  check_tensor(op, name, t, DType::f32, shape);
}

// logits (rows, V) f32 with V > 0; returns {rows, V}.
struct LogitsShape {
  int64_t rows, V;
};
inline LogitsShape check_logits(const char* op, const Tensor& logits) {
  check_dtype(op, "logits", logits, {DType::f32});
  check_ndim(op, "logits", logits, 2);
  TANDEM_CHECK(logits.size(1) > 0, "{}: logits {} has an empty vocabulary", op,
               logits.shape().str());
  return {logits.size(0), logits.size(1)};
}

// Every defined tensor on `device`.
inline void check_device(const char* op, Device device, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    TANDEM_CHECK(t->device() == device, "{}: tensor {} is on {}, the others on {}", op, t->str(),
                 t->device(), device);
  }
}

inline void check_stream(const char* op, Device device, const Stream& stream) {
  TANDEM_CHECK(device.is_cpu() || stream.device.is_cpu() || stream.device == device,
               "{}: stream is on {}, tensors on {}", op, stream.device, device);
}

// check_device and check_stream: the tensors and the stream where the op runs.
inline void check_placement(const char* op, Device device, std::initializer_list<const Tensor*> ts,
                            const Stream& stream) {
  check_device(op, device, ts);
  check_stream(op, device, stream);
}

// The settings of sample and of the shard ops: (B) each, in their dtypes (kernels/sample.cpp).
void check_sampling_tensors(const char* op, const SamplingTensors& settings, int64_t B);

}  // namespace tandem::ops::detail

// TANDEM_ON_CUDA(device, op, args...): on a CUDA device, calls cuda::op(args...) and returns
// from the calling op; CUDA implementations take raw pointers, sizes and the native stream
// (Stream::handle), never a Tensor, so .cu files stay free of fmt.
#if TANDEM_HAS_CUDA
#define TANDEM_ON_CUDA(dev, op, ...) \
  if ((dev).is_cuda()) {             \
    cuda::op(__VA_ARGS__);           \
    return;                          \
  }
#else
#define TANDEM_ON_CUDA(dev, op, ...)                                  \
  if ((dev).is_cuda()) {                                              \
    [](const auto&...) {}(__VA_ARGS__); /* arguments count as used */ \
    TANDEM_FAIL("{}: this build has no CUDA", #op);                   \
  }
#endif
