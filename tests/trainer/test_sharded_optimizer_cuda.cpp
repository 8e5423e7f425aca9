// ShardedAdamW with its weights, gradients and moments on a CUDA device and its collectives over
// NCCL (one rank on one GPU: NCCL refuses two ranks of one communicator on the same device): every
// level against the CPU ShardedAdamW on the same gradients, the decoder on CUDA trained through the
// unit hooks against AdamW on whole CUDA weights, the compute marks the communication thread waits
// for, and the refusal of the fixed-point sums. Skipped without a GPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "core/device.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "tests/model/tiny_model.h"
#include "tests/testutil.h"
#include "trainer/optimizer.h"

namespace tandem::trainer {
namespace {

using model::NamedTensor;
using model::Weights;

constexpr ShardLevel kLevels[] = {ShardLevel::optimizer, ShardLevel::gradients,
                                  ShardLevel::parameters};

// A one-rank communicator whose CUDA tensors go over NCCL on cuda:0 (null in a build without
// NCCL: the optimizer then runs its collectives' local form).
std::unique_ptr<Communicator> nccl_rank() {
  if (!nccl_compiled()) return nullptr;
  rendezvous::RankInfo info;
  info.master_addr = "127.0.0.1";
  info.master_port = test::free_port();
  CommOptions options;
  options.timeout_s = 60;
  options.device = Device::cuda(0);
  return Communicator::create(info, options);
}

std::unique_ptr<Weights> random_weights(const model::ModelConfig& c, Device d, uint64_t seed) {
  Weights host(c, DType::f32);
  test::fill_random_weights(host, seed);
  auto w = std::make_unique<Weights>(c, DType::f32, d);
  w->copy_from(host);
  return w;
}

// The f32 master weights, flattened in storage order, on the host (gathered unit by unit at
// ShardLevel::parameters).
std::vector<double> master_weights(ShardedAdamW& opt) {
  std::vector<double> out;
  if (opt.options().level == ShardLevel::parameters) {
    for (size_t u = 0; u < opt.layout().units().size(); ++u) {
      Tensor t = Tensor::empty({opt.layout().units()[u].flat.size()}, DType::f32);
      opt.gather_unit(u, t);
      const std::vector<double> part = test::to_f64(t);
      out.insert(out.end(), part.begin(), part.end());
    }
  } else {
    for (const NamedTensor& s : opt.params().storage()) {
      const std::vector<double> part = test::to_f64(s.tensor.to(Device::cpu()));
      out.insert(out.end(), part.begin(), part.end());
    }
  }
  return out;
}

// The unit calls of one backward pass (model::walk_unit_calls: the decoder's order) made on
// several optimizers' hooks in lockstep: `on_acquire(u)` once every optimizer holds unit u's
// weights, `fill(u)` just before unit u's gradients end (each optimizer's gradients() then holds
// unit u). Without hooks (the level optimizer) every unit is filled at once.
class Lockstep final : public model::UnitHooks {
 public:
  Lockstep(std::vector<Optimizer*> opts, std::function<void(size_t)> on_acquire,
           std::function<void(size_t)> fill)
      : opts_(std::move(opts)), on_acquire_(std::move(on_acquire)), fill_(std::move(fill)) {}

  void pass(const model::ModelConfig& c) {
    if (opts_[0]->unit_hooks() == nullptr) {
      for (size_t u = 0; u < static_cast<size_t>(c.num_layers) + 2; ++u) fill_(u);
      return;
    }
    for (Optimizer* o : opts_) o->begin_pass(model::UnitPass::forward_backward);
    model::walk_unit_calls(c, model::ModelPart::whole(c), model::UnitPass::forward_backward, *this);
  }

  void acquire(size_t u) override {
    for (Optimizer* o : opts_) o->unit_hooks()->acquire(u);
    on_acquire_(u);
  }
  void release(size_t u) override {
    for (Optimizer* o : opts_) o->unit_hooks()->release(u);
  }
  void begin_gradients(size_t u) override {
    for (Optimizer* o : opts_) o->unit_hooks()->begin_gradients(u);
  }
  void end_gradients(size_t u) override {
    fill_(u);
    for (Optimizer* o : opts_) o->unit_hooks()->end_gradients(u);
  }

