// Decoder: the activation plan and the entry points (training forward and backward, prefill,
// decode) that run the layers of model/decoder_layer.cpp over it.
#include "model/decoder.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/decoder_internal.h"
#include "model/vocab_parallel.h"

namespace tandem::model {

using namespace detail;

namespace {

// Hands out tensors from an arena, or (without one) only counts the bytes they would take, so
// that the plan and the allocation are one piece of code.
class Planner {
 public:
  explicit Planner(Arena* arena) : arena_(arena) {}
  Tensor take(const Shape& shape, DType dtype = DType::f32) {
    const size_t n = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    bytes_ += (n + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    return arena_ ? arena_->alloc(shape, dtype) : Tensor();
  }
  size_t bytes() const { return bytes_; }

 private:
  Arena* arena_;
  size_t bytes_ = 0;
};

// training: forward for backward; stage: a pipeline stage's forward for backward without the head;
// logits: forward_logits; scoring: score (the head in chunks of rows); inference: prefill and
// decode.
enum class Mode { training, stage, logits, scoring, inference };

struct Buffers {
  int64_t T = 0;
  Tensor tokens, positions, cu_seqlens, targets;  // i32 (T), (T), (B + 1), (T)
  Tensor prefix;                                  // i32 (B): PackedBatch::prefix (training)
  Tensor ones;                                    // (T, 1) f32 of ones (biases only)
  Tensor tp_parts;  // (tp T C) f32: the forward's tensor-parallel sums gather here (tp > 1)
  std::vector<Tensor> resid;    // (T, C) each: L + 1 layer inputs (training), or 2 (ping-pong)
  std::vector<LayerActs> acts;  // L (training, no recompute) or 1
  Tensor xf, rstdf;             // (T, C), (T): final rmsnorm
  Tensor logits, lse;           // (T, V), (T) (training)
  Tensor dlogits;               // (T, V) (training)
  // Training with PackedBatch::head_rows: R of the T rows go through the head. head_ids (T) i32
  // holds them (the first R entries), head_in (T, C) their final hidden states, dhead_in (T, C)
  // the gradient there; head_rows = R (T when every row goes).
  Tensor head_ids, head_in, dhead_in;
  int64_t head_rows = 0;
  // Scoring: head_ids (T) i32 as above, xf, rstdf, logits, lse and head_in of one chunk of R
  // rows, head_out (2 R) the chunk's logprob and entropy before they go to their rows.
  Tensor head_out;
  LayerGrads grads;  // (training)
  // Tensor parallelism: the tokens whose embedding rows this rank holds (emb_ids: their ids in its
  // vocabulary shard; emb_rows: their rows in T), kept from forward for the embedding's backward.
  Tensor emb_ids, emb_rows;  // (T), (T) i32
  int64_t emb_held = 0;      // their first emb_held entries are this call's
  // Training under tensor parallelism: the head rows' entropies over the whole vocabulary (the
  // first head_rows entries), which logprob_shard_backward reads.
  Tensor entropy;  // (T)
};

LayerActs plan_layer(Planner& p, const ModelConfig& c, int64_t T) {
  const int64_t C = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t F = c.intermediate_size;
  LayerActs a;
  a.x1 = p.take({T, C});
  a.rstd1 = p.take({T});
  if (c.qk_norm) {
    a.q_raw = p.take({T, H * D});
    a.k_raw = p.take({T, Hkv * D});
    a.rstd_q = p.take({T * H});
    a.rstd_k = p.take({T * Hkv});
  }
  a.q = p.take({T, H, D});
  a.k = p.take({T, Hkv, D});
  a.v = p.take({T, Hkv, D});
  a.att = p.take({T, H, D});
  a.lse = p.take({T, H});
  a.o_out = p.take({T, C});
  a.h_mid = p.take({T, C});
  a.x2 = p.take({T, C});
  a.rstd2 = p.take({T});
  a.gate_up = p.take({T, 2 * F});
  a.act = p.take({T, F});
  return a;
}

// B sequences, T tokens (T rows of logits in training; in inference the head reads B rows), into
// b: every tensor of a previous plan dropped, its vectors' memory kept (a decode step allocates
// nothing once the batch shape has been seen). c.num_layers: the layers the call runs (a pipeline
// stage's).
// tp: the tensor-parallel group's size (c is then a shard's config: V/tp logits a row).
// score_rows: the rows of a chunk of the head (scoring only).
void plan(Planner& p, const ModelConfig& c, int64_t T, int64_t B, Mode mode, bool recompute, int tp,
          Buffers& b, int64_t score_rows = 0) {
  const int64_t C = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t F = c.intermediate_size, V = c.vocab_size, L = c.num_layers;
  std::vector<Tensor> resid = std::move(b.resid);
  std::vector<LayerActs> acts = std::move(b.acts);
  b = Buffers{};
  b.resid = std::move(resid);
  b.acts = std::move(acts);
  b.acts.clear();
  b.T = T;
  b.tokens = p.take({T}, DType::i32);
  b.positions = p.take({T}, DType::i32);
  b.cu_seqlens = p.take({B + 1}, DType::i32);
  const bool backward = mode == Mode::training || mode == Mode::stage;
  if (mode == Mode::training || mode == Mode::scoring) b.targets = p.take({T}, DType::i32);
  if (mode != Mode::inference) b.prefix = p.take({B}, DType::i32);
  if (c.attention_bias) b.ones = p.take({T, 1});
  b.resid.resize(static_cast<size_t>(backward ? L + 1 : 2));
  for (Tensor& r : b.resid) r = p.take({T, C});
  const int64_t sets = backward && !recompute ? L : 1;
  for (int64_t l = 0; l < sets; ++l) b.acts.push_back(plan_layer(p, c, T));
  const int64_t R = mode == Mode::inference ? B  // rows of the head (at once)
                    : mode == Mode::scoring ? std::min(T, score_rows)
                                            : T;
  if (mode != Mode::stage) {
    b.xf = p.take({R, C});
    b.rstdf = p.take({R});
  }
  if (tp > 1) {
    b.tp_parts = p.take({tp * T * C});
    b.emb_ids = p.take({T}, DType::i32);
    b.emb_rows = p.take({T}, DType::i32);
  }
  if (mode == Mode::scoring) {
    b.logits = p.take({R, V});
    b.lse = p.take({R});
    b.head_ids = p.take({T}, DType::i32);
    b.head_in = p.take({R, C});
    b.head_out = p.take({2 * R});
  }
  if (mode == Mode::training) {
    b.logits = p.take({T, V});
    b.lse = p.take({T});
    b.dlogits = p.take({T, V});
    b.head_ids = p.take({T}, DType::i32);
    b.head_in = p.take({T, C});
    b.dhead_in = p.take({T, C});
    if (tp > 1) b.entropy = p.take({T});
  }
  if (backward) {
    LayerGrads& g = b.grads;
    g.dh = p.take({T, C});
    if (tp > 1 && c.qk_norm) {
      g.dx_qk_norm = p.take({T * C + 2 * D});
      if (g.dx_qk_norm.defined()) {  // (undefined when only counting)
        g.dx = g.dx_qk_norm.narrow(0, T * C).view({T, C});
        g.d_qk_norm = g.dx_qk_norm.narrow(T * C, 2 * D);
      }
    } else {
      g.dx = p.take({T, C});
    }
    g.d_act = p.take({T, F});
    g.d_gu = p.take({T, 2 * F});
    g.d_att = p.take({T, H * D});
    g.dq = p.take({T, H, D});
    g.dk = p.take({T, Hkv, D});
    g.dv = p.take({T, Hkv, D});
    if (c.qk_norm) {
      g.dq_raw = p.take({T, H * D});
      g.dk_raw = p.take({T, Hkv * D});
    }
  }
}

void upload(Tensor dst, std::span<const int32_t> src) {
  dst.copy_from(Tensor::wrap(const_cast<int32_t*>(src.data()), dst.shape(), DType::i32));
}

// host: scratch kept by the caller (grows to the largest t).
void fill_ones(Tensor t, std::vector<float>& host) {
  host.assign(static_cast<size_t>(t.numel()), 1.0f);
  t.copy_from(Tensor::wrap(host.data(), t.shape(), DType::f32));
}

std::vector<int32_t> to_host(const Tensor& t, const char* what) {
  TANDEM_CHECK(t.defined() && t.dtype() == DType::i32 && t.ndim() == 1,
               "decoder: kv cache view's {} must be an i32 vector, got {}", what,
               t.defined() ? t.str() : std::string("an undefined tensor"));
  const Tensor h = t.to(Device::cpu());
  const int32_t* p = h.data_as<int32_t>();
  return std::vector<int32_t>(p, p + h.numel());
}

void check_output(const Tensor& t, const Shape& shape, Device device, const char* what) {
  TANDEM_CHECK(t.defined() && t.dtype() == DType::f32 && t.shape() == shape && t.device() == device,
               "decoder: {} must be f32{}@{}, got {}", what, shape.str(), device.str(),
               t.defined() ? t.str() : std::string("an undefined tensor"));
}

// Host-side checks of packed ids: one message naming the field and the first bad entry.
void check_packed(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                  std::span<const int32_t> cu_seqlens, int64_t V, const char* what) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  TANDEM_CHECK(T > 0, "{}: no tokens", what);
  TANDEM_CHECK(static_cast<int64_t>(positions.size()) == T,
               "{}: positions has {} entries, tokens {}", what, positions.size(), T);
  TANDEM_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == T,
               "{}: cu_seqlens must run from 0 to T = {} over at least one sequence, got {} "
               "entries from {} to {}",
               what, T, cu_seqlens.size(), cu_seqlens.empty() ? -1 : cu_seqlens.front(),
               cu_seqlens.empty() ? -1 : cu_seqlens.back());
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b)
    TANDEM_CHECK(cu_seqlens[b] < cu_seqlens[b + 1],
                 "{}: cu_seqlens must increase strictly, got {} then {} at sequence {}", what,
                 cu_seqlens[b], cu_seqlens[b + 1], b);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = tokens[static_cast<size_t>(t)];
    TANDEM_CHECK(id >= 0 && id < V, "{}: token {} at position {} is outside the vocabulary [0, {})",
                 what, id, t, V);
    TANDEM_CHECK(positions[static_cast<size_t>(t)] >= 0, "{}: positions[{}] = {} is negative", what,
                 t, positions[static_cast<size_t>(t)]);
  }
}

