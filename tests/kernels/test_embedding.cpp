// embedding and embedding_backward: exact gathers, token-order sums, finite differences, ids
// out of range, thread-count determinism, and their parity cases.
#include <catch2/catch.hpp>

#include "core/parallel.h"
#include "kernels/ops.h"
#include "tests/kernels/parity.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::test;

namespace {

Tensor f32(const Shape& s) { return Tensor::empty(s, DType::f32); }

// dtable0 (V, C) plus dout's rows added at ids in token order, in R (double: the truth; float:
// the plain loop the op must equal).
template <class R>
std::vector<double> scatter_reference(const Tensor& ids, const Tensor& dout,
                                      const std::vector<double>& dtable0, int64_t C) {
  const std::vector<double> id = to_f64(ids), g = to_f64(dout);
  std::vector<R> acc(dtable0.begin(), dtable0.end());
  for (size_t t = 0; t < id.size(); ++t)
    for (int64_t c = 0; c < C; ++c)
      acc[static_cast<size_t>(static_cast<int64_t>(id[t]) * C + c)] +=
          static_cast<R>(g[t * static_cast<size_t>(C) + static_cast<size_t>(c)]);
  return {acc.begin(), acc.end()};
}

}  // namespace

TEST_CASE("embedding copies the table rows exactly for f32 and bf16 tables", "[unit]") {
  for (int64_t T : {7, 13}) {
    for (int64_t C : {37, 576}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        const int64_t V = 101;
        const Tensor table = random_tensor({V, C}, dt, 3 + C);
        const Tensor ids = random_ints({T}, DType::i32, 4 + T, 0, V);
        Tensor out = f32({T, C});
        ops::embedding(ids, table, out);
        const std::vector<double> tv = to_f64(table), got = to_f64(out);
        const int32_t* id = ids.data_as<int32_t>();
        int wrong = 0;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < C; ++c)
            wrong += got[static_cast<size_t>(t * C + c)] != tv[static_cast<size_t>(id[t] * C + c)];
        INFO("T " << T << " C " << C << " table " << dtype_name(dt));
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("embedding gives each row the same bits in any batch", "[unit]") {
  const int64_t T = 64, V = 301, C = 37;
  const Tensor table = random_tensor({V, C}, DType::bf16, 11);
  const Tensor ids = random_ints({T}, DType::i32, 12, 0, V);
  Tensor full = f32({T, C});
  ops::embedding(ids, table, full);
  for (int64_t n = 1; n <= T; ++n) {
    const int64_t start = (n * 7) % (T - n + 1);
    Tensor part = f32({n, C});
    ops::embedding(ids.narrow(start, n), table, part);
    INFO("rows " << start << ".." << start + n);
    CHECK(bitwise_equal(part, full.narrow(start, n)));
  }
}

TEST_CASE("embedding ops throw naming the position and the id of an id out of range", "[unit]") {
  const int64_t T = 13, V = 101, C = 37;
  const Tensor table = random_tensor({V, C}, DType::f32, 21);
  Tensor ids = random_ints({T}, DType::i32, 22, 0, V);
  ids.data_as<int32_t>()[9] = -3;
  ids.data_as<int32_t>()[4] = static_cast<int32_t>(V);
  Tensor out = f32({T, C});
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(ops::embedding(ids, table, out),
                    Contains("embedding") && Contains("ids[4] = 101") && Contains("[0, 101)"));
  ids.data_as<int32_t>()[4] = 0;
  CHECK_THROWS_WITH(ops::embedding(ids, table, out), Contains("ids[9] = -3"));

  // The backward checks before writing: dtable keeps its contents.
  const Tensor dout = random_tensor({T, C}, DType::f32, 23);
  const Tensor before = random_tensor({V, C}, DType::f32, 24);
  Tensor dtable = before.to(Device::cpu());
  CHECK_THROWS_WITH(ops::embedding_backward(ids, dout, dtable),
                    Contains("embedding_backward") && Contains("ids[9] = -3"));
  CHECK(bitwise_equal(dtable, before));
}

TEST_CASE("embedding ops reject mismatched shapes and dtypes naming the op", "[unit]") {
  const int64_t T = 7, V = 50, C = 37;
  const Tensor table = random_tensor({V, C}, DType::f32, 31);
  const Tensor ids = random_ints({T}, DType::i32, 32, 0, V);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(ops::embedding(random_ints({T}, DType::i64, 1, 0, V), table, f32({T, C})),
                    Contains("embedding") && Contains("ids"));
  CHECK_THROWS_WITH(ops::embedding(ids.view({1, T}), table, f32({T, C})), Contains("ids"));
  CHECK_THROWS_WITH(ops::embedding(ids, random_tensor({V, C}, DType::f16, 1), f32({T, C})),
                    Contains("table"));
  CHECK_THROWS_WITH(ops::embedding(ids, table, f32({T, C + 1})),
                    Contains("embedding") && Contains("out"));
  CHECK_THROWS_WITH(ops::embedding(ids, table, Tensor::empty({T, C}, DType::bf16)),
                    Contains("out"));
  CHECK_THROWS_WITH(ops::embedding_backward(ids, f32({T + 1, C}), f32({V, C})),
                    Contains("embedding_backward") && Contains("dout"));
  CHECK_THROWS_WITH(ops::embedding_backward(ids, f32({T, C}), Tensor::empty({V, C}, DType::bf16)),
                    Contains("embedding_backward") && Contains("dtable"));
}

TEST_CASE("embedding_backward sums repeated ids in token order and matches finite differences",
          "[unit]") {
  for (int64_t C : {37, 576}) {
    const int64_t T = 13, V = 11;  // fewer rows than tokens: ids repeat
    const Tensor ids = random_ints({T}, DType::i32, 41 + C, 0, V);
    const Tensor dout = random_tensor({T, C}, DType::f32, 42 + C);
    const Tensor start = random_tensor({V, C}, DType::f32, 43 + C);
    for (bool accumulate : {false, true}) {
      Tensor dtable = start.to(Device::cpu());
      ops::embedding_backward(ids, dout, dtable, accumulate);
      const std::vector<double> init =
          accumulate ? to_f64(start) : std::vector<double>(static_cast<size_t>(V * C), 0.0);
      const std::vector<double> truth = scatter_reference<double>(ids, dout, init, C);
      const std::vector<double> plain = scatter_reference<float>(ids, dout, init, C);
      check_within_reference_error(dtable, truth, plain,
                                   fmt::format("embedding_backward C {} acc {}", C, accumulate));
      // The plain f32 loop in token order is exactly what the op does.
      CHECK(max_abs_diff(to_f64(dtable), plain) == 0.0);
    }
    Tensor table = random_tensor({V, C}, DType::f32, 44 + C);
    auto loss = [&] {
      Tensor out = f32({T, C});
      ops::embedding(ids, table, out);
      return weighted_sum(out, dout);
    };
    Tensor dtable = f32({V, C});
    ops::embedding_backward(ids, dout, dtable);
    check_gradient(table, loss, dtable, fmt::format("embedding d/dtable C {}", C));
  }
}

TEST_CASE("embedding_backward gives the same bits with one or two threads", "[unit]") {
  const int64_t T = 517, V = 23, C = 300;
  const Tensor ids = random_ints({T}, DType::i32, 51, 0, V);
  const Tensor dout = random_tensor({T, C}, DType::f32, 52);
  const int threads = num_threads();
  std::vector<Tensor> results;
  for (int n : {1, 2}) {
    set_num_threads(n);
    Tensor dtable = f32({V, C});
    ops::embedding_backward(ids, dout, dtable);
    results.push_back(dtable);
  }
  set_num_threads(threads);
  CHECK(bitwise_equal(results[0], results[1]));
}

TANDEM_PARITY_CASES(embedding) {
  struct Gather {
    int64_t T, V, C;
    DType table;
  };
  for (Gather g : {Gather{13, 1001, 576, DType::f32}, Gather{517, 5003, 64, DType::bf16},
                   Gather{7, 49152, 37, DType::bf16}}) {
    add_parity_case({
        .name = fmt::format("embedding {} table ({} tokens) V {} C {}", dtype_name(g.table), g.T,
                            g.V, g.C),
        .inputs =
            [g](uint64_t seed) {
              return std::vector<Tensor>{random_ints({g.T}, DType::i32, seed, 0, g.V),
                                         random_tensor({g.V, g.C}, g.table, seed + 1)};
            },
        .outputs =
            [g](const std::vector<Tensor>&) {
              return std::vector<Tensor>{Tensor::zeros({g.T, g.C}, DType::f32)};
            },
        .run = [](const std::vector<Tensor>& in,
                  const std::vector<Tensor>& out) { ops::embedding(in[0], in[1], out[0]); },
        .max_nmse = 0.0,  // a copy: bitwise the same
    });
  }
  struct Scatter {
    int64_t T, V, C;
    bool accumulate;
  };
  for (Scatter s : {Scatter{513, 97, 200, true}, Scatter{13, 1001, 37, false},
                    Scatter{2049, 3001, 576, true}}) {
    add_parity_case({
        .name = fmt::format("embedding_backward ({} tokens) V {} C {}{}", s.T, s.V, s.C,
                            s.accumulate ? " accumulate" : ""),
        .inputs =
            [s](uint64_t seed) {
              return std::vector<Tensor>{random_ints({s.T}, DType::i32, seed, 0, s.V),
                                         random_tensor({s.T, s.C}, DType::f32, seed + 1)};
            },
        .outputs =
            [s](const std::vector<Tensor>&) {
              return std::vector<Tensor>{random_tensor({s.V, s.C}, DType::f32, 77)};
            },
        .run =
            [s](const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
              ops::embedding_backward(in[0], in[1], out[0], s.accumulate);
            },
        .max_nmse = 0.0,  // the same f32 additions in the same (token) order
    });
  }
}
