// PolicyTrainer: old/ref logprobs, micro-batched forward/backward through the decoder with the
// GRPO loss's gradient, AdamW per minibatch.
#include "trainer/train_step.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/clock.h"
#include "core/error.h"
#include "trainer/parallel/pipeline_runner.h"

namespace tandem::trainer {
namespace {

int64_t completion_tokens(std::span<const TrainSample> samples) {
  int64_t n = 0;
  for (const TrainSample& s : samples) n += static_cast<int64_t>(s.completion.size());
  return n;
}

// Contiguous ranges [begin, end) of samples whose packed tokens fit the budget (a sample larger
// than the budget gets a micro-batch of its own). With shared prompts a sample that continues its
// predecessor's prompt in the same micro-batch adds only its completion's tokens (see
// PackedBatch::from_prompts); a group split over two micro-batches packs its prompt in both.
std::vector<std::pair<size_t, size_t>> micro_batches(std::span<const TrainSample> samples,
                                                     int64_t budget, bool share_prompts,
                                                     bool by_group) {
  using Pair = model::PackedBatch::PromptCompletion;
  std::vector<std::pair<size_t, size_t>> out;
  size_t begin = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const Pair pair{samples[i].prompt, samples[i].completion};
    const Pair previous = i > 0 ? Pair{samples[i - 1].prompt, samples[i - 1].completion} : Pair{};
    const int64_t n =
        model::PackedBatch::rows_added(pair, i > begin ? &previous : nullptr, share_prompts);
    if (i > begin &&
        (tokens + n > budget || (by_group && samples[i].group != samples[i - 1].group))) {
      out.emplace_back(begin, i);
      begin = i;
      tokens = model::PackedBatch::rows_added(pair, nullptr, share_prompts);  // packs its prompt
      continue;
    }
    tokens += n;
  }
  if (begin < samples.size()) out.emplace_back(begin, samples.size());
  return out;
}

// The samples packed (a group's prompt once when shared); only the completion tokens' rows go
// through the head, and head_rows lists them sample after sample.
model::PackedBatch pack(std::span<const TrainSample> samples, bool share_prompts) {
  std::vector<model::PackedBatch::PromptCompletion> pairs;
  pairs.reserve(samples.size());
  for (const TrainSample& s : samples) pairs.push_back({s.prompt, s.completion});
  return model::PackedBatch::from_prompts(pairs, share_prompts);
}

// Adds `grads` (storage order, flattened) to `fixed` in units of 2^-kFixedBits; a non-finite or
// too large value is carried as kFixedInvalid, which the optimizer takes for a non-finite norm.
// The batch's metrics from every rank's: sums summed, extremes of the extremes, the step's
// counters (the same on every rank) kept.
// The metrics a rank's part of a batch adds (sums) and bounds (maxes; minima negated), in one
// order for the exchanges below.
struct MetricVectors {
  std::vector<double> sums, maxes;
};

MetricVectors pack_metrics(const TrainStepMetrics& m) {
  const PolicyLossMetrics& p = m.policy;
  return {{m.loss,
           static_cast<double>(m.tokens),
           static_cast<double>(m.packed_tokens),
           m.rollout_vs_trainer_mean_abs * static_cast<double>(m.tokens),
           static_cast<double>(p.tokens),
           static_cast<double>(p.sequences),
           p.pg_loss,
           p.kl_loss,
           p.entropy_loss,
           static_cast<double>(p.clipped_low),
           static_cast<double>(p.clipped_high),
           static_cast<double>(p.clipped_dual),
           p.kl_old_k1_sum,
           p.kl_old_k3_sum,
           p.kl_ref_sum,
           p.entropy_sum,
           p.ratio_sum,
           p.is_weight_sum,
           static_cast<double>(p.is_capped),
           static_cast<double>(p.mismatch_tokens),
           p.mismatch_abs_sum,
           p.mismatch_mult_sum,
           p.current_rollout_abs_sum},
          {m.rollout_vs_trainer_max_abs, -p.ratio_min, p.ratio_max, -p.is_weight_min,
           p.is_weight_max, p.mismatch_abs_max, m.seconds_old, m.seconds_ref, m.seconds_update,
           m.comm_s, m.comm_exposed_s, p.current_rollout_abs_max}};
}

void unpack_metrics(const MetricVectors& v, TrainStepMetrics& m) {
  PolicyLossMetrics& p = m.policy;
  const std::vector<double>&a = v.sums, &b = v.maxes;
  const auto i64 = [](double x) { return static_cast<int64_t>(std::llround(x)); };
  m.loss = a[0];
  m.tokens = i64(a[1]);
  m.packed_tokens = i64(a[2]);
  m.rollout_vs_trainer_mean_abs = m.tokens > 0 ? a[3] / static_cast<double>(m.tokens) : 0;
  p.tokens = i64(a[4]);
  p.sequences = i64(a[5]);
  p.pg_loss = a[6];
  p.kl_loss = a[7];
  p.entropy_loss = a[8];
  p.clipped_low = i64(a[9]);
  p.clipped_high = i64(a[10]);
  p.clipped_dual = i64(a[11]);
  p.kl_old_k1_sum = a[12];
  p.kl_old_k3_sum = a[13];
  p.kl_ref_sum = a[14];
  p.entropy_sum = a[15];
  p.ratio_sum = a[16];
  p.is_weight_sum = a[17];
  p.is_capped = i64(a[18]);
  p.mismatch_tokens = i64(a[19]);
  p.mismatch_abs_sum = a[20];
  p.mismatch_mult_sum = a[21];
  p.current_rollout_abs_sum = a[22];
  m.rollout_vs_trainer_max_abs = b[0];
  p.ratio_min = -b[1];
  p.ratio_max = b[2];
  p.is_weight_min = -b[3];
  p.is_weight_max = b[4];
  p.mismatch_abs_max = b[5];
  m.seconds_old = b[6];
  m.seconds_ref = b[7];
  m.seconds_update = b[8];
  m.comm_s = b[9];
  m.comm_exposed_s = b[10];
  p.current_rollout_abs_max = b[11];
}

// The batch's metrics from every rank's: sums summed, extremes of the extremes, the step's
// counters (the same on every rank) kept.
void reduce_metrics(Communicator& comm, TrainStepMetrics& m) {
  MetricVectors v = pack_metrics(m);
  const std::vector<double> all_sums = gather_doubles(comm, v.sums);
  const std::vector<double> all_maxes = gather_doubles(comm, v.maxes);
  std::fill(v.sums.begin(), v.sums.end(), 0.0);
  std::fill(v.maxes.begin(), v.maxes.end(), -std::numeric_limits<double>::infinity());
  for (int r = 0; r < comm.size(); ++r) {
    for (size_t i = 0; i < v.sums.size(); ++i)
      v.sums[i] += all_sums[static_cast<size_t>(r) * v.sums.size() + i];
    for (size_t i = 0; i < v.maxes.size(); ++i)
      v.maxes[i] = std::max(v.maxes[i], all_maxes[static_cast<size_t>(r) * v.maxes.size() + i]);
  }
  unpack_metrics(v, m);
}

// A pipeline's metrics are its last stage's (the one that computes the loss): sent to every stage
// (a broadcast of the packed doubles over the pipeline group).
void broadcast_last_stage_metrics(Communicator& pp, TrainStepMetrics& m) {
  MetricVectors v = pack_metrics(m);
  std::vector<double> all = v.sums;
  all.insert(all.end(), v.maxes.begin(), v.maxes.end());
  // (T) f64 bytes, carried as i64: the Communicator moves 8-byte words as they are.
  pp.broadcast(Tensor::wrap(all.data(), {static_cast<int64_t>(all.size())}, DType::i64),
               pp.size() - 1);
  std::copy(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(v.sums.size()), v.sums.begin());
  std::copy(all.begin() + static_cast<std::ptrdiff_t>(v.sums.size()), all.end(), v.maxes.begin());
  unpack_metrics(v, m);
}

// One micro-batch's loss from its logprobs and entropies lp, ent (T) (the rows of batch.head_rows
// are the samples' completion tokens in order): the loss, merged into metrics, and its gradient
// with respect to them (dentropy undefined without an entropy term).
struct MicroLoss {
  double loss = 0;
  Tensor dlogprob, dentropy;  // (T)
};

MicroLoss micro_loss(std::span<const TrainSample> part, size_t first_sample,
                     const model::PackedBatch& batch, const Tensor& lp, const Tensor& ent,
                     std::span<const float> old_logp, std::span<const float> ref_logp,
                     const PolicyLossConfig& config, const LossNormalisers& norm,
                     TrainStepMetrics& metrics) {
  const int64_t T = batch.num_tokens();
  std::vector<int32_t> lens;
  std::vector<float> adv, logp, entropy, rollout;
  size_t head = 0;  // the next entry of batch.head_rows: sample b's completion token k
  for (size_t b = 0; b < part.size(); ++b) {
    const int64_t nc = static_cast<int64_t>(part[b].completion.size());
    TANDEM_CHECK(static_cast<int64_t>(part[b].rollout_logp.size()) == nc,
                 "trainer: sample {} has {} completion tokens and {} rollout logprobs",
                 first_sample + b, nc, part[b].rollout_logp.size());
    lens.push_back(static_cast<int32_t>(nc));
    adv.push_back(part[b].advantage);
    for (int64_t k = 0; k < nc; ++k) {
      const int64_t row = batch.head_rows[head++];
      logp.push_back(lp.data_as<float>()[row]);
      entropy.push_back(ent.data_as<float>()[row]);
      rollout.push_back(part[b].rollout_logp[static_cast<size_t>(k)]);
    }
  }
  const size_t n = logp.size();
  PolicyLossInput in;
  in.seq_lens = lens;
  in.advantages = adv;
  in.logp = logp;
  in.old_logp = old_logp.subspan(0, n);
  if (!ref_logp.empty()) in.ref_logp = ref_logp.subspan(0, n);
  in.rollout_logp = rollout;
  in.entropy = entropy;
  const PolicyLoss pl = compute_policy_loss(in, config, norm);
  metrics.policy.merge(pl.metrics);
  MicroLoss out;
  out.loss = pl.loss;
  out.dlogprob = Tensor::zeros({T}, DType::f32);
  if (config.entropy_coef != 0) out.dentropy = Tensor::zeros({T}, DType::f32);
  for (size_t i = 0; i < n; ++i) {
    out.dlogprob.data_as<float>()[batch.head_rows[i]] = pl.dlogp[i];
    if (out.dentropy.defined()) out.dentropy.data_as<float>()[batch.head_rows[i]] = pl.dentropy[i];
  }
  return out;
}

}  // namespace

