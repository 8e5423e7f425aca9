// Communicator: checks each call's tensors, hands it to the Gloo or NCCL backend by device, splits
// sub-groups, and verify_same_config.
#include "core/comm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/rendezvous/prefix_store.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <thread>

#include "core/comm_backend.h"
#include "core/error.h"

namespace tandem {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

double EmulatedLink::seconds(double bytes, int steps) const {
  if (!on()) return 0;
  return bytes * 8 / (gbps * 1e9) + steps * latency_us * 1e-6;
}

CallStats::Tally CallStats::total() const {
  Tally sum;
  for (const auto& [call, t] : by_call) {
    sum.calls += t.calls;
    sum.bytes += t.bytes;
    sum.seconds += t.seconds;
  }
  return sum;
}

namespace comm_detail {

std::string Group::peer(int r) const {
  const int w = world_ranks[static_cast<size_t>(r)];
  return w == r ? fmt::format("rank {}", r) : fmt::format("rank {} (world rank {})", r, w);
}

std::string Group::call(const char* what, size_t bytes) const {
  return fmt::format("{} on group '{}' (rank {} of {}, {} bytes)", what, name, rank, size, bytes);
}

#if !TANDEM_HAS_NCCL
std::unique_ptr<Backend> make_nccl_backend(const Group& group, gloo::rendezvous::Store&, int) {
  TANDEM_FAIL(
      "group '{}': CUDA tensors need NCCL, and this build has none (build with the CUDA "
      "toolkit and NCCL at /usr/local/cuda)",
      group.name);
}
#endif

}  // namespace comm_detail

namespace {

// A rank that writes to a peer which just died must get an error, not SIGPIPE.
void ignore_sigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

std::string local_hostname(const rendezvous::Store& store, const rendezvous::RankInfo& info) {
  if (const char* h = std::getenv("TANDEM_HOSTNAME"); h != nullptr && *h != '\0') return h;
  if (std::string a = store.local_address(); !a.empty()) return a;
  if (info.master_addr == "127.0.0.1" || info.master_addr == "localhost") return "127.0.0.1";
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

void check_link(const EmulatedLink& link, const std::string& group) {
  TANDEM_CHECK(std::isfinite(link.gbps) && link.gbps >= 0 && std::isfinite(link.latency_us) &&
                   link.latency_us >= 0,
               "group '{}': the emulated link needs gbps >= 0 (0: off) and latency_us >= 0, found "
               "{} gbps and {} us (distributed.emulated_link_gbps, "
               "distributed.emulated_link_latency_us)",
               group, link.gbps, link.latency_us);
}

// The share of a buffer each rank sends in one ring pass over n ranks (in n - 1 steps).
double ring_share(int n) { return static_cast<double>(n - 1) / n; }

}  // namespace

std::unique_ptr<Communicator> Communicator::create(const rendezvous::RankInfo& info,
                                                   const CommOptions& options) {
  TANDEM_CHECK(options.timeout_s > 0, "distributed.timeout_s must be > 0, found {}",
               options.timeout_s);
  TANDEM_CHECK(info.rank >= 0 && info.rank < info.world_size,
               "rank {} is out of range for world size {}", info.rank, info.world_size);
  check_link(options.link, "world");
  ignore_sigpipe();
  std::unique_ptr<Communicator> c(new Communicator());
  c->rank_ = info.rank;
  c->size_ = info.world_size;
  c->name_ = "world";
  c->world_ranks_.resize(static_cast<size_t>(info.world_size));
  std::iota(c->world_ranks_.begin(), c->world_ranks_.end(), 0);
  c->timeout_ = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000));
  c->options_ = options;
  c->store_ = rendezvous::open_store(options.store, info, c->timeout_);
  const comm_detail::Group group{c->name_, c->name_,        c->rank_,
                                 c->size_, c->world_ranks_, c->timeout_};
  c->gloo_ = comm_detail::make_gloo_backend(group, c->store_->gloo(), c->gloo_device_,
                                            local_hostname(*c->store_, info));
  if (options.device.is_cuda())
    c->nccl_ = comm_detail::make_nccl_backend(group, c->store_->gloo(), options.device.index);
  return c;
}

std::unique_ptr<Communicator> Communicator::from_environment(const CommOptions& options) {
  return create(rendezvous::detect_rank_info_from_environment(options.master), options);
}

