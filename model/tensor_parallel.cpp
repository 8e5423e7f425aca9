// Tensor-parallel shards: the split of each parameter, its checks, and the cut from full weights.
#include "model/tensor_parallel.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace tandem::model {
namespace {

// "1, 3 or 9": the group sizes that divide n, for the error messages (those up to 64 said so).
std::string divisors(int64_t n) {
  constexpr int64_t kMost = 64;
  std::string out;
  std::vector<int64_t> d;
  for (int64_t k = 1; k <= n && k <= kMost; ++k)
    if (n % k == 0) d.push_back(k);
  for (size_t i = 0; i < d.size(); ++i)
    out += fmt::format("{}{}", i == 0 ? "" : (i + 1 == d.size() ? " or " : ", "), d[i]);
  return n > kMost ? out + fmt::format(" of the sizes up to {}", kMost) : out;
}

void check_divides(int64_t n, int size, const char* param) {
  TANDEM_CHECK(n % size == 0,
               "tensor parallel: {} = {} is not divisible by the tensor-parallel size {}: choose "
               "a size that divides it ({})",
               param, n, size, divisors(n));
}

// dst (rows, n) = columns [col0, col0 + n) of src (rows, N), one row at a time (tensors are
// row-major and contiguous: a column range is a strided view they cannot express).
void copy_columns(const Tensor& src, int64_t col0, const Tensor& dst) {
  const int64_t rows = src.size(0), N = src.size(1), n = dst.size(1);
  for (int64_t r = 0; r < rows; ++r)
    dst.narrow(r, 1).view({n}).copy_from(src.narrow(r, 1).view({N}).narrow(col0, n));
}

}  // namespace

TpSplit tp_split(const ModelConfig& full, int rank, int size) {
  TANDEM_CHECK(size >= 1 && rank >= 0 && rank < size,
               "tensor parallel: rank {} of a group of {} (the size must be >= 1 and the rank in "
               "[0, size))",
               rank, size);
  check_divides(full.num_heads, size, "num_attention_heads");
  const int64_t Hkv = full.num_kv_heads;
  TANDEM_CHECK(Hkv % size == 0 || size % Hkv == 0,
               "tensor parallel: num_key_value_heads = {} and the tensor-parallel size {}: the "
               "size must divide the KV heads ({}) or be a multiple of them (each KV head then "
               "replicated on size / {} ranks)",
               Hkv, size, divisors(Hkv), Hkv);
  check_divides(full.intermediate_size, size, "intermediate_size");
  check_divides(full.vocab_size, size, "vocab_size");
  TpSplit s;
  s.rank = rank;
  s.size = size;
  s.num_q_heads = full.num_heads / size;
  s.q_head0 = rank * s.num_q_heads;
  s.kv_replicated = Hkv < size;
  s.num_kv_heads = s.kv_replicated ? 1 : Hkv / size;
  // Replicated: rank r's query heads all belong to KV head r Hkv / size (H/size divides the
  // group size H/Hkv, as Hkv divides size).
  s.kv_head0 = s.kv_replicated ? rank * Hkv / size : rank * s.num_kv_heads;
  s.num_f = full.intermediate_size / size;
  s.f0 = rank * s.num_f;
  s.num_vocab = full.vocab_size / size;
  s.vocab0 = rank * s.num_vocab;
  return s;
}

ModelConfig tp_shard_config(const ModelConfig& full, int size) {
  const TpSplit s = tp_split(full, 0, size);
  ModelConfig c = full;
  c.num_heads = s.num_q_heads;
  c.num_kv_heads = s.num_kv_heads;
  c.intermediate_size = s.num_f;
  c.vocab_size = s.num_vocab;
  return c;
}

std::unique_ptr<Weights> cut_tp_shard(const Weights& full, int rank, int size) {
  const ModelConfig& fc = full.config();
  const TpSplit s = tp_split(fc, rank, size);
  auto out = std::make_unique<Weights>(tp_shard_config(fc, size), full.dtype(), full.device());
  Weights& w = *out;
  const int64_t D = fc.head_dim, F = fc.intermediate_size;
  const int64_t q0 = s.q_head0 * D, nq = s.num_q_heads * D;
  const int64_t kv0 = s.kv_head0 * D, nkv = s.num_kv_heads * D;
  w.embed.copy_from(full.embed.narrow(s.vocab0, s.num_vocab));
  if (!fc.tie_word_embeddings) w.lm_head.copy_from(full.lm_head.narrow(s.vocab0, s.num_vocab));
  w.final_norm.copy_from(full.final_norm);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& src = full.layers[l];
    LayerWeights& dst = w.layers[l];
    dst.input_norm.copy_from(src.input_norm);
    dst.post_norm.copy_from(src.post_norm);
    dst.q.copy_from(src.q.narrow(q0, nq));
    dst.k.copy_from(src.k.narrow(kv0, nkv));
    dst.v.copy_from(src.v.narrow(kv0, nkv));
    if (fc.attention_bias) {
      dst.q_bias.copy_from(src.q_bias.narrow(q0, nq));
      dst.k_bias.copy_from(src.k_bias.narrow(kv0, nkv));
      dst.v_bias.copy_from(src.v_bias.narrow(kv0, nkv));
    }
    if (fc.qk_norm) {
      dst.q_norm.copy_from(src.q_norm);
      dst.k_norm.copy_from(src.k_norm);
    }
    copy_columns(src.o, q0, dst.o);
    dst.gate.copy_from(src.gate.narrow(s.f0, s.num_f));
    dst.up.copy_from(src.up.narrow(s.f0, s.num_f));
    copy_columns(src.down.view({fc.hidden_size, F}), s.f0, dst.down);
  }
  return out;
}

}  // namespace tandem::model
