// Tests of weights over the wire (rollout.thrift: begin_weight_push, push_weight_bucket,
// commit_weight_push) on a worker of a tiny random SmolLM2-vocabulary model: a pushed version
// generates as a worker loaded from the same weights (f32, and bf16 cast by either side); bad
// buckets get typed refusals naming what is wrong and change nothing; a push interrupted midway,
// ended by a newer one or by its bound leaves the worker on its previous version; a bucket frame
// that lies about its data's size closes its connection only; the data channel refuses corrupted
// buckets, wrong tokens and oversize frames, and a connection cut off mid-bucket leaves no trace.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/half.h"
#include "core/xxh3.h"
#include "model/loader.h"
#include "model/prompt.h"
#include "rollout/service/client.h"
#include "rollout/service/server.h"
#include "rollout/service/weight_channel.h"
#include "rollout/service/weight_push.h"
#include "tests/model/tiny_model.h"
#include "tests/rpc/raw_frames.h"
#include "tests/testutil.h"

namespace tandem::rollout {
namespace {

using Catch::Matchers::Contains;

// The tiny model of seed 17 (what the workers load) and of seed 23 (what is pushed), written once.
const test::TempDir& models() {
  static test::TempDir dir("weight-push-models");
  static const bool written = [] {
    test::write_tiny_smollm2_hf(dir.file("v0"), 17);
    test::write_tiny_smollm2_hf(dir.file("v1"), 23);
    return true;
  }();
  (void)written;
  return dir;
}

struct Worker {
  std::unique_ptr<RolloutServer> server;
  std::unique_ptr<RolloutClient> client;

  explicit Worker(const std::string& model, DType dtype = DType::f32, double push_bound_s = 300,
                  const std::string& token = "", int64_t idle_timeout_ms = 600'000) {
    model::LoadedModel m = model::load_model(models().file(model), dtype);
    const model::PromptFormat format = model::prompt_format(m.tok(), "auto");
    EngineOptions e;
    e.num_blocks = 64;
    e.max_context = 64;
    e.max_seqs = 8;
    ServerOptions o;
    o.max_message_bytes = 64 << 10;  // buckets of at most 60 KiB: tensors split across them
    o.weight_update_timeout_s = push_bound_s;
    o.token = token;
    o.idle_timeout_ms = idle_timeout_ms;
    server = std::make_unique<RolloutServer>(std::move(m), format, e, o);
    client = std::make_unique<RolloutClient>(
        ClientOptions{.address = "127.0.0.1:" + std::to_string(server->port()),
                      .timeout_ms = 30000,
                      .token = token});
  }

  // Greedy-free sampled tokens and their logprobs, of the weights the worker serves.
  rpc::GenerateResponse sample() {
    rpc::GenerateRequest r;
    r.request_id = "probe";
    r.prompt_tokens = {1, 20, 300, 4000, 77};
    r.params.n = 2;
    r.params.seed = 9;
    r.params.max_tokens = 8;
    r.params.temperature = 0.8;
    r.params.stop_at_eos = false;
    return client->generate(r);
  }
};

void check_same_samples(const rpc::GenerateResponse& a, const rpc::GenerateResponse& b) {
  REQUIRE(a.samples.size() == b.samples.size());
  for (size_t i = 0; i < a.samples.size(); ++i) {
    CHECK(a.samples[i].tokens == b.samples[i].tokens);
    CHECK(a.samples[i].logprobs == b.samples[i].logprobs);  // bitwise
  }
}

// A CallError of kind weights_refused whose message names `fault` and holds `text`.
template <typename Fn>
void check_refused(const std::string& fault, const std::string& text, Fn&& fn) {
  try {
    fn();
    FAIL("expected the worker to refuse the weights (" << fault << ")");
  } catch (const CallError& e) {
    INFO(e.what());
    CHECK(std::string(call_failure_name(e.failure())) == "weights_refused");
    CHECK_THAT(e.what(), Contains("(" + fault + ",") && Contains(text));
  }
}

// A bucket of f32 pieces of `w`, checksummed.
rpc::WeightBucket bucket_of(const model::Weights& w, int64_t version, int32_t index,
                            const std::vector<rpc::WeightPiece>& pieces) {
  rpc::WeightBucket b;
  b.version = version;
  b.index = index;
  b.dtype = rpc::WeightDType::F32;
  b.pieces = pieces;
  for (const rpc::WeightPiece& p : pieces) {
    const auto* src = static_cast<const char*>(w.at(p.name).data()) + p.offset * 4;
    b.data.append(src, static_cast<size_t>(p.elements * 4));
  }
  b.xxh3 = static_cast<int64_t>(tandem::xxh3(b.data));
  return b;
}

rpc::WeightPiece piece(const std::string& name, int64_t offset, int64_t elements) {
  rpc::WeightPiece p;
  p.name = name;
  p.offset = offset;
  p.elements = elements;
  return p;
}

// A raw connection to a worker's data channel (rollout/service/weight_channel.h), past its hello.
struct RawChannel {
  int fd = -1;
  channel::Answer hello;

