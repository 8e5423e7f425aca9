// The per-rank side of the tensor-parallel tests: a seeded tiny random model, this rank's shard of
// it, and (1) prefill and decode logits of the sharded decoder against the whole model's, (2) a
// rollout of seeded requests through a tensor-parallel engine, printed for the test to compare
// across group sizes. WORLD_SIZE (1 when unset) is the group size: 1 runs the whole model alone.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/error.h"
#include "model/decoder.h"
#include "model/loader.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "rollout/engine.h"

namespace {

using namespace tandem;

// The test's models: every one has 4 query heads and V = 128, F = 96 (group sizes 1, 2 and 4
// divide them); llama's 2 KV heads are split at 2 ranks and replicated at 4, qwen2's one KV head
// is replicated at 2 and 4.
model::ModelConfig config_of(const std::string& kind) {
  model::ModelConfig c;
  c.vocab_size = 128;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 256;
  if (kind == "qwen2") {
    c.arch = model::Architecture::qwen2;
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    c.num_kv_heads = 1;
    c.rope.theta = 1000000.0f;
  } else if (kind == "qwen3") {
    c.arch = model::Architecture::qwen3;
    c.qk_norm = true;
    c.rms_norm_eps = 1e-6f;
  } else {
    TANDEM_CHECK(kind == "llama", "tp worker: unknown model kind '{}'", kind);
  }
  return c;
}

// splitmix64: the same values on every rank.
double uniform(uint64_t& state, double lo, double hi) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return lo + (hi - lo) * static_cast<double>(z >> 11) * 0x1.0p-53;
}

// Norms near 1, biases small, matrices scaled by 1.7 / sqrt(fan-in), embeddings in [-1, 1)
// (untied) or [-0.3, 0.3) (tied).
void fill(model::Weights& w, uint64_t seed) {
  for (const model::NamedTensor& s : w.storage()) {
    double lo = -1.0, hi = 1.0;
    if (s.name.find("norm") != std::string::npos) {
      lo = 0.7, hi = 1.3;
    } else if (s.name.find("bias") != std::string::npos) {
      lo = -0.3, hi = 0.3;
    } else if (s.name.find("embed") != std::string::npos) {
      // Tied to the head, embeddings of [-1, 1) give a token a logit of ~C / 3 for itself: such a
      // model repeats its input. Smaller ones keep the samples varied.
      if (w.config().tie_word_embeddings) lo = -0.3, hi = 0.3;
    } else {
      const double a = 1.7 / std::sqrt(static_cast<double>(s.tensor.size(1)));
      lo = -a, hi = a;
    }
    float* p = s.tensor.data_as<float>();
    for (int64_t i = 0; i < s.tensor.numel(); ++i) p[i] = static_cast<float>(uniform(seed, lo, hi));
  }
}

std::vector<int32_t> prompt(uint64_t& state, int n, int64_t V) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int32_t& t : p) t = static_cast<int32_t>(uniform(state, 0, static_cast<double>(V)));
  return p;
}

// A contiguous paged cache for B sequences of up to `cap` tokens each: sequence b owns blocks
// [b nb, (b + 1) nb).
struct Cache {
  int64_t P = 4, nb = 0;
  model::KvCacheView kv;
  Cache(const model::ModelConfig& c, int64_t B, int64_t cap) {
    nb = (cap + P - 1) / P;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      kv.k_cache.push_back(Tensor::zeros({B * nb, c.num_kv_heads, c.head_dim, P}, DType::f32));
      kv.v_cache.push_back(Tensor::zeros({B * nb, P, c.num_kv_heads, c.head_dim}, DType::f32));
    }
  }
  // The view after appending tokens [from[b], to[b]) of each sequence b.
  void view(const std::vector<int32_t>& from, const std::vector<int32_t>& to) {
    std::vector<int32_t> indptr{0}, indices, last, slots;
    for (size_t b = 0; b < to.size(); ++b) {
      const int64_t blocks = (to[b] + P - 1) / P;
      for (int64_t i = 0; i < blocks; ++i) indices.push_back(static_cast<int32_t>(b * nb + i));
      indptr.push_back(static_cast<int32_t>(indices.size()));
      last.push_back(static_cast<int32_t>(to[b] - (blocks - 1) * P));
      for (int32_t p = from[b]; p < to[b]; ++p)
        slots.push_back(static_cast<int32_t>((b * nb + p / P) * P + p % P));
    }
    auto t = [](const std::vector<int32_t>& v) {
      Tensor x = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32);
      std::copy(v.begin(), v.end(), x.data_as<int32_t>());
      return x;
    };
    kv.kv_indptr = t(indptr);
    kv.kv_indices = t(indices);
    kv.kv_last_len = t(last);
    kv.slot_mapping = t(slots);
  }
};

