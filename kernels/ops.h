// Every math op of tandem: shapes, dtypes and semantics. Rollout and training call only these.
//
// Conventions (the dimension letters of STYLE.md):
//   T tokens (packed: the sequences of a batch laid end to end, no padding), B sequences,
//   C model width, H query heads, Hkv key/value heads, D head size, F MLP width, V vocabulary.
// - Tensors are row-major and contiguous. Outputs are passed in, allocated by the caller (an
//   arena), and never reallocated. Scratch that an op needs (CPU: per-thread buffers of matmul,
//   attention, rmsnorm_backward and sample; CUDA: matmul's bf16 copies) only grows, to the
//   largest shape seen, so steady-state calls allocate nothing. Three CUDA ops still take small
//   stream-ordered allocations per call (cudaMallocAsync: sum_squares, rmsnorm_backward,
//   embedding's id check) and embedding waits for its stream: not yet capturable in a graph.
// - All tensors of one call live on the same device; the op runs there (CPU, or CUDA on
//   `stream`). A mismatch of shape, dtype or device throws tandem::Error naming the op and the
//   shapes; nothing broadcasts. Token ids out of range throw, they are never read out of bounds.
// - CPU ops compute in f32 (bf16/f16 inputs are widened exactly); the CPU matmuls can be set to
//   round their operands to bf16 instead (set_matmul_precision below; AMX or AVX512-BF16 where
//   the CPU has it).
//   CUDA matmuls compute in bf16 with f32 accumulation; everything else accumulates in f32.
// - Batch invariance: the result for one row (token, sequence) never depends on the other rows
//   of the call or on how many there are: reductions run in a fixed order along K and along the
//   sequence. So the rollout engine (decode, small batches) and the trainer (packed, large
//   batches) get bitwise the same numbers on one device.
// - Ops with `accumulate` add into their output instead of overwriting it.
// - Everything is deterministic: the same inputs give bitwise the same outputs, run to run.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/names.h"
#include "core/tensor.h"
#include "kernels/sample_kind.h"

namespace tandem::ops {

// ---------------------------------------------------------------------------------------------
// Matmul (the torch Linear layout: weights are (out, in)).

// y (M, N) = x (M, K) · w (N, K)^T, [+ y]. x, w: f32 or bf16, in any mix; y: f32.
// Batch-invariant: row i of y depends only on row i of x and on w.
void matmul(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate = false,
            const Stream& stream = {});
// dx (M, K) = dy (M, N) · w (N, K), [+ dx]. dy: f32; w: f32 or bf16; dx: f32.
void matmul_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx,
                           bool accumulate = false, const Stream& stream = {});
// dw (N, K) = dy (M, N)^T · x (M, K), [+ dw]. dy: f32; x: f32 or bf16; dw: f32.
void matmul_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& dw,
                            bool accumulate = false, const Stream& stream = {});

// The arithmetic of every CPU matmul product, process-wide (set it before any work: rollout and
// training must use the same one for their logprobs to agree). CUDA matmuls ignore it (always
// bf16 operands, f32 sums). The CPU backend (kernels/cpu/matmul.cpp) implements it.
// - f32 (the default): operands as they are, the dot-product kernel of kernels/cpu/matmul.h.
// - bf16: both operands rounded to bf16 (round to nearest even, denormal inputs to zero), their
//   products summed in f32: the mixed precision of the CUDA matmuls. On a CPU with AMX-BF16 the
//   sums run in AMX tiles (32 K values per tile step, in the hardware's own order, which is not
//   a sequence of f32 adds); on one with AVX512-BF16 but no AMX (AMD Zen 4) in `vdpbf16ps`
//   lanes (each output one f32 lane, from y_old with `accumulate`, taking K's pairs in order);
//   elsewhere (and with the portable kernel of the CPU tests) in the f32 kernel on the rounded
//   operands. So bits differ between the three, while each is deterministic, batch-invariant
//   and independent of the thread count.
enum class MatmulPrecision { f32, bf16 };
inline constexpr NamedValue<MatmulPrecision> kMatmulPrecisionNames[] = {
    {MatmulPrecision::f32, "f32"}, {MatmulPrecision::bf16, "bf16"}};