  RawChannel(int port, const std::string& token, int64_t version) {
    fd = test::connect_loopback(port);
    std::string h(channel::kHello);
    channel::put_u32(h, static_cast<uint32_t>(token.size()));
    h += token;
    channel::put_i64(h, version);
    test::send_all(fd, h);
    hello = channel::read_answer(fd);
  }
  ~RawChannel() { ::close(fd); }
  RawChannel(const RawChannel&) = delete;
  RawChannel& operator=(const RawChannel&) = delete;

  // A bucket's bytes as the sender writes them: header, pieces, `data`, the XXH3-64 `hash`.
  static std::string bucket(int32_t index, const std::vector<rpc::WeightPiece>& pieces,
                            const std::string& data, uint64_t hash,
                            std::optional<int64_t> data_bytes = std::nullopt) {
    channel::BucketHeader h;
    h.index = index;
    h.dtype = rpc::WeightDType::F32;
    h.pieces = static_cast<uint32_t>(pieces.size());
    h.data_bytes = data_bytes.value_or(static_cast<int64_t>(data.size()));
    std::string out = channel::encode(h);
    for (const rpc::WeightPiece& p : pieces) {
      channel::put_u32(out, static_cast<uint32_t>(p.name.size()));
      out += p.name;
      channel::put_i64(out, p.offset);
      channel::put_i64(out, p.elements);
    }
    out += data;
    channel::put_i64(out, static_cast<int64_t>(hash));
    return out;
  }

  // Whether the worker closed the connection (within 5 s).
  bool closed() const {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) != 1) return false;
    char byte = 0;
    return ::recv(fd, &byte, 1, 0) <= 0;
  }
};

std::string fault_name(int32_t code) {
  return rpc::to_string(static_cast<rpc::WeightPushFault::type>(code));
}

}  // namespace

TEST_CASE("weight buckets cover every tensor once within their bound", "[unit]") {
  model::LoadedModel m = model::load_model(models().file("v1"));
  const model::Weights& w = *m.weights;
  for (int64_t bound : {int64_t{200}, int64_t{4096}, int64_t{61440}, int64_t{64} << 20}) {
    INFO("bound " << bound);
    const auto plan = plan_weight_buckets(w, 4, bound);
    std::map<std::string, int64_t> next;  // per tensor: the element its next piece starts at
    for (const auto& bucket : plan) {
      REQUIRE_FALSE(bucket.empty());
      int64_t used = 0;
      for (const rpc::WeightPiece& p : bucket) {
        CHECK(p.offset == next[p.name]);
        CHECK(p.elements > 0);
        next[p.name] += p.elements;
        used += static_cast<int64_t>(p.name.size()) + kWeightPieceBytes + 4 * p.elements;
      }
      CHECK(used <= bound);
    }
    CHECK(next.size() == w.named().size());
    for (const model::NamedTensor& t : w.named()) CHECK(next[t.name] == t.tensor.numel());
    if (bound == 61440) CHECK(plan.size() > 100);  // the 12 MiB embedding split across buckets
  }
  CHECK_THROWS_WITH(plan_weight_buckets(w, 4, 40), Contains("cannot hold a piece"));
}

