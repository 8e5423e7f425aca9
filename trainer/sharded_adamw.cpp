// ShardedAdamW: the sharded form of AdamW (trainer/optimizer.h): its buffers, the reduce-scatter
// of the gradients, the range update and the all-gather of the parameters, their gathers per
// unit of the decoder at trainer.shard = "parameters", and its checkpointed moments.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <string>

#include "core/comm_thread.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#include "trainer/optimizer.h"
#include "trainer/optimizer_detail.h"
#include "trainer/sharded_device.h"

namespace tandem::trainer {

using namespace optimizer_detail;

const char* shard_level_name(ShardLevel level) {
  switch (level) {
    case ShardLevel::optimizer:
      return "optimizer";
    case ShardLevel::gradients:
      return "gradients";
    case ShardLevel::parameters:
      return "parameters";
  }
  return "?";
}

namespace {

// Bytes a ShardedAdamW holds by class now and at most since the last reset (weights,
// gradients, optimizer), counted by its Buffers.
struct Held {
  std::atomic<int64_t> now[3] = {0, 0, 0}, peak[3] = {0, 0, 0};
  static int index(ArenaClass c) {
    return c == ArenaClass::parameters ? 0 : c == ArenaClass::gradients ? 1 : 2;
  }
  void add(ArenaClass c, int64_t bytes) {
    const int i = index(c);
    const int64_t v = now[i] += bytes;
    int64_t p = peak[i].load();
    while (v > p && !peak[i].compare_exchange_weak(p, v)) {
    }
  }
};

// A tensor in an arena of its own (on the optimizer's device), so that the memory ledger counts it
// under its class (and the optimizer's Held, when given).
struct Buffer {
  std::unique_ptr<Arena> arena;
  Tensor t;
  Held* held = nullptr;
  ArenaClass cls = ArenaClass::parameters;
  int64_t bytes = 0;
  Buffer() = default;
  Buffer(ArenaClass c, int64_t n, DType dtype = DType::f32, Held* h = nullptr,
         Device device = Device::cpu())
      : arena(std::make_unique<Arena>(
            c, device, static_cast<size_t>(std::max<int64_t>(n, 1)) * dtype_size(dtype))),
        held(h),
        cls(c),
        bytes(static_cast<int64_t>(arena->capacity())) {
    t = arena->alloc({std::max<int64_t>(n, 1)}, dtype).narrow(0, n);
    t.zero();
    if (held) held->add(cls, bytes);
  }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      drop();
      arena = std::move(o.arena);
      t = o.t;
      held = o.held;
      cls = o.cls;
      bytes = o.bytes;
      o.held = nullptr;
      o.bytes = 0;
    }
    return *this;
  }
  ~Buffer() { drop(); }
  void drop() {
    if (held && bytes) held->add(cls, -bytes);
    held = nullptr;
    bytes = 0;
  }
  // The memory as floats or 64-bit integers (a staging buffer serves both).
  float* f32() const { return static_cast<float*>(t.data()); }
  int64_t* i64() const { return static_cast<int64_t*>(t.data()); }
};

// Gradient x in fixed point, or false when it is not finite or too large for the sum.
bool to_fixed(float x, int64_t& out) {
  const double d = std::ldexp(static_cast<double>(x), ShardedAdamW::kFixedBits);
  if (!(std::abs(d) < 0x1p61)) return false;
  out = std::llrint(d);
  return true;
}

}  // namespace

// The state of a ShardedAdamW: this rank's pieces (model::ShardLayout's local buffers), the
// communication thread, and at the gradients and parameters levels the unit hooks the decoder
// calls: units of weights gathered ahead (parameters) and units of gradients reduce-scattered as
// backward finishes them.
struct ShardedAdamW::Impl final : model::UnitHooks {
  Impl(model::Weights& params, Communicator* comm, const AdamWConfig& config,
       const ShardOptions& options)
      : full(&params),
        comm(comm),
        rank(comm != nullptr ? comm->rank() : 0),
        world(comm != nullptr ? comm->size() : 1),
        config(config),
        options(options),
        layout(params, world),
        model_config(params.config()),
        part(params.part()),
        dev(params.device()) {}