void set_matmul_precision(MatmulPrecision precision);
MatmulPrecision matmul_precision();
// A process-wide setting set for a scope: the previous value is put back at its end.
template <class T, T (*get)(), void (*set)(T)>
class ScopedSetting {
 public:
  explicit ScopedSetting(T value) : before_(get()) { set(value); }
  ~ScopedSetting() { set(before_); }
  ScopedSetting(const ScopedSetting&) = delete;
  ScopedSetting& operator=(const ScopedSetting&) = delete;

 private:
  T before_;
};
using ScopedMatmulPrecision =
    ScopedSetting<MatmulPrecision, matmul_precision, set_matmul_precision>;
// Which inner kernel the CPU matmuls use, process-wide like the precision (the job's
// placement.cpu_matmul_kernel, `tandem bench --cpu-matmul-kernel`; set it before any work):
// - automatic ("auto", the default): the best this CPU has (f32: AVX-512; the bf16 precision:
//   AMX, else AVX512-BF16).
// - portable: the portable f32 kernel, bitwise the AVX-512 one (tests prove it); the bf16
//   precision then runs it on the rounded operands.
// - avx512_bf16 ("avx512bf16"): as automatic, but the bf16 precision skips AMX: its AVX512-BF16
//   path where the CPU has AVX512-BF16 (so that a CPU with AMX can run and test the path of one
//   without).
enum class MatmulKernel { automatic, portable, avx512_bf16 };
inline constexpr NamedValue<MatmulKernel> kMatmulKernelNames[] = {
    {MatmulKernel::automatic, "auto"},
    {MatmulKernel::avx512_bf16, "avx512bf16"},
    {MatmulKernel::portable, "portable"}};
void set_matmul_kernel(MatmulKernel kernel);
MatmulKernel matmul_kernel();
// How the f32 CPU backward products (matmul_backward_input, matmul_backward_weight) run,
// process-wide (placement.cpu_matmul_backward, `tandem bench --cpu-matmul-backward`):
// - outer (the default): the outer-product kernel on the operands as they are
//   (kernels/cpu/matmul_backward.cpp).
// - transpose: the operands transposed, then the forward's dot-product kernel (the earlier path,
//   docs/kernels-matmul.md); other bits than outer's, the same batch invariance.
// The bf16 precision's backward products take neither (they are forward products on AMX or
// AVX512-BF16).
enum class MatmulBackward { outer, transpose };
inline constexpr NamedValue<MatmulBackward> kMatmulBackwardNames[] = {
    {MatmulBackward::outer, "outer"}, {MatmulBackward::transpose, "transpose"}};
void set_matmul_backward(MatmulBackward backward);
MatmulBackward matmul_backward();
// The three settings of the CPU matmuls together, set for a scope (a job, a benchmark) and put
// back as they were at its end.
struct MatmulSettings {
  MatmulPrecision precision = MatmulPrecision::f32;
  MatmulKernel kernel = MatmulKernel::automatic;
  MatmulBackward backward = MatmulBackward::outer;
};
void set_matmul_settings(MatmulSettings settings);
MatmulSettings matmul_settings();
using ScopedMatmulSettings = ScopedSetting<MatmulSettings, matmul_settings, set_matmul_settings>;
// Whether bf16 products can run on AMX here (the CPU has it and the kernel granted the tile
// state), and on AVX512-BF16.
bool matmul_has_amx();
bool matmul_has_avx512_bf16();
// The hardware the bf16 precision's CPU products run on now: AMX tiles, AVX512-BF16 dot products
// (`vdpbf16ps`), or the f32 kernel on the rounded operands (slower than the f32 precision: no
// bf16 hardware, or the portable kernel forced). The CPU's best, unless the kernel is set to
// avx512_bf16 (skip AMX: its path on a CPU with both) or portable (set_matmul_kernel).
enum class MatmulBf16Path { amx, avx512_bf16, f32_kernel };
MatmulBf16Path matmul_bf16_path();
// "amx", "avx512bf16" or "f32-kernel": the path's name in bench cases and logs.
const char* matmul_bf16_path_name(MatmulBf16Path path);
// The f32 CPU kernel the matmuls take now: "avx512", or "portable" (no AVX-512, or the
// portable kernel set).
const char* matmul_f32_path_name();
// Whether CPU matmuls use packed weights now (the bf16 precision on AMX or AVX512-BF16): then a
// weight can be packed once (PackedWeight) instead of on every call.
bool matmul_packs_weights();

