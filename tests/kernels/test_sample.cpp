// sample: greedy, the top-k, top-p and min-p sets, frequencies against the filtered distribution,
// determinism, batch invariance, agreement with logprob_gather, bad settings; and parity cases.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>

#include "core/parallel.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/kernels/sampling_rows.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct Drawn {
  Tensor token, logprob;
};

Drawn run_sample(const Tensor& logits, const std::vector<RowSpec>& rows) {
  const int64_t B = logits.size(0);
  Drawn d{Tensor::zeros({B}, DType::i32), Tensor::zeros({B}, DType::f32)};
  ops::sample(logits, make_settings(rows), d.token, d.logprob);
  return d;
}

// The same logits row repeated B times.
Tensor repeat_row(const std::vector<double>& row, int64_t B) {
  std::vector<double> all;
  for (int64_t b = 0; b < B; ++b) all.insert(all.end(), row.begin(), row.end());
  return tensor_from(all, {B, static_cast<int64_t>(row.size())});
}

// The filtered, renormalised distribution of ops.h's definition, in f64 with a sort.
std::vector<double> filtered_distribution(const std::vector<double>& x, const RowSpec& s) {
  const size_t V = x.size();
  std::vector<double> z(V), p(V);
  for (size_t v = 0; v < V; ++v)
    z[v] = static_cast<double>(static_cast<float>(x[v])) / s.temperature;
  const double m = *std::max_element(z.begin(), z.end());
  double total = 0;
  for (size_t v = 0; v < V; ++v) total += p[v] = std::exp(z[v] - m);
  for (double& q : p) q /= total;
  std::vector<size_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return z[a] > z[b]; });
  std::vector<bool> keep(V, false);
  const size_t k =
      s.top_k > 0 && static_cast<size_t>(s.top_k) < V ? static_cast<size_t>(s.top_k) : V;
  double kept_mass = 0;
  for (size_t i = 0; i < k; ++i) {
    keep[order[i]] = true;
    kept_mass += p[order[i]];
  }
  if (s.top_p < 1.0f) {
    double run = 0, threshold = -INFINITY;
    for (size_t i = 0; i < k; ++i) {
      run += p[order[i]];
      if (run >= s.top_p * kept_mass) {
        threshold = z[order[i]];
        break;
      }
    }
    for (size_t v = 0; v < V; ++v) keep[v] = keep[v] && z[v] >= threshold;
  }
  const double pmax = p[order[0]];
  for (size_t v = 0; v < V; ++v) keep[v] = keep[v] && p[v] >= s.min_p * pmax;
  double mass = 0;
  for (size_t v = 0; v < V; ++v) mass += keep[v] ? p[v] : 0.0;
  std::vector<double> out(V);
  for (size_t v = 0; v < V; ++v) out[v] = keep[v] ? p[v] / mass : 0.0;
  return out;
}

// Tokens drawn at offsets 0..n-1 for one row and one setting.
std::vector<int64_t> draw_counts(const std::vector<double>& row, RowSpec s, int64_t n) {
  std::vector<RowSpec> rows(static_cast<size_t>(n), s);
  for (int64_t i = 0; i < n; ++i) rows[static_cast<size_t>(i)].offset = i;
  const Drawn d = run_sample(repeat_row(row, n), rows);
  std::vector<int64_t> counts(row.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = d.token.data_as<int32_t>()[i];
    REQUIRE(t >= 0);
    REQUIRE(t < static_cast<int32_t>(row.size()));
    ++counts[static_cast<size_t>(t)];
  }
  return counts;
}

std::set<int64_t> drawn_set(const std::vector<double>& row, const RowSpec& s) {
  const std::vector<int64_t> counts = draw_counts(row, s, 600);
  std::set<int64_t> out;
  for (size_t v = 0; v < counts.size(); ++v)
    if (counts[v] > 0) out.insert(static_cast<int64_t>(v));
  return out;
}

std::vector<double> log_of(const std::vector<double>& p) {
  std::vector<double> out;
  for (double q : p) out.push_back(std::log(q));
  return out;
}

int32_t first_argmax(const float* x, int64_t V) {
  return static_cast<int32_t>(std::max_element(x, x + V) - x);
}

}  // namespace