void TrainStepConfig::validate() const {
  trainer::validate(loss);
  TANDEM_CHECK(epochs >= 1, "trainer: epochs (mu) must be >= 1, got {}", epochs);
  TANDEM_CHECK(minibatches >= 1, "trainer: minibatches must be >= 1, got {}", minibatches);
  TANDEM_CHECK(micro_batch_tokens >= 1, "trainer: micro_batch_tokens must be >= 1, got {}",
               micro_batch_tokens);
  TANDEM_CHECK(temperature > 0, "trainer: temperature must be > 0, got {}", temperature);
}

namespace {

// The decoder of `weights` under this rank's tensor parallelism; the policy's also with the
// optimizer's unit hooks.
model::DecoderOptions decoder_options(int64_t max_tokens, const ModelParallel& parallel,
                                      Optimizer* optimizer = nullptr) {
  model::DecoderOptions o;
  o.max_tokens = max_tokens;
  o.tp_group = parallel.tp;
  o.tp_kv_heads = parallel.tp_kv_heads;
  // 1F1B keeps at most P - s micro-batches in flight on stage s of P.
  if (parallel.pp != nullptr) o.pipeline_slots = parallel.pp->size() - parallel.pp->rank();
  if (optimizer != nullptr) o.unit_hooks = optimizer->unit_hooks();
  return o;
}

}  // namespace