// PackedBatch::prefix: empty, or one entry per sequence naming another sequence without a prefix
// of its own, whose last position the sequence's first position follows.
void check_prefix(const PackedBatch& batch, const char* what) {
  if (batch.prefix.empty()) return;
  const int64_t B = batch.num_sequences();
  TANDEM_CHECK(static_cast<int64_t>(batch.prefix.size()) == B,
               "{}: prefix has {} entries for {} sequences", what, batch.prefix.size(), B);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t p = batch.prefix[static_cast<size_t>(b)];
    if (p == -1) continue;
    TANDEM_CHECK(p >= 0 && p < B && p != b && batch.prefix[static_cast<size_t>(p)] == -1,
                 "{}: prefix[{}] = {} must be -1 or another sequence without a prefix", what, b, p);
    const int32_t end = batch.cu_seqlens[static_cast<size_t>(p) + 1];
    const int32_t last = batch.positions[static_cast<size_t>(end) - 1];
    const int32_t first =
        batch.positions[static_cast<size_t>(batch.cu_seqlens[static_cast<size_t>(b)])];
    TANDEM_CHECK(first == last + 1,
                 "{}: sequence {} starts at position {} but its prefix (sequence {}) ends at {}",
                 what, b, first, p, last);
  }
}

// The batch, temperature and outputs of forward and score (`op`): one message naming the field
// and the first bad entry.
void check_logprob_call(const PackedBatch& batch, int64_t V, float temperature,
                        const Tensor& logprob_out, const Tensor& entropy_out, Device device,
                        const char* op) {
  const std::string what = fmt::format("decoder {}", op);
  const int64_t T = batch.num_tokens();
  check_packed(batch.tokens, batch.positions, batch.cu_seqlens, V, what.c_str());
  check_prefix(batch, what.c_str());
  TANDEM_CHECK(static_cast<int64_t>(batch.targets.size()) == T,
               "{}: targets has {} entries, tokens {}", what, batch.targets.size(), T);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = batch.targets[static_cast<size_t>(t)];
    TANDEM_CHECK(id >= 0 && id < V,
                 "{}: target {} at position {} is outside the vocabulary [0, {})", what, id, t, V);
  }
  for (size_t r = 0; r < batch.head_rows.size(); ++r) {
    const int32_t row = batch.head_rows[r];
    TANDEM_CHECK(row >= 0 && row < T && (r == 0 || row > batch.head_rows[r - 1]),
                 "{}: head_rows[{}] = {} is not in [0, {}) above the row before it "
                 "(head_rows must increase)",
                 what, r, row, T);
  }
  TANDEM_CHECK(temperature > 0, "{}: temperature must be positive, got {}", what, temperature);
  check_output(logprob_out, {T}, device, fmt::format("{}'s logprob_out", op).c_str());
  if (entropy_out.defined())
    check_output(entropy_out, {T}, device, fmt::format("{}'s entropy_out", op).c_str());
}

// The targets of the rows that go through the head (PackedBatch::head_rows), in their order.
std::vector<int32_t> head_targets(const PackedBatch& batch) {
  std::vector<int32_t> targets;
  targets.reserve(batch.head_rows.size());
  for (const int32_t row : batch.head_rows)
    targets.push_back(batch.targets[static_cast<size_t>(row)]);
  return targets;
}

void check_not_tensor_parallel(const Communicator* tp, const char* what) {
  TANDEM_CHECK(tp == nullptr,
               "decoder {}: a tensor-parallel decoder (DecoderOptions::tp_group) runs forward, "
               "backward, score, prefill and decode; {} needs the whole model",
               what, what);
}

// A group of one rank has nothing to sum: the decoder runs as without a group (the same bits).
Communicator* tensor_parallel_group(const DecoderOptions& o) {
  return o.tp_group != nullptr && o.tp_group->size() > 1 ? o.tp_group : nullptr;
}

// The vocabulary-parallel head (model/vocab_parallel.h) runs on the CPU only for now.
void check_tp_device(Device device, const char* what) {
  TANDEM_CHECK(device.is_cpu(),
               "decoder {}: under tensor parallelism it runs on the CPU only for now (the "
               "vocabulary-parallel head's ops are CPU ops), got weights on {}",
               what, device.str());
}