TEST_CASE("sample with temperature 0 picks the first argmax with its temperature-1 logprob",
          "[unit]") {
  const int64_t B = 16, V = 1003;
  Tensor logits = random_tensor({B, V}, DType::f32, 3, -5.0, 5.0);
  float* x = logits.data_as<float>();
  x[2 * V + 9] = 7.0f;  // a tie on row 2: ids 5 and 9
  x[2 * V + 5] = 7.0f;
  std::vector<RowSpec> rows(B, RowSpec{.temperature = 0.0f, .top_k = 3, .top_p = 0.5f});
  const Drawn d = run_sample(logits, rows);
  for (int64_t b = 0; b < B; ++b)
    CHECK(d.token.data_as<int32_t>()[b] == first_argmax(x + b * V, V));
  CHECK(d.token.data_as<int32_t>()[2] == 5);
  Tensor lp = Tensor::zeros({B}, DType::f32), lse = Tensor::zeros({B}, DType::f32);
  ops::logprob_gather(logits, d.token, lp, lse, Tensor(), 1.0f);
  CHECK(bitwise_equal(lp, d.logprob));
}

TEST_CASE("sample with temperature 0 ends where a scan for a greater logit ends", "[unit]") {
  // The greedy token is found by a vectorised max and search; its result is the one of the scan
  // `if (x[v] > x[best]) best = v` for ties inside and across 16-lane blocks, in the tail, signed
  // zeros, -inf and NaN logits.
  const int64_t V = 1003;
  std::vector<std::vector<float>> rows;
  auto row = [&](uint64_t seed) {
    const Tensor t = random_tensor({V}, DType::f32, seed, -5.0, 5.0);
    return std::vector<float>(t.data_as<float>(), t.data_as<float>() + V);
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const int64_t at : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{500}, V - 1}) {
    std::vector<float> r = row(static_cast<uint64_t>(at) + 11);
    r[static_cast<size_t>(at)] = 9.0f;
    r[static_cast<size_t>(std::min(at + 7, V - 1))] = 9.0f;  // a later tie
    rows.push_back(r);
  }
  rows.push_back(std::vector<float>(V, -inf));
  rows.push_back(std::vector<float>(V, 0.0f));
  rows.back()[3] = -0.0f;
  rows.push_back(row(40));
  rows.back()[0] = nan;  // nothing is greater than NaN: the scan stays at 0
  rows.push_back(row(41));
  rows.back()[100] = nan;
  rows.back()[101] = 99.0f;
  rows.push_back(std::vector<float>(V, nan));
  rows.back()[0] = -inf;
  rows.push_back(std::vector<float>(V, nan));
  rows.back()[V - 1] = 1.0f;
  const int64_t B = static_cast<int64_t>(rows.size());
  Tensor logits = Tensor::empty({B, V}, DType::f32);
  for (int64_t b = 0; b < B; ++b)
    std::copy(rows[static_cast<size_t>(b)].begin(), rows[static_cast<size_t>(b)].end(),
              logits.data_as<float>() + b * V);
  const Drawn d = run_sample(logits, std::vector<RowSpec>(B, RowSpec{.temperature = 0.0f}));
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<float>& r = rows[static_cast<size_t>(b)];
    int32_t best = 0;
    for (int32_t v = 1; v < V; ++v)
      if (r[static_cast<size_t>(v)] > r[static_cast<size_t>(best)]) best = v;
    INFO("row " << b);
    CHECK(d.token.data_as<int32_t>()[b] == best);
  }
}

TEST_CASE("sample with top_k 1 always draws the argmax", "[unit]") {
  const std::vector<double> row = to_f64(random_tensor({1000}, DType::f32, 5, -3.0, 3.0));
  const std::vector<int64_t> counts =
      draw_counts(row, RowSpec{.temperature = 1.5f, .top_k = 1, .seed = 9}, 300);
  const int64_t best = std::max_element(row.begin(), row.end()) - row.begin();
  CHECK(counts[static_cast<size_t>(best)] == 300);
}

