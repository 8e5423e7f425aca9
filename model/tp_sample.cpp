// Sampling over vocabulary shards: the order of the ops::sample_shard_* phases with a collective
// between two of them (TpSampler), and the step over a Communicator.
#include "model/tp_sample.h"

#include <algorithm>

#include "core/error.h"

namespace tandem::model {

using ops::SampleRowKind;

Tensor& TpSampler::Buffer::fit(const Shape& shape, DType dtype, Device device) {
  const int64_t n = shape.numel();
  if (!storage.defined() || storage.numel() < n || storage.dtype() != dtype ||
      storage.device() != device)
    storage = Tensor::empty({std::max<int64_t>(n, 1)}, dtype, device);
  t = storage.narrow(0, n).view(shape);
  return t;
}

const Tensor& TpSampler::on_host(const Tensor& t, Buffer& host) {
  if (t.device().is_cpu()) return t;
  host.fit(t.shape(), t.dtype(), Device::cpu()).copy_from(t);
  return host.t;
}

void TpSampler::start(const Tensor& logits, const ops::SamplingTensors& settings, int rank,
                      int tp) {
  TANDEM_CHECK(logits.ndim() == 2,
               "tensor-parallel sampling: the logits shard {} must be (B, V/tp)",
               logits.shape().str());
  logits_ = logits;
  settings_ = settings;
  shard_ = {rank, tp};
  B_ = logits.size(0);
  Vs_ = logits.size(1);
  bytes_ = 0;
  const Device d = logits.device();
  // Maxima and kinds now: the op checks the shard and the settings.
  ops::sample_shard_maxima(logits, settings, shard_, maxima_.fit({B_, 2}, DType::f32, d),
                           kinds_.fit({B_}, DType::u8, d));
  kinds_at_ = on_host(kinds_.t, kinds_host_).data_as<uint8_t>();
  for (int64_t b = 0; b < B_; ++b)
    TANDEM_CHECK(kinds_at_[b] != static_cast<uint8_t>(SampleRowKind::invalid),
                 "tensor-parallel sampling: row {} has settings outside their ranges (temperature "
                 ">= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1])",
                 b);
  stage_ = Stage::maxima;
}

bool TpSampler::any(SampleRowKind kind) const {
  return std::any_of(kinds_at_, kinds_at_ + B_,
                     [kind](uint8_t k) { return k == static_cast<uint8_t>(kind); });
}

TpSampler::Collective TpSampler::gather(const char* what, const Tensor& in, Buffer& out,
                                        const Shape& shape) {
  out.fit(shape, DType::f32, in.device());
  bytes_ += static_cast<int64_t>(out.t.nbytes());
  return {Collective::Op::gather, what, in.view({in.numel()}), out.t.view({shape.numel()}), {}};
}

TpSampler::Collective TpSampler::sum(const char* what, const Tensor& in, const Tensor& out) {
  bytes_ += static_cast<int64_t>(out.nbytes());
  return {Collective::Op::sum, what, in.view({in.numel()}), out.view({out.numel()}), {}};
}

bool TpSampler::next(Collective& c) {
  const Device d = logits_.device();
  const int tp = shard_.count;
  switch (stage_) {
    case Stage::maxima:
      stage_ = Stage::stats;
      c = gather("maxima", maxima_.t, all_maxima_, {tp, B_, 2});
      return true;
    case Stage::stats:
      ops::sample_shard_stats(logits_, settings_, shard_, all_maxima_.t,
                              z_.fit({B_, Vs_}, DType::f32, d), e_.fit({B_, Vs_}, DType::f32, d),
                              stats_.fit({B_, 3}, DType::f32, d));
      stage_ = Stage::chain;
      hop_ = 1;
      if (tp > 1) hops_.fit({tp - 1, B_}, DType::f32, d);  // read only for plain rows
      c = gather("stats", stats_.t, all_stats_, {tp, B_, 3});
      return true;
    case Stage::chain:
      // Hop h: rank h continues the running kept sum from rank h - 1's end and every rank
      // learns its end. Only rank h sends values (the others zeros): a broadcast of B f32.
      if (any(SampleRowKind::plain) && hop_ < tp) {
        ops::sample_shard_chain(e_.t, settings_, shard_, all_stats_.t, hops_.t, hop_,
                                chain_.fit({B_}, DType::f32, d));
        c = sum("chain", chain_.t, hops_.t.narrow(hop_ - 1, 1));
        ++hop_;
        return true;
      }
      stage_ = Stage::counts;
      [[fallthrough]];
    case Stage::counts:
      ops::sample_shard_counts(z_.t, settings_, shard_, all_maxima_.t, all_stats_.t,
                               counts_.fit({B_}, DType::f32, d),
                               bounds_.fit({B_, 2}, DType::f32, d));
      stage_ = Stage::candidates;
      if (any(SampleRowKind::nucleus)) {
        c = gather("counts", counts_.t, all_counts_, {tp, B_});
        return true;
      }
      // Only top-k rows have candidates: every rank sends min(top_k, V/tp) of them.
      all_counts_.fit({tp, B_}, DType::f32, d);
      for (int r = 0; r < tp; ++r) all_counts_.t.narrow(r, 1).view({B_}).copy_from(counts_.t);
      [[fallthrough]];
    case Stage::candidates:
      stage_ = Stage::decide;
      if (any(SampleRowKind::top_k) || any(SampleRowKind::nucleus)) {
        cand_counts_.resize(static_cast<size_t>(tp));
        ops::sample_shard_elements(on_host(kinds_.t, kinds_host_),
                                   on_host(all_counts_.t, all_counts_host_), Vs_, cand_counts_);
        int64_t total = 0;
        for (const int64_t n : cand_counts_) total += n;
        ops::sample_shard_candidates(
            z_.t, settings_, shard_, all_counts_.t, bounds_.t,
            cands_.fit({cand_counts_[static_cast<size_t>(shard_.rank)]}, DType::f32, d));
        c = gather("candidates", cands_.t, all_cands_, {total});
        c.counts = cand_counts_;
        return true;
      }
      all_cands_.t = Tensor();
      [[fallthrough]];
    case Stage::decide:
      ops::sample_shard_decide(z_.t, e_.t, settings_, shard_, all_maxima_.t, all_stats_.t,
                               tp > 1 ? hops_.t : Tensor(), all_counts_.t, all_cands_.t,
                               token_.fit({B_}, DType::i32, d), logprob_.fit({B_}, DType::f32, d),
                               draws_.fit({B_, 2}, DType::f32, d));
      stage_ = Stage::draws;
      if (any(SampleRowKind::plain)) {
        c = sum("draws", draws_.t, all_draws_.fit({B_, 2}, DType::f32, d));
        return true;
      }
      [[fallthrough]];
    case Stage::draws:
      if (any(SampleRowKind::plain))
        ops::sample_shard_draws(kinds_.t, all_draws_.t, token_.t, logprob_.t);
      token_host_.resize(static_cast<size_t>(B_));
      logprob_host_.resize(static_cast<size_t>(B_));
      Tensor::wrap(token_host_.data(), {B_}, DType::i32).copy_from(token_.t);
      Tensor::wrap(logprob_host_.data(), {B_}, DType::f32).copy_from(logprob_.t);
      stage_ = Stage::done;
      return false;
    case Stage::done:
      break;
  }
  TANDEM_CHECK(false, "tensor-parallel sampling: next() called after the step ended; start one");
  return false;
}

void sample_over_shards(Communicator& group, TpSampler& sampler, const Tensor& logits,
                        const ops::SamplingTensors& settings, const Tensor& token,
                        const Tensor& logprob) {
  const int64_t B = logits.size(0);
  TANDEM_CHECK(token.dtype() == DType::i32 && token.numel() == B && logprob.dtype() == DType::f32 &&
                   logprob.numel() == B,
               "tensor-parallel sampling: token and logprob must be (B = {}) i32 and f32", B);
  sampler.start(logits, settings, group.rank(), group.size());
  TpSampler::Collective c;
  while (sampler.next(c)) {
    // maxima (tp, B, 2), stats (tp, B, 3), counts (tp, B), candidates (every rank's), draws
    // (B, 2): f32, c.out's bytes (TpSampler::step_bytes adds them up).
    if (c.op == TpSampler::Collective::Op::sum) {
      c.out.copy_from(c.in);
      group.all_reduce(c.out, ReduceOp::sum);
    } else if (c.counts.empty()) {
      group.all_gather(c.in, c.out);
    } else {
      group.all_gather_v(c.in, c.out, c.counts);
    }
  }
  token.view({B}).copy_from(
      Tensor::wrap(const_cast<int32_t*>(sampler.tokens().data()), {B}, DType::i32));
  logprob.view({B}).copy_from(
      Tensor::wrap(const_cast<float*>(sampler.logprobs().data()), {B}, DType::f32));
}

Tensor gather_vocab_rows(Communicator& group, const Tensor& shard_rows) {
  TANDEM_CHECK(
      shard_rows.device().is_cpu() && shard_rows.dtype() == DType::f32 && shard_rows.ndim() == 2,
      "gather_vocab_rows: the rows must be (R, V/tp) f32 on the CPU");
  const int64_t R = shard_rows.size(0), Vs = shard_rows.size(1), tp = group.size();
  Tensor gathered = Tensor::empty({tp, R, Vs}, DType::f32);
  group.all_gather(shard_rows.view({R * Vs}), gathered.view({tp * R * Vs}));  // R V f32
  Tensor out = Tensor::empty({R, tp * Vs}, DType::f32);
  const float* g = gathered.data_as<float>();
  float* o = out.data_as<float>();
  for (int64_t r = 0; r < tp; ++r)
    for (int64_t i = 0; i < R; ++i)
      std::copy(g + (r * R + i) * Vs, g + (r * R + i + 1) * Vs, o + i * tp * Vs + r * Vs);
  return out;
}

}  // namespace tandem::model