// Training a shard of c (group of tp): a KV head replicated on several ranks (Hkv < tp) would need
// the k/v gradients of those ranks summed, which backward does not do. A shard with a single KV
// head cannot tell that case from Hkv = tp: the caller says (DecoderOptions::tp_kv_heads).
// Checked before any collective, the same on every rank.
void check_tp_training(const ModelConfig& c, int tp, int64_t kv_heads) {
  const int64_t shard = c.num_kv_heads;
  TANDEM_CHECK(shard > 1 || kv_heads > 0,
               "decoder forward: this tensor-parallel shard holds a single KV head, which is "
               "either its own (num_key_value_heads = {}) or replicated on several ranks "
               "(num_key_value_heads < {}, which training refuses): set "
               "DecoderOptions::tp_kv_heads to the model's num_key_value_heads",
               tp, tp);
  const int64_t Hkv = kv_heads > 0 ? kv_heads : shard * tp;
  TANDEM_CHECK(Hkv >= tp ? shard * tp == Hkv : shard == 1 && tp % Hkv == 0,
               "decoder forward: DecoderOptions::tp_kv_heads = {} does not fit a shard of {} KV "
               "heads at the tensor-parallel size {} (model::tp_shard_config's split)",
               kv_heads, shard, tp);
  TANDEM_CHECK(Hkv >= tp,
               "decoder forward: num_key_value_heads = {} is less than the tensor-parallel size "
               "{}: each KV head is replicated on {} ranks, whose k/v gradients training would "
               "have to sum, which it does not; train with a tensor-parallel size that divides "
               "num_key_value_heads (inference serves this split)",
               Hkv, tp, tp / Hkv);
}

// Uploads the batch's prefixes into buf (or leaves it undefined: no prefixes).
Tensor upload_prefix(Tensor buf, const PackedBatch& batch) {
  if (batch.prefix.empty()) return Tensor();
  upload(buf, batch.prefix);
  return buf;
}

void check_no_unit_hooks(const UnitHooks* hooks, const char* what) {
  TANDEM_CHECK(hooks == nullptr,
               "decoder {}: a decoder over sharded weights (DecoderOptions::unit_hooks) runs the "
               "training forward and backward only",
               what);
}

// forward, backward, score, forward_logits, prefill and decode run the whole model.
void check_whole(const Weights& w, const char* what) {
  TANDEM_CHECK(w.whole(),
               "decoder {}: the weights hold a model part ({}); a pipeline stage's decoder runs "
               "forward_stage and backward_stage only",
               what, w.part().str(w.config()));
}

// A stage's hidden states at a boundary: f32 (T, C) on the decoder's device, or undefined exactly
// where the part has no neighbour there (`outside`: the first stage's h_in, the last's h_out).
void check_boundary(const Tensor& t, bool outside, int64_t micro, int64_t T, int64_t C,
                    Device device, const char* what, const char* op) {
  if (outside) {
    TANDEM_CHECK(!t.defined(),
                 "decoder {}: micro-batch {}'s {} must be undefined on this stage (its part has no "
                 "stage on that side), got {}",
                 op, micro, what, t.str());
    return;
  }
  check_output(t, {T, C}, device,
               fmt::format("{} of micro-batch {}'s {}", op, micro, what).c_str());
}

}  // namespace

struct Decoder::Impl {
  Impl(const Weights& w, const DecoderOptions& o)
      : net(w, tensor_parallel_group(o)),
        options(o),
        part(w.part()),
        whole(w.whole()),
        part_config(w.config()) {
    part_config.num_layers = part.num_layers;
  }
  Net net;
  DecoderOptions options;
  ModelPart part;           // of the weights
  bool whole;               // part is the whole model
  ModelConfig part_config;  // the weights' config with the part's layers: what a slot plans
  // One activation arena per pipeline slot, and the buffers of the call planned in it (a training
  // forward's until its backward). Slot 0 also serves every call but the stages'.
  struct Slot {
    std::unique_ptr<Arena> arena;
    Buffers bufs;
    // The micro-batch forwarded into it and not yet differentiated, kWholeForward (forward's, for
    // backward) or -1: free.
    int64_t micro = -1;
    float temperature = 1.0f;
  };
  static constexpr int64_t kWholeForward = -2;
  std::vector<Slot> slots;
  Buffers counted;  // the plan of a call when only its bytes are counted
  // Host scratch of the inference calls, grown to the largest batch seen.
  std::vector<int32_t> decode_cu;  // (B + 1)
  std::vector<float> ones_host;    // (T) (biases only)
  // Tensor parallelism: Buffers::emb_ids and emb_rows on the host.
  std::vector<int32_t> emb_ids_host, emb_rows_host;

  // Drops every micro-batch in flight, empties slot 0's arena and hands out the buffers of a call.
  Buffers& begin(const ModelConfig& c, Device device, int64_t T, int64_t B, Mode mode) {
    drop_all();
    return begin_slot(0, c, device, T, B, mode);
  }

  // Empties slot k's arena and hands out the buffers of a call, growing the arena when allowed.
  Buffers& begin_slot(size_t k, const ModelConfig& c, Device device, int64_t T, int64_t B,
                      Mode mode) {
    std::unique_ptr<Arena>& arena = slots[k].arena;
    Planner count(nullptr);
    plan(count, c, T, B, mode, options.recompute, tp_size(), counted, options.score_rows);
    if (count.bytes() > arena->capacity()) {
      TANDEM_CHECK(options.grow,
                   "decoder: a call of {} tokens needs {} bytes of activations, the arena planned "
                   "for max_tokens = {} holds {}: raise DecoderOptions::max_tokens",
                   T, count.bytes(), options.max_tokens, arena->capacity());
      arena.reset();  // give the old memory back first
      // Scoring grows to its own plan only: a training forward's for T would defeat its point.
      const bool scoring = mode == Mode::scoring;
      arena = std::make_unique<Arena>(
          ArenaClass::activations, device,
          scoring ? count.bytes() : std::max(count.bytes(), bytes_for(c, T)));
      if (!scoring) options.max_tokens = std::max(options.max_tokens, T);
    }
    arena->reserve();  // after release_activations()
    arena->reset();
    Planner p(arena.get());
    plan(p, c, T, B, mode, options.recompute, tp_size(), slots[k].bufs, options.score_rows);
    return slots[k].bufs;
  }

  void drop_all() {
    for (Slot& slot : slots) slot.micro = -1;
  }

  // The slot holding micro-batch `micro`, or slots.size().
  size_t slot_of(int64_t micro) const {
    size_t k = 0;
    while (k < slots.size() && slots[k].micro != micro) ++k;
    return k;
  }

  // "1, 4": the micro-batches in flight, for messages.
  std::string in_flight() const {
    std::vector<int64_t> ids;
    for (const Slot& slot : slots)
      if (slot.micro >= 0) ids.push_back(slot.micro);
    return ids.empty() ? std::string("none") : fmt::format("{}", fmt::join(ids, ", "));
  }

