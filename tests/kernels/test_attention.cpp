// attention, attention_backward, kv_cache_write and paged_attention_decode: against naive
// references and finite differences, decode vs packed bitwise, and their parity cases.
#include <fmt/ranges.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "core/half.h"
#include "core/parallel.h"
#include "kernels/cpu/attention.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

// A ragged packed batch: q (T, H, D), k and v (T, Hkv, D), cu_seqlens (B + 1).
struct Packed {
  std::vector<int> lens;
  int64_t T = 0, H = 0, Hkv = 0, D = 0;
  Tensor q, k, v, cu;
  float scale = 0;
};

Tensor cu_seqlens_of(const std::vector<int>& lens) {
  std::vector<double> cu{0};
  for (int n : lens) cu.push_back(cu.back() + n);
  return tensor_from(cu, {static_cast<int64_t>(cu.size())}, DType::i32);
}

Packed make_packed(const std::vector<int>& lens, int64_t H, int64_t Hkv, int64_t D, uint64_t seed,
                   double range = 2.0) {
  Packed p;
  p.lens = lens;
  p.T = std::accumulate(lens.begin(), lens.end(), int64_t{0});
  p.H = H;
  p.Hkv = Hkv;
  p.D = D;
  p.q = random_tensor({p.T, H, D}, DType::f32, seed, -range, range);
  p.k = random_tensor({p.T, Hkv, D}, DType::f32, seed + 1, -range, range);
  p.v = random_tensor({p.T, Hkv, D}, DType::f32, seed + 2);
  p.cu = cu_seqlens_of(lens);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  return p;
}

// Naive causal GQA attention with a full softmax, in R arithmetic: out (T, H, D), lse (T, H).
template <class R>
void naive_attention(const Packed& p, std::vector<double>& out, std::vector<double>& lse) {
  const std::vector<double> q = to_f64(p.q), k = to_f64(p.k), v = to_f64(p.v);
  const int64_t H = p.H, Hkv = p.Hkv, D = p.D, G = H / Hkv;
  out.assign(static_cast<size_t>(p.T * H * D), 0.0);
  lse.assign(static_cast<size_t>(p.T * H), 0.0);
  int64_t start = 0;
  for (int len : p.lens) {
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = (start + i) * H + h;
        std::vector<R> s(static_cast<size_t>(i + 1));
        R mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          R dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += static_cast<R>(q[static_cast<size_t>(row * D + d)]) *
                   static_cast<R>(k[static_cast<size_t>(((start + j) * Hkv + h / G) * D + d)]);
          s[static_cast<size_t>(j)] = dot * static_cast<R>(p.scale);
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        R sum = 0;
        for (R& x : s) {
          x = std::exp(x - mx);
          sum += x;
        }
        for (int64_t d = 0; d < D; ++d) {
          R acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            acc += s[static_cast<size_t>(j)] *
                   static_cast<R>(v[static_cast<size_t>(((start + j) * Hkv + h / G) * D + d)]);
          out[static_cast<size_t>(row * D + d)] = static_cast<double>(acc / sum);
        }
        lse[static_cast<size_t>(row)] = static_cast<double>(mx + std::log(sum));
      }
    }
    start += len;
  }
}

// Naive backward of naive_attention in R arithmetic (full softmax recomputed): dq, dk, dv.
template <class R>
void naive_attention_backward(const Packed& p, const Tensor& dout_t, std::vector<double>& dq,
                              std::vector<double>& dk, std::vector<double>& dv) {
  const std::vector<double> q = to_f64(p.q), k = to_f64(p.k), v = to_f64(p.v), g = to_f64(dout_t);
  const int64_t H = p.H, Hkv = p.Hkv, D = p.D, G = H / Hkv;
  std::vector<R> dq_r(q.size(), 0), dk_r(k.size(), 0), dv_r(v.size(), 0);
  const R scale = static_cast<R>(p.scale);
  auto at = [&](const std::vector<double>& x, int64_t i) {
    return static_cast<R>(x[static_cast<size_t>(i)]);
  };
  int64_t start = 0;
  for (int len : p.lens) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / G;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t qrow = ((start + i) * H + h) * D;
        std::vector<R> pr(static_cast<size_t>(i + 1)), dp(static_cast<size_t>(i + 1));
        R mx = -INFINITY, sum = 0, delta = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t krow = ((start + j) * Hkv + kvh) * D;
          R s = 0, t = 0;
          for (int64_t d = 0; d < D; ++d) {
            s += at(q, qrow + d) * at(k, krow + d);
            t += at(g, qrow + d) * at(v, krow + d);
          }
          pr[static_cast<size_t>(j)] = s * scale;
          dp[static_cast<size_t>(j)] = t;
          mx = std::max(mx, s * scale);
        }
        for (R& x : pr) {
          x = std::exp(x - mx);
          sum += x;
        }
        for (R& x : pr) x /= sum;
        for (int64_t j = 0; j <= i; ++j)
          delta += pr[static_cast<size_t>(j)] * dp[static_cast<size_t>(j)];
        for (int64_t j = 0; j <= i; ++j) {
          const int64_t krow = ((start + j) * Hkv + kvh) * D;
          const R pj = pr[static_cast<size_t>(j)];
          const R ds = pj * (dp[static_cast<size_t>(j)] - delta);
          for (int64_t d = 0; d < D; ++d) {
            dq_r[static_cast<size_t>(qrow + d)] += scale * ds * at(k, krow + d);
            dk_r[static_cast<size_t>(krow + d)] += scale * ds * at(q, qrow + d);
            dv_r[static_cast<size_t>(krow + d)] += pj * at(g, qrow + d);
          }
        }
      }
    }
    start += len;
  }
  dq.assign(dq_r.begin(), dq_r.end());
  dk.assign(dk_r.begin(), dk_r.end());
  dv.assign(dv_r.begin(), dv_r.end());
}

