// The process-wide ledger of arena bytes by class, under one mutex (arenas are reserved and
// released a few times per phase, never per token).
#include "core/memory_ledger.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "core/error.h"

namespace tandem::memory_ledger {
namespace {

struct Ledger {
  std::mutex mu;
  Snapshot bytes;
  Limit limit;
};

// Never destroyed: an arena held by a static object may be released after every other static
// has gone, at exit.
Ledger& ledger() {
  static Ledger* l = new Ledger;
  return *l;
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

const char* class_label(ArenaClass c) {
  switch (c) {
    case ArenaClass::parameters:
      return "weights";
    case ArenaClass::gradients:
      return "gradients";
    case ArenaClass::optimizer_states:
      return "optimizer";
    case ArenaClass::activations:
      return "activations";
    case ArenaClass::kv_blocks:
      return "kv_cache";
  }
  return "?";
}

Snapshot snapshot() {
  Ledger& l = ledger();
  const std::lock_guard lock(l.mu);
  return l.bytes;
}

Snapshot reset_peaks() {
  Ledger& l = ledger();
  const std::lock_guard lock(l.mu);
  const Snapshot before = l.bytes;
  for (ClassBytes& b : l.bytes.by_class) b.peak = b.current;
  l.bytes.total.peak = l.bytes.total.current;
  return before;
}

ScopedLimit::ScopedLimit(Limit limit) {
  Ledger& l = ledger();
  const std::lock_guard lock(l.mu);
  previous_ = std::exchange(l.limit, std::move(limit));
}

ScopedLimit::~ScopedLimit() {
  Ledger& l = ledger();
  const std::lock_guard lock(l.mu);
  l.limit = std::move(previous_);
}

void reserve(ArenaClass c, size_t bytes) {
  Ledger& l = ledger();
  const std::lock_guard lock(l.mu);
  Snapshot& s = l.bytes;
  const size_t after = s.total.current + bytes;
  if (l.limit.bytes > 0 && after > l.limit.bytes) {
    std::string held;
    for (const ArenaClass k : kAllClasses)
      held +=
          fmt::format("{}{} {:.1f}", held.empty() ? "" : ", ", class_label(k), mib(s[k].current));
    TANDEM_FAIL(
        "rank memory limit: reserving {:.1f} MiB of {} would hold {:.1f} MiB, over {} = {:.3g} "
        "GiB ({}) (held: {} MiB): raise {} or spread the job over more ranks",
        mib(bytes), class_label(c), mib(after), l.limit.key,
        static_cast<double>(l.limit.bytes) / (1024.0 * 1024.0 * 1024.0), l.limit.where, held,
        l.limit.key);
  }
  ClassBytes& b = s.by_class[static_cast<size_t>(c)];
  b.current += bytes;
  b.peak = std::max(b.peak, b.current);
  s.total.current = after;
  s.total.peak = std::max(s.total.peak, after);
}

void release(ArenaClass c, size_t bytes) {
  Ledger& l = ledger();
  const std::lock_guard lock(l.mu);
  ClassBytes& b = l.bytes.by_class[static_cast<size_t>(c)];
  b.current -= std::min(b.current, bytes);
  l.bytes.total.current -= std::min(l.bytes.total.current, bytes);
}

}  // namespace tandem::memory_ledger