Communicator::~Communicator() = default;

void Communicator::check_usable(const char* what) const {
  TANDEM_CHECK(broken_.empty(),
               "{} on group '{}': this communicator failed before and cannot be used again "
               "(first failure: {})",
               what, name_, broken_);
}

comm_detail::Backend& Communicator::backend_for(const Tensor& t, const char* what) {
  check_usable(what);
  if (t.device().is_cpu()) return *gloo_;
  TANDEM_CHECK(nccl_ != nullptr,
               "{} on group '{}': tensor {} is on {}, but this communicator has no NCCL "
               "communicator: create it with CommOptions.device = that device",
               what, name_, t.str(), t.device().str());
  TANDEM_CHECK(t.device() == options_.device,
               "{} on group '{}': tensor {} is on {}, the communicator's NCCL device is {}", what,
               name_, t.str(), t.device().str(), options_.device.str());
  return *nccl_;
}

void Communicator::set_link(const EmulatedLink& link) {
  check_link(link, name_);
  options_.link = link;
}

void Communicator::set_cuda_inputs_ready(bool ready) {
  if (nccl_ != nullptr) nccl_->set_inputs_ready(ready);
}

void Communicator::hold_for_link(std::chrono::steady_clock::time_point start, double bytes,
                                 int steps) const {
  if (!options_.link.on() || size_ == 1) return;
  const auto modeled = std::chrono::duration<double>(options_.link.seconds(bytes, steps));
  // sleep_until returns at once when the real transfer took longer already.
  std::this_thread::sleep_until(start +
                                std::chrono::duration_cast<std::chrono::nanoseconds>(modeled));
}

void Communicator::count_call(const char* what, std::chrono::steady_clock::time_point start,
                              int64_t bytes) const {
  if (call_stats_ == nullptr) return;
  CallStats::Tally& t = call_stats_->by_call[what];
  ++t.calls;
  t.bytes += bytes;
  t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <class Fn>
void Communicator::guarded(const char* what, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    if (broken_.empty()) broken_ = e.what();
    throw;
  } catch (const std::exception& e) {  // a library's own exception (gloo, std)
    if (broken_.empty()) broken_ = fmt::format("{} on group '{}': {}", what, name_, e.what());
    TANDEM_FAIL("{}", broken_);
  }
}

void Communicator::all_reduce(const Tensor& t, ReduceOp op) {
  const auto start = std::chrono::steady_clock::now();
  auto& b = backend_for(t, "all_reduce");
  guarded("all_reduce",
          [&] { b.all_reduce(t.data(), static_cast<size_t>(t.numel()), t.dtype(), op); });
  // Ring reduce-scatter then ring all-gather.
  hold_for_link(start, 2 * ring_share(size_) * static_cast<double>(t.nbytes()), 2 * (size_ - 1));
  count_call("all_reduce", start, static_cast<int64_t>(t.nbytes()));
}

void Communicator::reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  const auto start = std::chrono::steady_clock::now();
  auto& b = backend_for(in, "reduce_scatter");
  TANDEM_CHECK(
      in.dtype() == out.dtype() && in.device() == out.device() && in.numel() == out.numel() * size_,
      "reduce_scatter on group '{}': in {} must hold {} x out {} elements, same dtype "
      "and device",
      name_, in.str(), size_, out.str());
  guarded("reduce_scatter", [&] {
    b.reduce_scatter(in.data(), out.data(), static_cast<size_t>(out.numel()), in.dtype(), op);
  });
  hold_for_link(start, ring_share(size_) * static_cast<double>(in.nbytes()), (size_ - 1));
  count_call("reduce_scatter", start, static_cast<int64_t>(in.nbytes()));
}

void Communicator::all_gather(const Tensor& in, const Tensor& out) {
  std::vector<int64_t> counts(static_cast<size_t>(size_), in.numel());
  all_gather_v(in, out, counts);
}