struct Forward {
  Tensor out, lse;
};

Forward run_attention(const Packed& p) {
  Forward f{Tensor::empty({p.T, p.H, p.D}, DType::f32), Tensor::empty({p.T, p.H}, DType::f32)};
  ops::attention(p.q, p.k, p.v, p.cu, {}, f.out, f.lse, p.scale);
  return f;
}

struct Grads {
  Tensor dq, dk, dv;
};

Grads run_backward(const Packed& p, const Forward& f, const Tensor& dout) {
  Grads g{Tensor::empty(p.q.shape(), DType::f32), Tensor::empty(p.k.shape(), DType::f32),
          Tensor::empty(p.v.shape(), DType::f32)};
  ops::attention_backward(dout, p.q, p.k, p.v, f.out, f.lse, p.cu, {}, g.dq, g.dk, g.dv, p.scale);
  return g;
}

// Rows [start, start + len) of a (T, ...) tensor, as their own tensor.
Tensor rows(const Tensor& t, int64_t start, int64_t len) {
  Tensor r = Tensor::empty(t.narrow(start, len).shape(), t.dtype());
  r.copy_from(t.narrow(start, len));
  return r;
}

// A paged cache holding the packed batch: blocks of P slots with shuffled ids, and the first
// `shared_blocks` blocks of every sequence longer than them shared with sequence 0 (whose
// tokens there are copied into the others' k and v first, as a group's common prompt).
struct Paged {
  int64_t P = 0, num_blocks = 0;
  std::vector<std::vector<int>> blocks;  // per sequence, its block ids in order
  Tensor k_cache, v_cache;
};

Paged make_paged(Packed& p, int64_t P, int64_t shared_blocks, DType cache_dtype, uint64_t seed) {
  Paged c;
  c.P = P;
  const int64_t prefix = shared_blocks * P;
  std::vector<int64_t> starts{0};
  for (int len : p.lens) starts.push_back(starts.back() + len);
  // Copy sequence 0's prefix tokens into every sequence that shares it.
  float* q = p.q.data_as<float>();
  float* k = p.k.data_as<float>();
  float* v = p.v.data_as<float>();
  std::vector<bool> shares(p.lens.size(), false);
  for (size_t b = 1; b < p.lens.size(); ++b) {
    if (p.lens[b] <= prefix || p.lens[0] < prefix) continue;
    shares[b] = true;
    for (int64_t i = 0; i < prefix; ++i) {
      std::copy_n(q + (starts[0] + i) * p.H * p.D, p.H * p.D, q + (starts[b] + i) * p.H * p.D);
      std::copy_n(k + (starts[0] + i) * p.Hkv * p.D, p.Hkv * p.D,
                  k + (starts[b] + i) * p.Hkv * p.D);
      std::copy_n(v + (starts[0] + i) * p.Hkv * p.D, p.Hkv * p.D,
                  v + (starts[b] + i) * p.Hkv * p.D);
    }
  }
  int64_t needed = 3;  // a few blocks no sequence uses
  for (int len : p.lens) needed += (len + P - 1) / P;
  c.num_blocks = needed;
  std::vector<int> ids(static_cast<size_t>(needed));
  std::iota(ids.begin(), ids.end(), 0);
  const std::vector<double> r = to_f64(random_tensor({needed}, DType::f32, seed, 0.0, 1.0));
  for (int64_t i = needed - 1; i > 0; --i)
    std::swap(ids[static_cast<size_t>(i)],
              ids[static_cast<size_t>(r[static_cast<size_t>(i)] * static_cast<double>(i + 1))]);
  size_t next = 0;
  std::vector<double> slots;
  std::vector<int64_t> tokens;
  for (size_t b = 0; b < p.lens.size(); ++b) {
    const int64_t nb = (p.lens[b] + P - 1) / P;
    std::vector<int> bl;
    for (int64_t i = 0; i < nb; ++i) {
      if (shares[b] && i < shared_blocks) {
        bl.push_back(c.blocks[0][static_cast<size_t>(i)]);
        continue;
      }
      bl.push_back(ids[next++]);
      for (int64_t o = 0; o < P && i * P + o < p.lens[b]; ++o) {
        slots.push_back(static_cast<double>(bl.back() * P + o));
        tokens.push_back(starts[b] + i * P + o);
      }
    }
    c.blocks.push_back(bl);
  }
  // The cache starts with random values everywhere; kv_cache_write fills the used slots.
  c.k_cache = random_tensor({needed, p.Hkv, p.D, P}, cache_dtype, seed + 5);
  c.v_cache = random_tensor({needed, P, p.Hkv, p.D}, cache_dtype, seed + 6);
  const int64_t n = static_cast<int64_t>(tokens.size());
  Tensor kw = Tensor::empty({n, p.Hkv, p.D}, DType::f32),
         vw = Tensor::empty(kw.shape(), DType::f32);
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(k + tokens[static_cast<size_t>(i)] * p.Hkv * p.D, p.Hkv * p.D,
                kw.data_as<float>() + i * p.Hkv * p.D);
    std::copy_n(v + tokens[static_cast<size_t>(i)] * p.Hkv * p.D, p.Hkv * p.D,
                vw.data_as<float>() + i * p.Hkv * p.D);
  }
  ops::kv_cache_write(kw, vw, tensor_from(slots, {n}, DType::i32), c.k_cache, c.v_cache);
  return c;
}