 private:
  std::vector<Optimizer*> opts_;
  std::function<void(size_t)> on_acquire_, fill_;
};

// The storage tensors [first, end) of unit u.
std::pair<size_t, size_t> unit_tensors(const ShardedAdamW& opt, size_t u) {
  const model::ShardUnit& unit = opt.layout().units()[u];
  return {unit.first_tensor, unit.end_tensor};
}

}  // namespace

TEST_CASE("ShardedAdamW on CUDA over NCCL takes the CPU ShardedAdamW's steps at every level",
          "[gpu]") {
  test::skip_without_gpu();
  const std::unique_ptr<Communicator> comm = nccl_rank();
  AdamWConfig ac;
  ac.weight_decay = 0.1f;
  ac.max_grad_norm = 2.0f;  // clipped: the global norm decides
  const float lr = 1e-2f;
  for (const test::TinyKind kind : {test::TinyKind::llama_tied, test::TinyKind::qwen2}) {
    const model::ModelConfig c = test::tiny_model_config(kind);
    // The gradients of 3 steps of 2 micro-batches, on the host and on the device.
    std::vector<std::unique_ptr<Weights>> gh, gd;
    for (uint64_t k = 0; k < 6; ++k) {
      gh.push_back(random_weights(c, Device::cpu(), 300 + k));
      gd.push_back(random_weights(c, Device::cuda(), 300 + k));
    }
    for (const ShardLevel level : kLevels) {
      INFO(test::tiny_kind_name(kind) << " at " << shard_level_name(level));
      ShardOptions so;
      so.level = level;
      so.bucket_bytes = 16 << 10;  // a unit's collectives go in pieces
      auto wh = random_weights(c, Device::cpu(), 7);
      auto wd = random_weights(c, Device::cuda(), 7);
      const std::vector<double> initial = test::to_f64(wh->storage()[0].tensor);
      ShardedAdamW cpu(*wh, nullptr, ac, so), gpu(*wd, comm.get(), ac, so);
      if (level == ShardLevel::parameters) {
        wh.reset();  // the optimizers hold their pieces
        wd.reset();
      }
      double worst_gathered = 0;
      for (int step = 0; step < 3; ++step) {
        cpu.begin_step();
        gpu.begin_step();
        for (int micro = 0; micro < 2; ++micro) {
          const Weights& h = *gh[static_cast<size_t>(2 * step + micro)];
          const Weights& d = *gd[static_cast<size_t>(2 * step + micro)];
          Lockstep(
              {&cpu, &gpu},
              [&](size_t u) {
                // The unit the CUDA optimizer gathered is the CPU one's.
                const auto [t0, t1] = unit_tensors(cpu, u);
                for (size_t t = t0; t < t1; ++t)
                  worst_gathered = std::max(
                      worst_gathered,
                      test::max_abs_diff(
                          test::to_f64(gpu.compute_weights().storage()[t].tensor.to(Device::cpu())),
                          test::to_f64(cpu.compute_weights().storage()[t].tensor)));
              },
              [&](size_t u) {
                const auto [t0, t1] = unit_tensors(cpu, u);
                for (size_t t = t0; t < t1; ++t) {
                  ops::add(h.storage()[t].tensor, cpu.gradients().storage()[t].tensor);
                  ops::add(d.storage()[t].tensor, gpu.gradients().storage()[t].tensor);
                }
              })
              .pass(c);
          cpu.end_micro_batch();
          gpu.end_micro_batch();
        }
        const StepResult a = cpu.step(lr), b = gpu.step(lr);
        // The same summed gradients (one f32 addition per element on either device): the same
        // norm to the bit.
        CHECK(a.grad_norm == b.grad_norm);
        CHECK(a.clip_scale < 1.0f);
        CHECK(b.step == step + 1);
      }
      // The update's f32 arithmetic differs by a few ulps between the devices (FMA contraction):
      // far below one step's change (lr = 1e-2 per element on these weights of magnitude <= 1).
      const std::vector<double> want = master_weights(cpu), got = master_weights(gpu);
      REQUIRE(got.size() == want.size());
      CHECK(test::max_abs_diff(got, want) < 1e-5);
      CHECK(worst_gathered < 1e-5);
      // The weights moved (by far more than the tolerance).
      const std::vector<double> first(want.begin(),
                                      want.begin() + static_cast<std::ptrdiff_t>(initial.size()));
      CHECK(test::max_abs_diff(first, initial) > 1e-3);
    }
  }
}

TEST_CASE("the decoder on CUDA trains through ShardedAdamW's unit hooks as AdamW on whole weights",
          "[gpu]") {
  test::skip_without_gpu();
  const std::unique_ptr<Communicator> comm = nccl_rank();
  const model::ModelConfig c = test::tiny_model_config(test::TinyKind::llama_tied);
  AdamWConfig ac;
  ac.max_grad_norm = 0;  // off: AdamW sums its norm on the device in another order
  const float lr = 1e-2f;
  std::vector<std::vector<int32_t>> seqs;
  for (const int n : {9, 14, 6}) {
    const Tensor ids = test::random_ints({n}, DType::i32, 40 + n, 0, c.vocab_size);
    seqs.emplace_back(ids.data_as<int32_t>(), ids.data_as<int32_t>() + n);
  }
  const model::PackedBatch batch = model::PackedBatch::from_sequences(seqs);
  const int64_t T = batch.num_tokens();
  const Tensor dlogp = test::random_tensor({T}, DType::f32, 77).to(Device::cuda());
  // Two optimizer steps of two micro-batches (the same batch) each.
  const auto train = [&](Optimizer& opt) {
    model::Decoder dec(opt.compute_weights(), {.max_tokens = 64, .unit_hooks = opt.unit_hooks()});
    Tensor lp = Tensor::empty({T}, DType::f32, Device::cuda());
    for (int step = 0; step < 2; ++step) {
      opt.begin_step();
      for (int micro = 0; micro < 2; ++micro) {
        opt.begin_pass(model::UnitPass::forward_backward);
        dec.forward(batch, lp, Tensor());
        dec.backward(dlogp, Tensor(), opt.gradients());
        opt.end_micro_batch();
      }
      opt.step(lr);
    }
  };
  auto whole = random_weights(c, Device::cuda(), 7);
  {
    AdamW adamw(*whole, ac);
    train(adamw);
  }
  std::vector<double> want;
  for (const NamedTensor& s : whole->storage()) {
    const std::vector<double> part = test::to_f64(s.tensor.to(Device::cpu()));
    want.insert(want.end(), part.begin(), part.end());
  }
  for (const ShardLevel level : kLevels) {
    INFO(shard_level_name(level));
    auto w = random_weights(c, Device::cuda(), 7);
    ShardOptions so;
    so.level = level;
    so.bucket_bytes = 16 << 10;
    ShardedAdamW opt(*w, comm.get(), ac, so);
    if (level == ShardLevel::parameters) w.reset();
    CHECK((opt.unit_hooks() == nullptr) == (level == ShardLevel::optimizer));
    train(opt);
    const std::vector<double> got = master_weights(opt);
    REQUIRE(got.size() == want.size());
    // The same gradients (bound unit by unit instead of whole), the same update kernel.
    CHECK(test::max_abs_diff(got, want) < 1e-6);
  }
}

TEST_CASE("ShardedAdamW on CUDA orders its collectives after the compute and reports their time",
          "[gpu]") {
  test::skip_without_gpu();
  const std::unique_ptr<Communicator> comm = nccl_rank();
  const model::ModelConfig c = test::tiny_model_config(test::TinyKind::qwen2);
  for (const ShardLevel level : {ShardLevel::gradients, ShardLevel::parameters}) {
    INFO(shard_level_name(level));
    auto w = random_weights(c, Device::cuda(), 7);
    auto g = random_weights(c, Device::cuda(), 8);
    ShardOptions so;
    so.level = level;
    ShardedAdamW opt(*w, comm.get(), {}, so);
    CHECK(opt.device_marks() == 0);
    opt.take_comm_stats();
    opt.begin_step();
    Lockstep(
        {&opt}, [](size_t) {},
        [&](size_t u) {
          const auto [t0, t1] = unit_tensors(opt, u);
          for (size_t t = t0; t < t1; ++t)
            ops::add(g->storage()[t].tensor, opt.gradients().storage()[t].tensor);
        })
        .pass(c);
    opt.step(1e-3f);
    // Every closure of the communication thread waited for a mark on the compute stream: one per
    // gradient bucket (L + 2 units), and at the parameters level one per gather besides.
    const int64_t units = static_cast<int64_t>(opt.layout().units().size());
    CHECK(opt.device_marks() >= units);
    if (level == ShardLevel::parameters) CHECK(opt.device_marks() >= 2 * units);
    const CommStats s = opt.take_comm_stats();
    CHECK(s.collectives >= units);
    CHECK(s.comm_s > 0);
    CHECK(s.exposed_s >= 0);
  }
}

TEST_CASE("ShardedAdamW refuses the fixed-point sums on CUDA naming the key", "[gpu]") {
  test::skip_without_gpu();
  const model::ModelConfig c = test::micro_model_config(false);
  auto w = random_weights(c, Device::cuda(), 7);
  ShardOptions so;
  so.deterministic = true;
  CHECK_THROWS_WITH(ShardedAdamW(*w, nullptr, {}, so),
                    Catch::Contains("trainer.deterministic = false"));
}

}  // namespace tandem::trainer
