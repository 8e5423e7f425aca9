// LR schedules, with HF transformers' / verl's formulas (see docs/trainer-optimizer.md).
#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace tandem::trainer {

const char* lr_schedule_name(LrScheduleKind k) { return name_of(kLrScheduleKindNames, k).data(); }

LrScheduleKind lr_schedule_from_name(std::string_view name, const std::string& where) {
  const auto k = value_of(kLrScheduleKindNames, name);
  TANDEM_CHECK(k.has_value(), "{}: unknown learning-rate schedule '{}': expected {}", where, name,
               names_list(kLrScheduleKindNames));
  return *k;
}

void LrScheduleConfig::validate() const {
  TANDEM_CHECK(std::isfinite(lr) && lr >= 0.0f, "lr_schedule.lr must be finite and >= 0, got {}",
               lr);
  TANDEM_CHECK(warmup_steps >= 0, "lr_schedule.warmup_steps must be 0 or more, got {}",
               warmup_steps);
  TANDEM_CHECK(warmup_ratio >= 0.0 && warmup_ratio <= 1.0,
               "lr_schedule.warmup_ratio must lie in [0, 1], got {}", warmup_ratio);
  TANDEM_CHECK(warmup_steps == 0 || warmup_ratio == 0.0,
               "lr_schedule: set warmup_steps ({}) or warmup_ratio ({}), not both", warmup_steps,
               warmup_ratio);
  TANDEM_CHECK(total_steps >= 0, "lr_schedule.total_steps must be 0 or more, got {}", total_steps);
  TANDEM_CHECK(min_lr_ratio >= 0.0 && min_lr_ratio <= 1.0,
               "lr_schedule.min_lr_ratio must lie in [0, 1], got {}", min_lr_ratio);
  TANDEM_CHECK(num_cycles > 0.0 && std::isfinite(num_cycles),
               "lr_schedule.num_cycles must be positive, got {}", num_cycles);
  const bool decays = kind == LrScheduleKind::cosine || kind == LrScheduleKind::linear;
  TANDEM_CHECK(!decays || total_steps > 0,
               "lr_schedule.total_steps must be set (> 0) for the {} schedule, got {}",
               lr_schedule_name(kind), total_steps);
  TANDEM_CHECK(warmup_ratio == 0.0 || total_steps > 0,
               "lr_schedule.warmup_ratio {} needs lr_schedule.total_steps (> 0)", warmup_ratio);
  TANDEM_CHECK(kind != LrScheduleKind::constant || (warmup_steps == 0 && warmup_ratio == 0.0),
               "lr_schedule: the constant schedule has no warmup (warmup_steps {}, warmup_ratio "
               "{}): use warmup_constant",
               warmup_steps, warmup_ratio);
  TANDEM_CHECK(!decays || total_steps == 0 || warmup_steps <= total_steps,
               "lr_schedule.warmup_steps {} exceeds lr_schedule.total_steps {}", warmup_steps,
               total_steps);
}

LrSchedule::LrSchedule(const LrScheduleConfig& config) : config_(config) {
  config_.validate();
  warmup_ = config_.warmup_steps;
  if (config_.warmup_ratio > 0.0) {
    warmup_ = static_cast<int64_t>(config_.warmup_ratio * static_cast<double>(config_.total_steps));
  }
}

double LrSchedule::factor_at(int64_t step) const {
  TANDEM_CHECK(step >= 0, "lr_schedule: step {} must be 0 or more", step);
  if (config_.kind == LrScheduleKind::constant) return 1.0;
  if (step < warmup_)
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_));
  if (config_.kind == LrScheduleKind::warmup_constant) return 1.0;
  const int64_t total = config_.total_steps;
  const double progress = static_cast<double>(std::min(step, total) - warmup_) /
                          static_cast<double>(std::max<int64_t>(1, total - warmup_));
  const double min_ratio = config_.min_lr_ratio;
  if (config_.kind == LrScheduleKind::cosine) {
    const double x = std::cos(std::numbers::pi * config_.num_cycles * 2.0 * progress);
    return std::max(min_ratio, x * (1.0 - min_ratio) * 0.5 + (1.0 + min_ratio) * 0.5);
  }
  return min_ratio + (1.0 - min_ratio) * std::max(0.0, 1.0 - progress);
}

float LrSchedule::lr_at(int64_t step) const {
  return static_cast<float>(static_cast<double>(config_.lr) * factor_at(step));
}

}  // namespace tandem::trainer