// w (N, K) rounded and laid out in bf16 pairs (AMX's tile layout, which the AVX512-BF16 path
// reads too) once: what every bf16 CPU matmul against w builds anew. matmul(x, packed, y) gives
// bitwise matmul(x, w, y) while w keeps the values it had when packed; the owner packs again
// (pack()) when they change. Needs matmul_packs_weights().
class PackedWeight;
// y (M, N) [+]= x (M, K) · w^T from a packed w. x: f32 or bf16; y: f32; all on the CPU.
void matmul(const Tensor& x, const PackedWeight& w, const Tensor& y, bool accumulate = false);
class PackedWeight {
 public:
  PackedWeight() = default;
  explicit PackedWeight(const Tensor& w) { pack(w); }
  // Packs w (N, K) f32 or bf16 on the CPU, into the memory already held when it is large enough
  // (a refresh of new values of the same shape reallocates nothing).
  void pack(const Tensor& w);
  bool empty() const { return storage_.empty(); }
  int64_t rows() const { return n_; }
  int64_t cols() const { return k_; }
  size_t nbytes() const { return storage_.size() * sizeof(uint16_t); }
  const void* data() const { return storage_.data() + data_; }

 private:
  friend void matmul(const Tensor& x, const PackedWeight& w, const Tensor& y, bool accumulate);
  int64_t n_ = 0, k_ = 0, kp_ = 0;
  std::vector<uint16_t> storage_;
  int64_t data_ = 0;  // the 64-byte aligned start in storage_ (an offset: moves keep it valid)
};

// ---------------------------------------------------------------------------------------------
// Element-type casts and small vector ops.

// dst = src converted (f32/bf16/f16 to f32/bf16/f16, round to nearest even). Same numel.
void cast(const Tensor& src, const Tensor& dst, const Stream& stream = {});
// x *= s, in place. x: f32.
void scale(const Tensor& x, float s, const Stream& stream = {});
// out += x, elementwise. x, out: f32 of the same numel.
void add(const Tensor& x, const Tensor& out, const Stream& stream = {});
// out f32 = uniform [0, 1) values: out[i] = uniform_from_bits(philox_random(seed, stream_id,
// i / 4).v[i % 4]), the same numbers on every device.
void random_uniform(const Tensor& out, uint64_t seed, uint64_t stream_id,
                    const Stream& stream = {});
// out (1) f32 [+]= sum of x*x over all of x (f32), in a fixed order.
void sum_squares(const Tensor& x, const Tensor& out, bool accumulate = false,
                 const Stream& stream = {});
// sqrt of the sum of squares of every tensor (the global gradient norm); waits for the stream.
float global_norm(std::span<const Tensor> tensors, const Stream& stream = {});
// The sum of squares of x (n) f32 on the CPU in f64, in an order that depends on n alone: what
// sum_squares adds per chunk of 4096 elements. For norms over blocks of the caller's own (the
// optimizers' gradient norm: the same bits on any number of ranks).
double sum_squares_f64(const Tensor& x);

// ---------------------------------------------------------------------------------------------
// Embedding.

// out (T, C) f32 = table (V, C) [ids (T)], ids: i32, table: f32 or bf16. An id outside [0, V)
// throws, naming its position; on CUDA that check copies a flag back and waits for the stream.
void embedding(const Tensor& ids, const Tensor& table, const Tensor& out,
               const Stream& stream = {});
// dtable (V, C) f32 [+]= scatter-add of dout (T, C) f32 into the rows ids (T) name. Each row's
// contributions are summed in token order (deterministic). Ids are checked as in embedding.
void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable,
                        bool accumulate = false, const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// RMSNorm: out = x / sqrt(mean(x^2) + eps) * weight.

// x (T, C) f32, weight (C) f32 or bf16 -> out (T, C) f32, rstd (T) f32 (saved for backward).
void rmsnorm(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
             float eps, const Stream& stream = {});
