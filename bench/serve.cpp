// `tandem bench serve`: N concurrent clients of a rollout server on loopback for a bounded time,
// against the in-process engine on the same requests with the same N in flight: throughput
// (completion tokens/s, ratio served / in-process) and the p50 and p99 latency of a request; a
// weight update of the worker from a checkpoint beside the in-process publish; and one weight
// version pushed over the wire to 1 and 2 workers, beside a plain TCP copy of the same bytes on
// loopback (the limit) and beside the checkpoint-directory path.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "bench/bench.h"
#include "bench/peers.h"
#include "core/clock.h"
#include "core/crc32c.h"
#include "core/xxh3.h"
#include "model/hf.h"
#include "model/loader.h"
#include "model/prompt.h"
#include "rollout/engine.h"
#include "rollout/service/client.h"
#include "rollout/service/server.h"
#include "rollout/service/weight_push.h"

namespace tandem::bench {
namespace {

// Request i of the endless sequence both sides serve: a distinct prompt of `len` tokens.
rollout::Request request_of(const model::Tokenizer& tok, int64_t i, int64_t len, int n,
                            int new_tokens) {
  std::string text;
  std::vector<int32_t> ids;
  for (int k = 0; static_cast<int64_t>(ids.size()) < len; ++k) {
    text += fmt::format("Task {}-{}: compute {} times {} and explain. ", i, k, 13 + i, 7 + k);
    ids = tok.encode(text, false);
  }
  ids.resize(static_cast<size_t>(len));
  rollout::Request r{fmt::format("b{}", i), std::move(ids), {}};
  r.params.n = n;
  r.params.temperature = 1.0f;
  r.params.max_tokens = new_tokens;
  r.params.seed = static_cast<uint64_t>(i);
  return r;
}

struct Run {
  int64_t requests = 0;
  int64_t tokens = 0;  // completion tokens
  double seconds = 0;
  std::vector<double> latencies;  // seconds per request

