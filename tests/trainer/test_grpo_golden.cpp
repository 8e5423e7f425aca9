// tandem's GRPO advantages, losses, d loss / d logp and metrics against the torch float64 goldens
// of tests/golden/make_grpo_golden.py (tests/golden/grpo/*.json), every variant, to 1e-6 relative.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "trainer/grpo.h"

using namespace tandem::trainer;
using json = nlohmann::json;

namespace {

std::filesystem::path golden_dir() {
  return std::filesystem::path(TANDEM_SOURCE_DIR) / "tests/golden/grpo";
}

json load(const char* name) {
  std::ifstream in(golden_dir() / name);
  REQUIRE(in.good());
  return json::parse(in);
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// max |ours - golden| / max |golden| (absolute when the golden is all zero).
template <typename T>
double normalised_error(const std::vector<T>& ours, const std::vector<double>& golden) {
  REQUIRE(ours.size() == golden.size());
  double err = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(ours[i]) - golden[i]));
  }
  const double scale = max_abs(golden);
  return scale > 0 ? err / scale : err;
}

PolicyLossConfig config_from(const json& j) {
  PolicyLossConfig c;
  c.ratio_level = j.at("ratio_level") == "sequence" ? RatioLevel::kSequence : RatioLevel::kToken;
  c.clip = j.at("clip");
  c.eps_low = j.at("eps_low");
  c.eps_high = j.at("eps_high");
  c.dual_clip_c = j.at("dual_clip_c");
  c.aggregation = parse_loss_aggregation(j.at("aggregation").get<std::string>());
  c.seq_sum_norm = j.at("seq_sum_norm");
  c.kl_estimator = parse_kl_estimator(j.at("kl_estimator").get<std::string>());
  c.kl_beta = j.at("kl_beta");
  c.entropy_coef = j.at("entropy_coef");
  const std::string level = j.at("is_level");
  c.is_level = level == "none"    ? ImportanceLevel::kNone
               : level == "token" ? ImportanceLevel::kToken
                                  : ImportanceLevel::kSequence;
  c.is_mode = j.at("is_mode") == "mask" ? ImportanceMode::kMask : ImportanceMode::kTruncate;
  c.is_cap = j.at("is_cap");
  return c;
}

}  // namespace

TEST_CASE("GRPO advantages match the torch goldens", "[interop]") {
  const json g = load("advantages.json");
  const auto rewards = g.at("rewards").get<std::vector<float>>();
  const auto sizes = g.at("group_sizes").get<std::vector<int32_t>>();
  REQUIRE(g.at("cases").size() >= 10);
  for (const json& c : g.at("cases")) {
    AdvantageConfig config;
    config.baseline = c.at("baseline") == "leave-one-out" ? AdvantageBaseline::kLeaveOneOut
                                                          : AdvantageBaseline::kGroupMean;
    const std::string scale = c.at("scale");
    config.scale = scale == "group-std"   ? AdvantageScale::kGroupStd
                   : scale == "batch-std" ? AdvantageScale::kBatchStd
                                          : AdvantageScale::kNone;
    config.eps = c.at("eps");
    const Advantages ours = compute_advantages(rewards, sizes, config);
    INFO(c.at("baseline") << " " << scale << " eps " << config.eps);
    CHECK(normalised_error(ours.values, c.at("advantages").get<std::vector<double>>()) < 1e-6);
  }
}

TEST_CASE("GRPO policy losses and gradients match the torch goldens", "[interop]") {
  const json g = load("policy_loss.json");
  REQUIRE(g.at("cases").size() >= 20);
  for (const json& c : g.at("cases")) {
    INFO(c.at("name").get<std::string>());
    const json& x = c.at("inputs");
    const auto seq_lens = x.at("seq_lens").get<std::vector<int32_t>>();
    const auto adv = x.at("advantages").get<std::vector<float>>();
    const auto logp = x.at("logp").get<std::vector<float>>();
    const auto old = x.at("old_logp").get<std::vector<float>>();
    const auto ref = x.at("ref_logp").get<std::vector<float>>();
    const auto roll = x.at("rollout_logp").get<std::vector<float>>();
    const auto ent = x.at("entropy").get<std::vector<float>>();
    const PolicyLossConfig config = config_from(c.at("config"));
    const LossNormalisers norm{c.at("normalisers").at("global_tokens"),
                               c.at("normalisers").at("global_sequences")};
    const PolicyLoss ours =
        compute_policy_loss({seq_lens, adv, logp, old, ref, roll, ent}, config, norm);
    const double loss = c.at("loss");
    CHECK(std::abs(ours.loss - loss) <= 1e-6 * std::abs(loss));
    CHECK(normalised_error(ours.dlogp, c.at("dlogp").get<std::vector<double>>()) < 1e-6);
    CHECK(normalised_error(ours.dentropy, c.at("dentropy").get<std::vector<double>>()) < 1e-6);
    const json& m = c.at("metrics");
    const PolicyLossMetrics& o = ours.metrics;
    CHECK(o.clipped_low == m.at("clipped_low").get<int64_t>());
    CHECK(o.clipped_high == m.at("clipped_high").get<int64_t>());
    CHECK(o.ratio_min == Approx(m.at("ratio_min").get<double>()).epsilon(1e-9));
    CHECK(o.ratio_max == Approx(m.at("ratio_max").get<double>()).epsilon(1e-9));
    CHECK(o.kl_old_k3_sum == Approx(m.at("kl_old_k3_sum").get<double>()).epsilon(1e-9));
    CHECK(o.kl_ref_sum == Approx(m.value("kl_ref_sum", 0.0)).epsilon(1e-9));
    if (m.contains("is_weight_sum")) {
      CHECK(o.is_weight_sum == Approx(m.at("is_weight_sum").get<double>()).epsilon(1e-9));
    }
  }
}
