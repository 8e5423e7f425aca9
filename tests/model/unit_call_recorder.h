// A model::UnitHooks that records the calls a decoder makes, as text ("acquire 3", "end 0"), for
// tests of their order.
#pragma once

#include <string>
#include <vector>

#include "model/unit_hooks.h"

namespace tandem::test {

struct UnitCallRecorder final : model::UnitHooks {
  std::vector<std::string> calls;
  void acquire(size_t u) override { calls.push_back("acquire " + std::to_string(u)); }
  void release(size_t u) override { calls.push_back("release " + std::to_string(u)); }
  void begin_gradients(size_t u) override { calls.push_back("begin " + std::to_string(u)); }
  void end_gradients(size_t u) override { calls.push_back("end " + std::to_string(u)); }
};

}  // namespace tandem::test