void Communicator::all_gather_v(const Tensor& in, const Tensor& out,
                                std::span<const int64_t> counts) {
  const auto start = std::chrono::steady_clock::now();
  auto& b = backend_for(in, "all_gather");
  TANDEM_CHECK(static_cast<int>(counts.size()) == size_,
               "all_gather on group '{}': {} counts for {} ranks", name_, counts.size(), size_);
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  TANDEM_CHECK(in.dtype() == out.dtype() && in.device() == out.device() &&
                   in.numel() == counts[static_cast<size_t>(rank_)] && out.numel() == total,
               "all_gather on group '{}' (rank {}): in {} must hold {} elements and out {} their "
               "sum over ranks, {}, same dtype and device",
               name_, rank_, in.str(), counts[static_cast<size_t>(rank_)], out.str(), total);
  std::vector<size_t> sizes(counts.begin(), counts.end());
  guarded("all_gather", [&] { b.all_gather_v(in.data(), out.data(), sizes, in.dtype()); });
  hold_for_link(start, ring_share(size_) * static_cast<double>(out.nbytes()), (size_ - 1));
  count_call("all_gather", start, static_cast<int64_t>(out.nbytes()));
}

void Communicator::broadcast(const Tensor& t, int root) {
  const auto start = std::chrono::steady_clock::now();
  auto& b = backend_for(t, "broadcast");
  TANDEM_CHECK(root >= 0 && root < size_, "broadcast on group '{}': root {} is not a rank of {}",
               name_, root, size_);
  guarded("broadcast",
          [&] { b.broadcast(t.data(), static_cast<size_t>(t.numel()), t.dtype(), root); });
  // A pipelined ring from the root: every rank but the last sends the bytes once, and no rank has
  // them before the root has sent them.
  hold_for_link(start, static_cast<double>(t.nbytes()), (size_ - 1));
  count_call("broadcast", start, static_cast<int64_t>(t.nbytes()));
}

void Communicator::send_recv(std::span<const P2POp> ops) {
  if (ops.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  auto& b = backend_for(ops.front().tensor, "send_recv");
  for (const auto& op : ops)
    TANDEM_CHECK(op.tensor.device() == ops.front().tensor.device(),
                 "send_recv on group '{}': one call moves tensors of one device ({} and {})", name_,
                 op.tensor.device().str(), ops.front().tensor.device().str());
  guarded("send_recv", [&] { b.send_recv(ops); });
  // The link carries both ways at once: the larger of the bytes sent and received, one step.
  double sent = 0, received = 0;
  for (const auto& op : ops)
    (op.kind == P2POp::Kind::send ? sent : received) += static_cast<double>(op.tensor.nbytes());
  hold_for_link(start, std::max(sent, received), 1);
  count_call("send_recv", start, static_cast<int64_t>(sent + received));
}

void Communicator::barrier() {
  const auto start = std::chrono::steady_clock::now();
  check_usable("barrier");
  guarded("barrier", [&] { gloo_->barrier(); });
  // The dissemination barrier's rounds: ceil(log2(size)).
  int rounds = 0;
  while ((1 << rounds) < size_) ++rounds;
  hold_for_link(start, 0, rounds);
  count_call("barrier", start, 0);
}

std::unique_ptr<Communicator> Communicator::split(const std::string& name,
                                                  const std::vector<int>& ranks) {
  check_usable("split");
  TANDEM_CHECK(!name.empty() && name.find('/') == std::string::npos,
               "split of group '{}': name '{}' must be non-empty and without '/'", name_, name);
  int new_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    TANDEM_CHECK(ranks[i] >= 0 && ranks[i] < size_ && (i == 0 || ranks[i] > ranks[i - 1]),
                 "split '{}' of group '{}': ranks must be ascending ranks of the group (0..{})",
                 name, name_, size_ - 1);
    if (ranks[i] == rank_) new_rank = static_cast<int>(i);
  }
  TANDEM_CHECK(new_rank >= 0, "split '{}' of group '{}': rank {} is not among its ranks", name,
               name_, rank_);
  std::unique_ptr<Communicator> c(new Communicator());
  c->rank_ = new_rank;
  c->size_ = static_cast<int>(ranks.size());
  c->name_ = fmt::format("{}/{}#{}", name_, name, splits_[name]++);
  for (int r : ranks) c->world_ranks_.push_back(world_ranks_[static_cast<size_t>(r)]);
  c->timeout_ = timeout_;
  c->options_ = options_;
  c->store_ = store_;
  c->gloo_device_ = gloo_device_;
  // Groups split under one name at once (the even and the odd ranks) differ by their members.
  const comm_detail::Group group{
      c->name_,        fmt::format("{}[{}]", c->name_, fmt::join(c->world_ranks_, ",")),
      c->rank_,        c->size_,
      c->world_ranks_, c->timeout_};
  guarded("split", [&] {
    c->gloo_ = comm_detail::make_gloo_backend(group, store_->gloo(), c->gloo_device_, "");
    if (options_.device.is_cuda())
      c->nccl_ = comm_detail::make_nccl_backend(group, store_->gloo(), options_.device.index);
  });
  return c;
}

