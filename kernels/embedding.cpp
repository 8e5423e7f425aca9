// embedding and embedding_backward: checks, dispatch, and the error for an id out of range.
#include "kernels/cpu/embedding.h"
#include "core/error.h"
#include "kernels/check.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#if TANDEM_HAS_CUDA
#include "kernels/cuda/embedding.h"
#endif

namespace tandem::ops {

using namespace detail;

namespace {

[[noreturn]] void fail_bad_id(const char* op, const Tensor& ids, int64_t position, int64_t V) {
  int32_t id = 0;
  copy_bytes(&id, Device::cpu(), static_cast<const int32_t*>(ids.data()) + position, ids.device(),
             sizeof id);
  TANDEM_FAIL("{}: ids[{}] = {} is outside [0, {}): every token id must index a row of the table",
              op, position, id, V);
}

}  // namespace

void embedding(const Tensor& ids, const Tensor& table, const Tensor& out, const Stream& stream) {
  const OpTimer timer("embedding");
  constexpr const char* op = "embedding";
  check_dtype(op, "ids", ids, {DType::i32});
  check_ndim(op, "ids", ids, 1);
  check_dtype(op, "table", table, {DType::f32, DType::bf16});
  check_ndim(op, "table", table, 2);
  const int64_t T = ids.size(0), V = table.size(0), C = table.size(1);
  check_dtype(op, "out", out, {DType::f32});
  check_shape(op, "out", out, {T, C});
  check_device(op, ids.device(), {&ids, &table, &out});
  check_stream(op, ids.device(), stream);
  int64_t bad = -1;
#if TANDEM_HAS_CUDA
  if (ids.device().is_cuda()) {
    bad = cuda::embedding(ids.data_as<int32_t>(), table.data(), table.dtype(), out.data_as<float>(),
                          T, V, C, stream.handle);
  } else {
    bad = cpu::embedding(ids, table, out);
  }
#else
  TANDEM_ON_CUDA(ids.device(), embedding);
  bad = cpu::embedding(ids, table, out);
#endif
  if (bad >= 0) fail_bad_id(op, ids, bad, V);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable,
                        bool accumulate, const Stream& stream) {
  const OpTimer timer("embedding_backward");
  constexpr const char* op = "embedding_backward";
  check_dtype(op, "ids", ids, {DType::i32});
  check_ndim(op, "ids", ids, 1);
  check_dtype(op, "dtable", dtable, {DType::f32});
  check_ndim(op, "dtable", dtable, 2);
  const int64_t T = ids.size(0), V = dtable.size(0), C = dtable.size(1);
  check_dtype(op, "dout", dout, {DType::f32});
  check_shape(op, "dout", dout, {T, C});
  check_device(op, ids.device(), {&ids, &dout, &dtable});
  check_stream(op, ids.device(), stream);
  int64_t bad = -1;
#if TANDEM_HAS_CUDA
  if (ids.device().is_cuda()) {
    bad = cuda::embedding_backward(ids.data_as<int32_t>(), dout.data_as<float>(),
                                   dtable.data_as<float>(), T, V, C, accumulate, stream.handle);
  } else {
    // Checked before anything is written: dtable is left as it was on a bad id.
    bad = cpu::first_bad_id(ids, V);
    if (bad < 0) cpu::embedding_backward(ids, dout, dtable, accumulate);
  }
#else
  TANDEM_ON_CUDA(ids.device(), embedding_backward);
  bad = cpu::first_bad_id(ids, V);
  if (bad < 0) cpu::embedding_backward(ids, dout, dtable, accumulate);
#endif
  if (bad >= 0) fail_bad_id(op, ids, bad, V);
}

}  // namespace tandem::ops