// The residual add fused in front: residual_out = residual + delta (residual_out may be the
// residual tensor itself), then out = rmsnorm(residual_out). All (T, C) f32.
void add_rmsnorm(const Tensor& residual, const Tensor& delta, const Tensor& weight,
                 const Tensor& residual_out, const Tensor& out, const Tensor& rstd, float eps,
                 const Stream& stream = {});
// Given dout (T, C), x (T, C) (the normalised input: residual_out for add_rmsnorm), weight and
// rstd: dx (T, C) [+]= d/dx and dweight (C) f32 [+]= d/dweight (summed over T in a fixed
// order). With add_rmsnorm, pass accumulate_dx = true on the residual stream's gradient.
void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dweight, bool accumulate_dx = false,
                      bool accumulate_dweight = false, const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// Rotary position embedding, rotate-half (GPT-NeoX / Hugging Face) convention: for
// i < D/2 the pair (x[i], x[i + D/2]) is rotated by the angle pos * inv_freq[i],
// inv_freq[i] = theta^(-2i/D), optionally rescaled as Llama 3.1 does.
struct RopeParams {
  float theta = 10000.0f;
  // Llama-3 frequency scaling; off when factor == 0.
  float factor = 0.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int64_t original_max_position = 8192;
};
// x (T, N, D) f32 with N heads, positions (T) i32 -> out (T, N, D) f32; out may be x.
void rope(const Tensor& x, const Tensor& positions, const Tensor& out, const RopeParams& p,
          const Stream& stream = {});
// dx = the inverse rotation of dout; dx may be dout.
void rope_backward(const Tensor& dout, const Tensor& positions, const Tensor& dx,
                   const RopeParams& p, const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// SwiGLU: out = silu(gate) * up, gate and up side by side in one (T, 2F) tensor (the output of
// one fused gate/up matmul: columns [0, F) are gate, [F, 2F) are up).

// gate_up (T, 2F) f32 -> out (T, F) f32.
void swiglu(const Tensor& gate_up, const Tensor& out, const Stream& stream = {});
// dout (T, F), gate_up (T, 2F) -> dgate_up (T, 2F) (overwritten).
void swiglu_backward(const Tensor& dout, const Tensor& gate_up, const Tensor& dgate_up,
                     const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// Causal attention over packed variable-length sequences (GQA: query head h reads key/value
// head h / (H / Hkv)). cu_seqlens (B + 1) i32 holds the start of each sequence in T and T at
// the end. Token t of a sequence attends to that sequence's tokens 0..t.
// Keys are visited in blocks of kAttentionKeyBlock with an online softmax, in the same order
// as paged_attention_decode, so a token's output is bitwise the same computed either way.
inline constexpr int64_t kAttentionKeyBlock = 16;

//
// Shared prefixes (a GRPO group's prompt trained once for its G completions): prefix is
// undefined, or (B) i32 where prefix[b] = -1 or the index of another sequence whose tokens
// all come before sequence b's, as if the two were one sequence (b's token i sits at position
// len(prefix[b]) + i and attends to the whole prefix, then to its own tokens 0..i). A prefix
// sequence has no prefix itself; several sequences may share one. Keys are visited by that
// position, so a token's output is bitwise the one it gets in the concatenated sequence (and
// in paged decode). CPU only for now: on CUDA a defined prefix throws.
//
// q (T, H, D), k and v (T, Hkv, D), f32 -> out (T, H, D) f32, lse (T, H) f32 (the
// log-sum-exp of the scaled scores, saved for backward). scale: usually 1/sqrt(D).
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
               const Tensor& prefix, const Tensor& out, const Tensor& lse, float scale,
               const Stream& stream = {});
// Gradients of attention: dq (T, H, D), dk and dv (T, Hkv, D), overwritten. A prefix row's dk
// and dv sum the contributions of its own sequence's queries and of every sequence it prefixes.
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
                        const Tensor& prefix, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        float scale, const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// Paged KV cache, blocks of P token slots, f32 or bf16: v_cache (num_blocks, P, Hkv, D); k_cache
// (num_blocks, Hkv, D, P), keys transposed per block and head (decode reads them in place): key
// (h, d) of slot s at [s / P][h][d][s % P]. A sequence's blocks in CSR form (as FlashInfer):
// kv_indptr (B + 1) i32, kv_indices (kv_indptr[B]) i32 block ids, kv_last_len (B) i32 = slots
// used in its last block (1..P); length (blocks - 1) * P + last_len. Blocks may be shared.

// Writes k, v (T, Hkv, D) f32 into the cache slots slot_mapping (T) i32 (block * P + offset).
void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                    const Tensor& k_cache, const Tensor& v_cache, const Stream& stream = {});
// One query per sequence against its cached keys and values (all of them: the query's own
// token is already written). q (B, H, D) f32 -> out (B, H, D) f32.
void paged_attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& kv_indptr, const Tensor& kv_indices,
                            const Tensor& kv_last_len, const Tensor& out, float scale,
                            const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// Log-softmax gather: the logprob of each target token and the entropy of each row, fused so
