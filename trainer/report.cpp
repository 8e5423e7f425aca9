// report.html from metrics.jsonl.
#include "trainer/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/memory_ledger.h"

namespace tandem::trainer {
namespace {

struct Point {
  double step, value;
  double low = NAN, high = NAN;  // the value's interval, when the series has one
};

struct Series {
  std::string key, label, color;
  std::vector<Point> points;
  // Keys of the interval around each value (e.g. eval/pass@1_low and _high), drawn as error bars.
  std::string low_key = {}, high_key = {};
};

struct Chart {
  std::string title;
  std::vector<Series> series;
  // Drawn only when the run logs its metrics (a feature the job may not use); other charts say
  // "no data yet" until their first point.
  bool optional = false;
};

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string svg(const Chart& c) {
  // The legend has a row of its own between the title and the plot, so it never covers a line.
  constexpr double W = 420, H = 230, L = 52, R = 12, T = 44, B = 30;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const Series& s : c.series)
    for (const Point& p : s.points) {
      x0 = std::min(x0, p.step), x1 = std::max(x1, p.step);
      y0 = std::min({y0, p.value, std::isfinite(p.low) ? p.low : p.value});
      y1 = std::max({y1, p.value, std::isfinite(p.high) ? p.high : p.value});
    }
  std::string out = fmt::format(
      "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "viewBox=\"0 0 {} {}\"><text x=\"{}\" y=\"18\" class=\"title\">{}</text>",
      W, H, W, H, L, escape(c.title));
  if (!std::isfinite(x0)) return out + "<text x=\"60\" y=\"110\">no data yet</text></svg>";
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y0 -= 0.5, y1 += 0.5;
  const auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  const auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  out += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" class=\"axis\"/>"
      "<line x1=\"{0}\" y1=\"{3}\" x2=\"{0}\" y2=\"{1}\" class=\"axis\"/>",
      L, H - B, W - R, T);
  for (int i = 0; i <= 2; ++i) {  // y ticks: min, middle, max
    const double v = y0 + (y1 - y0) * i / 2.0;
    // Large values as integers: "2760" fits the margin, "2.76e+03" does not.
    const std::string label =
        std::fabs(v) >= 1000 ? fmt::format("{:.0f}", v) : fmt::format("{:.3g}", v);
    out += fmt::format("<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text>",
                       L - 4, py(v) + 4, label);
  }
  out += fmt::format(
      "<text x=\"{}\" y=\"{}\" class=\"tick\">{:.0f}</text>"
      "<text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"end\">step {:.0f}</text>",
      L, H - B + 16, x0, W - R, H - B + 16, x1);
  double legend_x = L + 8;
  for (const Series& s : c.series) {
    if (s.points.empty()) continue;
    std::string pts;
    for (const Point& p : s.points) pts += fmt::format("{:.1f},{:.1f} ", px(p.step), py(p.value));
    out += fmt::format(
        "<polyline class=\"series\" data-key=\"{}\" data-points=\"{}\" "
        "fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>",
        escape(s.key), s.points.size(), s.color, pts);
    for (const Point& p : s.points) {
      out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>", px(p.step),
                         py(p.value), s.color);
      if (!std::isfinite(p.low) || !std::isfinite(p.high)) continue;
      const double x = px(p.step), lo = py(p.low), hi = py(p.high);
      out += fmt::format(
          "<path class=\"interval\" data-key=\"{}\" stroke=\"{}\" stroke-width=\"1.5\" "
          "d=\"M{:.1f},{:.1f}V{:.1f}M{:.1f},{:.1f}h8M{:.1f},{:.1f}h8\"/>",
          escape(s.key), s.color, x, lo, hi, x - 4, lo, x - 4, hi);
    }
    if (c.series.size() > 1) {
      out += fmt::format(
          "<rect x=\"{:.0f}\" y=\"{}\" width=\"10\" height=\"3\" fill=\"{}\"/>"
          "<text x=\"{:.0f}\" y=\"{}\" class=\"legend\">{}</text>",
          legend_x, T - 12, s.color, legend_x + 14, T - 8, escape(s.label));
      legend_x += 6.5 * static_cast<double>(s.label.size()) + 30;
    }
  }
  return out + "</svg>";
}

constexpr const char* kFallbackChart = "reward fallbacks (fraction of samples)";