  model::Weights* full;  // whole f32 master weights (null at ShardLevel::parameters)
  Communicator* comm;
  int rank, world;
  AdamWConfig config;
  ShardOptions options;
  model::ShardLayout layout;
  model::ModelConfig model_config;
  model::ModelPart part;    // of the weights: the whole model, or a pipeline stage's
  ShardDevice dev;          // the device of every buffer below, and how collectives wait for it
  Held held;                // this optimizer's buffers by class
  std::vector<bool> decay;  // per storage tensor
  std::vector<bool> norm_excluded;  // per storage tensor: ShardOptions::norm_excluded
  // ShardOptions::shared: the unit of each tensor, with its group.
  std::vector<std::pair<size_t, Communicator*>> shared_units;
  Buffer m, v, grad;    // local buffers: moments, the summed gradients of the pieces
  Buffer fixed_sum;     // deterministic, gradients/parameters: the pieces' sums in fixed point
  Buffer params_local;  // parameters: the f32 master pieces
  bool finite = true;   // this rank saw no non-finite gradient since begin_step
  // Level optimizer: whole gradients; deterministic, their running sum in fixed point (P).
  std::unique_ptr<model::Weights> whole_grads;
  std::vector<int64_t> whole_fixed;
  // Levels gradients and parameters: tables bound unit by unit.
  std::unique_ptr<model::Weights> grads_table, compute_table;
  // Collectives run on `thread` over `thread_comm` (a split of comm), in submission order, the
  // same on every rank. stage: that thread's staging buffer.
  std::unique_ptr<Communicator> thread_comm;
  std::unique_ptr<CommThread> thread;
  Buffer stage, stage_out;
  int64_t chunk = 0;  // elements of a rank's part of one collective
  // Parameters: each unit's gathered weights (N S elements, the unit's flat elements first)
  // while resident, and the ticket of the gather that fills it.
  struct Resident {
    std::shared_ptr<Buffer> buf;
    CommThread::Ticket ticket = 0;
  };
  std::vector<Resident> resident;
  // CUDA: released units' weights kept until the compute queued before the release (which may
  // still read them) ran, oldest first.
  std::deque<std::pair<std::shared_ptr<Buffer>, ShardDevice::Mark>> retired;
  // CUDA: the buffers of finished gathers and reductions kept for the next unit of their class
  // and size, so that no cudaMalloc or cudaFree (which waits for the whole device) falls between
  // the compute's units. Used by the training thread only.
  std::multimap<std::pair<ArenaClass, int64_t>, std::shared_ptr<Buffer>> spare;
  std::vector<size_t> schedule;  // the units the current pass acquires, in order
  size_t next = 0;               // schedule position of the next acquire
  // Gradient buckets in flight (their reduce-scatters' tickets), oldest first.
  // On CUDA each with its bucket, which goes to `spare` once the reduction ran.
  std::deque<std::pair<CommThread::Ticket, std::shared_ptr<Buffer>>> in_flight;
  std::vector<std::shared_ptr<Buffer>> open;  // per unit: the bucket backward adds to

  size_t units() const { return layout.units().size(); }
  bool sharded_params() const { return options.level == ShardLevel::parameters; }
  bool sharded_grads() const { return options.level != ShardLevel::optimizer; }