PolicyTrainer::PolicyTrainer(Optimizer& optimizer, const model::Weights* reference,
                             const LrSchedule& schedule, const TrainStepConfig& config,
                             const ModelParallel& parallel)
    : optimizer_(optimizer),
      policy_(optimizer.compute_weights()),
      reference_(reference),
      schedule_(schedule),
      config_(config),
      parallel_(parallel),
      decoder_(std::make_unique<model::Decoder>(
          policy_, decoder_options(config.micro_batch_tokens, parallel, &optimizer))),
      comm_(optimizer.comm()) {
  config_.validate();
  auto* sharded = dynamic_cast<ShardedAdamW*>(&optimizer);
  TANDEM_CHECK(!config_.deterministic || (sharded != nullptr && sharded->options().deterministic),
               "trainer: the deterministic update needs the sharded optimizer in its "
               "deterministic mode (on one rank too)");
  share_ = config_.share_prompts && policy_.device().is_cpu();
  TANDEM_CHECK(config_.loss.kl_beta == 0 || reference_ != nullptr,
               "trainer: kl_beta {} needs reference weights", config_.loss.kl_beta);
  if (reference_ != nullptr) {
    ref_decoder_ = std::make_unique<model::Decoder>(
        *reference_, decoder_options(config_.micro_batch_tokens, parallel_));
  }
}