TEST_CASE("sample frequencies match the filtered renormalised distribution", "[unit]") {
  const std::vector<double> row = to_f64(random_tensor({10}, DType::f32, 17, -2.0, 2.0));
  const int64_t n = 4000;
  for (const RowSpec s :
       {RowSpec{.temperature = 0.8f, .seed = 1234},
        RowSpec{.temperature = 1.2f, .top_k = 6, .seed = 99},
        RowSpec{.temperature = 1.0f, .top_p = 0.8f, .seed = 7},
        RowSpec{.temperature = 0.9f, .min_p = 0.1f, .seed = 8},
        RowSpec{.temperature = 0.7f, .top_k = 7, .top_p = 0.9f, .min_p = 0.05f, .seed = 5}}) {
    INFO("temperature " << s.temperature << " top_k " << s.top_k << " top_p " << s.top_p
                        << " min_p " << s.min_p);
    const std::vector<double> want = filtered_distribution(row, s);
    const std::vector<int64_t> counts = draw_counts(row, s, n);
    double chi2 = 0;
    int kept = 0;
    for (size_t v = 0; v < want.size(); ++v) {
      INFO("token " << v << " drawn " << counts[v] << " times, expected p " << want[v]);
      if (want[v] == 0) {
        CHECK(counts[v] == 0);
        continue;
      }
      ++kept;
      const double e = want[v] * static_cast<double>(n);
      chi2 += (static_cast<double>(counts[v]) - e) * (static_cast<double>(counts[v]) - e) / e;
    }
    // A chi-square with kept - 1 degrees of freedom; mean dof, sd sqrt(2 dof). Seeds are fixed.
    const double dof = kept - 1;
    INFO("chi-square " << chi2 << " with " << dof << " degrees of freedom");
    CHECK(kept >= 2);
    CHECK(chi2 < dof + 5.0 * std::sqrt(2.0 * dof) + 5.0);
  }
}

TEST_CASE("sample draws only tokens of the reference kept set on random rows and settings",
          "[unit]") {
  const int64_t V = 1000, B = 48, draws = 40;
  const Tensor logits = random_tensor({B, V}, DType::f32, 91, -4.0, 4.0);
  const std::vector<double> all = to_f64(logits);
  for (int64_t b = 0; b < B; ++b) {
    const RowSpec s{.temperature = 0.5f + 0.05f * static_cast<float>(b % 20),
                    .top_k = b % 3 == 0 ? static_cast<int32_t>(5 + 7 * b) : 0,
                    .top_p = b % 4 == 0 ? 1.0f : 0.5f + 0.01f * static_cast<float>(b),
                    .min_p = b % 5 == 0 ? 0.01f * static_cast<float>(b % 7) : 0.0f,
                    .seed = 300 + b};
    INFO("row " << b << " top_k " << s.top_k << " top_p " << s.top_p << " min_p " << s.min_p);
    const std::vector<double> row(all.begin() + b * V, all.begin() + (b + 1) * V);
    const std::vector<double> want = filtered_distribution(row, s);
    const std::vector<int64_t> counts = draw_counts(row, s, draws);
    int64_t outside = 0;
    for (int64_t v = 0; v < V; ++v) outside += want[v] == 0 ? counts[v] : 0;
    CHECK(outside == 0);
  }
}

TEST_CASE("sample top_p keeps the fewest largest tokens and every tie at the threshold", "[unit]") {
  const std::vector<double> row = log_of({0.05, 0.30, 0.10, 0.25, 0.20, 0.10});
  CHECK(drawn_set(row, {.top_p = 0.7f, .seed = 3}) == std::set<int64_t>{1, 3, 4});
  // 0.3 + 0.25 + 0.2 = 0.75 < 0.8: the next value is 0.1, held by ids 2 and 5; both stay.
  CHECK(drawn_set(row, {.top_p = 0.8f, .seed = 4}) == std::set<int64_t>{1, 2, 3, 4, 5});
  CHECK(drawn_set(row, {.top_p = 0.25f, .seed = 5}) == std::set<int64_t>{1});
  // top-p applies to what top-k kept: of {1, 3, 4} (mass 0.75), 0.9 * 0.75 needs all three.
  CHECK(drawn_set(row, {.top_k = 3, .top_p = 0.9f, .seed = 6}) == std::set<int64_t>{1, 3, 4});
  CHECK(drawn_set(row, {.top_k = 3, .top_p = 0.5f, .seed = 6}) == std::set<int64_t>{1, 3});
}