// Decodes, for every sequence longer than `pos`, the query of its token at `pos` against its
// first pos + 1 cached tokens. Returns out (B', H, D) and the packed token index of each row.
Tensor decode_at(const Packed& p, const Paged& c, int64_t pos, std::vector<int64_t>& tokens) {
  std::vector<double> indptr{0}, indices, last;
  tokens.clear();
  int64_t start = 0;
  for (size_t b = 0; b < p.lens.size(); ++b) {
    if (p.lens[b] > pos) {
      const int64_t nb = pos / c.P + 1;
      for (int64_t i = 0; i < nb; ++i) indices.push_back(c.blocks[b][static_cast<size_t>(i)]);
      indptr.push_back(static_cast<double>(indices.size()));
      last.push_back(static_cast<double>(pos % c.P + 1));
      tokens.push_back(start + pos);
    }
    start += p.lens[b];
  }
  const int64_t B = static_cast<int64_t>(tokens.size());
  Tensor q = Tensor::empty({B, p.H, p.D}, DType::f32);
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(p.q.data_as<float>() + tokens[static_cast<size_t>(b)] * p.H * p.D, p.H * p.D,
                q.data_as<float>() + b * p.H * p.D);
  Tensor out = Tensor::empty({B, p.H, p.D}, DType::f32);
  ops::paged_attention_decode(
      q, c.k_cache, c.v_cache, tensor_from(indptr, {B + 1}, DType::i32),
      tensor_from(indices, {static_cast<int64_t>(indices.size())}, DType::i32),
      tensor_from(last, {B}, DType::i32), out, p.scale);
  return out;
}

// Every decoded row equals the packed attention's row of its token, bit for bit.
void check_decode_matches_packed(Packed& p, int64_t P, int64_t shared_blocks, DType cache_dtype) {
  Paged c = make_paged(p, P, shared_blocks, cache_dtype, 31);
  if (cache_dtype == DType::bf16) {
    // The cache holds bf16-rounded keys and values: the packed reference gets the same.
    for (Tensor* t : {&p.k, &p.v}) {
      float* x = t->data_as<float>();
      for (int64_t i = 0; i < t->numel(); ++i) x[i] = static_cast<float>(bf16(x[i]));
    }
  }
  const Forward f = run_attention(p);
  const int max_len = *std::max_element(p.lens.begin(), p.lens.end());
  // Decode on the AVX-512 path (where this CPU has it) and on the portable one.
  for (bool simd : {true, false}) {
    if (simd && !ops::cpu::attention_simd_active()) continue;
    ops::cpu::set_attention_simd(simd);
    int64_t rows_checked = 0, rows_equal = 0;
    std::vector<int64_t> tokens;
    for (int64_t pos = 0; pos < max_len; ++pos) {
      const Tensor out = decode_at(p, c, pos, tokens);
      for (size_t b = 0; b < tokens.size(); ++b) {
        ++rows_checked;
        rows_equal +=
            bitwise_equal(rows(out, static_cast<int64_t>(b), 1), rows(f.out, tokens[b], 1));
      }
    }
    ops::cpu::set_attention_simd(true);
    INFO("P " << P << " cache " << dtype_name(cache_dtype) << (simd ? " simd" : " portable") << ": "
              << rows_equal << " of " << rows_checked << " decoded rows equal the packed rows");
    CHECK(rows_checked == p.T);
    CHECK(rows_equal == rows_checked);
  }
}

}  // namespace

TEST_CASE("attention matches an f64 naive reference on ragged GQA batches", "[unit]") {
  struct Config {
    int64_t H, Hkv, D;
  };
  for (const Config& cfg : {Config{6, 2, 10}, Config{9, 3, 64}}) {
    const Packed p = make_packed({1, 7, 33, 16, 50}, cfg.H, cfg.Hkv, cfg.D, 11);
    const Forward f = run_attention(p);
    std::vector<double> out64, lse64, out32, lse32;
    naive_attention<double>(p, out64, lse64);
    naive_attention<float>(p, out32, lse32);
    const std::string what = fmt::format("H {} Hkv {} D {}", cfg.H, cfg.Hkv, cfg.D);
    check_within_reference_error(f.out, out64, out32, what + " out");
    check_within_reference_error(f.lse, lse64, lse32, what + " lse");
  }
}

TEST_CASE("attention_backward matches an f64 naive reference on ragged GQA batches", "[unit]") {
  struct Config {
    int64_t H, Hkv, D;
  };
  for (const Config& cfg : {Config{6, 2, 10}, Config{9, 3, 64}}) {
    const Packed p = make_packed({1, 7, 33, 16, 50}, cfg.H, cfg.Hkv, cfg.D, 13);
    const Tensor dout = random_tensor({p.T, p.H, p.D}, DType::f32, 17);
    const Forward f = run_attention(p);
    const Grads g = run_backward(p, f, dout);
    std::vector<double> dq64, dk64, dv64, dq32, dk32, dv32;
    naive_attention_backward<double>(p, dout, dq64, dk64, dv64);
    naive_attention_backward<float>(p, dout, dq32, dk32, dv32);
    const std::string what = fmt::format("H {} Hkv {} D {}", cfg.H, cfg.Hkv, cfg.D);
    check_within_reference_error(g.dq, dq64, dq32, what + " dq");
    check_within_reference_error(g.dk, dk64, dk32, what + " dk");
    check_within_reference_error(g.dv, dv64, dv32, what + " dv");
  }
}