PolicyTrainer::~PolicyTrainer() = default;

void PolicyTrainer::release_activations() {
  decoder_->release_activations();
  if (ref_decoder_) ref_decoder_->release_activations();
}

std::vector<float> PolicyTrainer::logprobs(const model::Weights& weights,
                                           std::span<const TrainSample> samples,
                                           std::vector<float>* entropy) {
  // The policy's and the reference's decoders are planned once; other weights get one for the
  // call.
  std::unique_ptr<model::Decoder> other;
  model::Decoder* dec = &weights == &policy_ ? decoder_.get() : ref_decoder_.get();
  if (&weights != &policy_ && &weights != reference_) {
    other = std::make_unique<model::Decoder>(
        weights, decoder_options(config_.micro_batch_tokens, parallel_));
    dec = other.get();
  }
  if (parallel_.pp != nullptr) return pipeline_logprobs(*dec, samples, entropy);
  std::vector<float> out;
  out.reserve(static_cast<size_t>(completion_tokens(samples)));
  if (entropy != nullptr) entropy->clear();
  const auto parts =
      micro_batches(samples, config_.micro_batch_tokens, share_, config_.deterministic);
  const bool mine = dec == decoder_.get();
  // Every rank's count first: the collectives of a pass run as it computes.
  const size_t passes = mine ? agree_passes(parts.size(), model::UnitPass::forward) : parts.size();
  for (const auto& [b0, b1] : parts) {
    const auto part = samples.subspan(b0, b1 - b0);
    const model::PackedBatch batch = pack(part, share_);
    Tensor lp = Tensor::empty({batch.num_tokens()}, DType::f32);
    Tensor ent = Tensor::empty({batch.num_tokens()}, DType::f32);
    if (mine) optimizer_.begin_pass(model::UnitPass::forward);
    dec->forward(batch, lp, ent, config_.temperature);
    for (const int32_t row : batch.head_rows) {
      out.push_back(lp.data_as<float>()[row]);
      if (entropy != nullptr) entropy->push_back(ent.data_as<float>()[row]);
    }
  }
  for (size_t i = parts.size(); i < passes; ++i) optimizer_.idle_pass(model::UnitPass::forward);
  return out;
}

size_t PolicyTrainer::agree_passes(size_t mine, model::UnitPass pass) {
  if (comm_ == nullptr || !optimizer_.lockstep(pass)) return mine;
  const double n = static_cast<double>(mine);
  double most = 0;
  for (const double x : gather_doubles(*comm_, std::span(&n, 1))) most = std::max(most, x);
  return static_cast<size_t>(most);
}

