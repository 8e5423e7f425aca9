// memory_ledger: the bytes this process's arenas hold, by class (current and peak), and a cap on
// their sum that an arena's reserve is refused past.
#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "core/arena.h"

namespace tandem::memory_ledger {

inline constexpr size_t kClasses = 5;  // the ArenaClass values
inline constexpr ArenaClass kAllClasses[kClasses] = {
    ArenaClass::parameters, ArenaClass::gradients, ArenaClass::optimizer_states,
    ArenaClass::activations, ArenaClass::kv_blocks};

// The class's name in metrics and messages: weights, gradients, optimizer, activations, kv_cache.
const char* class_label(ArenaClass c);

struct ClassBytes {
  size_t current = 0;  // held now
  size_t peak = 0;     // the most held since the start or the last reset_peaks()
};

struct Snapshot {
  std::array<ClassBytes, kClasses> by_class;  // indexed by ArenaClass
  ClassBytes total;  // all classes together (its peak is that of the sum, not a sum of peaks)
  const ClassBytes& operator[](ArenaClass c) const { return by_class[static_cast<size_t>(c)]; }
};

// Every arena's capacity from its reserve to its release, on every device of the process.
Snapshot snapshot();
// Each peak back to its current value, so that the next snapshot shows the peaks since now;
// returns the snapshot just before (no reserve on another thread falls between the two).
Snapshot reset_peaks();

// A cap on the bytes of all classes together. key names the setting it comes from and where
// (e.g. "placement.rank_memory_limit_gb" and "job.toml:7:1"), for the error.
struct Limit {
  size_t bytes = 0;  // 0: none
  std::string key;
  std::string where;
};

// Sets the cap for as long as it lives, then puts back the one before. A reserve that would take
// the total over it throws tandem::Error naming the class, the bytes, the key and what each class
// holds. Bytes held already stay held when a lower cap is set.
class ScopedLimit {
 public:
  explicit ScopedLimit(Limit limit);
  ~ScopedLimit();
  ScopedLimit(const ScopedLimit&) = delete;
  ScopedLimit& operator=(const ScopedLimit&) = delete;

 private:
  Limit previous_;
};

// Arena's side: count `bytes` of class c as held (throws, counting nothing, past the cap), and
// give them back.
void reserve(ArenaClass c, size_t bytes);
void release(ArenaClass c, size_t bytes);

}  // namespace tandem::memory_ledger