TEST_CASE("attention_backward matches finite differences for q k and v", "[unit]") {
  Packed p = make_packed({5, 19, 33}, 4, 2, 8, 21);
  const Tensor w = random_tensor({p.T, p.H, p.D}, DType::f32, 29);
  const Forward f = run_attention(p);
  const Grads g = run_backward(p, f, w);
  const auto loss = [&] { return weighted_sum(run_attention(p).out, w); };
  check_gradient(p.q, loss, g.dq, "dq");
  check_gradient(p.k, loss, g.dk, "dk");
  check_gradient(p.v, loss, g.dv, "dv");
}

TEST_CASE("paged decode matches packed attention bitwise for ragged batches", "[unit]") {
  for (int64_t P : {8, 12, 32}) {
    Packed small = make_packed({33, 7, 1, 16, 50}, 6, 2, 10, 41);
    check_decode_matches_packed(small, P, 64 / P / 2, DType::f32);
    Packed smol = make_packed({40, 7, 50, 33}, 9, 3, 64, 43);
    check_decode_matches_packed(smol, P, 1, DType::f32);
  }
  Packed qwen = make_packed({40, 7, 50, 1}, 12, 2, 128, 45);
  check_decode_matches_packed(qwen, 16, 2, DType::f32);
  Packed wide = make_packed({40, 7, 50, 33}, 9, 3, 64, 49);  // key blocks in place at P 64
  check_decode_matches_packed(wide, 64, 1, DType::f32);
  Packed bf = make_packed({33, 7, 1, 16, 50}, 9, 3, 64, 47);
  check_decode_matches_packed(bf, 16, 1, DType::bf16);
}

TEST_CASE("attention rows do not depend on the other sequences of the batch", "[unit]") {
  const Packed p = make_packed({1, 7, 33, 16, 50}, 9, 3, 64, 51);
  const Forward all = run_attention(p);
  int64_t start = 0;
  for (int len : p.lens) {
    Packed one = p;
    one.lens = {len};
    one.T = len;
    one.q = rows(p.q, start, len);
    one.k = rows(p.k, start, len);
    one.v = rows(p.v, start, len);
    one.cu = cu_seqlens_of({len});
    const Forward alone = run_attention(one);
    INFO("sequence at " << start << " of length " << len);
    CHECK(bitwise_equal(alone.out, rows(all.out, start, len)));
    CHECK(bitwise_equal(alone.lse, rows(all.lse, start, len)));
    start += len;
  }
}

namespace {

void check_same_bits(const Forward& fa, const Grads& ga, const Forward& fb, const Grads& gb) {
  CHECK(bitwise_equal(fa.out, fb.out));
  CHECK(bitwise_equal(fa.lse, fb.lse));
  CHECK(bitwise_equal(ga.dq, gb.dq));
  CHECK(bitwise_equal(ga.dk, gb.dk));
  CHECK(bitwise_equal(ga.dv, gb.dv));
}

}  // namespace

TEST_CASE("attention and its backward are bitwise the same with 1 or 2 threads", "[unit]") {
  const Packed p = make_packed({1, 7, 33, 16, 50}, 9, 3, 64, 61);
  const Tensor dout = random_tensor({p.T, p.H, p.D}, DType::f32, 67);
  const int saved = num_threads();
  set_num_threads(2);
  const Forward f2 = run_attention(p);
  const Grads g2 = run_backward(p, f2, dout);
  set_num_threads(1);
  const Forward f1 = run_attention(p);
  const Grads g1 = run_backward(p, f1, dout);
  set_num_threads(saved);
  check_same_bits(f1, g1, f2, g2);
}

TEST_CASE("the SIMD and portable attention paths agree bitwise", "[unit]") {
  if (!ops::cpu::attention_simd_active()) {
    WARN("this CPU has neither AVX-512 nor AVX2: only the portable path exists here");
    return;
  }
  for (int64_t D : {int64_t{10}, int64_t{64}, int64_t{128}, int64_t{40}}) {
    const Packed p = make_packed({1, 7, 33, 16, 50}, 4, 2, D, 71);
    const Tensor dout = random_tensor({p.T, p.H, p.D}, DType::f32, 73);
    const Forward fs = run_attention(p);
    const Grads gs = run_backward(p, fs, dout);
    ops::cpu::set_attention_simd(false);
    const Forward fp = run_attention(p);
    const Grads gp = run_backward(p, fp, dout);
    ops::cpu::set_attention_simd(true);
    INFO("D " << D);
    check_same_bits(fs, gs, fp, gp);
  }
}

