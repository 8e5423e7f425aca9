// rope and rope_backward: against f64 references, Llama-3 scaling against the Hugging Face
// formula, the inverse, finite differences, in-place use, batch invariance, bad arguments, and
// their parity cases.
#include <catch2/catch.hpp>

#include <cmath>
#include <numbers>

#include "kernels/cpu/rope.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

Tensor f32(const Shape& s) { return Tensor::empty(s, DType::f32); }

// Hugging Face's inverse frequencies (the default rope, and _compute_llama3_parameters written
// as the Python does it: masks over the whole vector), in double.
std::vector<double> hf_inv_freq(int64_t D, const ops::RopeParams& p) {
  std::vector<double> inv;
  for (int64_t i = 0; i < D; i += 2)
    inv.push_back(1.0 / std::pow(double{p.theta}, static_cast<double>(i) / static_cast<double>(D)));
  if (p.factor == 0.0f) return inv;
  const double factor = p.factor, low = p.low_freq_factor, high = p.high_freq_factor;
  const double old_context_len = static_cast<double>(p.original_max_position);
  const double low_freq_wavelen = old_context_len / low;
  const double high_freq_wavelen = old_context_len / high;
  std::vector<double> out(inv.size());
  for (size_t i = 0; i < inv.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / inv[i];
    const double inv_freq_llama = wavelen > low_freq_wavelen ? inv[i] / factor : inv[i];
    const double smooth_factor = (old_context_len / wavelen - low) / (high - low);
    const double smoothed =
        (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
    const bool is_medium_freq = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    out[i] = is_medium_freq ? smoothed : inv_freq_llama;
  }
  return out;
}

// x (T, N, D) rotated by pos * inv_freq: in f64 throughout (truth), or as a plain f32 loop with
// the frequencies rounded to float and the angle computed in f32 (the same-precision yardstick).
template <class R>
std::vector<double> rope_reference(const Tensor& x, const Tensor& positions,
                                   const std::vector<double>& inv_freq, bool inverse) {
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2), half = D / 2;
  const std::vector<double> xv = to_f64(x);
  const int32_t* pos = positions.data_as<int32_t>();
  std::vector<double> out(xv.size());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const R angle = static_cast<R>(pos[t]) * static_cast<R>(inv_freq[static_cast<size_t>(i)]);
      const R c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
      for (int64_t n = 0; n < N; ++n) {
        const size_t a = static_cast<size_t>((t * N + n) * D + i),
                     b = a + static_cast<size_t>(half);
        const R x1 = static_cast<R>(xv[a]), x2 = static_cast<R>(xv[b]);
        out[a] = x1 * c - x2 * s;
        out[b] = x2 * c + x1 * s;
      }
    }
  }
  return out;
}

ops::RopeParams llama3_params() {
  ops::RopeParams p;
  p.theta = 500000.0f;
  p.factor = 8.0f;
  p.low_freq_factor = 1.0f;
  p.high_freq_factor = 4.0f;
  p.original_max_position = 8192;
  return p;
}

void check_rope_against_reference(const Tensor& x, const Tensor& positions,
                                  const ops::RopeParams& p, const std::string& what) {
  const int64_t D = x.size(2);
  Tensor out = f32(x.shape());
  ops::rope(x, positions, out, p);
  const std::vector<double> inv = hf_inv_freq(D, p);
  check_within_reference_error(out, rope_reference<double>(x, positions, inv, false),
                               rope_reference<float>(x, positions, inv, false), what);
  Tensor back = f32(x.shape());
  ops::rope_backward(x, positions, back, p);
  check_within_reference_error(back, rope_reference<double>(x, positions, inv, true),
                               rope_reference<float>(x, positions, inv, true), what + " backward");
}

}  // namespace