double PolicyTrainer::accumulate(std::span<const TrainSample> samples,
                                 std::span<const float> old_logp, std::span<const float> ref_logp,
                                 const LossNormalisers& norm, TrainStepMetrics& metrics) {
  if (parallel_.pp != nullptr)
    return accumulate_pipelined(samples, old_logp, ref_logp, norm, metrics);
  double loss = 0;
  size_t token0 = 0;  // first completion token of the micro-batch in the minibatch's arrays
  const auto parts =
      micro_batches(samples, config_.micro_batch_tokens, share_, config_.deterministic);
  const size_t passes = agree_passes(parts.size(), model::UnitPass::forward_backward);
  for (const auto& [b0, b1] : parts) {
    const auto part = samples.subspan(b0, b1 - b0);
    const model::PackedBatch batch = pack(part, share_);
    const int64_t T = batch.num_tokens();
    metrics.packed_tokens += T;
    Tensor lp = Tensor::empty({T}, DType::f32);
    Tensor ent = Tensor::empty({T}, DType::f32);
    optimizer_.begin_pass(model::UnitPass::forward_backward);
    decoder_->forward(batch, lp, ent, config_.temperature);

    const MicroLoss ml = micro_loss(part, b0, batch, lp, ent, old_logp.subspan(token0),
                                    ref_logp.empty() ? ref_logp : ref_logp.subspan(token0),
                                    config_.loss, norm, metrics);
    loss += ml.loss;
    decoder_->backward(ml.dlogprob, ml.dentropy, optimizer_.gradients());
    optimizer_.end_micro_batch();
    token0 += batch.head_rows.size();
  }
  for (size_t i = parts.size(); i < passes; ++i)
    optimizer_.idle_pass(model::UnitPass::forward_backward);
  return loss;
}

double PolicyTrainer::accumulate_pipelined(std::span<const TrainSample> samples,
                                           std::span<const float> old_logp,
                                           std::span<const float> ref_logp,
                                           const LossNormalisers& norm, TrainStepMetrics& metrics) {
  Communicator& pp = *parallel_.pp;
  const bool first = pp.rank() == 0, last = pp.rank() == pp.size() - 1;
  const int64_t C = decoder_->config().hidden_size;
  // Every stage packs the same micro-batches (the plan the runner's shapes come from).
  const auto parts =
      micro_batches(samples, config_.micro_batch_tokens, share_, config_.deterministic);
  std::vector<model::PackedBatch> batches;
  std::vector<size_t> token0;  // each micro-batch's first completion token in the minibatch
  size_t tokens = 0;
  for (const auto& [b0, b1] : parts) {
    batches.push_back(pack(samples.subspan(b0, b1 - b0), share_));
    token0.push_back(tokens);
    tokens += batches.back().head_rows.size();
    metrics.packed_tokens += batches.back().num_tokens();
  }
  double loss = 0;
  std::vector<MicroLoss> grads_in(batches.size());  // the last stage's d loss / d logp
  PipeStage stage;
  stage.activation_shape = [&](int i) {
    return Shape{batches[static_cast<size_t>(i)].num_tokens(), C};
  };
  const int real = static_cast<int>(batches.size());
  stage.real = real;
  stage.forward = [&](int i, const Tensor& input) {
    if (i >= real) {  // a micro-batch of the data-parallel replicas only
      optimizer_.idle_pass(model::UnitPass::forward);
      return Tensor();
    }
    optimizer_.begin_pass(model::UnitPass::forward);
    const model::PackedBatch& batch = batches[static_cast<size_t>(i)];
    const int64_t T = batch.num_tokens();
    if (!last) {
      Tensor h = Tensor::empty({T, C}, DType::f32);
      decoder_->forward_stage(i, batch, input, h);
      return h;
    }
    Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
    decoder_->forward_stage(i, batch, input, lp, ent, config_.temperature);
    const auto [b0, b1] = parts[static_cast<size_t>(i)];
    const size_t t0 = token0[static_cast<size_t>(i)];
    MicroLoss& ml = grads_in[static_cast<size_t>(i)];
    ml =
        micro_loss(samples.subspan(b0, b1 - b0), b0, batch, lp, ent, old_logp.subspan(t0),
                   ref_logp.empty() ? ref_logp : ref_logp.subspan(t0), config_.loss, norm, metrics);
    loss += ml.loss;
    return Tensor();
  };
  stage.backward = [&](int i, const Tensor& grad_output) {
    if (parallel_.before_stage_backward != nullptr) (*parallel_.before_stage_backward)(i);
    if (i >= real) {
      optimizer_.idle_pass(model::UnitPass::backward);
      return Tensor();
    }
    optimizer_.begin_pass(model::UnitPass::backward);
    const int64_t T = batches[static_cast<size_t>(i)].num_tokens();
    const Tensor dh_in = first ? Tensor() : Tensor::empty({T, C}, DType::f32);
    if (last) {
      const MicroLoss& ml = grads_in[static_cast<size_t>(i)];
      decoder_->backward_stage(i, ml.dlogprob, ml.dentropy, optimizer_.gradients(), dh_in);
    } else {
      decoder_->backward_stage(i, grad_output, optimizer_.gradients(), dh_in);
    }
    optimizer_.end_micro_batch();
    return dh_in;
  };
  // The micro-batches every stage runs: at trainer.shard = "gradients" and "parameters" the most
  // any data-parallel replica has (the stage's collectives with its peers in the other replicas
  // come in the same order), the replica's own at "optimizer" (whose collectives come after the
  // minibatch); every stage of a pipeline agrees, as its replica's.
  const size_t passes = agree_passes(batches.size(), model::UnitPass::backward);
  if (passes == 0) return 0;
  run_pipeline(pp, PipeSchedule::one_f_one_b, static_cast<int>(passes), stage);
  return loss;
}