namespace {

// A packed batch with shared prefixes and the same batch with every prefix copied in front of
// the sequences it prefixes (each prefix also kept as a sequence of its own), and for each
// shared row the rows of the expanded batch that hold it.
struct PrefixCase {
  Packed shared, expanded;
  Tensor prefix;                             // (B) i32 of the shared batch
  std::vector<std::vector<int64_t>> copies;  // per shared row: its rows in the expanded batch
  std::vector<int64_t> query_row;            // per shared row: the expanded row that queries
};

PrefixCase make_prefix_case(int64_t H, int64_t Hkv, int64_t D, uint64_t seed) {
  // Sequence b's length and prefix: plain 20; two branches of sequence 3 (37 tokens, ending
  // inside a key block) placed before it; one after; a 16-token prefix (a whole block) with two.
  const std::vector<int> lens{20, 1, 29, 37, 16, 16, 17, 5};
  const std::vector<int> pre{-1, 3, 3, -1, 3, -1, 5, 5};
  PrefixCase c;
  c.shared = make_packed(lens, H, Hkv, D, seed);
  std::vector<double> pd(pre.begin(), pre.end());
  c.prefix = tensor_from(pd, {static_cast<int64_t>(pre.size())}, DType::i32);
  std::vector<int64_t> starts{0};
  for (int n : lens) starts.push_back(starts.back() + n);
  // Expanded: each sequence in order, a prefixed one as prefix rows + its own rows.
  std::vector<int> elens;
  std::vector<int64_t> src;  // shared row of each expanded row
  c.copies.assign(static_cast<size_t>(c.shared.T), {});
  c.query_row.assign(static_cast<size_t>(c.shared.T), -1);
  for (size_t b = 0; b < lens.size(); ++b) {
    int n = 0;
    if (pre[b] >= 0) {
      const auto p = static_cast<size_t>(pre[b]);
      for (int64_t r = starts[p]; r < starts[p + 1]; ++r, ++n) {
        c.copies[static_cast<size_t>(r)].push_back(static_cast<int64_t>(src.size()));
        src.push_back(r);
      }
    }
    for (int64_t r = starts[b]; r < starts[b + 1]; ++r, ++n) {
      c.copies[static_cast<size_t>(r)].push_back(static_cast<int64_t>(src.size()));
      c.query_row[static_cast<size_t>(r)] = static_cast<int64_t>(src.size());
      src.push_back(r);
    }
    elens.push_back(n);
  }
  c.expanded = make_packed(elens, H, Hkv, D, seed);
  for (size_t e = 0; e < src.size(); ++e) {
    const auto i = static_cast<int64_t>(e);
    for (auto [dst, from] : {std::pair{&c.expanded.q, &c.shared.q},
                             {&c.expanded.k, &c.shared.k},
                             {&c.expanded.v, &c.shared.v}})
      dst->narrow(i, 1).copy_from(from->narrow(src[e], 1));
  }
  return c;
}

Forward run_prefixed(const PrefixCase& c) {
  const Packed& p = c.shared;
  Forward f{Tensor::empty({p.T, p.H, p.D}, DType::f32), Tensor::empty({p.T, p.H}, DType::f32)};
  ops::attention(p.q, p.k, p.v, p.cu, c.prefix, f.out, f.lse, p.scale);
  return f;
}

Grads run_prefixed_backward(const PrefixCase& c, const Forward& f, const Tensor& dout) {
  const Packed& p = c.shared;
  Grads g{Tensor::empty(p.q.shape(), DType::f32), Tensor::empty(p.k.shape(), DType::f32),
          Tensor::empty(p.v.shape(), DType::f32)};
  ops::attention_backward(dout, p.q, p.k, p.v, f.out, f.lse, p.cu, c.prefix, g.dq, g.dk, g.dv,
                          p.scale);
  return g;
}

}  // namespace

TEST_CASE("attention with shared prefixes gives every row the bits of the expanded batch",
          "[unit]") {
  struct Config {
    int64_t H, Hkv, D;
  };
  for (const Config& cfg : {Config{6, 2, 10}, Config{9, 3, 64}}) {
    const PrefixCase c = make_prefix_case(cfg.H, cfg.Hkv, cfg.D, 301);
    const Forward fs = run_prefixed(c);
    const Forward fe = run_attention(c.expanded);
    int64_t equal = 0;
    for (int64_t r = 0; r < c.shared.T; ++r) {
      const int64_t e = c.query_row[static_cast<size_t>(r)];
      equal += bitwise_equal(rows(fs.out, r, 1), rows(fe.out, e, 1)) &&
               bitwise_equal(rows(fs.lse, r, 1), rows(fe.lse, e, 1));
    }
    INFO("H " << cfg.H << " Hkv " << cfg.Hkv << " D " << cfg.D);
    CHECK(equal == c.shared.T);

    // Backward: the expanded batch's gradient with dout only on the querying rows; a shared
    // row's dk and dv are the sums over its copies, its dq the querying copy's.
    const Tensor dout = random_tensor({c.shared.T, cfg.H, cfg.D}, DType::f32, 303);
    Tensor dout_e = Tensor::zeros({c.expanded.T, cfg.H, cfg.D}, DType::f32);
    for (int64_t r = 0; r < c.shared.T; ++r)
      dout_e.narrow(c.query_row[static_cast<size_t>(r)], 1).copy_from(dout.narrow(r, 1));
    const Grads gs = run_prefixed_backward(c, fs, dout);
    std::vector<double> dq64, dk64, dv64;
    naive_attention_backward<double>(c.expanded, dout_e, dq64, dk64, dv64);
    const int64_t qw = cfg.H * cfg.D, kw = cfg.Hkv * cfg.D;
    std::vector<double> dq(static_cast<size_t>(c.shared.T * qw)),
        dk(static_cast<size_t>(c.shared.T * kw)), dv(dk.size());
    for (int64_t r = 0; r < c.shared.T; ++r) {
      const int64_t e = c.query_row[static_cast<size_t>(r)];
      for (int64_t i = 0; i < qw; ++i)
        dq[static_cast<size_t>(r * qw + i)] = dq64[static_cast<size_t>(e * qw + i)];
      for (int64_t e2 : c.copies[static_cast<size_t>(r)])
        for (int64_t i = 0; i < kw; ++i) {
          dk[static_cast<size_t>(r * kw + i)] += dk64[static_cast<size_t>(e2 * kw + i)];
          dv[static_cast<size_t>(r * kw + i)] += dv64[static_cast<size_t>(e2 * kw + i)];
        }
    }
    for (auto [name, got, want] :
         {std::tuple{"dq", &gs.dq, &dq}, {"dk", &gs.dk, &dk}, {"dv", &gs.dv, &dv}}) {
      const double err = max_abs_diff(to_f64(*got), *want), scale = max_abs(*want);
      INFO(name << ": max |error| " << err << " against max |value| " << scale);
      CHECK(err <= 1e-5 * scale);
    }
  }
}

