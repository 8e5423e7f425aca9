// IdleConnections: the connected, idle connections of a Thrift client (rpc/thrift_client.h),
// reused across calls and threads.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

namespace tandem {

// The idle connections of a Thrift client, reused across calls and threads. C: a connection
// with a `transport` member (std::shared_ptr<TTransport>).
template <class C>
class IdleConnections {
 public:
  ~IdleConnections() { drop_all(); }
  // An idle connection, or null when there is none.
  std::unique_ptr<C> take() {
    std::lock_guard lock(mutex_);
    if (idle_.empty()) return nullptr;
    std::unique_ptr<C> c = std::move(idle_.back());
    idle_.pop_back();
    return c;
  }
  void give_back(std::unique_ptr<C> c) {
    std::lock_guard lock(mutex_);
    idle_.push_back(std::move(c));
  }
  // Closes every idle connection (after a transport error: the others may be stale too).
  void drop_all() {
    std::vector<std::unique_ptr<C>> dropped;
    {
      std::lock_guard lock(mutex_);
      dropped.swap(idle_);
    }
    for (auto& c : dropped) {
      try {
        c->transport->close();
      } catch (...) {  // closing a dead socket may throw; nothing to do about it here
      }
    }
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<C>> idle_;
};

}  // namespace tandem