  void init() {
    TANDEM_CHECK(layout.units().size() == model::PartUnits(model_config, part).count,
                 "optimizer: the weights' {} units are not the {} units of their part ({}) the "
                 "decoder's unit hooks number",
                 layout.units().size(), model::PartUnits(model_config, part).count,
                 part.str(model_config));
    for (const model::NamedTensor& s : full->storage())
      decay.push_back(AdamW::decays(config, s.name));
    find_model_parallel_tensors(full->storage());
    const int64_t n = layout.local_size();
    const Device d = dev.device();
    m = Buffer(ArenaClass::optimizer_states, n, DType::f32, &held, d);
    v = Buffer(ArenaClass::optimizer_states, n, DType::f32, &held, d);
    grad = Buffer(ArenaClass::gradients, n, DType::f32, &held, d);
    if (options.deterministic && sharded_grads())
      fixed_sum = Buffer(ArenaClass::gradients, n, DType::i64, &held);
    chunk = std::max<int64_t>(1024, options.bucket_bytes / 8 / world);  // i64 staging: 8 bytes
    stage = Buffer(ArenaClass::gradients, world * chunk, DType::i64, &held, d);
    stage_out = Buffer(ArenaClass::gradients, chunk, DType::i64, &held, d);
    if (comm != nullptr) {
      std::vector<int> all(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
      thread_comm = comm->split("shard", all);
      // Every closure waits for the compute its inputs come from (issue()): on CUDA the
      // collectives then need not wait for the rest of the compute stream.
      thread_comm->set_cuda_inputs_ready(true);
    }
    thread = std::make_unique<CommThread>("shard");
    resident.resize(units());
    open.resize(units());
    if (sharded_grads())
      grads_table = model::Weights::unbound(model_config, part, DType::f32, dev.device());
    if (!sharded_params()) held.add(ArenaClass::parameters, static_cast<int64_t>(full->nbytes()));
    if (sharded_params()) {
      params_local = Buffer(ArenaClass::parameters, n, DType::f32, &held, d);
      for (size_t u = 0; u < units(); ++u) {
        const model::FlatRange r = layout.range(u, rank);
        float* dst = params_local.f32() + layout.units()[u].local;
        layout.for_each_piece(r.begin, r.end, [&](size_t t, int64_t off, int64_t at, int64_t k) {
          dev.copy(dst + at, full->storage()[t].tensor.data_as<float>() + off,
                   k * int64_t{sizeof(float)});
        });
      }
      full = nullptr;
      compute_table = model::Weights::unbound(model_config, part, DType::f32, dev.device());
    }
  }

  // Runs fn on the communication thread once the compute queued so far ran (on CUDA fn reads what
  // it wrote: a gradient bucket, updated weights); the caller waits for the ticket before it reads
  // what fn wrote.
  CommThread::Ticket issue(std::function<void()> fn) {
    return thread->submit([after = dev.mark(), fn = std::move(fn)] {
      ShardDevice::wait(after);
      fn();
    });
  }

  // issue(fn), waited for unless overlapping.
  CommThread::Ticket submit(std::function<void()> fn) {
    const CommThread::Ticket t = issue(std::move(fn));
    if (!options.overlap) thread->wait(t);
    return t;
  }

  // A zeroed buffer of n f32 on the device: a spare one of this class and size, or a new one.
  std::shared_ptr<Buffer> take(ArenaClass c, int64_t n) {
    const auto it = spare.find({c, n});
    if (it == spare.end()) return std::make_shared<Buffer>(c, n, DType::f32, &held, dev.device());
    std::shared_ptr<Buffer> b = std::move(it->second);
    spare.erase(it);
    b->t.zero();
    return b;
  }

  // A buffer no collective and no queued compute uses any more: kept for take() on CUDA.
  void keep(std::shared_ptr<Buffer> b) {
    if (b && !dev.is_cpu()) spare.emplace(std::make_pair(b->cls, b->t.numel()), std::move(b));
  }

  // Waits for every collective and for the compute that may read a released unit.
  void drain() {
    thread->wait_all();
    for (auto& [ticket, bucket] : in_flight) keep(std::move(bucket));
    in_flight.clear();
    for (auto& [buf, mark] : retired) {
      ShardDevice::wait(mark);
      keep(std::move(buf));
    }
    retired.clear();
  }

  // --- Collectives of one unit (on the communication thread) ---

  // out (N S) = every rank's piece of unit u (src: this rank's S elements), in rank order.
  void gather_pieces(size_t u, const float* src, float* out) {
    if (options.before_gather != nullptr) (*options.before_gather)(rank, u);
    const int64_t S = layout.units()[u].shard;
    float* st = stage.f32();
    for (int64_t k = 0; k < S; k += chunk) {
      const int64_t len = std::min(chunk, S - k);
      if (thread_comm)
        thread_comm->all_gather(Tensor::wrap(const_cast<float*>(src) + k, {len}, DType::f32),
                                Tensor::wrap(st, {world * len}, DType::f32));
      else
        dev.copy(st, src + k, len * int64_t{sizeof(float)});
      for (int r = 0; r < world; ++r)
        dev.copy(out + r * S + k, st + r * len, len * int64_t{sizeof(float)});
    }
  }

  // This rank's piece of the sum over ranks of unit u's gradients (in: N S, the unit's flat
  // elements then zeros), added to grad (or fixed_sum when deterministic).
  void reduce_piece(size_t u, const float* in) {
    const int64_t S = layout.units()[u].shard, local = layout.units()[u].local;
    for (int64_t k = 0; k < S; k += chunk) {
      const int64_t len = std::min(chunk, S - k);
      if (options.deterministic) {
        int64_t* st = stage.i64();
        for (int r = 0; r < world; ++r)
          for (int64_t i = 0; i < len; ++i) {
            int64_t q = 0;
            if (!to_fixed(in[r * S + k + i], q)) finite = false;
            st[r * len + i] = q;
          }
        const int64_t* sum = reduce_staged<int64_t>(len, DType::i64);
        int64_t* acc = fixed_sum.i64() + local + k;
        for (int64_t i = 0; i < len; ++i) acc[i] += sum[i];
      } else {
        float* st = stage.f32();
        for (int r = 0; r < world; ++r) {
          dev.copy(st + r * len, in + r * S + k, len * int64_t{sizeof(float)});
          // (On CUDA a non-finite value makes the sum, and so the global norm, non-finite.)
          for (int64_t i = 0; dev.is_cpu() && i < len; ++i)
            if (!std::isfinite(st[r * len + i])) finite = false;
        }
        const float* sum = reduce_staged<float>(len, DType::f32);
        dev.add(Tensor::wrap(const_cast<float*>(sum), {len}, DType::f32, dev.device()),
                grad.t.narrow(local + k, len));
      }
    }
  }

  // This rank's len elements of the sum over the ranks of the N len values staged in `stage`
  // (rank r's at r len), into stage_out. On the communication thread.
  template <class T>
  const T* reduce_staged(int64_t len, DType dtype) {
    T* st = static_cast<T*>(stage.t.data());
    T* sum = static_cast<T*>(stage_out.t.data());
    if (thread_comm)
      thread_comm->reduce_scatter(Tensor::wrap(st, {world * len}, dtype),
                                  Tensor::wrap(sum, {len}, dtype));
    else
      dev.copy(sum, st, len * int64_t{sizeof(T)});
    return sum;
  }

  // --- UnitHooks ---

  // The units a pass acquires, in the decoder's order (model::walk_unit_calls).
  void begin_pass(model::UnitPass pass) {
    schedule.clear();
    next = 0;
    if (!sharded_params()) return;
    struct Acquires final : model::UnitHooks {
      std::vector<size_t>& out;
      explicit Acquires(std::vector<size_t>& o) : out(o) {}
      void acquire(size_t u) override { out.push_back(u); }
      void release(size_t) override {}
      void begin_gradients(size_t) override {}
      void end_gradients(size_t) override {}
    } acquires(schedule);
    model::walk_unit_calls(model_config, part, pass, acquires);
  }

  // Starts the gather of unit u unless it is resident or on its way.
  void fetch(size_t u) {
    Resident& r = resident[u];
    if (r.buf) return;
    const int64_t S = layout.units()[u].shard;
    r.buf = take(ArenaClass::parameters, world * S);
    const float* src = params_local.f32() + layout.units()[u].local;
    float* out = r.buf->f32();
    r.ticket = submit([this, u, src, out] { gather_pieces(u, src, out); });
  }

  void acquire(size_t u) override {
    if (!sharded_params()) return;
    TANDEM_CHECK(next < schedule.size() && schedule[next] == u,
                 "sharded optimizer: the decoder asked for unit {} ({}), the pass expected {}", u,
                 layout.units()[u].name,
                 next < schedule.size() ? layout.units()[schedule[next]].name : "none");
    fetch(u);
    thread->wait(resident[u].ticket);
    const model::ShardUnit& unit = layout.units()[u];
    compute_table->bind(unit.first_tensor, unit.end_tensor, resident[u].buf->t);
    ++next;
    if (next < schedule.size()) fetch(schedule[next]);  // prefetch while u computes
  }

  void release(size_t u) override {
    if (!sharded_params()) return;
    // Kept when the pass acquires it again right away (the head between forward and backward).
    for (size_t i = next; i < std::min(schedule.size(), next + 2); ++i)
      if (schedule[i] == u) return;
    const model::ShardUnit& unit = layout.units()[u];
    compute_table->unbind(unit.first_tensor, unit.end_tensor);
    thread->wait(resident[u].ticket);
    if (!dev.is_cpu()) {
      retired.emplace_back(std::move(resident[u].buf), dev.mark());
      // At most two units wait: the gathered weights held stay bounded when the device lags.
      while (!retired.empty() &&
             (retired.size() > 2 || ShardDevice::done(retired.front().second))) {
        ShardDevice::wait(retired.front().second);
        keep(std::move(retired.front().first));
        retired.pop_front();
      }
    }
    resident[u] = {};
  }

  void begin_gradients(size_t u) override {
    if (!sharded_grads()) return;
    // At most two buckets in flight: the gradients held stay bounded when communication lags.
    while (in_flight.size() >= 2) {
      thread->wait(in_flight.front().first);
      keep(std::move(in_flight.front().second));
      in_flight.pop_front();
    }
    const model::ShardUnit& unit = layout.units()[u];
    open[u] = take(ArenaClass::gradients, world * unit.shard);
    grads_table->bind(unit.first_tensor, unit.end_tensor, open[u]->t);
  }

  void end_gradients(size_t u) override {
    if (!sharded_grads()) return;
    const model::ShardUnit& unit = layout.units()[u];
    grads_table->unbind(unit.first_tensor, unit.end_tensor);
    std::shared_ptr<Buffer> bucket = std::move(open[u]);
    in_flight.emplace_back(submit([this, u, bucket] { reduce_piece(u, bucket->f32()); }),
                           dev.is_cpu() ? nullptr : bucket);
  }

  // The unit calls of one pass without a micro-batch.
  void idle_pass(model::UnitPass pass) {
    begin_pass(pass);
    model::walk_unit_calls(model_config, part, pass, *this);
  }

  // ShardOptions::norm_excluded and ::shared by storage index and unit; throws naming a tensor the
  // weights lack or a shared one that is not a unit of its own.
  void find_model_parallel_tensors(std::span<const model::NamedTensor> storage) {
    const auto index_of = [&](const std::string& name, const char* what) {
      for (size_t i = 0; i < storage.size(); ++i)
        if (storage[i].name == name) return i;
      TANDEM_FAIL(
          "optimizer: {} names '{}', which is not a storage tensor of these weights ({} "
          "layers)",
          what, name, model_config.num_layers);
    };
    norm_excluded.assign(storage.size(), false);
    for (const std::string& name : options.norm_excluded)
      norm_excluded[index_of(name, "ShardOptions::norm_excluded")] = true;
    TANDEM_CHECK(options.norm_excluded.empty() || options.model_parallel != nullptr,
                 "optimizer: tensors left out of the global norm need the model-parallel group "
                 "that counts them (ShardOptions::model_parallel)");
    for (const ShardOptions::SharedGradient& sg : options.shared) {
      const size_t t = index_of(sg.tensor, "ShardOptions::shared");
      const size_t u = layout.unit_of_tensor(t);
      const model::ShardUnit& unit = layout.units()[u];
      TANDEM_CHECK(sg.group != nullptr && unit.flat.size() == storage[t].tensor.numel(),
                   "optimizer: the shared gradient of '{}' needs a group and a unit of its own "
                   "(its unit '{}' holds {} elements, the tensor {})",
                   sg.tensor, unit.name, unit.flat.size(), storage[t].tensor.numel());
      shared_units.emplace_back(u, sg.group);
    }
  }

  // ShardOptions::shared: this rank's piece of each shared unit's summed gradient, summed over the
  // ranks holding a copy (all-reduce of the piece, f32).
  void reduce_shared() {
    for (const auto& [u, group] : shared_units) {
      const model::ShardUnit& unit = layout.units()[u];
      const int64_t n = layout.range(u, rank).size();
      if (n > 0) group->all_reduce(grad.t.narrow(unit.local, n));
    }
  }

  // --- The step ---

  // With this rank's pieces of the summed gradients in grad: the copies' sums, the global norm,
  // the update.
  StepResult finish_step(float lr, AdamWCounters& counters) {
    reduce_shared();
    return update(global_norm(), lr, counters);
  }

  // The global norm from this rank's pieces of the summed gradients (grad), the same bits on
  // every rank: every block's f64 sum of squares, gathered, added in unit then block order.
  float global_norm() {
    const int64_t local_blocks = layout.local_size() / kNormBlock;
    std::vector<double> sums(static_cast<size_t>(local_blocks), 0.0);
    const float* g = grad.f32();
    std::vector<float> host;  // on CUDA the pieces' copy the blocks are summed from
    if (!dev.is_cpu()) {
      host.resize(static_cast<size_t>(layout.local_size()));
      copy_bytes(host.data(), Device::cpu(), g, dev.device(), host.size() * sizeof(float));
      g = host.data();
    }
    for (size_t u = 0; u < units(); ++u) {
      const model::ShardUnit& unit = layout.units()[u];
      const int64_t n = layout.range(u, rank).size();
      const int64_t b0 = unit.local / kNormBlock;
      const float* x = g + unit.local;
      std::vector<float> masked;  // the piece with the tensors left out of the norm zeroed
      const model::FlatRange piece = layout.range(u, rank);
      layout.for_each_piece(piece.begin, piece.end,
                            [&](size_t tensor, int64_t, int64_t offset, int64_t count) {
                              if (!norm_excluded[tensor]) return;
                              if (masked.empty()) masked.assign(x, x + n);
                              std::fill_n(masked.begin() + offset, count, 0.0f);
                            });
      if (!masked.empty()) x = masked.data();
      const std::vector<double> part = block_sums(x, n, unit.shard / kNormBlock);
      std::copy(part.begin(), part.end(), sums.begin() + b0);
    }
    if (!finite) std::fill(sums.begin(), sums.end(), std::numeric_limits<double>::quiet_NaN());
    const std::vector<double> all = comm != nullptr ? gather_doubles(*comm, sums) : sums;
    std::vector<double> ordered(static_cast<size_t>(layout.total_blocks()), 0.0);
    for (int r = 0; r < world; ++r)
      for (size_t u = 0; u < units(); ++u) {
        const model::ShardUnit& unit = layout.units()[u];
        const int64_t per = unit.shard / kNormBlock;
        for (int64_t j = 0; j < per; ++j) {
          const int64_t b = r * per + j;  // the block's index in the unit
          if (b >= layout.blocks(u)) break;
          ordered[static_cast<size_t>(layout.first_block(u) + b)] =
              all[static_cast<size_t>(r * local_blocks + unit.local / kNormBlock + j)];
        }
      }
    if (options.model_parallel != nullptr) ordered = model_parallel_sums(ordered);
    return norm_of_sums(ordered);
  }

  // Every rank of the model-parallel group's block sums, concatenated in its rank order (each
  // rank's list padded to the longest for the gather).
  std::vector<double> model_parallel_sums(const std::vector<double>& mine) {
    Communicator& mp = *options.model_parallel;
    const double count = static_cast<double>(mine.size());
    const std::vector<double> counts = gather_doubles(mp, std::span(&count, 1));
    const auto most = static_cast<size_t>(*std::max_element(counts.begin(), counts.end()));
    std::vector<double> padded = mine;
    padded.resize(most, 0.0);
    const std::vector<double> all = gather_doubles(mp, padded);
    std::vector<double> out;
    for (size_t r = 0; r < counts.size(); ++r)
      out.insert(
          out.end(), all.begin() + static_cast<std::ptrdiff_t>(r * most),
          all.begin() + static_cast<std::ptrdiff_t>(r * most + static_cast<size_t>(counts[r])));
    return out;
  }

  // Level optimizer: this rank's pieces of the sum over ranks of the whole gradients (f32 or, when
  // fixed is not empty, fixed point) into grad. On the communication thread, waited for.
  void reduce_whole(const model::Weights* g, std::span<const int64_t> fixed) {
    thread->wait(issue([&] {
      for (size_t u = 0; u < units(); ++u) {
        const model::ShardUnit& unit = layout.units()[u];
        const int64_t S = unit.shard;
        for (int64_t k = 0; k < S; k += chunk) {
          const int64_t len = std::min(chunk, S - k);
          float* out = grad.f32() + unit.local + k;
          if (!fixed.empty()) {
            int64_t* st = stage.i64();
            std::fill(st, st + world * len, int64_t{0});
            for (int r = 0; r < world; ++r) {
              const int64_t lo = std::min(unit.flat.end, unit.flat.begin + r * S + k);
              const int64_t hi = std::min(unit.flat.end, lo + len);
              for (int64_t i = lo; i < hi; ++i) {
                if (fixed[static_cast<size_t>(i)] == kFixedInvalid) finite = false;
                st[r * len + i - lo] = fixed[static_cast<size_t>(i)] == kFixedInvalid
                                           ? 0
                                           : fixed[static_cast<size_t>(i)];
              }
            }
            const int64_t* sum = reduce_staged<int64_t>(len, DType::i64);
            for (int64_t i = 0; i < len; ++i)
              out[i] = static_cast<float>(std::ldexp(static_cast<double>(sum[i]), -kFixedBits));
          } else {
            float* st = stage.f32();
            dev.zero(st, world * len * int64_t{sizeof(float)});
            for (int r = 0; r < world; ++r) {
              const int64_t lo = unit.flat.begin + r * S + k;
              layout.for_each_piece(std::min(lo, unit.flat.end), std::min(lo + len, unit.flat.end),
                                    [&](size_t t, int64_t off, int64_t at, int64_t count) {
                                      dev.copy(st + r * len + at,
                                               g->storage()[t].tensor.data_as<float>() + off,
                                               count * int64_t{sizeof(float)});
                                    });
            }
            const float* sum = reduce_staged<float>(len, DType::f32);
            dev.copy(out, sum, len * int64_t{sizeof(float)});
            for (int64_t i = 0; dev.is_cpu() && i < len; ++i)
              if (!std::isfinite(out[i])) finite = false;
          }
        }
      }
    }));
  }

  // The update of this rank's pieces under the global norm; below ShardLevel::parameters every
  // rank's updated pieces are then all-gathered into every rank's whole weights.
  StepResult update(float norm, float lr, AdamWCounters& counters) {
    StepResult r = decide_step(norm, lr, config, counters);
    if (r.skipped) return r;
    ops::AdamWParams p = update_params(config, counters, r);
    for (size_t u = 0; u < units(); ++u) {
      const model::ShardUnit& unit = layout.units()[u];
      const model::FlatRange mine = layout.range(u, rank);
      layout.for_each_piece(
          mine.begin, mine.end, [&](size_t t, int64_t off, int64_t at, int64_t k) {
            p.weight_decay = decay[t] ? config.weight_decay : 0.0f;
            const int64_t l = unit.local + at;
            const Tensor param = full != nullptr ? flat(full->storage()[t].tensor).narrow(off, k)
                                                 : params_local.t.narrow(l, k);
            ops::adamw(param, grad.t.narrow(l, k), m.t.narrow(l, k), v.t.narrow(l, k), p);
          });
    }
    if (full != nullptr && comm != nullptr) {
      thread->wait(issue([&] {
        for (size_t u = 0; u < units(); ++u) {
          const model::ShardUnit& unit = layout.units()[u];
          // This rank's updated piece (into grad, spent), then every rank's.
          float* mine = grad.f32() + unit.local;
          dev.zero(mine, unit.shard * int64_t{sizeof(float)});
          const model::FlatRange own = layout.range(u, rank);
          layout.for_each_piece(
              own.begin, own.end, [&](size_t t, int64_t off, int64_t at, int64_t k) {
                dev.copy(mine + at, full->storage()[t].tensor.data_as<float>() + off,
                         k * int64_t{sizeof(float)});
              });
          const int64_t S = unit.shard;
          float* st = stage.f32();
          for (int64_t k = 0; k < S; k += chunk) {
            const int64_t len = std::min(chunk, S - k);
            thread_comm->all_gather(Tensor::wrap(mine + k, {len}, DType::f32),
                                    Tensor::wrap(st, {world * len}, DType::f32));
            for (int q = 0; q < world; ++q) {
              if (q == rank) continue;
              const int64_t lo = std::min(unit.flat.end, unit.flat.begin + q * S + k);
              layout.for_each_piece(lo, std::min(unit.flat.end, lo + len),
                                    [&](size_t t, int64_t off, int64_t at, int64_t count) {
                                      dev.copy(full->storage()[t].tensor.data_as<float>() + off,
                                               st + q * len + at, count * int64_t{sizeof(float)});
                                    });
            }
          }
        }
      }));
    }
    ++counters.step;
    counters.consecutive_skips = 0;
    r.step = counters.step;
    return r;
  }

  void begin_step() {
    drain();
    finite = true;
    grad.t.zero();
    if (fixed_sum.arena) fixed_sum.t.zero();
    if (!sharded_grads()) {
      if (!whole_grads) {
        whole_grads = std::make_unique<model::Weights>(model_config, full->part(), DType::f32,
                                                       dev.device(), ArenaClass::gradients);
        held.add(ArenaClass::gradients, static_cast<int64_t>(whole_grads->nbytes()));
      }
      whole_grads->zero();
      if (options.deterministic && whole_fixed.empty()) {
        whole_fixed.assign(static_cast<size_t>(layout.total()), 0);
        held.add(ArenaClass::gradients, 8 * layout.total());
      }
      std::fill(whole_fixed.begin(), whole_fixed.end(), 0);
    }
  }

  void end_micro_batch() {
    if (sharded_grads() || !options.deterministic) return;
    // Level optimizer, deterministic: this micro-batch's gradients added in fixed point.
    size_t k = 0;
    for (const model::NamedTensor& s : whole_grads->storage()) {
      const float* g = s.tensor.data_as<float>();
      for (int64_t i = 0; i < s.tensor.numel(); ++i, ++k) {
        int64_t q = 0;
        if (whole_fixed[k] == kFixedInvalid || !to_fixed(g[i], q)) {
          whole_fixed[k] = kFixedInvalid;
          continue;
        }
        whole_fixed[k] += q;
      }
    }
    whole_grads->zero();
  }

  StepResult step(float lr, AdamWCounters& counters) {
    if (!sharded_grads()) {
      if (options.deterministic)
        reduce_whole(nullptr, whole_fixed);
      else
        reduce_whole(whole_grads.get(), {});
    } else {
      drain();
      if (options.deterministic) {
        const int64_t* q = fixed_sum.i64();
        float* g = grad.f32();
        for (int64_t i = 0; i < layout.local_size(); ++i)
          g[i] = static_cast<float>(std::ldexp(static_cast<double>(q[i]), -kFixedBits));
      }
    }
    return finish_step(lr, counters);
  }
};

ShardedAdamW::ShardedAdamW(model::Weights& params, Communicator* comm, const AdamWConfig& config,
                           const ShardOptions& options)
    : comm_(comm) {
  config.validate();
  TANDEM_CHECK(params.dtype() == DType::f32,
               "optimizer: sharded AdamW needs f32 master weights, got {} on {}", params.dtype(),
               params.device().str());
  TANDEM_CHECK(params.device().is_cpu() || !options.deterministic,
               "optimizer: the deterministic (fixed-point) gradient sums of the sharded optimizer "
               "run on the CPU only, and the master weights are on {}: set "
               "trainer.deterministic = false, or train on the CPU",
               params.device().str());
  TANDEM_CHECK(options.bucket_bytes > 0, "optimizer: bucket of {} bytes", options.bucket_bytes);
  impl_ = std::make_unique<Impl>(params, comm, config, options);
  impl_->init();
}

ShardedAdamW::~ShardedAdamW() {
  if (impl_ && impl_->thread) {
    try {
      impl_->thread->wait_all();
    } catch (...) {  // already reported by the call that failed
    }
  }
}

const model::Weights& ShardedAdamW::compute_weights() {
  return impl_->sharded_params() ? *impl_->compute_table : *impl_->full;
}
model::UnitHooks* ShardedAdamW::unit_hooks() {
  return impl_->sharded_grads() ? impl_.get() : nullptr;
}
void ShardedAdamW::begin_pass(model::UnitPass pass) { impl_->begin_pass(pass); }
void ShardedAdamW::idle_pass(model::UnitPass pass) {
  if (lockstep(pass)) impl_->idle_pass(pass);
}
bool ShardedAdamW::lockstep(model::UnitPass pass) const {
  return comm_ != nullptr &&
         (impl_->sharded_params() || (impl_->sharded_grads() && pass != model::UnitPass::forward));
}
void ShardedAdamW::begin_step() { impl_->begin_step(); }
model::Weights& ShardedAdamW::gradients() {
  return impl_->sharded_grads() ? *impl_->grads_table : *impl_->whole_grads;
}
void ShardedAdamW::end_micro_batch() { impl_->end_micro_batch(); }
StepResult ShardedAdamW::step(float lr) { return impl_->step(lr, counters_); }

int64_t ShardedAdamW::state_bytes() const {
  const int64_t n = impl_->layout.local_size();
  return 3 * 4 * n + (impl_->fixed_sum.arena ? 8 * n : 0);
}

ShardedAdamW::Memory ShardedAdamW::memory(bool reset_peaks) {
  Held& h = impl_->held;
  Memory m{h.peak[0].load(), h.peak[1].load(), h.peak[2].load()};
  if (reset_peaks)
    for (int i = 0; i < 3; ++i) h.peak[i] = h.now[i].load();
  return m;
}

int64_t ShardedAdamW::device_marks() const { return impl_->dev.marks(); }

CommStats ShardedAdamW::take_comm_stats() {
  const CommThread::Stats s = impl_->thread->take_stats();
  return {s.busy_s, s.waited_s, s.closures};
}

StepResult ShardedAdamW::step(const model::Weights& grads, float lr) {
  TANDEM_CHECK(impl_->options.level == ShardLevel::optimizer,
               "optimizer: step(gradients) is the optimizer level's");
  TANDEM_CHECK(grads.dtype() == DType::f32 &&
                   grads.storage().size() + 1 == impl_->layout.tensor_starts().size(),
               "optimizer: the gradients belong to another model");
  TANDEM_CHECK(grads.device() == impl_->dev.device(),
               "optimizer: the gradients are on {}, the optimizer's weights on {}",
               grads.device().str(), impl_->dev.device().str());
  impl_->thread->wait_all();
  impl_->finite = true;
  impl_->reduce_whole(&grads, {});
  return impl_->finish_step(lr, counters_);
}

StepResult ShardedAdamW::step_fixed(std::span<const int64_t> fixed, float lr) {
  TANDEM_CHECK(static_cast<int64_t>(fixed.size()) == total(),
               "optimizer: {} fixed-point gradients for {} parameters", fixed.size(), total());
  impl_->thread->wait_all();
  impl_->finite = true;
  impl_->reduce_whole(nullptr, fixed);
  return impl_->finish_step(lr, counters_);
}

const model::ShardLayout& ShardedAdamW::layout() const { return impl_->layout; }
const ShardOptions& ShardedAdamW::options() const { return impl_->options; }
const AdamWConfig& ShardedAdamW::config() const { return impl_->config; }
int64_t ShardedAdamW::total() const { return impl_->layout.total(); }
const Tensor& ShardedAdamW::m() const { return impl_->m.t; }
const Tensor& ShardedAdamW::v() const { return impl_->v.t; }
Tensor& ShardedAdamW::m() { return impl_->m.t; }
Tensor& ShardedAdamW::v() { return impl_->v.t; }
Tensor& ShardedAdamW::local_params() { return impl_->params_local.t; }

model::Weights& ShardedAdamW::params() {
  TANDEM_CHECK(impl_->full != nullptr,
               "optimizer: at trainer.shard = \"parameters\" no rank holds the whole weights "
               "(gather_unit gathers one unit)");
  return *impl_->full;
}

void ShardedAdamW::gather_unit(size_t unit, const Tensor& out) {
  Impl& m = *impl_;
  TANDEM_CHECK(m.sharded_params() && unit < m.units(),
               "optimizer: gather_unit needs trainer.shard = \"parameters\" and a unit below {}",
               m.units());
  const model::ShardUnit& u = m.layout.units()[unit];
  TANDEM_CHECK(out.dtype() == DType::f32 && out.numel() == u.flat.size() &&
                   (out.device().is_cpu() || out.device() == m.dev.device()),
               "optimizer: gather_unit of {} needs f32({}) on the CPU or {}, got {}", u.name,
               u.flat.size(), m.dev.device().str(), out.str());
  Buffer all(ArenaClass::parameters, m.world * u.shard, DType::f32, nullptr, m.dev.device());
  m.thread->wait(
      m.issue([&] { m.gather_pieces(unit, m.params_local.f32() + u.local, all.f32()); }));
  copy_bytes(out.data(), out.device(), all.f32(), m.dev.device(),
             static_cast<size_t>(u.flat.size()) * sizeof(float));
}

namespace {

// Copies flat elements [range.begin, range.end) of the tables' storage tensors (flattened one
// after the other, starts: each one's flat offset) to `buf`, or from it (into_table).
void copy_flat(const model::Weights& table, std::span<const int64_t> starts, model::FlatRange range,
               float* buf, bool into_table) {
  for (size_t t = 0; t + 1 < starts.size(); ++t) {
    const int64_t a = std::max(range.begin, starts[t]), b = std::min(range.end, starts[t + 1]);
    if (a >= b) continue;
    float* x = table.storage()[t].tensor.data_as<float>() + (a - starts[t]);
    float* y = buf + (a - range.begin);
    if (into_table)
      std::copy(y, y + (b - a), x);
    else
      std::copy(x, x + (b - a), y);
  }
}

void check_moment_table(const model::ShardLayout& layout, const model::Weights& w,
                        const char* what) {
  const std::span<const int64_t> starts = layout.tensor_starts();
  bool fits =
      w.dtype() == DType::f32 && w.device().is_cpu() && w.storage().size() + 1 == starts.size();
  for (size_t t = 0; fits && t < w.storage().size(); ++t)
    fits = w.storage()[t].tensor.numel() == starts[t + 1] - starts[t];
  TANDEM_CHECK(fits,
               "optimizer: {}: the moments' table is not an f32 CPU table of the optimizer's "
               "weights ({} tensors, {} elements)",
               what, starts.size() - 1, layout.total());
}

}  // namespace

void ShardedAdamW::gather_moments(model::Weights& m_out, model::Weights& v_out) {
  Impl& m = *impl_;
  TANDEM_CHECK(m.dev.device().is_cpu(), "optimizer: gather_moments runs on the CPU only");
  check_moment_table(m.layout, m_out, "gather_moments");
  check_moment_table(m.layout, v_out, "gather_moments");
  for (size_t unit = 0; unit < m.units(); ++unit) {
    const model::ShardUnit& u = m.layout.units()[unit];
    Buffer all(ArenaClass::optimizer_states, m.world * u.shard, DType::f32, nullptr,
               m.dev.device());
    for (auto [local, out] : {std::pair{&m.m, &m_out}, std::pair{&m.v, &v_out}}) {
      m.thread->wait(m.issue([&] { m.gather_pieces(unit, local->f32() + u.local, all.f32()); }));
      copy_flat(*out, m.layout.tensor_starts(), u.flat, all.f32(), true);
    }
  }
}

namespace {

// This rank's pieces of `in` (a table of the layout's tensors) into its local buffer `local`,
// zeros past each unit's real elements.
void set_pieces(const model::ShardLayout& layout, int rank, const model::Weights& in,
                float* local) {
  for (size_t unit = 0; unit < layout.units().size(); ++unit) {
    const model::ShardUnit& u = layout.units()[unit];
    float* piece = local + u.local;
    std::fill(piece, piece + u.shard, 0.0f);
    copy_flat(in, layout.tensor_starts(), layout.range(unit, rank), piece, false);
  }
}

}  // namespace

void ShardedAdamW::set_moments(const model::Weights& m_in, const model::Weights& v_in) {
  Impl& m = *impl_;
  TANDEM_CHECK(m.dev.device().is_cpu(), "optimizer: set_moments runs on the CPU only");
  check_moment_table(m.layout, m_in, "set_moments");
  check_moment_table(m.layout, v_in, "set_moments");
  set_pieces(m.layout, m.rank, m_in, m.m.f32());
  set_pieces(m.layout, m.rank, v_in, m.v.f32());
}

void ShardedAdamW::set_local_params(const model::Weights& params) {
  Impl& m = *impl_;
  TANDEM_CHECK(m.options.level == ShardLevel::parameters,
               "optimizer: set_local_params is for trainer.shard = \"parameters\"; below it set "
               "params() itself");
  TANDEM_CHECK(m.dev.device().is_cpu(), "optimizer: set_local_params runs on the CPU only");
  check_moment_table(m.layout, params, "set_local_params");
  set_pieces(m.layout, m.rank, params, m.params_local.f32());
}

}  // namespace tandem::trainer