std::vector<float> PolicyTrainer::pipeline_logprobs(model::Decoder& dec,
                                                    std::span<const TrainSample> samples,
                                                    std::vector<float>* entropy) {
  Communicator& pp = *parallel_.pp;
  const int s = pp.rank();
  const bool first = s == 0, last = s == pp.size() - 1;
  const int64_t C = dec.config().hidden_size;
  std::vector<float> out(static_cast<size_t>(completion_tokens(samples)), 0.0f);
  if (entropy != nullptr) entropy->assign(out.size(), 0.0f);
  size_t k = 0;  // the next completion token
  const auto parts =
      micro_batches(samples, config_.micro_batch_tokens, share_, config_.deterministic);
  const bool mine = &dec == decoder_.get();
  const size_t passes = mine ? agree_passes(parts.size(), model::UnitPass::forward) : parts.size();
  for (size_t i = 0; i < parts.size(); ++i) {
    if (mine) optimizer_.begin_pass(model::UnitPass::forward);
    const model::PackedBatch batch =
        pack(samples.subspan(parts[i].first, parts[i].second - parts[i].first), share_);
    const int64_t T = batch.num_tokens();
    const auto micro = static_cast<int64_t>(i);
    Tensor input;
    if (!first) {  // the previous stage's activation: (T, C) f32
      input = Tensor::empty({T, C}, DType::f32);
      const P2POp op = recv_from(s - 1, input);
      pp.send_recv(std::span(&op, 1));
    }
    if (!last) {
      Tensor h = Tensor::empty({T, C}, DType::f32);
      dec.forward_stage(micro, batch, input, h);
      dec.drop_stage(micro);
      const P2POp op = send_to(s + 1, h);  // (T, C) f32 to the next stage
      pp.send_recv(std::span(&op, 1));
      k += batch.head_rows.size();
      continue;
    }
    Tensor lp = Tensor::empty({T}, DType::f32), ent = Tensor::empty({T}, DType::f32);
    dec.forward_stage(micro, batch, input, lp, ent, config_.temperature);
    dec.drop_stage(micro);
    for (const int32_t row : batch.head_rows) {
      out[k] = lp.data_as<float>()[row];
      if (entropy != nullptr) (*entropy)[k] = ent.data_as<float>()[row];
      ++k;
    }
  }
  for (size_t i = parts.size(); i < passes; ++i) optimizer_.idle_pass(model::UnitPass::forward);
  return out;
}