  // A free slot for micro-batch `micro` (op: forward_stage), throwing when it is already in flight
  // or every slot holds one. Drops forward's state (a stage call is another call).
  size_t free_slot(int64_t micro, const char* op) {
    if (slots[0].micro == kWholeForward) slots[0].micro = -1;
    TANDEM_CHECK(micro >= 0, "decoder {}: micro-batch ids are 0 or more, got {}", op, micro);
    TANDEM_CHECK(slot_of(micro) == slots.size(),
                 "decoder {}: micro-batch {} is already in flight (forwarded, not yet "
                 "differentiated): call backward_stage({}) or drop_stage({}) first",
                 op, micro, micro, micro);
    const size_t k = slot_of(-1);
    TANDEM_CHECK(k < slots.size(),
                 "decoder {}: micro-batch {} would be in flight with {} others (micro-batches {}), "
                 "but DecoderOptions::pipeline_slots = {}: differentiate one first or raise "
                 "pipeline_slots (1F1B keeps up to P - s on stage s of P)",
                 op, micro, slots.size(), in_flight(), slots.size());
    return k;
  }

  // The slot of micro-batch `micro` in flight (op: backward_stage), throwing when there is none.
  // Drops forward's state.
  size_t busy_slot(int64_t micro, const char* op) {
    if (slots[0].micro == kWholeForward) slots[0].micro = -1;
    const size_t k = slot_of(micro);
    TANDEM_CHECK(micro >= 0 && k < slots.size(),
                 "decoder {}: micro-batch {} is not in flight (in flight: {}): forward_stage it "
                 "first; a backward consumes it and any call but the stages' drops it",
                 op, micro, in_flight());
    return k;
  }

  // Uploads a packed batch's ids, positions, sequences and prefix into b (after begin); the
  // layers' attention inputs over them.
  AttentionInputs upload_batch(Buffers& b, const PackedBatch& batch) {
    upload(b.tokens, batch.tokens);
    upload(b.positions, batch.positions);
    upload(b.cu_seqlens, batch.cu_seqlens);
    b.prefix = upload_prefix(b.prefix, batch);
    if (b.ones.defined()) fill_ones(b.ones, ones_host);
    return {b.positions, b.cu_seqlens, nullptr, {}, {}, {}, b.ones, b.prefix, b.tp_parts};
  }

  // Uploads the batch (b from begin in the logits or scoring mode) and runs the embedding and
  // the layers through two residual buffers, keeping one layer's activations; returns the last
  // layer's output (T, C).
  Tensor run_layers(Buffers& b, const Weights& w, const PackedBatch& batch) {
    const AttentionInputs in = upload_batch(b, batch);
    embed(b, w, batch.tokens);
    const int64_t L = w.config().num_layers;
    for (int64_t l = 0; l < L; ++l)
      net.layer_forward(l, b.acts[0], b.resid[static_cast<size_t>(l % 2)],
                        b.resid[static_cast<size_t>((l + 1) % 2)], in);
    return b.resid[static_cast<size_t>(L % 2)];
  }

  int tp_size() const { return net.tp() ? net.tp()->size() : 1; }

  // The arena for calls of up to T tokens.
  size_t bytes_for(const ModelConfig& c, int64_t T) const {
    if (!whole) {
      // A pipeline stage: its training plan only (c is part_config).
      Planner stage(nullptr);
      Buffers b;
      plan(stage, c, T, T, part.head ? Mode::training : Mode::stage, options.recompute, tp_size(),
           b);
      return stage.bytes();
    }
    return Decoder::plan_bytes(c, T, options.recompute, tp_size());
  }

  // resid[0] = the embedding rows of the call's tokens (b.tokens, uploaded). Tensor parallel: each
  // rank gathers the rows its vocabulary shard holds (into resid[1], free until layer 0 writes it)
  // and scatters them over zeros; the all-reduce then adds one row and zeros: the same bits as the
  // full table.
  void embed(Buffers& b, const Weights& w, std::span<const int32_t> tokens) {
    const Stream& s = net.stream();
    Communicator* tp = net.tp();
    if (tp == nullptr) {
      ops::embedding(b.tokens, w.embed, b.resid[0], s);
      return;
    }
    const int64_t Vs = w.config().vocab_size, v0 = tp->rank() * Vs;
    emb_ids_host.clear();
    emb_rows_host.clear();
    for (size_t t = 0; t < tokens.size(); ++t) {
      if (tokens[t] < v0 || tokens[t] >= v0 + Vs) continue;
      emb_ids_host.push_back(static_cast<int32_t>(tokens[t] - v0));
      emb_rows_host.push_back(static_cast<int32_t>(t));
    }
    const int64_t n = b.emb_held = static_cast<int64_t>(emb_ids_host.size());
    if (n == 0) {
      b.resid[0].zero();
    } else {
      const Tensor ids = b.emb_ids.narrow(0, n), rows = b.emb_rows.narrow(0, n);
      const Tensor gathered = b.resid[1].narrow(0, n);
      upload(ids, emb_ids_host);
      upload(rows, emb_rows_host);
      ops::embedding(ids, w.embed, gathered, s);
      ops::embedding_backward(rows, gathered, b.resid[0], false, s);
    }
    tp->all_reduce(b.resid[0]);  // the TP group's vocabulary rows: (T, C) f32 summed
  }

  // grads.embed += the embedding's gradient: dh (T, C) at the call's tokens. Tensor parallel:
  // the tokens of the rank's vocabulary rows only (embed's emb_ids and emb_rows), their rows of dh
  // gathered into scratch (T, C) in token order, so that each table row sums its tokens in the
  // whole table's order.
  void embed_backward(Buffers& b, const Tensor& dh, const Tensor& scratch, Weights& grads) {
    const Stream& s = net.stream();
    if (net.tp() == nullptr) {
      ops::embedding_backward(b.tokens, dh, grads.embed, true, s);
      return;
    }
    const int64_t n = b.emb_held;
    if (n == 0) return;
    const Tensor gathered = scratch.narrow(0, n);
    ops::embedding(b.emb_rows.narrow(0, n), dh, gathered, s);
    ops::embedding_backward(b.emb_ids.narrow(0, n), gathered, grads.embed, true, s);
  }

  // The head over R rows h (R, C), into xf (R, C), rstdf (R) and logits (R, V) (V/tp: the rank's
  // vocabulary columns): logprob (R), lse (R) and entropy (R; undefined: skipped) of the rows'
  // targets (R), over the whole vocabulary. Row-wise, so a row's bits do not depend on the others
  // but for the order of the tensor-parallel sums.
  void head_logprob(const Tensor& h, const Tensor& xf, const Tensor& rstdf, const Tensor& logits,
                    const Tensor& targets, const Tensor& logprob, const Tensor& lse,
                    const Tensor& entropy, float temperature) {
    net.head(h, xf, rstdf, logits);
    Communicator* tp = net.tp();
    if (tp == nullptr) {
      ops::logprob_gather(logits, targets, logprob, lse, entropy, temperature, net.stream());
      return;
    }
    // Two all-reduces over the TP group, of the rows' statistics only (the logits stay): the
    // maxima, (R) f32, then the rescaled sums, (R, 4) f32.
    const int64_t Vs = logits.size(1);
    vocab_parallel_logprob(*tp, logits, targets, tp->rank() * Vs, tp->size() * Vs, logprob, lse,
                           entropy, temperature);
  }