// Prefill of 3 prompts then 6 decode steps (greedy on the whole model's logits) on the whole
// model and on this rank's shard: the largest difference of the shard's logits (its vocabulary
// rows) from the whole model's same columns, over the largest logit.
int scenario_logits(const model::ModelConfig& c, const model::Weights& full,
                    const model::Weights& shard, Communicator* tp) {
  const std::vector<int> lengths = {5, 9, 2};
  const int B = static_cast<int>(lengths.size()), steps = 6;
  uint64_t state = 99;
  std::vector<std::vector<int32_t>> seqs;
  for (int n : lengths) seqs.push_back(prompt(state, n, c.vocab_size));
  model::Decoder whole(full), part(shard, {.tp_group = tp});
  Cache cw(full.config(), B, 9 + steps), cp(shard.config(), B, 9 + steps);
  std::vector<int32_t> tokens, positions, cu{0}, from(B, 0), to(B);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < lengths[static_cast<size_t>(b)]; ++j) {
      tokens.push_back(seqs[static_cast<size_t>(b)][static_cast<size_t>(j)]);
      positions.push_back(j);
    }
    cu.push_back(static_cast<int32_t>(tokens.size()));
    to[static_cast<size_t>(b)] = lengths[static_cast<size_t>(b)];
  }
  Tensor lw = Tensor::empty({B, c.vocab_size}, DType::f32);
  const int64_t Vs = shard.config().vocab_size, v0 = tp != nullptr ? tp->rank() * Vs : 0;
  Tensor lp = Tensor::empty({B, Vs}, DType::f32);
  double max_diff = 0, max_abs = 0;
  auto compare = [&] {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t v = 0; v < Vs; ++v) {
        const double w = lw.data_as<float>()[b * c.vocab_size + v0 + v];
        max_diff = std::max(max_diff, std::fabs(w - lp.data_as<float>()[b * Vs + v]));
        max_abs = std::max(max_abs, std::fabs(w));
      }
    }
  };
  cw.view(from, to);
  cp.view(from, to);
  whole.prefill(tokens, positions, cu, cw.kv, lw);
  part.prefill(tokens, positions, cu, cp.kv, lp);
  compare();
  for (int step = 0; step < steps; ++step) {
    tokens.clear();
    positions.clear();
    for (int b = 0; b < B; ++b) {
      const float* row = lw.data_as<float>() + b * c.vocab_size;
      tokens.push_back(static_cast<int32_t>(std::max_element(row, row + c.vocab_size) - row));
      positions.push_back(to[static_cast<size_t>(b)]);
      from[static_cast<size_t>(b)] = to[static_cast<size_t>(b)]++;
    }
    cw.view(from, to);
    cp.view(from, to);
    whole.decode(tokens, positions, cw.kv, lw);
    part.decode(tokens, positions, cp.kv, lp);
    compare();
  }
  std::printf("logits max_abs_diff %.9g max_abs %.9g\n", max_diff, max_abs);
  return 0;
}