TrainStepMetrics PolicyTrainer::step(std::span<const TrainSample> samples,
                                     const BatchShard* shard) {
  TANDEM_CHECK(shard == nullptr || comm_ != nullptr,
               "trainer: a batch shard needs the sharded optimizer of several ranks");
  TANDEM_CHECK(shard != nullptr || comm_ == nullptr,
               "trainer: on several ranks a step needs this rank's shard of the batch");
  TANDEM_CHECK(shard == nullptr || shard->positions.size() == samples.size(),
               "trainer: {} samples and {} batch positions", samples.size(),
               shard ? shard->positions.size() : 0);
  const size_t batch = shard != nullptr ? shard->lengths.size() : samples.size();
  TANDEM_CHECK(batch > 0, "trainer: a step needs samples");
  TANDEM_CHECK(batch % static_cast<size_t>(config_.minibatches) == 0,
               "trainer: {} minibatches do not divide a batch of {} samples", config_.minibatches,
               batch);
  // The batch position of each sample.
  std::vector<size_t> position(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    position[i] = shard != nullptr ? shard->positions[i] : i;
    TANDEM_CHECK(!samples[i].prompt.empty() && !samples[i].completion.empty(),
                 "trainer: sample {} needs a prompt and at least one completion token", i);
    TANDEM_CHECK(
        shard == nullptr ||
            (position[i] < batch && (i == 0 || position[i] > position[i - 1]) &&
             shard->lengths[position[i]] == static_cast<int64_t>(samples[i].completion.size())),
        "trainer: sample {} does not match entry {} of the batch", i, position[i]);
  }
  TrainStepMetrics m;
  m.tokens = completion_tokens(samples);

  // pi_old: the rollout's logprobs are exact when the policy has not moved since the rollout
  // (one epoch, one minibatch); otherwise recompute them before the first update.
  auto t0 = Clock::now();
  std::vector<float> rollout_all;
  for (const TrainSample& s : samples)
    rollout_all.insert(rollout_all.end(), s.rollout_logp.begin(), s.rollout_logp.end());
  std::vector<float> old = rollout_all;
  if (config_.epochs > 1 || config_.minibatches > 1 || config_.always_recompute_old) {
    old = logprobs(policy_, samples);
    m.old_recomputed = true;
    double sum = 0;
    for (size_t i = 0; i < old.size(); ++i) {
      const double d = std::abs(static_cast<double>(old[i]) - rollout_all[i]);
      m.rollout_vs_trainer_max_abs = std::max(m.rollout_vs_trainer_max_abs, d);
      sum += d;
    }
    m.rollout_vs_trainer_mean_abs = old.empty() ? 0 : sum / static_cast<double>(old.size());
  }
  m.seconds_old = seconds_since(t0);
  t0 = Clock::now();
  std::vector<float> ref;
  if (config_.loss.kl_beta > 0) ref = logprobs(*reference_, samples);
  m.seconds_ref = seconds_since(t0);

  t0 = Clock::now();
  // Minibatch mb is entries [mb * per_mb, (mb + 1) * per_mb) of the batch; this rank trains the
  // ones it holds, normalised by the whole minibatch's tokens and sequences.
  const size_t per_mb = batch / static_cast<size_t>(config_.minibatches);
  for (int epoch = 0; epoch < config_.epochs; ++epoch) {
    size_t token0 = 0;
    for (int mb = 0; mb < config_.minibatches; ++mb) {
      const size_t g0 = static_cast<size_t>(mb) * per_mb, g1 = g0 + per_mb;
      const auto l0 = static_cast<size_t>(std::lower_bound(position.begin(), position.end(), g0) -
                                          position.begin());
      const auto l1 = static_cast<size_t>(std::lower_bound(position.begin(), position.end(), g1) -
                                          position.begin());
      const auto part = samples.subspan(l0, l1 - l0);
      const int64_t tokens = completion_tokens(part);
      int64_t mb_tokens = tokens;
      if (shard != nullptr) {
        mb_tokens = 0;
        for (size_t i = g0; i < g1; ++i) mb_tokens += shard->lengths[i];
      }
      const LossNormalisers norm{mb_tokens, static_cast<int64_t>(per_mb)};
      optimizer_.begin_step();
      const auto old_part =
          std::span<const float>(old).subspan(token0, static_cast<size_t>(tokens));
      const auto ref_part =
          ref.empty() ? std::span<const float>()
                      : std::span<const float>(ref).subspan(token0, static_cast<size_t>(tokens));
      m.loss += accumulate(part, old_part, ref_part, norm, m);
      m.lr = schedule_.lr_at(optimizer_steps_);
      const StepResult r = optimizer_.step(m.lr);
      m.grad_norm = r.grad_norm;
      if (r.skipped) ++m.skipped_steps;
      ++m.optimizer_steps;
      ++optimizer_steps_;
      token0 += static_cast<size_t>(tokens);
    }
  }
  m.seconds_update = seconds_since(t0);
  const CommStats cs = optimizer_.take_comm_stats();
  m.comm_s = cs.comm_s;
  m.comm_exposed_s = cs.exposed_s;
  if (parallel_.pp != nullptr) broadcast_last_stage_metrics(*parallel_.pp, m);
  if (shard != nullptr) reduce_metrics(*comm_, m);
  return m;
}

}  // namespace tandem::trainer