TEST_CASE("a weight push over the wire generates as a worker loaded from the same weights",
          "[unit]") {
  model::LoadedModel pushed = model::load_model(models().file("v1"));  // the trainer's, f32
  for (DType dtype : {DType::f32, DType::bf16}) {
    INFO("worker dtype " << dtype_name(dtype));
    Worker reference("v1", dtype);
    Worker w("v0", dtype);
    const rpc::GenerateResponse before = w.sample();
    const WeightPushResult r = push_weights(*w.client, *pushed.weights, 5, 64 << 20);
    CHECK(r.sent);
    CHECK(r.version == 5);
    CHECK(r.buckets > 100);  // bounded by the worker's 64 KiB frames
    CHECK(r.bytes == pushed.weights->num_parameters() * static_cast<int64_t>(dtype_size(dtype)));
    CHECK(w.client->weight_version() == 5);
    const rpc::GenerateResponse after = w.sample();
    CHECK(after.samples[0].weight_version == 5);
    CHECK(after.samples[0].logprobs != before.samples[0].logprobs);
    check_same_samples(after, reference.sample());
    // Nothing to send to a worker that holds the version.
    CHECK_FALSE(push_weights(*w.client, *pushed.weights, 5, 64 << 20).sent);
  }
  SECTION("f32 buckets are cast by a bf16 worker on arrival") {
    Worker reference("v1", DType::bf16);
    Worker w("v0", DType::bf16);
    CHECK(w.client->begin_weight_push(3).dtype == rpc::WeightDType::BF16);
    const auto plan = plan_weight_buckets(*pushed.weights, 4, 60000);
    for (size_t i = 0; i < plan.size(); ++i) {
      rpc::WeightBucket b = bucket_of(*pushed.weights, 3, static_cast<int32_t>(i), plan[i]);
      w.client->push_weight_bucket(b);
    }
    CHECK(w.client->commit_weight_push(3, static_cast<int32_t>(plan.size())) == 3);
    check_same_samples(w.sample(), reference.sample());
  }
}

TEST_CASE("pushes of one weight source to several workers checksum each chunk once", "[unit]") {
  model::LoadedModel pushed = model::load_model(models().file("v1"));
  const auto source = std::make_shared<WeightSource>(*pushed.weights);
  Worker reference("v1");
  Worker a("v0"), b("v0"), half("v0", DType::bf16);
  CHECK(push_weights(*a.client, source, 4, 64 << 20).sent);
  const int64_t chunks = source->chunks_checksummed();
  CHECK(chunks > 100);  // a chunk or more per bucket of the workers' 64 KiB frames
  // The second worker takes every hash from the first push, and its commit checks them all.
  CHECK(push_weights(*b.client, source, 4, 64 << 20).sent);
  CHECK(source->chunks_checksummed() == chunks);
  check_same_samples(a.sample(), reference.sample());
  check_same_samples(b.sample(), reference.sample());
  // Another dtype is another plan: its own checksums.
  CHECK(push_weights(*half.client, source, 4, 64 << 20).sent);
  CHECK(source->chunks_checksummed() > chunks);
  CHECK(half.client->weight_version() == 4);
  // At once from threads, with a withdraw only after both.
  Worker c("v0"), d("v0");
  const auto fresh = std::make_shared<WeightSource>(*pushed.weights);
  std::thread other([&] { push_weights(*c.client, fresh, 6, 64 << 20); });
  push_weights(*d.client, fresh, 6, 64 << 20);
  other.join();
  fresh->withdraw();
  CHECK(fresh->chunks_checksummed() == chunks);
  check_same_samples(c.sample(), reference.sample());
  check_same_samples(d.sample(), reference.sample());
}