// that the (T, V) probabilities are never stored. Logits are divided by temperature first.

// logits (T, V) f32, targets (T) i32 -> logprob (T) f32, lse (T) f32 (log-sum-exp of the
// scaled logits, saved for backward), entropy (T) f32 (pass an undefined Tensor to skip it).
// A target outside [0, V) throws on the CPU; on CUDA (which does not synchronise to check) its
// logprob is NaN and its row of the backward's gradient is NaN.
void logprob_gather(const Tensor& logits, const Tensor& targets, const Tensor& logprob,
                    const Tensor& lse, const Tensor& entropy, float temperature = 1.0f,
                    const Stream& stream = {});
// dlogits (T, V) [+]= d(sum dlogprob * logprob + dentropy * entropy)/dlogits. dentropy may
// be undefined.
void logprob_gather_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                             const Tensor& targets, const Tensor& lse, const Tensor& dlogits,
                             float temperature = 1.0f, bool accumulate = false,
                             const Stream& stream = {});

// Vocabulary-parallel forms, for a head whose vocabulary is split over tensor-parallel ranks
// (model/vocab_parallel.h combines them across the ranks, never gathering the logits): logits
// (T, Vs) f32 are columns [vocab_begin, vocab_begin + Vs) of the vocabulary; targets (T) i32 are
// ids of the whole vocabulary. The row's max, sums and lse are kernels/vocab_shards.h's, which
// sampling over shards (sample_shard_*) shares: a rollout's logprob of a token and this head's
// are the same bits for the same logits. CPU only for now.
// maxima (T) f32: the shard's largest logit of each row.
void logprob_shard_maxima(const Tensor& logits, const Tensor& maxima, const Stream& stream = {});
// Given all_maxima (tp, T) f32, every rank's maxima in rank order: stats (T, 4) f32, per row of
// z = logits / temperature with e = softmax_exp(z - max z) (max z: the whole row's): the shard's
// sum of e (NaN where the shard holds a NaN logit), its sum of e (z - max z), the target's z where
// the shard holds it, else 0, and 1 where it holds it, else 0.
void logprob_shard_stats(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                         const Tensor& all_maxima, const Tensor& stats, float temperature = 1.0f,
                         const Stream& stream = {});
// Given all_maxima (tp, T) and all_stats (tp, T, 4) f32, every rank's maxima and stats in rank
// order, each row's target held by one rank: logprob (T), lse (T) and entropy (T; undefined:
// skipped) over the whole vocabulary, the ranks' sums added in rank order.
void logprob_shard_combine(const Tensor& all_maxima, const Tensor& all_stats, const Tensor& logprob,
                           const Tensor& lse, const Tensor& entropy, float temperature = 1.0f,
                           const Stream& stream = {});
// dlogits (T, Vs) [+]= the shard's columns of d(sum dlogprob * logprob + dentropy *
// entropy)/dlogits, given the whole vocabulary's lse (T) and, with dentropy, entropy (T).
void logprob_shard_backward(const Tensor& dlogprob, const Tensor& dentropy, const Tensor& logits,
                            const Tensor& targets, int64_t vocab_begin, const Tensor& lse,
                            const Tensor& entropy, const Tensor& dlogits, float temperature = 1.0f,
                            bool accumulate = false, const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// AdamW (decoupled weight decay, Loshchilov & Hutter), on f32 master weights and moments.
struct AdamWParams {
  float lr = 1e-6f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  int64_t step = 1;         // 1-based, for bias correction
  float grad_scale = 1.0f;  // multiplies the gradient first (the clipping coefficient)
};
// param, grad, m, v (N) f32, updated in place (grad is read only). param_copy: an undefined
// Tensor, or (N) bf16/f32 that receives the new parameters (the rollout copy).
void adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWParams& p, const Tensor& param_copy = {}, const Stream& stream = {});