  // Backward of a training forward's head over its first R rows, which read h (R, C): given
  // dlogprob (R) and dentropy (R, or undefined), dh (R, C) = the gradient at h; grads' lm_head
  // (tensor parallel: the rank's vocabulary rows) and final norm += theirs. Tensor parallel:
  // dlogits are the rank's columns (logprob_shard_backward, from the forward's lse and entropy),
  // so dlogits · lm_head is the rank's part of d xf, summed over the group before the norm.
  void head_backward(Buffers& b, float temperature, const Tensor& dlogprob, const Tensor& dentropy,
                     const Weights& w, const Tensor& h, const Tensor& dh, Weights& grads) {
    const Stream& s = net.stream();
    const int64_t R = h.size(0);
    const Tensor logits = b.logits.narrow(0, R), dlogits = b.dlogits.narrow(0, R);
    const Tensor targets = b.targets.narrow(0, R), lse = b.lse.narrow(0, R);
    const Tensor dxf = b.grads.dx.narrow(0, R);
    Communicator* tp = net.tp();
    if (tp == nullptr) {
      ops::logprob_gather_backward(dlogprob, dentropy, logits, targets, lse, dlogits, temperature,
                                   false, s);
    } else {
      const int64_t Vs = logits.size(1);
      ops::logprob_shard_backward(dlogprob, dentropy, logits, targets, tp->rank() * Vs, lse,
                                  b.entropy.narrow(0, R), dlogits, temperature, false, s);
    }
    ops::matmul_backward_input(dlogits, w.lm_head, dxf, false, s);
    if (tp != nullptr) tp->all_reduce(dxf);  // the TP group's vocabulary rows: (R, C) f32 summed
    ops::matmul_backward_weight(dlogits, b.xf.narrow(0, R), grads.lm_head, true, s);
    ops::rmsnorm_backward(dxf, h, w.final_norm, b.rstdf.narrow(0, R), dh, grads.final_norm, false,
                          true, s);
  }

  // logits_out (B, V) = the head of h (B, C); tensor parallel, (B, V/tp): the rank's vocabulary
  // rows, which it samples from without gathering the others (model/tp_sample.h).
  void logits(Buffers& b, const Tensor& h, const Tensor& logits_out) {
    const int64_t B = h.size(0);
    net.head(h, b.xf.narrow(0, B), b.rstdf.narrow(0, B), logits_out);
  }
};

size_t Decoder::plan_bytes(const ModelConfig& config, int64_t T, bool recompute, int tp) {
  TANDEM_CHECK(tp >= 1, "decoder plan_bytes: the tensor-parallel size must be >= 1, got {}", tp);
  Planner train(nullptr), infer(nullptr);
  Buffers b;
  plan(train, config, T, T, Mode::training, recompute, tp, b);
  plan(infer, config, T, T, Mode::inference, recompute, tp, b);
  return std::max(train.bytes(), infer.bytes());
}

Decoder::Decoder(const Weights& weights, const DecoderOptions& options)
    : weights_(&weights), impl_(std::make_unique<Impl>(weights, options)) {
  TANDEM_CHECK(options.max_tokens > 0,
               "decoder: DecoderOptions::max_tokens must be positive, got {}", options.max_tokens);
  TANDEM_CHECK(options.pipeline_slots >= 1,
               "decoder: DecoderOptions::pipeline_slots must be 1 or more, got {}",
               options.pipeline_slots);
  impl_->slots.resize(static_cast<size_t>(options.pipeline_slots));
  for (Impl::Slot& slot : impl_->slots)
    slot.arena = std::make_unique<Arena>(ArenaClass::activations, weights.device(),
                                         impl_->bytes_for(impl_->part_config, options.max_tokens));
  if (options.pack_weights) impl_->net.pack_weights();
}

Decoder::~Decoder() = default;

void Decoder::set_weights(const Weights& weights) {
  const ModelConfig &a = weights.config(), &b = config();
  TANDEM_CHECK(a.arch == b.arch && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
                   a.intermediate_size == b.intermediate_size && a.num_layers == b.num_layers &&
                   a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads &&
                   a.head_dim == b.head_dim && a.tie_word_embeddings == b.tie_word_embeddings &&
                   a.attention_bias == b.attention_bias && a.qk_norm == b.qk_norm &&
                   weights.device() == device() && weights.part() == weights_->part(),
               "decoder set_weights: the new weights ({} layers, width {}, on {}, {}) must have "
               "the config, device and part of the current ones ({} layers, width {}, on {}, {})",
               a.num_layers, a.hidden_size, weights.device().str(), weights.part().str(a),
               b.num_layers, b.hidden_size, device().str(), weights_->part().str(b));
  impl_->drop_all();
  weights_ = &weights;
  impl_->net.set_weights(weights);
  if (impl_->options.pack_weights) impl_->net.pack_weights();
}

int64_t Decoder::vocab_size() const {
  return config().vocab_size * (impl_->options.tp_group ? impl_->options.tp_group->size() : 1);
}

size_t Decoder::activation_bytes() const {
  size_t bytes = 0;
  for (const Impl::Slot& slot : impl_->slots) bytes += slot.arena->capacity();
  return bytes;
}

void Decoder::release_activations() {
  impl_->drop_all();
  for (Impl::Slot& slot : impl_->slots) slot.arena->release();
}

void Decoder::forward(const PackedBatch& batch, const Tensor& logprob_out,
                      const Tensor& entropy_out, float temperature) {
  check_whole(*weights_, "forward");
  check_logprob_call(batch, vocab_size(), temperature, logprob_out, entropy_out, device(),
                     "forward");
  impl_->drop_all();
  train_forward(0, batch, Tensor(), Tensor(), logprob_out, entropy_out, temperature);
  impl_->slots[0].micro = Impl::kWholeForward;
}

void Decoder::train_forward(size_t slot, const PackedBatch& batch, const Tensor& h_in,
                            const Tensor& h_out, const Tensor& logprob_out,
                            const Tensor& entropy_out, float temperature) {
  const ModelConfig& c = config();
  const int64_t T = batch.num_tokens(), L = static_cast<int64_t>(weights_->layers.size());
  Impl& m = *impl_;
  if (m.net.tp() != nullptr) {  // before the first collective, the same on every rank
    check_tp_device(device(), "training forward");
    check_tp_training(c, m.tp_size(), m.options.tp_kv_heads);
  }
  const bool head = m.part.head;
  Buffers& b = m.begin_slot(slot, m.part_config, device(), T, batch.num_sequences(),
                            head ? Mode::training : Mode::stage);
  const AttentionInputs in = m.upload_batch(b, batch);
  if (head) upload(b.targets, batch.targets);
  const Stream& s = m.net.stream();
  const UnitCalls units(m.options.unit_hooks, c, m.part);
  // Tensor parallel: the entropy is computed in any case and kept (backward's
  // logprob_shard_backward reads it).
  const bool tp = m.net.tp() != nullptr;
  if (h_in.defined()) {  // a pipeline stage after the first: the previous one's output
    Tensor(b.resid[0]).copy_from(h_in);
  } else {
    units.acquire(units.units().embed);
    m.embed(b, *weights_, batch.tokens);
    units.release(units.units().embed);
  }
  for (int64_t l = 0; l < L; ++l) {
    LayerActs& a = b.acts[static_cast<size_t>(m.options.recompute ? 0 : l)];
    units.acquire(units.layer(l));
    m.net.layer_forward(l, a, b.resid[static_cast<size_t>(l)], b.resid[static_cast<size_t>(l + 1)],
                        in);
    units.release(units.layer(l));
  }
  const Tensor& h = b.resid[static_cast<size_t>(L)];
  if (!head) {  // a pipeline stage before the last: its output goes to the next one
    Tensor(h_out).copy_from(h);
    return;
  }
  units.acquire_head();
  if (batch.head_rows.empty()) {
    b.head_rows = T;
    m.head_logprob(h, b.xf, b.rstdf, b.logits, b.targets, logprob_out, b.lse,
                   tp ? b.entropy : entropy_out, temperature);
    if (tp && entropy_out.defined()) Tensor(entropy_out).copy_from(b.entropy);
  } else {
    // Only the selected rows: gathered (the embedding op is a row gather on any device), through
    // the head, and their logprob and entropy scattered back over zeros.
    const int64_t R = b.head_rows = static_cast<int64_t>(batch.head_rows.size());
    const Tensor ids = b.head_ids.narrow(0, R), tg = b.targets.narrow(0, R);
    upload(ids, batch.head_rows);
    upload(tg, head_targets(batch));
    const Tensor hs = b.head_in.narrow(0, R), xf = b.xf.narrow(0, R), rf = b.rstdf.narrow(0, R);
    const Tensor logits = b.logits.narrow(0, R), lse = b.lse.narrow(0, R);
    ops::embedding(ids, h, hs, s);
    // The compact logprob and entropy go to the front of dlogits (free until backward; tensor
    // parallel: the entropy to b.entropy, kept), then to their rows.
    const Tensor lp = b.dlogits.view({T * c.vocab_size}).narrow(0, R);
    const Tensor ent =
        tp ? b.entropy.narrow(0, R) : b.dlogits.view({T * c.vocab_size}).narrow(R, R);
    m.head_logprob(hs, xf, rf, logits, tg, lp, lse, tp || entropy_out.defined() ? ent : Tensor(),
                   temperature);
    ops::embedding_backward(ids, lp.view({R, 1}), logprob_out.view({T, 1}), false, s);
    if (entropy_out.defined())
      ops::embedding_backward(ids, ent.view({R, 1}), entropy_out.view({T, 1}), false, s);
  }
  units.release_head();
  m.slots[slot].temperature = temperature;
}