  double tokens_per_s() const { return static_cast<double>(tokens) / seconds; }
  double quantile(double q) {
    if (latencies.empty()) return 0;
    std::sort(latencies.begin(), latencies.end());
    const size_t k = std::min(latencies.size() - 1,
                              static_cast<size_t>(q * static_cast<double>(latencies.size())));
    return latencies[k];
  }
};

// `clients` threads, each calling generate() on the server one request after another, until
// `seconds` have passed (requests started before then finish).
Run run_served(int port, const std::vector<rollout::Request>& requests, int clients,
               double seconds) {
  std::atomic<size_t> next{0};
  std::mutex mutex;
  Run run;
  const Clock::time_point t0 = Clock::now();
  auto client = [&] {
    rollout::RolloutClient c({.address = fmt::format("127.0.0.1:{}", port)});
    for (size_t i = next++; i < requests.size() && seconds_since(t0) < seconds; i = next++) {
      const rollout::Request& q = requests[i];
      rollout::rpc::GenerateRequest r;
      r.request_id = q.id;
      r.prompt_tokens = q.prompt;
      r.params.n = q.params.n;
      r.params.temperature = q.params.temperature;
      r.params.max_tokens = q.params.max_tokens;
      r.params.seed = static_cast<int64_t>(q.params.seed);
      r.params.stop_at_eos = false;
      const Clock::time_point start = Clock::now();
      const rollout::rpc::GenerateResponse out = c.generate(r);
      const double latency = seconds_since(start);
      int64_t tokens = 0;
      for (const auto& s : out.samples) tokens += static_cast<int64_t>(s.tokens.size());
      std::lock_guard lock(mutex);
      ++run.requests;
      run.tokens += tokens;
      run.latencies.push_back(latency);
    }
  };
  std::vector<std::thread> threads;
  for (int k = 0; k < clients; ++k) threads.emplace_back(client);
  for (auto& t : threads) t.join();
  run.seconds = seconds_since(t0);
  return run;
}

// The same requests on an engine in this process, `in_flight` at a time (a new one submitted as
// soon as one finishes), as the clients keep them.
Run run_in_process(const model::Weights& w, const model::Tokenizer& tok,
                   const rollout::EngineOptions& eo, const std::vector<rollout::Request>& requests,
                   int in_flight) {
  rollout::Engine engine(w, eo, &tok);
  Run run;
  std::unordered_map<std::string, Clock::time_point> started;
  size_t next = 0;
  const Clock::time_point t0 = Clock::now();
  auto submit = [&] {
    started[requests[next].id] = Clock::now();
    engine.submit(requests[next++]);
  };
  while (next < requests.size() && static_cast<int>(started.size()) < in_flight) submit();
  while (!started.empty()) {
    engine.step();
    for (const rollout::RequestOutput& o : engine.poll()) {
      run.latencies.push_back(std::chrono::duration<double>(Clock::now() - started[o.id]).count());
      started.erase(o.id);
      ++run.requests;
      for (const auto& s : o.samples) run.tokens += static_cast<int64_t>(s.tokens.size());
      if (next < requests.size()) submit();
    }
  }
  run.seconds = seconds_since(t0);
  return run;
}

// `bytes` through each of `streams` loopback TCP connections at once, `chunk` bytes a write: what
// the machine moves without any protocol, the limit of a push. In the cache (`from` empty): a
// sender writes one buffer of `chunk` bytes again and again, a receiver reads into one of its own,
// so neither side touches memory beyond its cache. From memory: every sender writes `from` (the
// same bytes a push sends: all streams read the one copy, as the pushes to several workers read
// the one policy) and each receiver reads them into a buffer of its own as large, touched before
// the clock starts (as a worker's staging weights are after its first push). Seconds from the
// first connect to the last byte read.
double raw_loopback_s(int64_t bytes, int64_t chunk, int streams, std::string_view from = {}) {
  const bool in_memory = !from.empty();
  std::vector<std::vector<char>> into(static_cast<size_t>(streams));
  for (auto& buf : into) buf.assign(static_cast<size_t>(in_memory ? bytes : chunk), 'r');
  const std::vector<char> chunk_buf(in_memory ? 0 : static_cast<size_t>(chunk), 'w');
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  TANDEM_CHECK(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                   ::listen(listener, streams) == 0,
               "bench serve: cannot listen on loopback");
  socklen_t n = sizeof a;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &n);
  std::vector<std::thread> threads;
  const Clock::time_point t0 = Clock::now();
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {  // receiver
      const int fd = ::accept(listener, nullptr, nullptr);
      char* buf = into[static_cast<size_t>(s)].data();
      for (int64_t got = 0; got < bytes;) {
        const int64_t at = in_memory ? got : 0;
        const ssize_t r = ::read(fd, buf + at, std::min<int64_t>(chunk, bytes - got));
        TANDEM_CHECK(r > 0, "bench serve: loopback read failed");
        got += r;
      }
      ::close(fd);
    });
    threads.emplace_back([&] {  // sender
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      TANDEM_CHECK(::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0,
                   "bench serve: cannot connect on loopback");
      for (int64_t sent = 0; sent < bytes;) {
        const char* p = in_memory ? from.data() + sent : chunk_buf.data();
        const ssize_t r = ::write(fd, p, std::min<int64_t>(chunk, bytes - sent));
        TANDEM_CHECK(r > 0, "bench serve: loopback write failed");
        sent += r;
      }
      ::close(fd);
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = seconds_since(t0);
  ::close(listener);
  return seconds;
}

// One weight version of `w` pushed over the wire to every worker at once (a thread each from one
// WeightSource, as the disaggregated job does), in buckets of at most `bucket_bytes`; seconds until
// every commit.
double push_s(const std::vector<std::unique_ptr<rollout::RolloutClient>>& clients,
              const model::Weights& w, int64_t version, int64_t bucket_bytes, int64_t& bytes) {
  std::vector<std::thread> threads;
  std::vector<int64_t> sent(clients.size());
  const Clock::time_point t0 = Clock::now();
  const auto source = std::make_shared<rollout::WeightSource>(w);
  for (size_t i = 0; i < clients.size(); ++i)
    threads.emplace_back([&, i] {
      sent[i] = rollout::push_weights(*clients[i], source, version, bucket_bytes).bytes;
    });
  for (auto& t : threads) t.join();
  const double seconds = seconds_since(t0);
  bytes = sent[0];
  return seconds;
}

// The checkpoint-directory path of the same version: written once, then loaded by every worker
// at once (begin_weight_update, commit_weight_update).
double directory_s(const std::vector<std::unique_ptr<rollout::RolloutClient>>& clients,
                   const model::Weights& w, int64_t version, const std::string& dir) {
  const Clock::time_point t0 = Clock::now();
  std::filesystem::remove_all(dir);
  model::save_hf(w, dir);
  std::vector<std::thread> threads;
  for (const auto& c : clients)
    threads.emplace_back([&] {
      c->begin_weight_update(version);
      c->commit_weight_update(version, dir);
    });
  for (auto& t : threads) t.join();
  return seconds_since(t0);
}

// What a push adds to the plain copy on each side, per byte: the XXH3-64 of a bucket (the sender
// hashes a chunk before the socket copies it from the weights, the worker after the socket copied
// it into its staging weights); beside it the CRC-32C the push used before; and, for reference, a
// memcpy of it, the copy each side made before the data channel. Each on one core; GB/s, best of
// a few runs over `bytes` in buckets of `bucket_bytes`.
struct ChecksumRates {
  double xxh3 = 0, crc32c = 0, copy = 0;
};
ChecksumRates checksum_and_copy_gbs(int64_t bytes, int64_t bucket_bytes) {
  std::vector<char> from(static_cast<size_t>(bucket_bytes), 'x'), to(from.size(), 'y');
  double hash_s = 1e30, crc_s = 1e30, copy_s = 1e30;
  uint32_t crc = 0;
  uint64_t hash = 0;
  for (int r = 0; r < 3; ++r) {
    Clock::time_point t0 = Clock::now();
    for (int64_t done = 0; done < bytes; done += bucket_bytes) {
      Xxh3 h;
      h.update(from.data(), from.size());
      hash ^= h.digest();
    }
    hash_s = std::min(hash_s, seconds_since(t0));
    t0 = Clock::now();
    for (int64_t done = 0; done < bytes; done += bucket_bytes)
      crc = crc32c({from.data(), from.size()}, crc);
    crc_s = std::min(crc_s, seconds_since(t0));
    t0 = Clock::now();
    for (int64_t done = 0; done < bytes; done += bucket_bytes) {
      std::memcpy(to.data(), from.data(), from.size());
      from[static_cast<size_t>(done / bucket_bytes) % from.size()] =
          static_cast<char>(crc ^ static_cast<uint32_t>(hash));
    }
    copy_s = std::min(copy_s, seconds_since(t0));
  }
  const auto gbs = [&](double s) { return static_cast<double>(bytes) / s / 1e9; };
  return {gbs(hash_s), gbs(crc_s), gbs(copy_s)};
}

// Weights over the wire: the model's f32 weights (the trainer's) pushed to 1 and 2 f32 workers
// over their data channels in buckets bounded as the workers' 16 MiB frames, beside a plain
// loopback TCP copy of the same bytes (the same streams at once) and beside the checkpoint
// directory. Best of `reps` each.
void run_weight_push(const Options& opt, const std::string& path, const std::string& model_name) {
  const int reps = opt.quick ? 1 : 5;
  model::LoadedModel trainer = model::load_model(path);
  const model::Weights& w = *trainer.weights;
  const rollout::ServerOptions so;  // 16 MiB frames
  const int64_t bucket_bytes = std::min<int64_t>(64 << 20, rollout::max_bucket_bytes(so));
  // The bytes a push sends, in one block: what the plain copy from memory sends.
  std::string policy_bytes;
  for (const model::NamedTensor& t : w.named())
    policy_bytes.append(static_cast<const char*>(t.tensor.data()), t.tensor.nbytes());
  std::vector<std::unique_ptr<rollout::RolloutServer>> servers;
  int64_t version = 1;
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("tandem-bench-serve-{}", ::getpid()))
          .string();
  for (int workers : {1, 2}) {
    while (static_cast<int>(servers.size()) < workers) {
      model::LoadedModel m = model::load_model(path);
      const model::PromptFormat format = model::prompt_format(m.tok(), "auto");
      rollout::EngineOptions eo;
      eo.num_blocks = 64;
      servers.push_back(std::make_unique<rollout::RolloutServer>(std::move(m), format, eo, so));
    }
    std::vector<std::unique_ptr<rollout::RolloutClient>> clients;
    for (const auto& s : servers)
      clients.push_back(std::make_unique<rollout::RolloutClient>(
          rollout::ClientOptions{.address = fmt::format("127.0.0.1:{}", s->port())}));
    int64_t bytes = 0;
    double wire = 1e30, raw = 1e30, cached = 1e30, directory = 1e30;
    // Interleaved, so that a busy moment of the machine hits all alike.
    for (int r = 0; r < reps; ++r) {
      wire = std::min(wire, push_s(clients, w, version++, bucket_bytes, bytes));
      raw = std::min(raw, raw_loopback_s(bytes, bucket_bytes, workers, policy_bytes));
      cached = std::min(cached, raw_loopback_s(bytes, bucket_bytes, workers));
    }
    directory = directory_s(clients, w, version++, dir);
    std::filesystem::remove_all(dir);
    const std::string c = fmt::format(
        "{} f32 weight push over the wire to {} worker{}, buckets of "
        "{} MiB, loopback",
        model_name, workers, workers > 1 ? "s" : "", bucket_bytes >> 20);
    const double gbs = static_cast<double>(bytes) * workers / wire / 1e9;
    const double raw_gbs = static_cast<double>(bytes) * workers / raw / 1e9;
    const double cached_gbs = static_cast<double>(bytes) * workers / cached / 1e9;
    print_line(opt, {{"bench", "service"},
                     {"case", c},
                     {"metric", "push_throughput"},
                     {"unit", "GB/s"},
                     {"value", gbs},
                     {"limit", raw_gbs},
                     {"limit_source", fmt::format("plain TCP copy of the same bytes on loopback, "
                                                  "{} stream{}, from the one copy in memory into "
                                                  "a buffer as large per stream",
                                                  workers, workers > 1 ? "s" : "")},
                     {"fraction_of_limit", gbs / raw_gbs},
                     {"in_cache_copy", cached_gbs},
                     {"fraction_of_in_cache_copy", gbs / cached_gbs},
                     {"bytes_per_worker", bytes}});
    print_line(opt, {{"bench", "service"},
                     {"case", c},
                     {"metric", "push_s"},
                     {"unit", "s"},
                     {"value", wire},
                     {"peer", "checkpoint directory (write, then every worker loads it)"},
                     {"peer_value", directory},
                     {"ratio", directory / wire},
                     {"raw_loopback_s", raw},
                     {"in_cache_copy_s", cached}});
  }
  const int64_t bytes = trainer.weights->num_parameters() * 4;
  const ChecksumRates rates = checksum_and_copy_gbs(bytes, bucket_bytes);
  print_line(opt, {{"bench", "service"},
                   {"case", fmt::format("{} f32 weights, what a push adds on each side: XXH3-64 "
                                        "of buckets of {} MiB, one core",
                                        model_name, bucket_bytes >> 20)},
                   {"metric", "checksum_throughput"},
                   {"unit", "GB/s"},
                   {"value", rates.xxh3},
                   {"peer", "CRC-32C (SSE4.2 crc32, three streams: core/crc32c.cpp)"},
                   {"peer_value", rates.crc32c},
                   {"ratio", rates.xxh3 / rates.crc32c}});
  print_line(opt, {{"bench", "service"},
                   {"case", fmt::format("{} f32 weights, for reference: memcpy of buckets of {} "
                                        "MiB, one core",
                                        model_name, bucket_bytes >> 20)},
                   {"metric", "copy_throughput"},
                   {"unit", "GB/s"},
                   {"value", rates.copy}});
}

}  // namespace