// ---------------------------------------------------------------------------------------------
// Sampling, per sequence: logits (B, V) f32 and per-row settings
//   temperature (B) f32 (0 = greedy), top_k (B) i32 (0 = off), top_p (B) f32 (1 = off),
//   min_p (B) f32 (0 = off), seed (B) i64, offset (B) i64 (the decode step).
// Filters apply to the temperature-scaled probabilities p in this order: top-k (the k largest,
// ties to the lower id), then top-p (the fewest largest whose mass reaches top_p of what is
// left), then min-p (p >= min_p * max p). The token is drawn by inverse CDF over the kept
// tokens in vocabulary order with u = uniform_from_bits(philox_random(seed, 0, offset).v[0]),
// so CPU and CUDA draw the same token from the same logits. No full sort of the vocabulary.
// Outputs: token (B) i32 and logprob (B) f32 = its log-probability under the full
// temperature-scaled distribution (under temperature 1 when greedy), the number the trainer
// recomputes. Bad settings (temperature < 0, top_k < 0, top_p outside (0, 1], min_p outside
// [0, 1]) throw naming the row on the CPU; on CUDA that row gets token -1 and a NaN logprob.
struct SamplingTensors {
  Tensor temperature, top_k, top_p, min_p, seed, offset;
};
void sample(const Tensor& logits, const SamplingTensors& settings, const Tensor& token,
            const Tensor& logprob, const Stream& stream = {});

// Sampling over vocabulary shards: sample's definition for a tensor-parallel group of tp ranks in
// which rank r holds only the logits shard (B, Vs) f32 of the vocabulary entries [r Vs, (r + 1)
// Vs) of V = tp Vs < 2^24 (ids travel as f32 values), tp <= 64. A step is a run of the local
// phases below, every rank running the same ones, with one collective over the group between two
// of them (model/tp_sample.h orchestrates them; docs/rollout.md, "Tensor-parallel sampling"). A
// gathered tensor (tp, ...) is the ranks' outputs laid end to end in rank order. Every op takes
// the rank's shard and settings (B) as sample does; every rank ends with the same tokens and
// logprobs. Row kinds (SampleRowKind, kernels/sample_kind.h): greedy, top_k (0 < top_k < V),
// nucleus (top_p < 1, top-k off), plain (the rest). With z = x / temperature (1 when greedy) and
// e = softmax_exp(z - max z) over the whole row, masses summing e in 16 lanes (sample's order):
//  1. maxima: maxima (B, 2) f32 [the shard's largest logit, its lowest global id]; kinds (B) u8.
//     Bad settings throw naming the row on the CPU; on CUDA the row's kind is invalid.
//  2. stats, given all_maxima (tp, B, 2): z, e (B, Vs) f32 of the shard; stats (B, 3) f32 [sum of
//     the shard's e; plain rows on rank 0: the running sum of the kept e (e >= min_p), one f32
//     addition after the other in vocabulary order, else 0; nucleus rows: the largest t with
//     mass(z >= t) >= top_p times the shard's sum, plain rows: the global id of the last kept
//     token with e > 0 or -1, other rows: max z].
//  3. chain, hop h in [1, tp) (plain rows only), given all_stats (tp, B, 3) and hops (tp - 1, B)
//     whose rows [0, h - 1) the earlier hops delivered: chain (B) f32 = on rank h, for plain
//     rows, rank h - 1's end of the running kept sum (rank 0's: all_stats[0, b, 1]; rank r's:
//     hops[r - 1, b]) continued over the shard; 0 elsewhere. Summed over the group it is hop h's
//     row of hops.
//  4. counts, given all_stats: counts (B) f32 = the shard's candidates of the row (top-k rows:
//     min(top_k, Vs), its top min(top_k, Vs) with ties to the lower ids, which hold the global
//     top-k; nucleus rows: z >= the least of the ranks' thresholds, which hold the global
//     nucleus; other rows 0); bounds (B, 2) f32 [the threshold, the ties kept at it].
//  5. candidates, given all_counts (tp, B) and bounds: cands (n) f32, what the rank sends: row
//     after row its candidates as [z, global id] pairs, or the whole shard of z where the row's
//     candidates over all ranks are more than half of V (dense). n = the rank's entry of
//     sample_shard_elements.
//  6. decide, given all_maxima, all_stats, hops (undefined when tp = 1), all_counts and all_cands
//     (every rank's cands, undefined when no row is top-k or nucleus): token (B) i32 and logprob
//     (B) f32 of the greedy, top-k and nucleus rows (sample's steps on the row's candidates in
//     vocabulary order; plain rows untouched); draws (B, 2) f32 [token, logprob] of the plain
//     rows on the rank whose range holds the draw, zeros elsewhere.
//  7. draws, given all_draws (B, 2) (draws summed over the group): the plain rows' token and
//     logprob.
// Against sample on the whole logits: the same tokens for greedy, top-k and plain rows; a nucleus
// row's target sums the ranks' sums in rank order, so a threshold exactly on a boundary may fall
// differently by rounding; logprobs differ in the last bits (lse sums e in another order).
struct VocabShard {
  int rank = 0;
  int count = 1;  // tp
};
void sample_shard_maxima(const Tensor& logits, const SamplingTensors& settings, VocabShard shard,
                         const Tensor& maxima, const Tensor& kinds, const Stream& stream = {});