void Decoder::forward_logits(const PackedBatch& batch, const Tensor& logits_out) {
  const ModelConfig& c = config();
  const int64_t T = batch.num_tokens();
  check_not_tensor_parallel(impl_->net.tp(), "forward_logits");
  check_whole(*weights_, "forward_logits");
  check_no_unit_hooks(impl_->options.unit_hooks, "forward_logits");
  check_packed(batch.tokens, batch.positions, batch.cu_seqlens, c.vocab_size,
               "decoder forward_logits");
  check_prefix(batch, "decoder forward_logits");
  check_output(logits_out, {T, c.vocab_size}, device(), "forward_logits' logits_out");
  Impl& m = *impl_;
  Buffers& b = m.begin(c, device(), T, batch.num_sequences(), Mode::logits);
  const Tensor h = m.run_layers(b, *weights_, batch);
  m.net.head(h, b.xf, b.rstdf, logits_out);
}

void Decoder::score(const PackedBatch& batch, const Tensor& logprob_out, const Tensor& entropy_out,
                    float temperature) {
  const ModelConfig& c = config();
  const int64_t T = batch.num_tokens();
  Impl& m = *impl_;
  if (m.net.tp() != nullptr) check_tp_device(device(), "score");
  check_whole(*weights_, "score");
  check_no_unit_hooks(m.options.unit_hooks, "score");
  check_logprob_call(batch, vocab_size(), temperature, logprob_out, entropy_out, device(), "score");
  TANDEM_CHECK(m.options.score_rows > 0,
               "decoder score: DecoderOptions::score_rows must be positive, got {}",
               m.options.score_rows);
  Buffers& b = m.begin(c, device(), T, batch.num_sequences(), Mode::scoring);
  const bool all = batch.head_rows.empty();
  const int64_t R = all ? T : static_cast<int64_t>(batch.head_rows.size());
  if (all) {
    upload(b.targets, batch.targets);
  } else {
    // The selected rows (head_ids) and their targets, compact; the others' outputs are 0, as
    // forward's.
    upload(b.targets.narrow(0, R), head_targets(batch));
    upload(b.head_ids.narrow(0, R), batch.head_rows);
    Tensor(logprob_out).zero();
    if (entropy_out.defined()) Tensor(entropy_out).zero();
  }
  const Tensor h = m.run_layers(b, *weights_, batch);
  const Stream& s = m.net.stream();
  // The head chunk by chunk: each row's bits are forward's (the ops are row-wise; under tensor
  // parallelism, but for the order of the sums over the group when the chunks are not forward's
  // rows), and a chunk of selected rows is gathered, scored and added to its rows over zeros as
  // forward scatters.
  const int64_t rows = b.xf.size(0);
  for (int64_t r0 = 0; r0 < R; r0 += rows) {
    const int64_t n = std::min(rows, R - r0);
    const Tensor xf = b.xf.narrow(0, n), rf = b.rstdf.narrow(0, n);
    const Tensor logits = b.logits.narrow(0, n), lse = b.lse.narrow(0, n);
    const Tensor tg = b.targets.narrow(r0, n);
    if (all) {
      m.head_logprob(h.narrow(r0, n), xf, rf, logits, tg, logprob_out.narrow(r0, n), lse,
                     entropy_out.defined() ? entropy_out.narrow(r0, n) : Tensor(), temperature);
      continue;
    }
    const Tensor ids = b.head_ids.narrow(r0, n), hs = b.head_in.narrow(0, n);
    const Tensor lp = b.head_out.narrow(0, n), ent = b.head_out.narrow(rows, n);
    ops::embedding(ids, h, hs, s);
    m.head_logprob(hs, xf, rf, logits, tg, lp, lse, entropy_out.defined() ? ent : Tensor(),
                   temperature);
    ops::embedding_backward(ids, lp.view({n, 1}), logprob_out.view({T, 1}), true, s);
    if (entropy_out.defined())
      ops::embedding_backward(ids, ent.view({n, 1}), entropy_out.view({T, 1}), true, s);
  }
}

void Decoder::backward(const Tensor& dlogprob, const Tensor& dentropy, Weights& grads) {
  Impl& m = *impl_;
  check_whole(*weights_, "backward");
  TANDEM_CHECK(m.slots[0].micro == Impl::kWholeForward,
               "decoder backward: no training forward to differentiate (call forward first; "
               "backward consumes it, and any other call discards it)");
  train_backward(0, dlogprob, dentropy, Tensor(), grads, Tensor());
}