TEST_CASE(
    "a rollout worker refuses malformed weight buckets with typed errors and keeps its "
    "weights",
    "[unit]") {
  model::LoadedModel pushed = model::load_model(models().file("v1"));
  const model::Weights& pw = *pushed.weights;
  Worker w("v0");
  const rpc::GenerateResponse before = w.sample();
  RolloutClient& c = *w.client;
  const std::string norm = "model.layers.0.input_layernorm.weight";  // 64 elements
  auto good = [&](int32_t index = 0) { return bucket_of(pw, 2, index, {piece(norm, 0, 64)}); };

  check_refused("NO_PUSH", "no weight push in progress", [&] {
    rpc::WeightBucket b = good();
    c.push_weight_bucket(b);
  });
  check_refused("NO_PUSH", "begin_weight_push first", [&] { c.commit_weight_push(2, 0); });
  check_refused("VERSION", "not newer than the worker's 0", [&] { c.begin_weight_push(0); });
  CHECK(c.begin_weight_push(2).worker_version == 0);

  check_refused("VERSION", "the push in progress is of v2", [&] {
    rpc::WeightBucket b = good();
    b.version = 3;
    c.push_weight_bucket(b);
  });
  check_refused("NAME", "no tensor 'model.layers.9.mlp.up_proj.weight'", [&] {
    rpc::WeightBucket b = good();
    b.pieces[0].name = "model.layers.9.mlp.up_proj.weight";
    c.push_weight_bucket(b);
  });
  check_refused("SIZE", "elements 32..96 of '" + norm + "', which has 64", [&] {
    rpc::WeightBucket b = bucket_of(pw, 2, 0, {piece(norm, 0, 32), piece(norm, 32, 32)});
    b.pieces[1].elements = 64;
    b.data.append(std::string(128, '\0'));
    b.xxh3 = static_cast<int64_t>(tandem::xxh3(b.data));
    c.push_weight_bucket(b);
  });
  check_refused("SIZE", "252 bytes of data for pieces of 64 elements", [&] {
    rpc::WeightBucket b = good();
    b.data.resize(252);
    b.xxh3 = static_cast<int64_t>(tandem::xxh3(b.data));
    c.push_weight_bucket(b);
  });
  check_refused("SIZE", "of -3 elements", [&] {
    rpc::WeightBucket b = good();
    b.pieces[0].elements = -3;
    c.push_weight_bucket(b);
  });
  check_refused("DTYPE", "data of dtype 2 for weights of f32", [&] {
    rpc::WeightBucket b = good();
    b.dtype = rpc::WeightDType::BF16;  // 128 bytes for 64 elements would fit, the type does not
    b.data.resize(128);
    b.xxh3 = static_cast<int64_t>(tandem::xxh3(b.data));
    c.push_weight_bucket(b);
  });
  check_refused("DTYPE", "data of dtype 7", [&] {
    rpc::WeightBucket b = good();
    b.dtype = static_cast<rpc::WeightDType::type>(7);
    c.push_weight_bucket(b);
  });
  check_refused("CHECKSUM", "the bucket says", [&] {
    rpc::WeightBucket b = good();
    b.data[17] ^= 1;  // one bit flipped on the way
    c.push_weight_bucket(b);
  });
  check_refused("OVERLAP", "elements 10..20 of '" + norm + "' arrived already", [&] {
    rpc::WeightBucket b = bucket_of(pw, 2, 0, {piece(norm, 0, 20), piece(norm, 10, 10)});
    c.push_weight_bucket(b);
  });

  // None of the refused buckets left a trace: a good one is taken, once even when sent again.
  rpc::WeightBucket b0 = good();
  c.push_weight_bucket(b0);
  c.push_weight_bucket(b0);
  check_refused("OVERLAP", "bucket 0 of v2 arrived already, with other data", [&] {
    rpc::WeightBucket b = bucket_of(pw, 2, 0, {piece(norm, 0, 63)});
    c.push_weight_bucket(b);
  });
  check_refused("OVERLAP", "elements 0..64 of '" + norm + "' arrived already", [&] {
    rpc::WeightBucket b = good(1);
    c.push_weight_bucket(b);
  });
  check_refused("INCOMPLETE", "bucket 1 of 2 has not arrived", [&] { c.commit_weight_push(2, 2); });
  check_refused("INCOMPLETE", "of '" + pw.named()[0].name + "' arrived",
                [&] { c.commit_weight_push(2, 1); });

  // Still the weights it had, generating as before; then a whole push takes.
  CHECK(c.weight_version() == 0);
  check_same_samples(w.sample(), before);
  CHECK(push_weights(c, pw, 4, 64 << 20).version == 4);
  CHECK(w.sample().samples[0].weight_version == 4);
  check_refused("VERSION", "not newer than the worker's 4", [&] { c.begin_weight_push(3); });
}