TEST_CASE("attention with shared prefixes: AVX-512 and portable paths, 1 and 2 threads agree",
          "[unit]") {
  const PrefixCase c = make_prefix_case(9, 3, 64, 311);
  const Tensor dout = random_tensor({c.shared.T, 9, 64}, DType::f32, 313);
  const int saved = num_threads();
  set_num_threads(2);
  const Forward f2 = run_prefixed(c);
  const Grads g2 = run_prefixed_backward(c, f2, dout);
  set_num_threads(1);
  ops::cpu::set_attention_simd(false);
  const Forward f1 = run_prefixed(c);
  const Grads g1 = run_prefixed_backward(c, f1, dout);
  ops::cpu::set_attention_simd(true);
  set_num_threads(saved);
  check_same_bits(f1, g1, f2, g2);
}

TEST_CASE("attention rejects a bad prefix", "[unit]") {
  const Packed p = make_packed({3, 5, 4}, 4, 2, 8, 321);
  Tensor out = Tensor::empty({p.T, p.H, p.D}, DType::f32);
  Tensor lse = Tensor::empty({p.T, p.H}, DType::f32);
  const auto run = [&](const Tensor& prefix) {
    ops::attention(p.q, p.k, p.v, p.cu, prefix, out, lse, p.scale);
  };
  CHECK_NOTHROW(run(tensor_from({-1, 0, 0}, {3}, DType::i32)));
  CHECK_NOTHROW(run(tensor_from({2, -1, -1}, {3}, DType::i32)));
  CHECK_THROWS_AS(run(tensor_from({-1, 1, 0}, {3}, DType::i32)), Error);   // itself
  CHECK_THROWS_AS(run(tensor_from({-1, 0, 1}, {3}, DType::i32)), Error);   // a prefixed one
  CHECK_THROWS_AS(run(tensor_from({-1, 3, 0}, {3}, DType::i32)), Error);   // out of range
  CHECK_THROWS_AS(run(tensor_from({-1, -2, 0}, {3}, DType::i32)), Error);  // negative
  CHECK_THROWS_AS(run(tensor_from({-1, 0}, {2}, DType::i32)), Error);      // one per sequence
  CHECK_THROWS_AS(run(tensor_from({-1, 0, 0}, {3}, DType::f32)), Error);
  Tensor dq = Tensor::empty(p.q.shape(), DType::f32), dk = Tensor::empty(p.k.shape(), DType::f32);
  Tensor dv = Tensor::empty(p.k.shape(), DType::f32);
  CHECK_THROWS_AS(
      ops::attention_backward(out, p.q, p.k, p.v, out, lse, p.cu,
                              tensor_from({1, 0, -1}, {3}, DType::i32), dq, dk, dv, p.scale),
      Error);
}

TEST_CASE("kv_cache_write stores keys and values at their slots in f32 and bf16 caches", "[unit]") {
  const int64_t T = 13, Hkv = 3, D = 10, NB = 7, P = 4;
  const Tensor k = random_tensor({T, Hkv, D}, DType::f32, 81);
  const Tensor v = random_tensor({T, Hkv, D}, DType::f32, 82);
  std::vector<double> slots;
  for (int64_t t = 0; t < T; ++t) slots.push_back(static_cast<double>((t * 11 + 5) % (NB * P)));
  const Tensor sm = tensor_from(slots, {T}, DType::i32);
  // Element i = h * D + d of slot s: in v_cache by slot, in k_cache transposed per block.
  const auto k_at = [&](int64_t s, int64_t i) {
    return static_cast<size_t>(((s / P) * Hkv * D + i) * P + s % P);
  };
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor kc = random_tensor({NB, Hkv, D, P}, dt, 83);
    Tensor vc = random_tensor({NB, P, Hkv, D}, dt, 84);
    const std::vector<double> kc0 = to_f64(kc), vc0 = to_f64(vc);
    ops::kv_cache_write(k, v, sm, kc, vc);
    const std::vector<double> kc1 = to_f64(kc), vc1 = to_f64(vc);
    const std::vector<double> kr = to_f64(k), vr = to_f64(v);
    std::vector<bool> written(static_cast<size_t>(NB * P), false);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = static_cast<int64_t>(slots[static_cast<size_t>(t)]);
      written[static_cast<size_t>(s)] = true;
      for (int64_t i = 0; i < Hkv * D; ++i) {
        const size_t src = static_cast<size_t>(t * Hkv * D + i);
        const size_t dst = static_cast<size_t>(s * Hkv * D + i);
        const double want_k =
            dt == DType::f32 ? kr[src] : static_cast<float>(bf16(static_cast<float>(kr[src])));
        const double want_v =
            dt == DType::f32 ? vr[src] : static_cast<float>(bf16(static_cast<float>(vr[src])));
        REQUIRE(kc1[k_at(s, i)] == want_k);
        REQUIRE(vc1[dst] == want_v);
      }
    }
    for (int64_t s = 0; s < NB * P; ++s) {
      if (written[static_cast<size_t>(s)]) continue;
      for (int64_t i = 0; i < Hkv * D; ++i) {
        const size_t at = static_cast<size_t>(s * Hkv * D + i);
        REQUIRE(kc1[k_at(s, i)] == kc0[k_at(s, i)]);
        REQUIRE(vc1[at] == vc0[at]);
      }
    }
  }
}