void Decoder::train_backward(size_t slot, const Tensor& dlogprob, const Tensor& dentropy,
                             const Tensor& dh_out, Weights& grads, const Tensor& dh_in) {
  Impl& m = *impl_;
  const ModelConfig& c = config();
  Buffers& b = m.slots[slot].bufs;
  const int64_t T = b.T, L = static_cast<int64_t>(weights_->layers.size());
  const float temperature = m.slots[slot].temperature;
  if (m.part.head) {
    check_output(dlogprob, {T}, device(), "backward's dlogprob");
    if (dentropy.defined()) check_output(dentropy, {T}, device(), "backward's dentropy");
  }
  const ModelConfig& gc = grads.config();
  TANDEM_CHECK(grads.dtype() == DType::f32 && grads.device() == device() &&
                   grads.part() == weights_->part() &&
                   grads.layers.size() == weights_->layers.size() &&
                   gc.vocab_size == c.vocab_size && gc.hidden_size == c.hidden_size &&
                   gc.tie_word_embeddings == c.tie_word_embeddings &&
                   gc.attention_bias == c.attention_bias && gc.qk_norm == c.qk_norm &&
                   gc.num_heads == c.num_heads && gc.num_kv_heads == c.num_kv_heads &&
                   gc.head_dim == c.head_dim && gc.intermediate_size == c.intermediate_size,
               "decoder backward: grads must be f32 Weights on {} of the same model and part ({}); "
               "got {} weights on {} ({} layers, {})",
               device().str(), weights_->part().str(c), grads.dtype(), grads.device().str(),
               grads.layers.size(), grads.part().str(gc));
  m.slots[slot].micro = -1;
  const Stream& s = m.net.stream();
  const AttentionInputs in{b.positions, b.cu_seqlens, nullptr,  {},        {},
                           {},          b.ones,       b.prefix, b.tp_parts};
  LayerGrads& g = b.grads;
  const UnitCalls units(m.options.unit_hooks, c, m.part);

  const Tensor& h = b.resid[static_cast<size_t>(L)];
  if (m.part.head) {
    units.begin_head_gradients();
    units.acquire_head();
  }
  if (!m.part.head) {  // a pipeline stage before the last: the next one's dL/dh
    Tensor(g.dh).copy_from(dh_out);
  } else if (b.head_rows == T) {
    m.head_backward(b, temperature, dlogprob, dentropy, *weights_, h, g.dh, grads);
  } else {
    // The selected rows' dlogprob and dentropy (gathered into dhead_in's first rows, free until
    // rmsnorm_backward), back through the head, and the hidden-state gradient scattered to
    // its rows over zeros.
    const int64_t R = b.head_rows;
    const Tensor ids = b.head_ids.narrow(0, R);
    const Tensor flat = b.dhead_in.view({T * c.hidden_size});
    const Tensor dlp = flat.narrow(0, R), dent = flat.narrow(R, R);
    ops::embedding(ids, dlogprob.view({T, 1}), dlp.view({R, 1}), s);
    if (dentropy.defined()) ops::embedding(ids, dentropy.view({T, 1}), dent.view({R, 1}), s);
    const Tensor dhs = b.dhead_in.narrow(0, R);
    m.head_backward(b, temperature, dlp, dentropy.defined() ? dent : Tensor(), *weights_,
                    b.head_in.narrow(0, R), dhs, grads);
    ops::embedding_backward(ids, dhs, g.dh, false, s);
  }
  if (m.part.head) {
    units.release_head();
    units.end_head_gradients();
  }
  for (int64_t l = L - 1; l >= 0; --l) {
    LayerActs& a = b.acts[static_cast<size_t>(m.options.recompute ? 0 : l)];
    const Tensor& h_in = b.resid[static_cast<size_t>(l)];
    units.acquire(units.layer(l));
    // Recompute writes layer l's output again, the same bits; nothing reads it any more.
    if (m.options.recompute)
      m.net.layer_forward(l, a, h_in, b.resid[static_cast<size_t>(l + 1)], in);
    units.begin_gradients(units.layer(l));
    m.net.layer_backward(l, a, h_in, in, g, grads.layers[static_cast<size_t>(l)]);
    units.end_gradients(units.layer(l));
    units.release(units.layer(l));
  }
  if (!m.part.embedding) {  // a pipeline stage after the first: dL/dh_in goes to the previous one
    Tensor(dh_in).copy_from(g.dh);
    return;
  }
  units.begin_embed_gradients();
  m.embed_backward(b, g.dh, g.dx, grads);  // g.dx: free scratch now
  units.end_embed_gradients();
}

void Decoder::forward_stage(int64_t micro, const PackedBatch& batch, const Tensor& h_in,
                            const Tensor& h_out) {
  Impl& m = *impl_;
  const ModelConfig& c = config();
  TANDEM_CHECK(!m.part.head,
               "decoder forward_stage: micro-batch {}: this part ({}) holds the head; pass "
               "logprob_out, entropy_out and the temperature instead of h_out",
               micro, m.part.str(c));
  check_packed(batch.tokens, batch.positions, batch.cu_seqlens, vocab_size(),
               "decoder forward_stage");
  check_prefix(batch, "decoder forward_stage");
  const int64_t T = batch.num_tokens(), C = c.hidden_size;
  check_boundary(h_in, m.part.embedding, micro, T, C, device(), "h_in", "forward_stage");
  check_boundary(h_out, false, micro, T, C, device(), "h_out", "forward_stage");
  const size_t slot = m.free_slot(micro, "forward_stage");
  train_forward(slot, batch, h_in, h_out, Tensor(), Tensor(), 1.0f);
  m.slots[slot].micro = micro;
}

void Decoder::forward_stage(int64_t micro, const PackedBatch& batch, const Tensor& h_in,
                            const Tensor& logprob_out, const Tensor& entropy_out,
                            float temperature) {
  Impl& m = *impl_;
  const ModelConfig& c = config();
  TANDEM_CHECK(m.part.head,
               "decoder forward_stage: micro-batch {}: this part ({}) has no head; pass h_out for "
               "the next stage instead of logprob_out and entropy_out",
               micro, m.part.str(c));
  check_logprob_call(batch, vocab_size(), temperature, logprob_out, entropy_out, device(),
                     "forward_stage");
  check_boundary(h_in, m.part.embedding, micro, batch.num_tokens(), c.hidden_size, device(), "h_in",
                 "forward_stage");
  const size_t slot = m.free_slot(micro, "forward_stage");
  train_forward(slot, batch, h_in, Tensor(), logprob_out, entropy_out, temperature);
  m.slots[slot].micro = micro;
}

void Decoder::backward_stage(int64_t micro, const Tensor& dh_out, Weights& grads,
                             const Tensor& dh_in) {
  Impl& m = *impl_;
  const ModelConfig& c = config();
  TANDEM_CHECK(!m.part.head,
               "decoder backward_stage: micro-batch {}: this part ({}) holds the head; pass "
               "dlogprob and dentropy instead of dh_out",
               micro, m.part.str(c));
  const size_t slot = m.busy_slot(micro, "backward_stage");
  const int64_t T = m.slots[slot].bufs.T, C = c.hidden_size;
  check_boundary(dh_out, false, micro, T, C, device(), "dh_out", "backward_stage");
  check_boundary(dh_in, m.part.embedding, micro, T, C, device(), "dh_in", "backward_stage");
  train_backward(slot, Tensor(), Tensor(), dh_out, grads, dh_in);
}

void Decoder::backward_stage(int64_t micro, const Tensor& dlogprob, const Tensor& dentropy,
                             Weights& grads, const Tensor& dh_in) {
  Impl& m = *impl_;
  const ModelConfig& c = config();
  TANDEM_CHECK(m.part.head,
               "decoder backward_stage: micro-batch {}: this part ({}) has no head; pass dh_out "
               "from the next stage instead of dlogprob and dentropy",
               micro, m.part.str(c));
  const size_t slot = m.busy_slot(micro, "backward_stage");
  check_boundary(dh_in, m.part.embedding, micro, m.slots[slot].bufs.T, c.hidden_size, device(),
                 "dh_in", "backward_stage");
  train_backward(slot, dlogprob, dentropy, Tensor(), grads, dh_in);
}

void Decoder::drop_stage(int64_t micro) {
  const size_t slot = impl_->slot_of(micro);
  if (micro >= 0 && slot < impl_->slots.size()) impl_->slots[slot].micro = -1;
}