TEST_CASE("an interrupted weight push leaves the worker on its previous complete version",
          "[unit]") {
  model::LoadedModel v1 = model::load_model(models().file("v1"));
  model::LoadedModel v0 = model::load_model(models().file("v0"));
  Worker w("v0", DType::f32, 0.5);
  RolloutClient& c = *w.client;
  const rpc::GenerateResponse at_v0 = w.sample();
  REQUIRE(push_weights(c, *v1.weights, 1, 64 << 20).version == 1);
  const rpc::GenerateResponse at_v1 = w.sample();

  // Half of version 2 (the v0 weights), then the trainer goes away.
  const auto plan = plan_weight_buckets(*v0.weights, 4, 60000);
  auto send_half = [&](int64_t version) {
    c.begin_weight_push(version);
    for (size_t i = 0; i < plan.size() / 2; ++i) {
      rpc::WeightBucket b = bucket_of(*v0.weights, version, static_cast<int32_t>(i), plan[i]);
      c.push_weight_bucket(b);
    }
  };
  send_half(2);
  CHECK(c.weight_version() == 1);
  check_same_samples(w.sample(), at_v1);  // generating under v1 meanwhile
  check_refused("INCOMPLETE", "has not arrived",
                [&] { c.commit_weight_push(2, static_cast<int32_t>(plan.size())); });

  // A newer push ends it; the old one's buckets are refused.
  const int64_t abandoned = c.stats().weight_updates_abandoned;
  c.begin_weight_push(3);
  CHECK(c.stats().weight_updates_abandoned == abandoned + 1);
  CHECK_THAT(c.stats().last_weight_update_error, Contains("begin_weight_push of v3 ended it"));
  check_refused("VERSION", "the push in progress is of v3", [&] {
    rpc::WeightBucket b = bucket_of(*v0.weights, 2, 0, plan[0]);
    c.push_weight_bucket(b);
  });

  // One that no call continues ends after limits.weight_update_timeout_s.
  send_half(4);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (c.stats().weight_updates_abandoned < abandoned + 3 &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(c.stats().weight_updates_abandoned == abandoned + 3);  // v3 by v4's begin, v4 by its bound
  CHECK_THAT(c.stats().last_weight_update_error, Contains("limits.weight_update_timeout_s"));
  check_refused("NO_PUSH", "no weight push in progress", [&] { c.commit_weight_push(4, 1); });
  CHECK(c.weight_version() == 1);
  check_same_samples(w.sample(), at_v1);

  // A whole later push takes: v0's weights again, its samples again.
  CHECK(push_weights(c, *v0.weights, 5, 64 << 20).version == 5);
  const rpc::GenerateResponse again = w.sample();
  CHECK(again.samples[0].weight_version == 5);
  for (size_t i = 0; i < again.samples.size(); ++i)
    CHECK(again.samples[i].logprobs == at_v0.samples[i].logprobs);
}

TEST_CASE("a weight bucket frame whose data size lies closes that connection only", "[unit]") {
  Worker w("v0");
  w.client->begin_weight_push(1);
  // push_weight_bucket(bucket = {version 1, data: `size` bytes claimed, 8 sent}).
  auto frame = [](int32_t size) {
    const std::string name = "push_weight_bucket";
    std::string call = test::wire_i32(static_cast<int32_t>(0x80010001)) +
                       test::wire_i32(static_cast<int32_t>(name.size())) + name + test::wire_i32(1);
    call += std::string(1, 12) + test::wire_i16(1);  // field 1: the bucket (a struct)
    call += std::string(1, 10) + test::wire_i16(1) + std::string(7, '\0') + std::string(1, 1);
    call += std::string(1, 11) + test::wire_i16(5) + test::wire_i32(size) + std::string(8, 'x');
    return test::framed(call + std::string(2, '\0'));
  };
  for (int32_t size : {0x7fffffff, 11, -4}) {  // 10 bytes are left in the frame
    INFO("data size " << size);
    const int fd = test::connect_loopback(w.server->port());
    test::send_all(fd, frame(size));
    shutdown(fd, SHUT_WR);
    pollfd p{fd, POLLIN, 0};
    REQUIRE(poll(&p, 1, 3000) == 1);
    char byte = 0;
    CHECK(recv(fd, &byte, 1, 0) == 0);  // closed, no answer
    close(fd);
  }
  CHECK(w.server->stats().refused == 3);
  // The push and the worker go on.
  model::LoadedModel v1 = model::load_model(models().file("v1"));
  CHECK(push_weights(*w.client, *v1.weights, 2, 64 << 20).version == 2);
}

TEST_CASE("the weight channel refuses a corrupted bucket and takes the good one after it",
          "[unit]") {
  model::LoadedModel pushed = model::load_model(models().file("v1"));
  const model::Weights& pw = *pushed.weights;
  Worker w("v0");
  const rpc::GenerateResponse before = w.sample();
  const rpc::WeightPushReady ready = w.client->begin_weight_push(2);
  REQUIRE(ready.__isset.data_port);
  RawChannel ch(ready.data_port, "", 2);
  CHECK(ch.hello.code == channel::kTaken);
  const std::string norm = "model.layers.0.input_layernorm.weight";  // 64 elements
  const rpc::WeightBucket good = bucket_of(pw, 2, 0, {piece(norm, 0, 64)});
  const auto hash = static_cast<uint64_t>(good.xxh3);

  std::string flipped = good.data;
  flipped[17] ^= 1;  // one bit flipped on the way
  test::send_all(ch.fd, RawChannel::bucket(0, good.pieces, flipped, hash));
  channel::Answer a = channel::read_answer(ch.fd);
  CHECK(fault_name(a.code) == "CHECKSUM");
  CHECK_THAT(a.message, Contains("bucket 0 of v2: the data's XXH3-64"));
  // Refused before its data (the data read past): the connection goes on.
  test::send_all(ch.fd, RawChannel::bucket(0, {piece("no.such.tensor", 0, 64)}, good.data, hash));
  a = channel::read_answer(ch.fd);
  CHECK(fault_name(a.code) == "NAME");
  CHECK(a.tensor == "no.such.tensor");
  test::send_all(ch.fd, RawChannel::bucket(0, {piece(norm, 0, 60)}, good.data, hash));
  CHECK(fault_name(channel::read_answer(ch.fd).code) == "SIZE");
  // The refused buckets left no trace: the good one is taken, and once when sent again.
  test::send_all(ch.fd, RawChannel::bucket(0, good.pieces, good.data, hash));
  CHECK(channel::read_answer(ch.fd).code == channel::kTaken);
  test::send_all(ch.fd, RawChannel::bucket(0, good.pieces, good.data, hash));
  CHECK(channel::read_answer(ch.fd).code == channel::kTaken);
  test::send_all(ch.fd, RawChannel::bucket(1, good.pieces, good.data, hash));
  CHECK(fault_name(channel::read_answer(ch.fd).code) == "OVERLAP");
  check_refused("INCOMPLETE", "of '" + pw.named()[0].name + "' arrived",
                [&] { w.client->commit_weight_push(2, 1); });
  // A partial push: the worker is on the weights it had.
  CHECK(w.client->weight_version() == 0);
  check_same_samples(w.sample(), before);
}

TEST_CASE("a weight channel cut off mid-bucket leaves nothing of it and the push goes on",
          "[unit]") {
  model::LoadedModel pushed = model::load_model(models().file("v1"));
  const model::Weights& pw = *pushed.weights;
  // Connections silent for 1 s are closed by the worker.
  Worker w("v0", DType::f32, 300, "", 1000);
  const rpc::GenerateResponse before = w.sample();
  const int port = w.client->begin_weight_push(2).data_port;
  const std::string norm = "model.layers.0.input_layernorm.weight";
  const rpc::WeightBucket good = bucket_of(pw, 2, 0, {piece(norm, 0, 64)});
  const std::string bytes =
      RawChannel::bucket(0, good.pieces, good.data, static_cast<uint64_t>(good.xxh3));
  {
    RawChannel closes(port, "", 2);  // closes half way through the data
    test::send_all(closes.fd, bytes.substr(0, bytes.size() - 100));
  }
  {
    RawChannel stalls(port, "", 2);  // stops sending half way: closed after the idle timeout
    test::send_all(stalls.fd, bytes.substr(0, bytes.size() - 100));
    CHECK(stalls.closed());
  }
  // Neither marked its pieces received, nor holds them: the whole bucket is taken.
  RawChannel ch(port, "", 2);
  test::send_all(ch.fd, bytes);
  CHECK(channel::read_answer(ch.fd).code == channel::kTaken);
  CHECK(w.client->weight_version() == 0);
  check_same_samples(w.sample(), before);
  // A whole push over the channel takes.
  CHECK(push_weights(*w.client, pw, 3, 64 << 20).version == 3);
  CHECK(w.sample().samples[0].weight_version == 3);
}

TEST_CASE("the weight channel refuses a wrong token an oversize bucket and a stranger", "[unit]") {
  Worker w("v0", DType::f32, 300, "s3cret");
  const rpc::WeightPushReady ready = w.client->begin_weight_push(2);
  {
    RawChannel wrong(ready.data_port, "guess", 2);
    CHECK(wrong.hello.code == channel::kUnauthorized);
    CHECK_THAT(wrong.hello.message, Contains("wrong token"));
    CHECK(wrong.closed());
  }
  {
    RawChannel none(ready.data_port, "", 2);
    CHECK(none.hello.code == channel::kUnauthorized);
  }
  {
    RawChannel other(ready.data_port, "s3cret", 7);  // not the push in progress
    CHECK(fault_name(other.hello.code) == "VERSION");
    CHECK(other.closed());
  }
  const std::string norm = "model.layers.0.input_layernorm.weight";
  for (const auto& [what, header] :
       {std::pair{"data over the bound",
                  RawChannel::bucket(0, {piece(norm, 0, 64)}, "", 0, ready.max_bucket_bytes + 1)},
        std::pair{"a negative size", RawChannel::bucket(0, {piece(norm, 0, 64)}, "", 0, -8)},
        std::pair{"pieces over the bound",
                  RawChannel::bucket(0, std::vector<rpc::WeightPiece>(100000, piece(norm, 0, 1)),
                                     "", 0, 4)}}) {
    INFO(what);
    RawChannel ch(ready.data_port, "s3cret", 2);
    REQUIRE(ch.hello.code == channel::kTaken);
    test::send_all(ch.fd, header);
    const channel::Answer a = channel::read_answer(ch.fd);
    CHECK(fault_name(a.code) == "SIZE");
    CHECK(ch.closed());  // its framing cannot be trusted
  }
  {
    const int fd = test::connect_loopback(ready.data_port);
    test::send_all(fd, "GET / HTTP/1.1\r\n\r\n");
    CHECK(channel::read_answer(fd).code == channel::kMalformed);
    ::close(fd);
  }
  // The worker goes on: a push with the token takes.
  model::LoadedModel v1 = model::load_model(models().file("v1"));
  CHECK(push_weights(*w.client, *v1.weights, 3, 64 << 20).version == 3);
  // A client with the wrong token cannot begin one.
  RolloutClient wrong({.address = w.client->options().address, .token = "guess"});
  try {
    push_weights(wrong, *v1.weights, 4, 64 << 20);
    FAIL("expected Unauthorized");
  } catch (const CallError& e) {
    CHECK(e.failure() == CallFailure::unauthorized);
  }
}

}  // namespace tandem::rollout
