// The publisher's f32 -> bf16 cast: the AVX512-BF16 path and the portable loop against
// core/half.h's rounding, bit for bit, and a one-rank publish large enough to take the parallel,
// streaming path against the kernels' cast.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"
#include "kernels/ops.h"
#include "tests/testutil.h"
#include "weight_sync/cast.h"
#include "weight_sync/layout.h"
#include "weight_sync/plan.h"
#include "weight_sync/transfer.h"

using namespace tandem;

namespace {

// Random bit patterns (every class of float: normal, subnormal, zero, infinity, NaN), with runs of
// the delicate values at random places.
std::vector<float> delicate_floats(size_t n, uint64_t seed) {
  const uint32_t special[] = {0x7fc00001u, 0x7f800001u, 0xffa00000u, 0x7f800000u, 0xff800000u,
                              0x80000000u, 0x00000000u, 0x7f7fffffu, 0xff7fffffu, 0x3f808000u,
                              0x3f818000u, 0xbf808000u, 0x00000001u, 0x80000001u, 0x007fffffu,
                              0x00400000u, 0x00018000u, 0x00008000u, 0x0000ffffu, 0x00800000u,
                              0x7fffffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x807fffffu};
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> bits(n);
  for (uint32_t& b : bits) {
    const uint64_t r = rng();
    switch (r % 4) {
      case 0:  // any pattern
        b = static_cast<uint32_t>(r >> 32);
        break;
      case 1:  // a subnormal or zero
        b = static_cast<uint32_t>(r >> 32) & 0x807fffffu;
        break;
      case 2:  // a special value
        b = special[(r >> 32) % std::size(special)];
        break;
      default:  // a tie or near-tie in bf16
        b = (static_cast<uint32_t>(r >> 32) & 0xffff0000u) | (0x7fffu + (r >> 8) % 3);
    }
  }
  // Long stretches of ordinary values too, so that the vector path's common branch runs.
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> out(n);
  std::memcpy(out.data(), bits.data(), n * sizeof(float));
  for (size_t i = n / 2; i < n; ++i) out[i] = u(rng);
  return out;
}

}  // namespace

TEST_CASE("f32 to bf16 cast of the publisher rounds every input as core half does on both paths",
          "[unit]") {
  const std::vector<float> in = delicate_floats(40000, 17);
  std::vector<uint16_t> expected(in.size());
  for (size_t i = 0; i < in.size(); ++i) expected[i] = f32_to_bf16_bits(in[i]);

  std::vector<uint16_t> portable(in.size());
  weight_sync::f32_to_bf16_portable(in.data(), portable.data(), static_cast<int64_t>(in.size()));
  CHECK(portable == expected);

  if (!weight_sync::has_avx512_bf16()) {
    WARN("this CPU has no AVX512-BF16: only the portable loop was checked");
    return;
  }
  // Every start and length modulo the vector's 32 elements and the streaming stores' 64 bytes,
  // with 0xabcd guard values around what each call writes.
  for (const bool stream : {false, true})
    for (int64_t first = 0; first < 40; ++first)
      for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{32}, int64_t{33},
                              int64_t{95}, int64_t{4099}, int64_t{39000} - first}) {
        std::vector<uint16_t> out(in.size() + 2, 0xabcd);
        weight_sync::f32_to_bf16_avx512_bf16(in.data() + first, out.data() + 1 + first, n, stream);
        CAPTURE(stream, first, n);
        CHECK(out[static_cast<size_t>(first)] == 0xabcd);
        CHECK(out[static_cast<size_t>(first + n + 1)] == 0xabcd);
        CHECK(std::equal(out.begin() + 1 + first, out.begin() + 1 + first + n,
                         expected.begin() + first));
      }
}

TEST_CASE("publisher on one rank casts a large parameter on two threads bitwise as the kernels do",
          "[unit]") {
  // 35 M + 17 elements: past the 64 MiB from which the cast streams, split mid-parameter.
  const int64_t n = (int64_t{35} << 20) + 17;
  const std::vector<float> small = delicate_floats(1 << 16, 5);
  Tensor master = Tensor::empty({n}, DType::f32), bias = Tensor::empty({33}, DType::f32);
  for (int64_t i = 0; i < n; ++i)
    master.data_as<float>()[i] = small[static_cast<size_t>((i * 40503) % (1 << 16))];
  for (int64_t i = 0; i < 33; ++i) bias.data_as<float>()[i] = small[static_cast<size_t>(i)];
  const std::vector<weight_sync::ParamSpec> specs = {{"big.weight", {n}, DType::f32},
                                                     {"big.bias", {33}, DType::f32}};
  Tensor engine = Tensor::zeros({n}, DType::bf16), engine_bias = Tensor::zeros({33}, DType::bf16);
  const weight_sync::Layout one = weight_sync::Layout::replicated(specs, 1);
  weight_sync::Publisher pub(weight_sync::ReshardPlan::make(one, one.with_dtype(DType::bf16)),
                             nullptr, {master, bias}, {engine, engine_bias});
  const weight_sync::SyncStats st = pub.publish(1);
  CHECK(st.bytes_copied == (n + 33) * 2);
  Tensor expected = Tensor::zeros({n}, DType::bf16),
         expected_bias = Tensor::zeros({33}, DType::bf16);
  ops::cast(master, expected);
  ops::cast(bias, expected_bias);
  CHECK(test::bitwise_equal(engine, expected));
  CHECK(test::bitwise_equal(engine_bias, expected_bias));
}