TEST_CASE("attention ops throw on bad shapes and out-of-range indices", "[unit]") {
  const Packed p = make_packed({3, 5}, 4, 2, 8, 91);
  Tensor out = Tensor::empty({p.T, p.H, p.D}, DType::f32);
  Tensor lse = Tensor::empty({p.T, p.H}, DType::f32);
  // cu_seqlens not increasing, and not ending at T.
  CHECK_THROWS_AS(
      ops::attention(p.q, p.k, p.v, tensor_from({0, 5, 3}, {3}, DType::i32), {}, out, lse, p.scale),
      Error);
  CHECK_THROWS_AS(
      ops::attention(p.q, p.k, p.v, tensor_from({0, 3, 7}, {3}, DType::i32), {}, out, lse, p.scale),
      Error);
  // H not a multiple of Hkv.
  const Tensor k3 = random_tensor({p.T, 3, p.D}, DType::f32, 92);
  CHECK_THROWS_AS(ops::attention(p.q, k3, k3, p.cu, {}, out, lse, p.scale), Error);
  CHECK_THROWS_AS(
      ops::attention(p.q, p.k, p.v, p.cu, {}, Tensor::empty({p.T, p.H}, DType::f32), lse, p.scale),
      Error);
  Tensor dq = Tensor::empty(p.q.shape(), DType::f32), dk = Tensor::empty(p.k.shape(), DType::f32);
  CHECK_THROWS_AS(
      ops::attention_backward(out, p.q, p.k, p.v, out, lse, p.cu, {}, dq, dk, dq, p.scale), Error);
  CHECK_THROWS_AS(
      ops::attention_backward(out, p.q, p.k, p.v, out, lse, tensor_from({0, 4, 7}, {3}, DType::i32),
                              {}, dq, dk, Tensor::empty(p.k.shape(), DType::f32), p.scale),
      Error);
  // Cache slots and blocks.
  const int64_t NB = 3, P = 4;
  Tensor kc = random_tensor({NB, 2, 8, P}, DType::f32, 93);
  Tensor vc = random_tensor({NB, P, 2, 8}, DType::f32, 94);
  const Tensor k2 = random_tensor({2, 2, 8}, DType::f32, 95);
  CHECK_THROWS_AS(ops::kv_cache_write(k2, k2, tensor_from({1, 12}, {2}, DType::i32), kc, vc),
                  Error);
  CHECK_THROWS_AS(ops::kv_cache_write(k2, k2, tensor_from({-1, 2}, {2}, DType::i32), kc, vc),
                  Error);
  CHECK_THROWS_AS(ops::kv_cache_write(k2, k2, tensor_from({1, 2}, {2}, DType::i32), kc,
                                      random_tensor({NB, P, 2, 8}, DType::bf16, 96)),
                  Error);
  // A k_cache laid out by slot, like v_cache.
  CHECK_THROWS_WITH(ops::kv_cache_write(k2, k2, tensor_from({1, 2}, {2}, DType::i32), vc, vc),
                    Catch::Contains("transposed"));
  const Tensor q = random_tensor({2, 4, 8}, DType::f32, 97);
  Tensor o = Tensor::empty({2, 4, 8}, DType::f32);
  const Tensor indptr = tensor_from({0, 1, 3}, {3}, DType::i32);
  const auto decode = [&](const Tensor& ptr, const Tensor& idx, const Tensor& last) {
    ops::paged_attention_decode(q, kc, vc, ptr, idx, last, o, 0.3f);
  };
  CHECK_NOTHROW(decode(indptr, tensor_from({2, 0, 1}, {3}, DType::i32),
                       tensor_from({3, 4}, {2}, DType::i32)));
  CHECK_THROWS_AS(
      decode(indptr, tensor_from({2, 3, 1}, {3}, DType::i32), tensor_from({3, 4}, {2}, DType::i32)),
      Error);
  CHECK_THROWS_AS(decode(indptr, tensor_from({2, -1, 1}, {3}, DType::i32),
                         tensor_from({3, 4}, {2}, DType::i32)),
                  Error);
  CHECK_THROWS_AS(
      decode(indptr, tensor_from({2, 0, 1}, {3}, DType::i32), tensor_from({0, 4}, {2}, DType::i32)),
      Error);
  CHECK_THROWS_AS(
      decode(indptr, tensor_from({2, 0, 1}, {3}, DType::i32), tensor_from({3, 5}, {2}, DType::i32)),
      Error);
  CHECK_THROWS_AS(
      decode(tensor_from({0, 1, 4}, {3}, DType::i32), tensor_from({2, 0, 1}, {3}, DType::i32),
             tensor_from({3, 4}, {2}, DType::i32)),
      Error);
  CHECK_THROWS_AS(
      decode(tensor_from({0, 2, 1}, {3}, DType::i32), tensor_from({2, 0, 1}, {3}, DType::i32),
             tensor_from({3, 4}, {2}, DType::i32)),
      Error);
}

namespace {

// Parity inputs: a packed batch as {q, k, v, cu_seqlens}.
std::vector<Tensor> packed_inputs(const std::vector<int>& lens, int64_t H, int64_t Hkv, int64_t D,
                                  uint64_t seed) {
  const Packed p = make_packed(lens, H, Hkv, D, seed);
  return {p.q, p.k, p.v, p.cu};
}

float scale_of(const Tensor& q) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.size(2))));
}