// A series in the fallback chart for each reward/<name>/fallback_fraction of the line.
void add_fallback_series(const nlohmann::json& line, std::vector<Chart>& charts) {
  static constexpr const char* kColors[] = {"#d62728", "#ff7f0e", "#8c564b", "#e377c2",
                                            "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4"};
  constexpr std::string_view kPrefix = "reward/", kSuffix = "/fallback_fraction";
  auto chart = std::find_if(charts.begin(), charts.end(),
                            [](const Chart& c) { return c.title == kFallbackChart; });
  for (auto it = line.begin(); it != line.end(); ++it) {
    const std::string& key = it.key();
    if (key.size() <= kPrefix.size() + kSuffix.size() || !key.starts_with(kPrefix) ||
        !key.ends_with(kSuffix))
      continue;
    std::vector<Series>& series = chart->series;
    if (std::any_of(series.begin(), series.end(), [&](const Series& s) { return s.key == key; }))
      continue;
    const std::string name =
        key.substr(kPrefix.size(), key.size() - kPrefix.size() - kSuffix.size());
    series.push_back({key, name, kColors[series.size() % std::size(kColors)], {}});
  }
}

// The columns of the memory table: each ledger class's peak, the arenas' together and the peak
// RSS, as the metrics name them after memory/ or memory/rank<r>/ (trainer/job_record.cpp).
std::vector<std::pair<std::string, std::string>> memory_columns() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const ArenaClass c : memory_ledger::kAllClasses)
    out.emplace_back(fmt::format("{}_peak_mib", memory_ledger::class_label(c)),
                     memory_ledger::class_label(c));
  out.emplace_back("arena_peak_mib", "arenas together");
  out.emplace_back("peak_rss_mib", "process peak RSS");
  return out;
}

// The most each rank held over the run, by column (NAN: never logged).
using MemoryTable = std::map<int64_t, std::vector<double>>;

void add_memory_row(const nlohmann::json& line, MemoryTable& table) {
  const auto columns = memory_columns();
  const auto take = [&](int64_t rank, const std::string& prefix) {
    for (size_t k = 0; k < columns.size(); ++k) {
      const auto it = line.find(prefix + columns[k].first);
      if (it == line.end() || !it->is_number()) continue;
      std::vector<double>& row = table.try_emplace(rank, columns.size(), NAN).first->second;
      const double v = it->get<double>();
      row[k] = std::isnan(row[k]) ? v : std::max(row[k], v);
    }
  };
  take(0, "memory/");  // rank 0's, also logged alone on one rank
  for (int64_t r = 0; line.contains(fmt::format("memory/rank{}/peak_rss_mib", r)); ++r)
    take(r, fmt::format("memory/rank{}/", r));
}

std::string memory_table_html(const MemoryTable& table) {
  const auto columns = memory_columns();
  // A run that logged its RSS alone (before the ledger's metrics) has no table.
  const bool classes = std::any_of(table.begin(), table.end(), [](const auto& row) {
    return std::any_of(row.second.begin(), row.second.end() - 2,
                       [](double v) { return !std::isnan(v); });
  });
  if (!classes) return "";
  std::string out =
      "<h2>peak memory by class and rank (MiB)</h2><p>The most each rank's arenas held in a step, "
      "by class (core/memory_ledger.h), and the process's peak resident memory.</p>"
      "<table class=\"memory\"><tr><th>rank</th>";
  for (const auto& [key, label] : columns) out += fmt::format("<th>{}</th>", escape(label));
  out += "</tr>";
  for (const auto& [rank, row] : table) {
    out += fmt::format("<tr data-rank=\"{}\"><td>{}</td>", rank, rank);
    for (const double v : row)
      out += std::isnan(v) ? std::string("<td>-</td>") : fmt::format("<td>{:.1f}</td>", v);
    out += "</tr>";
  }
  return out + "</table>";
}

}  // namespace

