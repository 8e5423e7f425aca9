// The vocabulary-parallel head's logprobs, entropies and gradients (model/vocab_parallel.h,
// ops::logprob_shard_*): split over 1, 2 and 3 ranks (threads with their own communicators) they
// give what ops::logprob_gather gives on the whole logits, but for f32 rounding; a vocabulary the
// ranks do not split exactly, and a target outside it, are refused naming the row.
#include <catch2/catch.hpp>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "model/vocab_parallel.h"
#include "tests/testutil.h"
#include "tests/trainer/on_ranks.h"

using namespace tandem;

namespace {

// Columns [begin, end) of a (T, V) f32 tensor, as a new (T, end - begin) tensor.
Tensor columns(const Tensor& x, int64_t begin, int64_t end) {
  const int64_t T = x.size(0), V = x.size(1);
  Tensor out = Tensor::empty({T, end - begin}, DType::f32);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = begin; v < end; ++v)
      out.data_as<float>()[t * (end - begin) + v - begin] = x.data_as<float>()[t * V + v];
  return out;
}

// Rank r of n holds columns [V r / n, V (r + 1) / n): uneven splits included.
int64_t split(int64_t V, int r, int n) { return V * r / n; }

}  // namespace

TEST_CASE(
    "a vocabulary split over 1 2 and 3 ranks gives the whole logits' logprobs entropies "
    "and gradients",
    "[unit]") {
  const int64_t T = 9, V = 101;
  const Tensor logits = test::random_tensor({T, V}, DType::f32, 3, -9.0, 9.0);
  Tensor targets = test::random_ints({T}, DType::i32, 4, 0, V);
  targets.data_as<int32_t>()[0] = 0;  // the first and the last column are targets too
  targets.data_as<int32_t>()[1] = static_cast<int32_t>(V - 1);
  const Tensor dlogprob = test::random_tensor({T}, DType::f32, 5, -1.0, 1.0);
  const Tensor dentropy = test::random_tensor({T}, DType::f32, 6, -1.0, 1.0);

  for (const float temperature : {1.0f, 0.7f}) {
    INFO("temperature " << temperature);
    Tensor lp = Tensor::empty({T}, DType::f32), lse = Tensor::empty({T}, DType::f32),
           ent = Tensor::empty({T}, DType::f32), grad = Tensor::empty({T, V}, DType::f32);
    ops::logprob_gather(logits, targets, lp, lse, ent, temperature);
    ops::logprob_gather_backward(dlogprob, dentropy, logits, targets, lse, grad, temperature);
    const std::vector<double> want_lp = test::to_f64(lp), want_ent = test::to_f64(ent),
                              want_grad = test::to_f64(grad);

    for (const int n : {1, 2, 3}) {
      INFO(n << " ranks");
      const test::TempDir tmp("vocab-parallel");
      std::mutex mu;
      std::vector<double> got_grad(static_cast<size_t>(T * V));
      test::on_ranks(n, tmp.file("store"), [&](int r, Communicator& comm) {
        const int64_t b = split(V, r, n), e = split(V, r + 1, n);
        const Tensor mine = columns(logits, b, e);
        Tensor p = Tensor::empty({T}, DType::f32), l = Tensor::empty({T}, DType::f32),
               h = Tensor::empty({T}, DType::f32), g = Tensor::empty({T, e - b}, DType::f32);
        model::vocab_parallel_logprob(comm, mine, targets, b, V, p, l, h, temperature);
        ops::logprob_shard_backward(dlogprob, dentropy, mine, targets, b, l, h, g, temperature);
        const std::lock_guard<std::mutex> lock(mu);
        CHECK(test::max_abs_diff(test::to_f64(p), want_lp) < 2e-5);
        CHECK(test::max_abs_diff(test::to_f64(h), want_ent) < 2e-5);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t v = b; v < e; ++v)
            got_grad[static_cast<size_t>(t * V + v)] = g.data_as<float>()[t * (e - b) + v - b];
      });
      CHECK(test::max_abs_diff(got_grad, want_grad) < 1e-5);
    }
  }

  // Without the entropy: the logprobs alone, and a backward of the logprobs alone.
  Tensor lp = Tensor::empty({T}, DType::f32), lse = Tensor::empty({T}, DType::f32),
         grad = Tensor::empty({T, V}, DType::f32);
  ops::logprob_gather(logits, targets, lp, lse, Tensor{});
  ops::logprob_gather_backward(dlogprob, Tensor{}, logits, targets, lse, grad);
  const test::TempDir tmp("vocab-parallel-noent");
  test::on_ranks(2, tmp.file("store"), [&](int r, Communicator& comm) {
    const int64_t b = split(V, r, 2), e = split(V, r + 1, 2);
    const Tensor mine = columns(logits, b, e);
    Tensor p = Tensor::empty({T}, DType::f32), l = Tensor::empty({T}, DType::f32),
           g = Tensor::empty({T, e - b}, DType::f32);
    model::vocab_parallel_logprob(comm, mine, targets, b, V, p, l, Tensor{});
    ops::logprob_shard_backward(dlogprob, Tensor{}, mine, targets, b, l, Tensor{}, g);
    CHECK(test::max_abs_diff(test::to_f64(p), test::to_f64(lp)) < 2e-5);
    CHECK(test::max_abs_diff(test::to_f64(g), test::to_f64(columns(grad, b, e))) < 1e-5);
  });
}

TEST_CASE(
    "a vocabulary-parallel head refuses columns that do not split the vocabulary and "
    "targets outside it",
    "[unit]") {
  const int64_t T = 3, V = 20;
  const Tensor logits = test::random_tensor({T, V}, DType::f32, 8, -3.0, 3.0);
  Tensor targets = test::random_ints({T}, DType::i32, 9, 10, V);
  targets.data_as<int32_t>()[0] = 15;
  Tensor p = Tensor::empty({T}, DType::f32), l = Tensor::empty({T}, DType::f32);

  // Both ranks hold columns [0, 10): nobody holds id 15.
  const test::TempDir tmp("vocab-parallel-bad");
  auto errors = test::on_ranks(
      2, tmp.file("store"),
      [&](int, Communicator& comm) {
        model::vocab_parallel_logprob(comm, columns(logits, 0, 10), targets, 0, V, p, l, Tensor{});
      },
      true);
  for (const std::string& e : errors)
    CHECK_THAT(e, Catch::Contains("row 0's target id 15 is held by 0 ranks' columns, not one"));

  Tensor outside = targets;
  outside.data_as<int32_t>()[1] = static_cast<int32_t>(V);
  const test::TempDir tmp2("vocab-parallel-outside");
  errors = test::on_ranks(
      1, tmp2.file("store"),
      [&](int, Communicator& comm) {
        model::vocab_parallel_logprob(comm, logits, outside, 0, V, p, l, Tensor{});
      },
      true);
  CHECK_THAT(errors[0], Catch::Contains("row 1 has target id 20, outside the vocabulary [0, 20)"));
}