int run_serve_bench(const Options& opt, const std::string& model_path) {
  const std::string path =
      model_path.empty() ? (repo_root() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").string()
                         : model_path;
  const int64_t prompt_len = 32;
  const int new_tokens = opt.quick ? 8 : 16, n = 2;
  // Long enough for a few requests per client on a small CPU; requests started before the end
  // finish.
  const double seconds = opt.quick ? 1.0 : std::max(6.0, 20 * opt.min_seconds);
  const std::vector<int> client_counts =
      opt.quick ? std::vector<int>{2} : std::vector<int>{1, 4, 8};
  const std::string model_name = std::filesystem::path(path).stem().string();
  // --filter "weight push": the push over the wire only.
  if (!opt.filter.empty() && std::string("weight push over the wire").find(opt.filter) == 0) {
    run_weight_push(opt, path, model_name);
    return 0;
  }

  model::LoadedModel served = model::load_model(path);
  model::LoadedModel local = model::load_model(path);
  rollout::EngineOptions eo;
  eo.max_context = prompt_len + new_tokens + 1;
  eo.num_blocks = 4096;
  eo.max_seqs = 256;
  std::vector<rollout::Request> requests;
  for (int64_t i = 0; i < 4098; ++i)
    requests.push_back(request_of(local.tok(), i, prompt_len, n, new_tokens));

  const model::PromptFormat format = model::prompt_format(served.tok(), "auto");
  rollout::ServerOptions so;
  so.max_in_flight = 256;
  so.max_new_tokens = new_tokens;
  so.max_prompt_tokens = prompt_len;
  rollout::RolloutServer server(std::move(served), format, eo, so);
  // Both sides warm up (first steps allocate and pack) on requests of their own.
  const std::vector<rollout::Request> warm_up(requests.end() - 2, requests.end());
  run_served(server.port(), warm_up, 2, 1e9);
  run_in_process(*local.weights, local.tok(), eo, warm_up, 2);

  for (int clients : client_counts) {
    const std::vector<rollout::Request> timed(requests.begin(), requests.end() - 2);
    Run remote = run_served(server.port(), timed, clients, seconds);
    const std::vector<rollout::Request> same(requests.begin(), requests.begin() + remote.requests);
    Run in_process = run_in_process(*local.weights, local.tok(), eo, same, clients);
    const std::string c = fmt::format("{} {} clients, prompt {}, n {}, {} new, loopback",
                                      model_name, clients, prompt_len, n, new_tokens);
    print_line(opt, {{"bench", "service"},
                     {"case", c},
                     {"metric", "tokens_per_s"},
                     {"unit", "tokens/s"},
                     {"value", remote.tokens_per_s()},
                     {"peer", "in-process engine"},
                     {"peer_value", in_process.tokens_per_s()},
                     {"ratio", remote.tokens_per_s() / in_process.tokens_per_s()},
                     {"requests", remote.requests}});
    for (const auto& [name, q] : {std::pair{"p50_latency", 0.5}, std::pair{"p99_latency", 0.99}}) {
      const double ours = remote.quantile(q) * 1e3, peer = in_process.quantile(q) * 1e3;
      print_line(opt, {{"bench", "service"},
                       {"case", c},
                       {"metric", name},
                       {"unit", "ms"},
                       {"value", ours},
                       {"peer", "in-process engine"},
                       {"peer_value", peer},
                       {"ratio", peer / ours}});
    }
  }

  // A weight update: the worker reads the checkpoint and swaps it in between two steps, against
  // the in-process publish of weights already in memory (Engine::set_weights).
  {
    rollout::RolloutClient c({.address = fmt::format("127.0.0.1:{}", server.port())});
    const Clock::time_point t0 = Clock::now();
    c.begin_weight_update(1);
    c.commit_weight_update(1, path);
    const double remote = seconds_since(t0);
    rollout::Engine engine(*local.weights, eo, &local.tok());
    const Clock::time_point t1 = Clock::now();
    engine.set_weights(*local.weights, 1);
    const double in_process = seconds_since(t1);
    print_line(opt,
               {{"bench", "service"},
                {"case", fmt::format("{} weight update from a checkpoint, loopback", model_name)},
                {"metric", "weight_update_s"},
                {"unit", "s"},
                {"value", remote},
                {"peer", "in-process set_weights"},
                {"peer_value", in_process},
                {"ratio", in_process / remote}});
  }
  server.stop();
  run_weight_push(opt, path, model_name);
  return 0;
}

}  // namespace tandem::bench