void write_report(const std::string& metrics_jsonl, const std::string& html_path,
                  const std::string& title) {
  std::vector<Chart> charts = {
      {"reward (mean)", {{"reward/mean", "reward", "#1f77b4", {}}}},
      {"held-out accuracy",
       {{"eval/pass@1",
         "pass@1 (95% interval)",
         "#2ca02c",
         {},
         "eval/pass@1_low",
         "eval/pass@1_high"},
        {"eval/pass@k", "pass@k", "#98df8a", {}}}},
      {"KL", {{"kl_ref", "to reference", "#d62728", {}}, {"kl_old", "to old", "#ff9896", {}}}},
      {"entropy", {{"entropy", "entropy", "#9467bd", {}}}},
      {"response length",
       {{"response_length/mean", "mean", "#8c564b", {}},
        {"response_length/max", "max", "#c49c94", {}}}},
      {"clip fraction",
       {{"pg_clipfrac_low", "low", "#e377c2", {}}, {"pg_clipfrac_high", "high", "#f7b6d2", {}}}},
      {"throughput (tokens/s)", {{"tokens_per_s", "tokens/s", "#17becf", {}}}},
      {"dynamic sampling (groups)",
       {{"dynamic_sampling/groups_generated", "generated", "#393b79", {}},
        {"dynamic_sampling/groups_kept", "kept", "#6b6ecf", {}}}},
      {"peak memory (RSS, MiB)", {{"memory/peak_rss_mib", "peak RSS", "#843c39", {}}}},
      // One series per reward function, added as its reward/<name>/fallback_fraction appears.
      {kFallbackChart, {}},
      {"time per phase (s)",
       {{"time/rollout_s", "rollout", "#ff7f0e", {}},
        {"time/reward_s", "reward", "#bcbd22", {}},
        {"time/train_s", "train", "#7f7f7f", {}}}},
      // A disaggregated job: how long the trainer waited for its batch, and the workers for
      // requests (rollout.max_staleness above 0 overlaps the two).
      {"idle per step (s)",
       {{"time/trainer_idle_s", "trainer", "#636363", {}},
        {"time/rollout_idle_s", "rollout", "#fd8d3c", {}}},
       /*optional=*/true},
      // Logged when the trainer recomputes the old logprobs (e.g. a bf16 rollout copy).
      {"rollout vs trainer logprob |Δ|",
       {{"rollout_trainer_logp/max_abs", "max", "#e6550d", {}},
        {"rollout_trainer_logp/mean_abs", "mean", "#fdae6b", {}}},
       /*optional=*/true},
  };
  std::ifstream in(metrics_jsonl);
  std::string line;
  int64_t rows = 0;
  MemoryTable memory;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number()) continue;
    ++rows;
    const double step = j["step"].get<double>();
    add_fallback_series(j, charts);
    add_memory_row(j, memory);
    for (Chart& c : charts)
      for (Series& s : c.series)
        if (j.contains(s.key) && j[s.key].is_number()) {
          const double v = j[s.key].get<double>();
          if (!std::isfinite(v)) continue;
          Point p{step, v};
          if (!s.low_key.empty() && j.contains(s.low_key) && j[s.low_key].is_number() &&
              j.contains(s.high_key) && j[s.high_key].is_number())
            p.low = j[s.low_key].get<double>(), p.high = j[s.high_key].get<double>();
          s.points.push_back(p);
        }
  }
  std::string html = fmt::format(
      "<!doctype html><html><head><meta charset=\"utf-8\"><title>{0}</title><style>"
      "body{{font-family:sans-serif;margin:24px;color:#222}}"
      ".charts{{display:flex;flex-wrap:wrap;gap:16px}}"
      ".chart{{border:1px solid #ddd;background:#fff}}.title{{font-weight:bold;font-size:13px}}"
      "table.memory{{border-collapse:collapse;margin-top:8px}}"
      ".memory td,.memory th{{border:1px solid #ddd;padding:3px 8px;text-align:right}}"
      ".axis{{stroke:#888}}.tick{{font-size:10px;fill:#555}}.legend{{font-size:11px;fill:#333}}"
      "</style></head><body><h1>{0}</h1><p>{1} metric lines from {2}</p><div class=\"charts\">",
      escape(title), rows, escape(metrics_jsonl));
  for (const Chart& c : charts) {
    const bool empty = std::all_of(c.series.begin(), c.series.end(),
                                   [](const Series& s) { return s.points.empty(); });
    if (!(c.optional && empty)) html += svg(c);
  }
  html += "</div>" + memory_table_html(memory) + "</body></html>\n";
  write_file_atomically(html_path, html, "free space or move logging.dir");
}

}  // namespace tandem::trainer