void sample_shard_stats(const Tensor& logits, const SamplingTensors& settings, VocabShard shard,
                        const Tensor& all_maxima, const Tensor& z, const Tensor& e,
                        const Tensor& stats, const Stream& stream = {});
void sample_shard_chain(const Tensor& e, const SamplingTensors& settings, VocabShard shard,
                        const Tensor& all_stats, const Tensor& hops, int hop, const Tensor& chain,
                        const Stream& stream = {});
void sample_shard_counts(const Tensor& z, const SamplingTensors& settings, VocabShard shard,
                         const Tensor& all_maxima, const Tensor& all_stats, const Tensor& counts,
                         const Tensor& bounds, const Stream& stream = {});
void sample_shard_candidates(const Tensor& z, const SamplingTensors& settings, VocabShard shard,
                             const Tensor& all_counts, const Tensor& bounds, const Tensor& cands,
                             const Stream& stream = {});
void sample_shard_decide(const Tensor& z, const Tensor& e, const SamplingTensors& settings,
                         VocabShard shard, const Tensor& all_maxima, const Tensor& all_stats,
                         const Tensor& hops, const Tensor& all_counts, const Tensor& all_cands,
                         const Tensor& token, const Tensor& logprob, const Tensor& draws,
                         const Stream& stream = {});
void sample_shard_draws(const Tensor& kinds, const Tensor& all_draws, const Tensor& token,
                        const Tensor& logprob, const Stream& stream = {});
// The f32 values each rank sends in the candidates phase, from kinds (B) u8 and all_counts (tp, B)
// f32 on the CPU: elements (tp).
void sample_shard_elements(const Tensor& kinds, const Tensor& all_counts, int64_t Vs,
                           std::span<int64_t> elements);

// ---------------------------------------------------------------------------------------------
// Op timing, for benchmarks that break a step into its parts (tandem bench train). While on,
// every call of the ops above adds its wall time to a total per op name and shape (a call
// inside another op, such as global_norm's sum_squares, counts as the outer op's). Measures the
// CPU ops; on CUDA it would time the launches. Off by default (then one relaxed load per call).
struct OpTime {
  std::string op;               // "matmul", "attention_backward", ...
  int64_t m = 0, n = 0, k = 0;  // the matmuls' M, N, K as above; 0 for other ops
  int64_t calls = 0;
  double seconds = 0;
};
void set_op_timing(bool on);
// The totals recorded since the last call, and a fresh start.
std::vector<OpTime> take_op_times();

}  // namespace tandem::ops
