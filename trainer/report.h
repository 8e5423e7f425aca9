// report.html: a self-contained page (inline SVG, no scripts, no network) charting a run's
// metrics.jsonl — reward, held-out accuracy (pass@1 with its 95% interval), KL, entropy, response
// length, clip fraction, throughput, dynamic sampling's groups, peak memory and time per phase. The
// job rewrites it after every step; tests/apps/test_report_browser.cpp checks it in headless
// Chromium.
#pragma once

#include <string>

namespace tandem::trainer {

// Reads metrics_jsonl and writes the report to html_path (through a temporary file and a
// rename, so a reader never sees half a page; a failed write removes the temporary file and
// throws naming html_path). Lines that are not JSON objects are skipped.
void write_report(const std::string& metrics_jsonl, const std::string& html_path,
                  const std::string& title);

}  // namespace tandem::trainer