TEST_CASE("sample min_p keeps the tokens with p at least min_p times the largest", "[unit]") {
  const std::vector<double> row = log_of({0.05, 0.30, 0.10, 0.25, 0.20, 0.10});
  CHECK(drawn_set(row, {.min_p = 0.5f, .seed = 11}) == std::set<int64_t>{1, 3, 4});
  CHECK(drawn_set(row, {.min_p = 0.7f, .seed = 12}) == std::set<int64_t>{1, 3});
  CHECK(drawn_set(row, {.min_p = 1.0f, .seed = 13}) == std::set<int64_t>{1});
  CHECK(drawn_set(row, {.min_p = 0.1f, .seed = 14}) == std::set<int64_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("sample top_k keeps exactly k with ties going to the lower ids", "[unit]") {
  const std::vector<double> row = {1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0};
  CHECK(drawn_set(row, {.top_k = 3, .seed = 21}) == std::set<int64_t>{1, 2, 3});
  CHECK(drawn_set(row, {.top_k = 4, .seed = 22}) == std::set<int64_t>{1, 2, 3, 4});
  CHECK(drawn_set(row, {.top_k = 2, .seed = 23}) == std::set<int64_t>{1, 3});
  CHECK(drawn_set(row, {.top_k = 6, .seed = 24}) == std::set<int64_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("sample never draws a token whose logit is -inf", "[unit]") {
  std::vector<double> row = to_f64(random_tensor({500}, DType::f32, 71, -1.0, 1.0));
  for (size_t v = 0; v < row.size(); v += 2) row[v] = -INFINITY;
  for (const RowSpec s : {RowSpec{.seed = 1}, RowSpec{.temperature = 2.0f, .top_k = 400, .seed = 2},
                          RowSpec{.top_p = 0.95f, .seed = 3}}) {
    std::vector<RowSpec> rows(300, s);
    for (size_t i = 0; i < rows.size(); ++i) rows[i].offset = static_cast<int64_t>(i);
    const Drawn d = run_sample(repeat_row(row, 300), rows);
    for (int64_t i = 0; i < 300; ++i) {
      INFO("draw " << i << " token " << d.token.data_as<int32_t>()[i]);
      CHECK(d.token.data_as<int32_t>()[i] % 2 == 1);
    }
    CHECK(all_finite(d.logprob));
  }
}

TEST_CASE("sample logprob equals logprob_gather of the drawn token bitwise", "[unit]") {
  const int64_t B = 24, V = 4099;
  const Tensor logits = random_tensor({B, V}, DType::f32, 31, -8.0, 8.0);
  std::vector<RowSpec> rows;
  for (int64_t b = 0; b < B; ++b)
    rows.push_back({.temperature = 0.3f + 0.1f * static_cast<float>(b),
                    .top_k = b % 3 == 0 ? 40 : 0,
                    .top_p = b % 2 == 0 ? 0.9f : 1.0f,
                    .min_p = b % 5 == 0 ? 0.02f : 0.0f,
                    .seed = 1000 + b,
                    .offset = 3 * b});
  const Drawn d = run_sample(logits, rows);
  for (int64_t b = 0; b < B; ++b) {
    INFO("row " << b);
    Tensor lp = Tensor::zeros({1}, DType::f32), lse = Tensor::zeros({1}, DType::f32);
    ops::logprob_gather(logits.narrow(b, 1), d.token.narrow(b, 1), lp, lse, Tensor(),
                        rows[static_cast<size_t>(b)].temperature);
    CHECK(bitwise_equal(lp, d.logprob.narrow(b, 1)));
  }
}

TEST_CASE("sample is deterministic and batch invariant bitwise", "[unit]") {
  const int64_t V = 3001;
  const Tensor all = random_tensor({64, V}, DType::f32, 41, -6.0, 6.0);
  std::vector<RowSpec> rows;
  for (int64_t b = 0; b < 64; ++b)
    rows.push_back({.temperature = b % 7 == 0 ? 0.0f : 0.5f + 0.05f * static_cast<float>(b % 11),
                    .top_k = b % 3 == 0 ? 50 : 0,
                    .top_p = b % 4 == 1 ? 0.85f : 1.0f,
                    .min_p = b % 5 == 2 ? 0.05f : 0.0f,
                    .seed = 77,
                    .offset = b});
  const Drawn whole = run_sample(all, rows);
  const Drawn again = run_sample(all, rows);
  CHECK(bitwise_equal(whole.token, again.token));
  CHECK(bitwise_equal(whole.logprob, again.logprob));
  // A different offset draws differently somewhere.
  std::vector<RowSpec> shifted = rows;
  for (RowSpec& r : shifted) r.offset += 1000;
  CHECK_FALSE(bitwise_equal(run_sample(all, shifted).token, whole.token));
  const int before = num_threads();
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (int64_t B : {1, 7, 64}) {
      for (int64_t start : {int64_t{0}, 64 - B, (64 - B) / 2}) {
        INFO("threads " << threads << " rows " << start << " to " << start + B);
        const std::vector<RowSpec> part(rows.begin() + start, rows.begin() + start + B);
        const Drawn d = run_sample(all.narrow(start, B).to(Device::cpu()), part);
        CHECK(bitwise_equal(d.token, whole.token.narrow(start, B)));
        CHECK(bitwise_equal(d.logprob, whole.logprob.narrow(start, B)));
      }
    }
  }
  set_num_threads(before);
}

TEST_CASE("sample rejects bad settings naming the row", "[unit]") {
  const Tensor logits = random_tensor({4, 30}, DType::f32, 51);
  Tensor token = Tensor::zeros({4}, DType::i32), lp = Tensor::zeros({4}, DType::f32);
  const auto with_row2 = [](RowSpec bad) {
    std::vector<RowSpec> rows(4);
    rows[2] = bad;
    return make_settings(rows);
  };
  for (const RowSpec bad : {RowSpec{.temperature = -0.5f}, RowSpec{.top_k = -1},
                            RowSpec{.top_p = 0.0f}, RowSpec{.top_p = 1.5f}, RowSpec{.min_p = -0.1f},
                            RowSpec{.min_p = 1.1f}, RowSpec{.temperature = NAN}}) {
    CHECK_THROWS_WITH(ops::sample(logits, with_row2(bad), token, lp), Catch::Contains("row 2"));
  }
  ops::SamplingTensors short_seed = with_row2({});
  short_seed.seed = Tensor::zeros({3}, DType::i64);
  CHECK_THROWS_AS(ops::sample(logits, short_seed, token, lp), Error);
  ops::SamplingTensors wrong_type = with_row2({});
  wrong_type.top_k = Tensor::zeros({4}, DType::i64);
  CHECK_THROWS_AS(ops::sample(logits, wrong_type, token, lp), Error);
}

TANDEM_PARITY_CASES(sample) {
  // Inputs: logits, then the six settings tensors; outputs: token, logprob.
  const auto add = [](std::string name, int64_t B, int64_t V,
                      std::function<RowSpec(int64_t)> spec) {
    add_parity_case({
        .name = std::move(name),
        .inputs =
            [B, V, spec](uint64_t seed) {
              std::vector<RowSpec> rows;
              for (int64_t b = 0; b < B; ++b) rows.push_back(spec(b));
              const ops::SamplingTensors s = make_settings(rows);
              return std::vector<Tensor>{random_tensor({B, V}, DType::f32, seed, -8.0, 8.0),
                                         s.temperature,
                                         s.top_k,
                                         s.top_p,
                                         s.min_p,
                                         s.seed,
                                         s.offset};
            },
        .outputs =
            [B](const std::vector<Tensor>&) {
              return std::vector<Tensor>{Tensor::zeros({B}, DType::i32),
                                         Tensor::zeros({B}, DType::f32)};
            },
        .run =
            [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::sample(in[0], {in[1], in[2], in[3], in[4], in[5], in[6]}, out[0], out[1]);
            },
        .max_nmse = 1e-8,
        .min_int_match = 0.98,
    });
  };
  add("sample (64, 1000) mixed greedy top-k top-p min-p", 64, 1000, [](int64_t b) {
    return RowSpec{.temperature = b % 9 == 0 ? 0.0f : 0.4f + 0.1f * static_cast<float>(b % 13),
                   .top_k = b % 3 == 0 ? 20 : (b % 3 == 1 ? 1000 : 0),
                   .top_p = b % 4 == 0 ? 0.8f : 1.0f,
                   .min_p = b % 5 == 0 ? 0.03f : 0.0f,
                   .seed = 5 + b,
                   .offset = 1000 * b};
  });
  add("sample (4, 151936) top_k 50 top_p 0.9", 4, 151936, [](int64_t b) {
    return RowSpec{.temperature = 1.0f, .top_k = 50, .top_p = 0.9f, .seed = 42, .offset = b};
  });
  add("sample (3, 49152) everything off", 3, 49152,
      [](int64_t b) { return RowSpec{.temperature = 1.0f, .seed = 43, .offset = b}; });
}