TEST_CASE("rope matches an f64 reference within the error of an f32 reference", "[unit]") {
  for (int64_t T : {7, 13}) {
    for (int64_t D : {64, 10}) {
      const Tensor positions = random_ints({T}, DType::i32, 100 + T, 0, 4096);
      for (int64_t N : {9, 3}) {  // queries (H) and keys (Hkv)
        const Tensor x = random_tensor({T, N, D}, DType::f32, T * 100 + N * 10 + D);
        ops::RopeParams p;
        p.theta = D == 64 ? 10000.0f : 1000000.0f;
        check_rope_against_reference(x, positions, p,
                                     fmt::format("rope ({}, {}, {}) theta {}", T, N, D, p.theta));
      }
    }
  }
}

TEST_CASE("rope with Llama-3 scaling matches the Hugging Face formula", "[unit]") {
  const ops::RopeParams p = llama3_params();
  for (int64_t D : {128, 64}) {
    // The three bands of the formula all occur: kept, interpolated, and divided by factor.
    const std::vector<double> truth = hf_inv_freq(D, p);
    ops::RopeParams plain_p = p;
    plain_p.factor = 0.0f;
    const std::vector<double> plain = hf_inv_freq(D, plain_p);
    int kept = 0, divided = 0, smoothed = 0;
    for (size_t i = 0; i < truth.size(); ++i) {
      if (truth[i] == plain[i]) {
        ++kept;
      } else if (truth[i] == plain[i] / p.factor) {
        ++divided;
      } else {
        ++smoothed;
      }
    }
    CHECK(kept > 0);
    CHECK(divided > 0);
    CHECK(smoothed > 0);
    std::vector<float> ours(static_cast<size_t>(D / 2));
    ops::cpu::rope_inv_freq(D, p, ours.data());
    for (size_t i = 0; i < truth.size(); ++i) {
      INFO("inv_freq[" << i << "]");
      CHECK(ours[i] == static_cast<float>(truth[i]));
    }
    const int64_t T = 13;
    const Tensor positions = random_ints({T}, DType::i32, 7, 0, 65536);
    for (int64_t N : {12, 2}) {
      const Tensor x = random_tensor({T, N, D}, DType::f32, 8 + N + D);
      check_rope_against_reference(x, positions, p,
                                   fmt::format("rope llama3 ({}, {}, {})", T, N, D));
    }
  }
}

TEST_CASE("rope_backward undoes rope and matches finite differences", "[unit]") {
  for (int64_t D : {64, 10}) {
    for (bool scaled : {false, true}) {
      const ops::RopeParams p = scaled ? llama3_params() : ops::RopeParams{};
      const int64_t T = 13, N = 3;
      const Tensor positions = random_ints({T}, DType::i32, 61, 0, 8192);
      Tensor x = random_tensor({T, N, D}, DType::f32, 62 + D);
      Tensor y = f32(x.shape()), z = f32(x.shape());
      ops::rope(x, positions, y, p);
      ops::rope_backward(y, positions, z, p);
      CHECK(max_abs_diff(to_f64(z), to_f64(x)) < 1e-5);
      CHECK(max_abs_diff(to_f64(y), to_f64(x)) > 1e-2);  // it did rotate

      const Tensor w = random_tensor(x.shape(), DType::f32, 63);
      auto loss = [&] {
        Tensor out = f32(x.shape());
        ops::rope(x, positions, out, p);
        return weighted_sum(out, w);
      };
      Tensor dx = f32(x.shape());
      ops::rope_backward(w, positions, dx, p);
      check_gradient(x, loss, dx, fmt::format("rope d/dx D {} scaled {}", D, scaled));
    }
  }
}

TEST_CASE("rope in place gives the bits of rope out of place", "[unit]") {
  const int64_t T = 13, N = 9, D = 64;
  const Tensor positions = random_ints({T}, DType::i32, 71, 0, 4096);
  const Tensor x = random_tensor({T, N, D}, DType::f32, 72);
  Tensor out = f32(x.shape());
  ops::rope(x, positions, out, llama3_params());
  Tensor inplace = x.to(Device::cpu());
  ops::rope(inplace, positions, inplace, llama3_params());
  CHECK(bitwise_equal(inplace, out));
  Tensor back = f32(x.shape());
  ops::rope_backward(out, positions, back, llama3_params());
  ops::rope_backward(inplace, positions, inplace, llama3_params());
  CHECK(bitwise_equal(inplace, back));
}

