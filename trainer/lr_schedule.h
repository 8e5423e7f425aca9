// Learning-rate schedules: constant, linear warmup then constant, linear warmup then cosine decay,
// linear warmup then linear decay; lr_at(step) for the step about to be taken (0-based).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/names.h"

namespace tandem::trainer {

enum class LrScheduleKind : uint8_t { constant, warmup_constant, cosine, linear };
inline constexpr NamedValue<LrScheduleKind> kLrScheduleKindNames[] = {
    {LrScheduleKind::constant, "constant"},
    {LrScheduleKind::warmup_constant, "warmup_constant"},
    {LrScheduleKind::cosine, "cosine"},
    {LrScheduleKind::linear, "linear"}};
const char* lr_schedule_name(LrScheduleKind k);  // its name in kLrScheduleKindNames
// Parses those names; throws tandem::Error naming `where` and the accepted names.
LrScheduleKind lr_schedule_from_name(std::string_view name, const std::string& where);

struct LrScheduleConfig {
  LrScheduleKind kind = LrScheduleKind::constant;
  float lr = 1e-6f;           // the peak learning rate
  int64_t warmup_steps = 0;   // linear warmup from 0 over this many steps
  double warmup_ratio = 0.0;  // or: warmup_steps = int(warmup_ratio * total_steps) (verl's)
  int64_t total_steps = 0;    // the whole run (cosine and linear need it)
  double min_lr_ratio = 0.0;  // cosine and linear end at min_lr_ratio * lr
  double num_cycles = 0.5;    // cosine: 0.5 = one half-wave from lr down to min
  // Throws tandem::Error naming the field (lr_schedule.<field>) when a value is out of range.
  void validate() const;
};

class LrSchedule {
 public:
  explicit LrSchedule(const LrScheduleConfig& config);
  // The learning rate of optimizer step `step` (0 for the first): torch LambdaLR's lr after
  // `step` scheduler steps. Steps past total_steps keep the final rate.
  float lr_at(int64_t step) const;
  // The multiplier of lr at `step`, in double.
  double factor_at(int64_t step) const;
  int64_t warmup_steps() const { return warmup_; }
  const LrScheduleConfig& config() const { return config_; }

 private:
  LrScheduleConfig config_;
  int64_t warmup_ = 0;
};

}  // namespace tandem::trainer