void add_packed_cases(const std::vector<int>& lens, int64_t H, int64_t Hkv, int64_t D) {
  const std::string shape =
      fmt::format("lens {} H {} Hkv {} D {}", fmt::join(lens, "/"), H, Hkv, D);
  add_parity_case({
      .name = "attention " + shape,
      .inputs = [=](uint64_t seed) { return packed_inputs(lens, H, Hkv, D, seed); },
      .outputs =
          [](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{Tensor::zeros(in[0].shape(), DType::f32),
                                       Tensor::zeros({in[0].size(0), in[0].size(1)}, DType::f32)};
          },
      .run =
          [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
            ops::attention(in[0], in[1], in[2], in[3], {}, out[0], out[1], scale_of(in[0]));
          },
      .max_nmse = 1e-9,
  });
  // Backward inputs: q, k, v, cu_seqlens, dout, and out and lse from the CPU forward.
  add_parity_case({
      .name = "attention_backward " + shape,
      .inputs =
          [=](uint64_t seed) {
            std::vector<Tensor> in = packed_inputs(lens, H, Hkv, D, seed);
            Tensor out = Tensor::empty(in[0].shape(), DType::f32);
            Tensor lse = Tensor::empty({in[0].size(0), in[0].size(1)}, DType::f32);
            ops::attention(in[0], in[1], in[2], in[3], {}, out, lse, scale_of(in[0]));
            in.push_back(random_tensor(in[0].shape(), DType::f32, seed + 9));
            in.push_back(out);
            in.push_back(lse);
            return in;
          },
      .outputs =
          [](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{Tensor::zeros(in[0].shape(), DType::f32),
                                       Tensor::zeros(in[1].shape(), DType::f32),
                                       Tensor::zeros(in[2].shape(), DType::f32)};
          },
      .run =
          [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
            ops::attention_backward(in[4], in[0], in[1], in[2], in[5], in[6], in[3], {}, out[0],
                                    out[1], out[2], scale_of(in[0]));
          },
      .max_nmse = 1e-9,
  });
}

// Decode inputs: q (B, H, D), the caches, kv_indptr, kv_indices, kv_last_len: B sequences of
// the given lengths over shuffled blocks of P slots, the first block shared by all of them.
std::vector<Tensor> decode_inputs(const std::vector<int>& lens, int64_t H, int64_t Hkv, int64_t D,
                                  int64_t P, DType dt, uint64_t seed) {
  const int64_t B = static_cast<int64_t>(lens.size());
  std::vector<double> indptr{0}, indices, last;
  int64_t next = 1;  // block 0 is the shared one
  for (int len : lens) {
    const int64_t nb = (len + P - 1) / P;
    indices.push_back(0);
    for (int64_t i = 1; i < nb; ++i) indices.push_back(static_cast<double>((next++ * 7) % 97));
    indptr.push_back(static_cast<double>(indices.size()));
    last.push_back(static_cast<double>((len - 1) % P + 1));
  }
  return {random_tensor({B, H, D}, DType::f32, seed, -2.0, 2.0),
          random_tensor({97, Hkv, D, P}, dt, seed + 1, -2.0, 2.0),
          random_tensor({97, P, Hkv, D}, dt, seed + 2),
          tensor_from(indptr, {B + 1}, DType::i32),
          tensor_from(indices, {static_cast<int64_t>(indices.size())}, DType::i32),
          tensor_from(last, {B}, DType::i32)};
}

}  // namespace

TANDEM_PARITY_CASES(attention) {
  add_packed_cases({1, 7, 33, 16, 50}, 6, 2, 10);
  add_packed_cases({1, 7, 33, 16, 50}, 9, 3, 64);
  add_packed_cases({77, 130}, 12, 2, 128);
  for (DType dt : {DType::f32, DType::bf16}) {
    add_parity_case({
        .name = fmt::format(
            "kv_cache_write {} cache (37, 3, 64) into (11, 3, 64, 16) and (11, 16, 3, 64)",
            dtype_name(dt)),
        .inputs =
            [](uint64_t seed) {
              std::vector<double> slots;
              for (int t = 0; t < 37; ++t) slots.push_back((t * 29 + 3) % 176);
              return std::vector<Tensor>{random_tensor({37, 3, 64}, DType::f32, seed),
                                         random_tensor({37, 3, 64}, DType::f32, seed + 1),
                                         tensor_from(slots, {37}, DType::i32)};
            },
        .outputs =
            [dt](const std::vector<Tensor>&) {
              return std::vector<Tensor>{random_tensor({11, 3, 64, 16}, dt, 5),
                                         random_tensor({11, 16, 3, 64}, dt, 6)};
            },
        .run =
            [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::kv_cache_write(in[0], in[1], in[2], out[0], out[1]);
            },
        .max_nmse = 0.0,  // copies and round-to-nearest-even conversions are exact functions
    });
    for (int64_t P : {16, 12}) {
      add_parity_case({
          .name = fmt::format("paged_attention_decode {} cache P {} lens 1/40/200/17 H 9 Hkv 3 "
                              "D 64",
                              dtype_name(dt), P),
          .inputs =
              [dt, P](uint64_t seed) {
                return decode_inputs({1, 40, 200, 17}, 9, 3, 64, P, dt, seed);
              },
          .outputs =
              [](const std::vector<Tensor>& in) {
                return std::vector<Tensor>{Tensor::zeros(in[0].shape(), DType::f32)};
              },
          .run =
              [](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
                ops::paged_attention_decode(in[0], in[1], in[2], in[3], in[4], in[5], out[0],
                                            scale_of(in[0]));
              },
          // The cache widens to f32 exactly on both backends; only the summation order differs.
          .max_nmse = dt == DType::f32 ? 1e-9 : 1e-8,
      });
    }
  }
}
