// The parity table's registry and runner, and the tests that walk it.
#include "tests/kernels/parity.h"

#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <cstring>

#include "tests/testutil.h"

namespace tandem::test {
namespace {

constexpr size_t kGuardBytes = 256;
constexpr uint8_t kGuardByte = 0xA5;

std::vector<ParityCase>& registry() {
  static std::vector<ParityCase> cases;
  return cases;
}

struct Guarded {
  std::shared_ptr<void> base;  // the whole buffer, guards included
  Tensor view;                 // the output inside it
  size_t bytes;
};

Guarded make_guarded(const Tensor& init, Device d) {
  const size_t total = init.nbytes() + 2 * kGuardBytes;
  std::vector<uint8_t> host(total, kGuardByte);
  std::memcpy(host.data() + kGuardBytes, init.data(), init.nbytes());
  void* p = device_alloc(d, total);
  std::shared_ptr<void> base(p, [d](void* q) { device_free(d, q); });
  copy_bytes(p, d, host.data(), Device::cpu(), total);
  return {base, Tensor::wrap(static_cast<char*>(p) + kGuardBytes, init.shape(), init.dtype(), d),
          total};
}

bool guards_intact(const Guarded& g, Device d) {
  std::vector<uint8_t> host(g.bytes);
  copy_bytes(host.data(), Device::cpu(), g.base.get(), d, g.bytes);
  for (size_t i = 0; i < kGuardBytes; ++i)
    if (host[i] != kGuardByte || host[g.bytes - 1 - i] != kGuardByte) return false;
  return true;
}

bool is_int(DType t) { return t == DType::i32 || t == DType::i64 || t == DType::u8; }

}  // namespace

int add_parity_case(ParityCase c) {
  registry().push_back(std::move(c));
  return static_cast<int>(registry().size()) - 1;
}

const std::vector<ParityCase>& parity_cases() { return registry(); }

const std::vector<std::string>& ops_with_parity() {
  static const std::vector<std::string> ops = {"matmul",
                                               "matmul_backward_input",
                                               "matmul_backward_weight",
                                               "cast",
                                               "scale",
                                               "add",
                                               "random_uniform",
                                               "sum_squares",
                                               "embedding",
                                               "embedding_backward",
                                               "rmsnorm",
                                               "add_rmsnorm",
                                               "rmsnorm_backward",
                                               "rope",
                                               "rope_backward",
                                               "swiglu",
                                               "swiglu_backward",
                                               "attention",
                                               "attention_backward",
                                               "kv_cache_write",
                                               "paged_attention_decode",
                                               "logprob_gather",
                                               "logprob_gather_backward",
                                               "adamw",
                                               "sample",
                                               "sample_shard_maxima",
                                               "sample_shard_stats",
                                               "sample_shard_chain",
                                               "sample_shard_counts",
                                               "sample_shard_candidates",
                                               "sample_shard_decide",
                                               "sample_shard_draws"};
  return ops;
}

std::vector<Tensor> run_guarded(const ParityCase& c, const std::vector<Tensor>& cpu_inputs,
                                Device device) {
  std::vector<Tensor> inputs;
  for (const Tensor& t : cpu_inputs) inputs.push_back(device.is_cpu() ? t : t.to(device));
  std::vector<Guarded> outs;
  std::vector<Tensor> views;
  for (const Tensor& init : c.outputs(cpu_inputs)) {
    outs.push_back(make_guarded(init, device));
    views.push_back(outs.back().view);
  }
  c.run(inputs, views);
  Stream{device, nullptr}.synchronize();
  std::vector<Tensor> results;
  for (size_t i = 0; i < outs.size(); ++i) {
    INFO(c.name << " on " << device.str() << ": output " << i);
    CHECK(guards_intact(outs[i], device));
    results.push_back(views[i].to(Device::cpu()));
  }
  return results;
}

}  // namespace tandem::test

using namespace tandem;
using namespace tandem::test;

TEST_CASE("the parity table holds a case for every op", "[unit]") {
  for (const std::string& op : ops_with_parity()) {
    bool found = false;
    for (const ParityCase& c : parity_cases()) found |= c.name.rfind(op + " ", 0) == 0;
    INFO("no parity case for op " << op);
    CHECK(found);
  }
}

TEST_CASE("every parity case runs deterministically on the CPU with intact guard bytes", "[unit]") {
  for (const ParityCase& c : parity_cases()) {
    INFO(c.name);
    const std::vector<Tensor> in = c.inputs(1234);
    const std::vector<Tensor> a = run_guarded(c, in, Device::cpu());
    const std::vector<Tensor> b = run_guarded(c, in, Device::cpu());
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("output " << i);
      CHECK(all_finite(a[i]));
      CHECK(bitwise_equal(a[i], b[i]));
    }
  }
}

TEST_CASE("every CUDA op matches the CPU op on random inputs", "[gpu]") {
  skip_without_gpu();
  std::string table = fmt::format("{:<60} {:>12} {:>10}\n", "case", "nmse/match", "result");
  int failed = 0;
  for (const ParityCase& c : parity_cases()) {
    INFO(c.name);
    const std::vector<Tensor> in = c.inputs(99);
    const std::vector<Tensor> cpu = run_guarded(c, in, Device::cpu());
    std::vector<Tensor> gpu;
    try {
      gpu = run_guarded(c, in, Device::cuda());
    } catch (const Error& e) {  // one broken op must not hide the rest of the table
      ++failed;
      table += fmt::format("{:<60} {:>12} {:>10}  {}\n", c.name, "-", "ERROR", e.what());
      CHECK(std::string(e.what()).empty());
      continue;
    }
    bool ok = true;
    double worst = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
      ok &= all_finite(gpu[i]);
      const std::vector<double> a = to_f64(gpu[i]), b = to_f64(cpu[i]);
      if (is_int(cpu[i].dtype())) {
        size_t same = 0;
        for (size_t j = 0; j < a.size(); ++j) same += a[j] == b[j];
        const double match =
            a.empty() ? 1.0 : static_cast<double>(same) / static_cast<double>(a.size());
        worst = std::max(worst, 1.0 - match);
        ok &= match >= c.min_int_match;
      } else {
        const double e = nmse(a, b);
        worst = std::max(worst, e);
        ok &= e <= c.max_nmse;
      }
    }
    failed += ok ? 0 : 1;
    table += fmt::format("{:<60} {:>12.3e} {:>10}\n", c.name, worst, ok ? "ok" : "FAIL");
    CHECK(ok);
  }
  fmt::print("{}{} of {} parity cases failed\n", table, failed, parity_cases().size());
}