// --- verify_same_config --------------------------------------------------------------------------

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// "key = value" lines by dotted key ("[a.b]" headers prefix the keys under them); other lines by
// their line number.
std::map<std::string, std::string> config_entries(const std::string& text) {
  std::map<std::string, std::string> entries;
  std::istringstream in(text);
  std::string line, section;
  int number = 0;
  auto trim = [](std::string s) {
    const size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  };
  while (std::getline(in, line)) {
    ++number;
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#') continue;
    if (t[0] == '[') {
      section = trim(t.substr(t.find_first_not_of('['), t.find(']') - t.find_first_not_of('[')));
      entries[fmt::format("line {}", number)] = t;
      continue;
    }
    const size_t eq = t.find('=');
    if (eq == std::string::npos) {
      entries[fmt::format("line {}", number)] = t;
    } else {
      const std::string key = trim(t.substr(0, eq));
      entries[section.empty() ? key : section + "." + key] = trim(t.substr(eq + 1));
    }
  }
  return entries;
}

}  // namespace

void verify_same_config(Communicator& comm, const std::string& text) {
  const int n = comm.size();
  Tensor hash = Tensor::empty({1}, DType::i64), hashes = Tensor::empty({n}, DType::i64);
  hash.data_as<int64_t>()[0] = static_cast<int64_t>(fnv1a(text));
  comm.all_gather(hash, hashes);
  const int64_t* h = hashes.data_as<int64_t>();
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && h[r] == h[0];
  if (same) return;

  Tensor size = Tensor::empty({1}, DType::i64), sizes = Tensor::empty({n}, DType::i64);
  size.data_as<int64_t>()[0] = static_cast<int64_t>(text.size());
  comm.all_gather(size, sizes);
  std::vector<int64_t> counts(sizes.data_as<int64_t>(), sizes.data_as<int64_t>() + n);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  Tensor all = Tensor::empty({total}, DType::u8);
  Tensor mine = Tensor::empty({static_cast<int64_t>(text.size())}, DType::u8);
  if (!text.empty()) std::memcpy(mine.data(), text.data(), text.size());
  comm.all_gather_v(mine, all, counts);

  std::vector<std::string> texts;
  int64_t offset = 0;
  for (int r = 0; r < n; ++r) {
    texts.emplace_back(static_cast<const char*>(all.data()) + offset,
                       static_cast<size_t>(counts[static_cast<size_t>(r)]));
    offset += counts[static_cast<size_t>(r)];
  }
  const auto reference = config_entries(texts[0]);
  std::string report;
  for (int r = 1; r < n; ++r) {
    if (h[r] == h[0]) continue;
    const auto entries = config_entries(texts[static_cast<size_t>(r)]);
    std::vector<std::string> diffs;
    for (const auto& [key, value] : reference) {
      auto it = entries.find(key);
      if (it == entries.end())
        diffs.push_back(fmt::format("{}: rank 0 has {}, rank {} lacks it", key, value, r));
      else if (it->second != value)
        diffs.push_back(
            fmt::format("{}: rank 0 has {}, rank {} has {}", key, value, r, it->second));
    }
    for (const auto& [key, value] : entries)
      if (!reference.contains(key))
        diffs.push_back(fmt::format("{}: rank {} has {}, rank 0 lacks it", key, r, value));
    if (diffs.empty()) diffs.push_back("the texts differ only in comments or spacing");
    report += fmt::format("\n  rank {} vs rank 0: {}", r, fmt::join(diffs, "; "));
  }
  TANDEM_FAIL(
      "the ranks of group '{}' run different configs: give every rank the same job file and "
      "overrides{}",
      comm.name(), report);
}

}  // namespace tandem
