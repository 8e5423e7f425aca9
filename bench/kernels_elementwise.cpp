// Kernel benchmarks of cast and sum_squares (bandwidth-bound).
#include "bench/bench.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::bench {

TANDEM_KERNEL_BENCH(elementwise) {
  const Device d = runner.device();
  // A SmolLM2-135M parameter set's worth of elements.
  const int64_t n = runner.options().quick ? (int64_t{1} << 22) : 134'515'008;
  Tensor f32 = Tensor::zeros({n}, DType::f32, d);
  Tensor half = Tensor::zeros({n}, DType::bf16, d);
  Tensor out = Tensor::zeros({1}, DType::f32, d);
  const double nd = static_cast<double>(n);
  runner.measure("cast", fmt::format("f32 to bf16 ({})", n), 0, nd * 6,
                 [&] { ops::cast(f32, half); });
  runner.measure("sum_squares", fmt::format("f32 ({})", n), 0, nd * 4,
                 [&] { ops::sum_squares(f32, out); });
}

}  // namespace tandem::bench
