// The steady clock every phase timing reads, and seconds elapsed since a time point of it.
#pragma once

#include <chrono>

namespace tandem {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace tandem