TEST_CASE("rope gives each token the same bits in any batch", "[unit]") {
  const int64_t T = 64, N = 3, D = 64;
  const Tensor positions = random_ints({T}, DType::i32, 81, 0, 4096);
  const Tensor x = random_tensor({T, N, D}, DType::f32, 82);
  Tensor full = f32(x.shape());
  ops::rope(x, positions, full, {});
  for (int64_t n = 1; n <= T; ++n) {
    const int64_t start = (n * 7) % (T - n + 1);
    Tensor part = f32({n, N, D});
    ops::rope(x.narrow(start, n), positions.narrow(start, n), part, {});
    INFO("rows " << start << ".." << start + n);
    CHECK(bitwise_equal(part, full.narrow(start, n)));
  }
}

TEST_CASE("rope rejects odd head sizes mismatched positions and bad scaling", "[unit]") {
  const int64_t T = 7, N = 3;
  const Tensor positions = random_ints({T}, DType::i32, 91, 0, 100);
  const Tensor x = random_tensor({T, N, 64}, DType::f32, 92);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(
      ops::rope(random_tensor({T, N, 9}, DType::f32, 1), positions, f32({T, N, 9}), {}),
      Contains("rope") && Contains("head size 9"));
  CHECK_THROWS_WITH(ops::rope(x, random_ints({T + 1}, DType::i32, 1, 0, 9), f32(x.shape()), {}),
                    Contains("rope") && Contains("positions"));
  CHECK_THROWS_WITH(ops::rope(x, random_ints({T}, DType::i64, 1, 0, 9), f32(x.shape()), {}),
                    Contains("positions"));
  CHECK_THROWS_WITH(ops::rope(x, positions, f32({T, N + 1, 64}), {}),
                    Contains("rope") && Contains("out"));
  CHECK_THROWS_WITH(ops::rope(x.view({T, N * 64}), positions, f32({T, N * 64}), {}),
                    Contains("rope") && Contains("x"));
  ops::RopeParams bad = llama3_params();
  bad.high_freq_factor = bad.low_freq_factor;
  CHECK_THROWS_WITH(ops::rope(x, positions, f32(x.shape()), bad), Contains("Llama-3"));
  CHECK_THROWS_WITH(ops::rope_backward(x, positions, Tensor::empty(x.shape(), DType::bf16), {}),
                    Contains("rope_backward") && Contains("dx"));
}

TANDEM_PARITY_CASES(rope) {
  struct Case {
    const char* op;
    int64_t T, N, D;
    bool llama3, in_place;
  };
  for (Case c :
       {Case{"rope", 13, 9, 64, false, false}, Case{"rope", 517, 3, 64, true, false},
        Case{"rope", 7, 12, 128, true, true}, Case{"rope_backward", 13, 2, 10, false, false},
        Case{"rope_backward", 300, 9, 64, true, true}}) {
    add_parity_case({
        .name = fmt::format("{} ({}, {}, {}){}{}", c.op, c.T, c.N, c.D, c.llama3 ? " llama3" : "",
                            c.in_place ? " in place" : ""),
        .inputs =
            [c](uint64_t seed) {
              return std::vector<Tensor>{random_tensor({c.T, c.N, c.D}, DType::f32, seed),
                                         random_ints({c.T}, DType::i32, seed + 1, 0, 32768)};
            },
        .outputs =
            [c](const std::vector<Tensor>& in) {
              return std::vector<Tensor>{c.in_place ? in[0].to(Device::cpu())
                                                    : Tensor::zeros(in[0].shape(), DType::f32)};
            },
        .run =
            [c](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              const ops::RopeParams p = c.llama3 ? llama3_params() : ops::RopeParams{};
              const Tensor& src = c.in_place ? out[0] : in[0];
              if (std::string(c.op) == "rope") {
                ops::rope(src, in[1], out[0], p);
              } else {
                ops::rope_backward(src, in[1], out[0], p);
              }
            },
        .max_nmse = 1e-8,  // cosf/sinf differ by an ulp or two between libm and CUDA
    });
  }
}