// Seeded requests (sampled with top-k, top-p and min-p, greedy, n > 1, top logprobs) through an
// engine of few small blocks and a small token budget (chunked prefill, forks, paging,
// preemption), then its
// memory released, the weights swapped for `second` (version 2) and the requests run again: one
// line per sample with its tokens and logprobs.
// diverge: this rank gives one request another seed (the group must refuse the first step).
int scenario_rollout(const model::ModelConfig& c, const model::Weights& shard,
                     const model::Weights& second, Communicator* tp, bool diverge) {
  rollout::EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 24;  // fewer than the requests need at once: preemptions
  o.max_batch_tokens = 16;
  o.max_seqs = 8;
  o.max_context = 128;
  rollout::Engine engine(shard, o, nullptr, tp);
  uint64_t state = 7;
  std::vector<rollout::Request> requests(4);
  auto params = [](int n, float temperature, uint64_t seed) {
    rollout::SamplingParams p;
    p.n = n;
    p.temperature = temperature;
    p.seed = seed;
    return p;
  };
  requests[0].prompt = prompt(state, 21, c.vocab_size);
  requests[0].params = params(3, 1.0f, 11);
  requests[0].params.top_p = 0.9f;
  requests[0].params.top_k = 20;
  requests[1].prompt = prompt(state, 6, c.vocab_size);
  requests[1].params = params(1, 0.0f, 0);
  requests[1].params.top_logprobs = 3;
  requests[2].prompt = prompt(state, 33, c.vocab_size);
  requests[2].params = params(2, 0.7f, 5);
  requests[2].params.min_p = 0.05f;
  requests[2].params.top_p = 0.8f;          // top-p alone: the nucleus gathered over the shards
  requests[3].prompt = requests[0].prompt;  // a prefix-cache hit
  requests[3].params = params(2, 1.3f, 3);
  requests[3].params.top_logprobs = 2;
  if (diverge) requests[2].params.seed += 1;
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = fmt::format("r{}", i);
    requests[i].params.max_tokens = 10;
  }
  auto print = [](const std::vector<rollout::RequestOutput>& outputs) {
    for (const rollout::RequestOutput& r : outputs) {
      for (const rollout::SampleOutput& s : r.samples) {
        std::string line =
            fmt::format("sample {} {} {} v{} |", r.id, s.index,
                        rollout::finish_reason_name(s.finish_reason), s.weight_version);
        for (int32_t t : s.tokens) line += fmt::format(" {}", t);
        line += " |";
        for (float lp : s.logprobs) line += fmt::format(" {:.9g}", lp);
        for (const auto& top : s.top_logprobs)
          for (const rollout::TokenLogprob& t : top)
            line += fmt::format(" {}:{:.9g}", t.token, t.logprob);
        std::printf("%s\n", line.c_str());
      }
    }
  };
  engine.set_weights(shard, 1);
  print(engine.generate(requests));
  engine.release_memory();
  engine.set_weights(second, 2);
  print(engine.generate(requests));
  std::printf("steps %lld preemptions %lld\n", static_cast<long long>(engine.stats().steps),
              static_cast<long long>(engine.stats().preemptions));
  std::printf("sampling bytes %lld\n", static_cast<long long>(engine.stats().sampling_bytes));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: tandem_tp_worker logits|rollout llama|qwen2|qwen3|MODEL_PATH "
                 "[TP|diverge RANK]\n");
    return 2;
  }
  const std::string what = argv[1];
  const char* world = std::getenv("WORLD_SIZE");
  const int size = world != nullptr ? std::atoi(world) : 1;
  try {
    // A test model, or a real one from a path (its weights twice: no swap to other values).
    const std::string kind = argv[2];
    const bool real = kind.find('/') != std::string::npos;
    model::LoadedModel loaded;
    if (real) loaded = model::load_model(kind, DType::f32);
    const model::ModelConfig c = real ? loaded.config() : config_of(kind);
    std::unique_ptr<model::Weights> made, made2;
    if (!real) {
      made = std::make_unique<model::Weights>(c, DType::f32);
      made2 = std::make_unique<model::Weights>(c, DType::f32);
      fill(*made, 17);
      fill(*made2, 18);
    }
    const model::Weights& full = real ? *loaded.weights : *made;
    const model::Weights& full2 = real ? *loaded.weights : *made2;
    // The world, and the tensor-parallel group of this rank: the world, or with TP < world one of
    // world / TP replicas of TP consecutive ranks.
    std::unique_ptr<Communicator> world_comm, group;
    std::unique_ptr<model::Weights> shard, shard2;
    const bool diverge = argc > 4 && std::string(argv[3]) == "diverge";
    const int tp = argc > 3 && !diverge ? std::atoi(argv[3]) : size;
    if (size > 1) {
      // A size that does not fit the model is refused before any connection, as a job checks it.
      model::tp_shard_config(c, tp);
      CommOptions options;
      options.timeout_s = 30;
      world_comm = Communicator::from_environment(options);
      if (tp < size) {
        const int replica = world_comm->rank() / tp;
        std::vector<int> ranks;
        for (int r = 0; r < tp; ++r) ranks.push_back(replica * tp + r);
        group = world_comm->split(fmt::format("rollout{}", replica), ranks);
      }
    }
    Communicator* comm = group ? group.get() : world_comm.get();
    if (comm != nullptr && comm->size() > 1) {
      shard = model::cut_tp_shard(full, comm->rank(), comm->size());
      shard2 = model::cut_tp_shard(full2, comm->rank(), comm->size());
    }
    const model::Weights& mine = shard ? *shard : full;
    const model::Weights& mine2 = shard2 ? *shard2 : full2;
    Communicator* tp_group = shard ? comm : nullptr;
    const bool this_diverges = diverge && world_comm && world_comm->rank() == std::atoi(argv[4]);
    int rc = 2;
    if (what == "logits") rc = scenario_logits(c, full, mine, tp_group);
    if (what == "rollout") rc = scenario_rollout(c, mine, mine2, tp_group, this_diverges);
    if (rc == 2) std::fprintf(stderr, "unknown scenario %s\n", what.c_str());
    if (rc == 0) std::printf("ok rank %d of %d\n", world_comm ? world_comm->rank() : 0, size);
    std::fflush(stdout);
    return rc;
  } catch (const Error& e) {
    std::printf("error: %s\n", e.what());
    std::fflush(stdout);
    return 3;
  }
}
