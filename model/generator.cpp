// Generator: prefill, then decode one token at a time through a paged cache whose blocks are
// simply 0, 1, 2, ... .
#include "model/generator.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::model {
namespace {

constexpr int64_t kBlock = 16;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Tensor i32_tensor(std::span<const int32_t> v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32);
  std::copy(v.begin(), v.end(), t.data_as<int32_t>());
  return t;
}

}  // namespace

double GenerateResult::decode_tokens_per_second() const {
  const size_t steps = tokens.empty() ? 0 : tokens.size() - 1;
  return decode_seconds > 0 ? static_cast<double>(steps) / decode_seconds : 0.0;
}

struct Generator::Impl {
  const Weights& weights;
  int64_t max_context;
  Decoder decoder;
  std::vector<Tensor> k_cache, v_cache;
  Tensor logits;
  ops::SamplingTensors sampling;
  Tensor token, logprob;

  Impl(const Weights& w, int64_t ctx)
      : weights(w), max_context(ctx), decoder(w, DecoderOptions{.max_tokens = 256}) {
    const ModelConfig& c = w.config();
    const int64_t blocks = (ctx + kBlock - 1) / kBlock;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      k_cache.push_back(Tensor::zeros({blocks, kBlock, c.num_kv_heads, c.head_dim}, DType::f32));
      v_cache.push_back(Tensor::zeros({blocks, kBlock, c.num_kv_heads, c.head_dim}, DType::f32));
    }
    logits = Tensor::empty({1, c.vocab_size}, DType::f32);
    sampling.temperature = Tensor::empty({1}, DType::f32);
    sampling.top_k = Tensor::empty({1}, DType::i32);
    sampling.top_p = Tensor::empty({1}, DType::f32);
    sampling.min_p = Tensor::empty({1}, DType::f32);
    sampling.seed = Tensor::empty({1}, DType::i64);
    sampling.offset = Tensor::empty({1}, DType::i64);
    token = Tensor::empty({1}, DType::i32);
    logprob = Tensor::empty({1}, DType::f32);
  }

  // The cache view for one sequence of `length` tokens after this step, whose new tokens sit at
  // positions [first, length).
  KvCacheView view(int64_t first, int64_t length) const {
    KvCacheView kv{k_cache, v_cache, {}, {}, {}, {}};
    const int64_t blocks = (length + kBlock - 1) / kBlock;
    std::vector<int32_t> indices(static_cast<size_t>(blocks)), slots;
    for (int64_t b = 0; b < blocks; ++b) indices[static_cast<size_t>(b)] = static_cast<int32_t>(b);
    for (int64_t p = first; p < length; ++p) slots.push_back(static_cast<int32_t>(p));
    const int32_t indptr[2] = {0, static_cast<int32_t>(blocks)};
    const int32_t last = static_cast<int32_t>(length - (blocks - 1) * kBlock);
    kv.kv_indptr = i32_tensor(indptr);
    kv.kv_indices = i32_tensor(indices);
    kv.kv_last_len = i32_tensor(std::span<const int32_t>(&last, 1));
    kv.slot_mapping = i32_tensor(slots);
    return kv;
  }
};

Generator::Generator(const Weights& weights, int64_t max_context)
    : impl_(std::make_unique<Impl>(weights, max_context)) {
  TANDEM_CHECK(max_context > 0, "generator: max_context must be positive, got {}", max_context);
}

Generator::~Generator() = default;

GenerateResult Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& opt,
                                   const std::function<void(int32_t)>& on_token) {
  Impl& m = *impl_;
  const int64_t n = static_cast<int64_t>(prompt.size());
  TANDEM_CHECK(n > 0, "generate: the prompt is empty");
  TANDEM_CHECK(n + opt.max_tokens <= m.max_context,
               "generate: prompt ({} tokens) + max_tokens ({}) exceed the context of {}", n,
               opt.max_tokens, m.max_context);
  *m.sampling.temperature.data_as<float>() = opt.temperature;
  *m.sampling.top_k.data_as<int32_t>() = opt.top_k;
  *m.sampling.top_p.data_as<float>() = opt.top_p;
  *m.sampling.min_p.data_as<float>() = opt.min_p;
  *m.sampling.seed.data_as<int64_t>() = static_cast<int64_t>(opt.seed);

  GenerateResult r;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  const int32_t cu[2] = {0, static_cast<int32_t>(n)};
  m.decoder.prefill(prompt, positions, cu, m.view(0, n), m.logits);
  r.prefill_seconds = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < opt.max_tokens; ++step) {
    if (step > 0) {
      const int32_t tok = r.tokens.back();
      const int32_t pos = static_cast<int32_t>(n + step - 1);
      m.decoder.decode(std::span<const int32_t>(&tok, 1), std::span<const int32_t>(&pos, 1),
                       m.view(pos, pos + 1), m.logits);
    } else {
      t0 = std::chrono::steady_clock::now();  // decode time starts after the first token
    }
    *m.sampling.offset.data_as<int64_t>() = step;
    ops::sample(m.logits, m.sampling, m.token, m.logprob);
    const int32_t tok = *m.token.data_as<int32_t>();
    r.tokens.push_back(tok);
    r.logprobs.push_back(*m.logprob.data_as<float>());
    if (on_token) on_token(tok);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), tok) != opt.stop_ids.end()) {
      r.stopped = true;
      break;
    }
  }
  r.decode_seconds = seconds_since(t0);
  return r;
}

}  // namespace tandem::model