void Decoder::prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                      std::span<const int32_t> cu_seqlens, const KvCacheView& kv,
                      const Tensor& logits_out) {
  check_no_unit_hooks(impl_->options.unit_hooks, "prefill");
  check_whole(*weights_, "prefill");
  const ModelConfig& c = config();
  const int64_t V = vocab_size();
  check_packed(tokens, positions, cu_seqlens, V, "decoder prefill");
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1;
  check_output(logits_out, {B, c.vocab_size}, device(), "prefill's logits_out");
  TANDEM_CHECK(static_cast<int64_t>(kv.k_cache.size()) == c.num_layers &&
                   static_cast<int64_t>(kv.v_cache.size()) == c.num_layers,
               "decoder prefill: the kv cache view has {} k and {} v tensors, the model {} layers",
               kv.k_cache.size(), kv.v_cache.size(), c.num_layers);
  bool fresh = true;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t start = cu_seqlens[static_cast<size_t>(b)];
    const int32_t n = cu_seqlens[static_cast<size_t>(b) + 1] - start;
    const int32_t p0 = positions[static_cast<size_t>(start)];
    for (int32_t j = 0; j < n; ++j)
      TANDEM_CHECK(positions[static_cast<size_t>(start + j)] == p0 + j,
                   "decoder prefill: positions of sequence {} must count up by one from {}, "
                   "got {} at its token {}",
                   b, p0, positions[static_cast<size_t>(start + j)], j);
    if (p0 != 0) fresh = false;
  }

  Impl& m = *impl_;
  Buffers& buf = m.begin(c, device(), T, B, Mode::inference);
  upload(buf.tokens, tokens);
  upload(buf.positions, positions);
  upload(buf.cu_seqlens, cu_seqlens);
  if (buf.ones.defined()) fill_ones(buf.ones, m.ones_host);
  AttentionInputs in{buf.positions, buf.cu_seqlens, &kv, {}, {}, {}, buf.ones, {}, buf.tp_parts};
  if (!fresh) {
    // Continuing chunks: every query row becomes a one-query "sequence" over the cached tokens
    // up to and including itself, for paged_attention_decode (the same key order as
    // attention, so the same bits).
    const int64_t P = kv.v_cache[0].size(1);
    const std::vector<int32_t> indptr = to_host(kv.kv_indptr, "kv_indptr");
    const std::vector<int32_t> indices = to_host(kv.kv_indices, "kv_indices");
    const std::vector<int32_t> last_len = to_host(kv.kv_last_len, "kv_last_len");
    TANDEM_CHECK(
        static_cast<int64_t>(indptr.size()) == B + 1 && static_cast<int64_t>(last_len.size()) == B,
        "decoder prefill: kv_indptr has {} and kv_last_len {} entries for {} sequences",
        indptr.size(), last_len.size(), B);
    std::vector<int32_t> row_indptr{0}, row_indices, row_last;
    for (int64_t b = 0; b < B; ++b) {
      const int32_t first = indptr[static_cast<size_t>(b)];
      const int32_t blocks = indptr[static_cast<size_t>(b) + 1] - first;
      const int64_t cached = (blocks - 1) * P + last_len[static_cast<size_t>(b)];
      const int32_t end = cu_seqlens[static_cast<size_t>(b) + 1];
      TANDEM_CHECK(blocks > 0 && first >= 0 &&
                       indptr[static_cast<size_t>(b) + 1] <= static_cast<int32_t>(indices.size()) &&
                       cached == positions[static_cast<size_t>(end) - 1] + 1,
                   "decoder prefill: sequence {} holds {} cached tokens ({} blocks) after this "
                   "chunk, its last position is {}: the cache view must include the chunk",
                   b, cached, blocks, positions[static_cast<size_t>(end) - 1]);
      for (int32_t t = cu_seqlens[static_cast<size_t>(b)]; t < end; ++t) {
        const int64_t n = positions[static_cast<size_t>(t)] + 1;
        const int64_t nb = (n + P - 1) / P;
        for (int64_t i = 0; i < nb; ++i)
          row_indices.push_back(indices[static_cast<size_t>(first + i)]);
        row_indptr.push_back(static_cast<int32_t>(row_indices.size()));
        row_last.push_back(static_cast<int32_t>(n - (nb - 1) * P));
      }
    }
    auto to_device = [&](const std::vector<int32_t>& v) {
      Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, device());
      upload(t, v);
      return t;
    };
    in.indptr = to_device(row_indptr);
    in.indices = to_device(row_indices);
    in.last_len = to_device(row_last);
  }
  const Stream& s = m.net.stream();
  m.embed(buf, *weights_, tokens);
  for (int64_t l = 0; l < c.num_layers; ++l)
    m.net.layer_forward(l, buf.acts[0], buf.resid[static_cast<size_t>(l % 2)],
                        buf.resid[static_cast<size_t>((l + 1) % 2)], in);
  // The last row of each sequence, gathered with the embedding op (a row gather on any device).
  std::vector<int32_t> last(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    last[static_cast<size_t>(b)] = cu_seqlens[static_cast<size_t>(b) + 1] - 1;
  const Tensor last_ids = buf.cu_seqlens.narrow(0, B);  // reused: cu_seqlens is no longer read
  upload(last_ids, last);
  const Tensor rows = buf.resid[static_cast<size_t>(c.num_layers % 2 == 0 ? 1 : 0)].narrow(0, B);
  ops::embedding(last_ids, buf.resid[static_cast<size_t>(c.num_layers % 2)], rows, s);
  m.logits(buf, rows, logits_out);
}

void Decoder::decode(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                     const KvCacheView& kv, const Tensor& logits_out) {
  check_no_unit_hooks(impl_->options.unit_hooks, "decode");
  check_whole(*weights_, "decode");
  const ModelConfig& c = config();
  const int64_t B = static_cast<int64_t>(tokens.size());
  Impl& m = *impl_;
  std::vector<int32_t>& cu = m.decode_cu;
  cu.resize(static_cast<size_t>(B) + 1);
  for (int64_t b = 0; b <= B; ++b) cu[static_cast<size_t>(b)] = static_cast<int32_t>(b);
  check_packed(tokens, positions, cu, vocab_size(), "decoder decode");
  check_output(logits_out, {B, c.vocab_size}, device(), "decode's logits_out");
  TANDEM_CHECK(static_cast<int64_t>(kv.k_cache.size()) == c.num_layers &&
                   static_cast<int64_t>(kv.v_cache.size()) == c.num_layers,
               "decoder decode: the kv cache view has {} k and {} v tensors, the model {} layers",
               kv.k_cache.size(), kv.v_cache.size(), c.num_layers);
  Buffers& buf = m.begin(c, device(), B, B, Mode::inference);
  upload(buf.tokens, tokens);
  upload(buf.positions, positions);
  if (buf.ones.defined()) fill_ones(buf.ones, m.ones_host);
  const AttentionInputs in{buf.positions,  {},       &kv, kv.kv_indptr, kv.kv_indices,
                           kv.kv_last_len, buf.ones, {},  buf.tp_parts};
  m.embed(buf, *weights_, tokens);
  for (int64_t l = 0; l < c.num_layers; ++l)
    m.net.layer_forward(l, buf.acts[0], buf.resid[static_cast<size_t>(l % 2)],
                        buf.resid[static_cast<size_t>((l + 1) % 2)], in);
  m.logits(buf, buf.resid[static_cast<size_t>(c.num_layers % 2)], logits_out);
}

}  // namespace tandem::model