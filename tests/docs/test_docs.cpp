// docs/ is a reference: no page outside docs/bench/ carries dated lab-diary headings, and the
// links of the README and the docs point at files and headings that exist.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testutil.h"

namespace fs = std::filesystem;

namespace {

// The markdown heading lines of `text` (outside ``` fences).
std::vector<std::string> headings(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  bool fenced = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("```")) fenced = !fenced;
    if (!fenced && std::regex_search(line, std::regex(R"(^#{1,6} )"))) out.push_back(line);
  }
  return out;
}

// Headings that date a section (2026-12-02) or number a run ("Run 16"): lab-diary material,
// which belongs in docs/bench/.
std::vector<std::string> dated_headings(const std::string& text) {
  static const std::regex dated(R"(\b[0-9]{4}-[0-9]{2}-[0-9]{2}\b|\b[Rr]uns? [0-9]+\b)");
  std::vector<std::string> out;
  for (const std::string& h : headings(text))
    if (std::regex_search(h, dated)) out.push_back(h);
  return out;
}

// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
std::string anchor_of(const std::string& heading) {
  std::string text = heading.substr(heading.find(' ') + 1), out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '-' || c == '_')
      out += static_cast<char>(std::tolower(u));
    else if (c == ' ')
      out += '-';
    else if (u >= 0x80)
      out += c;  // letters beyond ASCII stay (GitHub keeps them)
  }
  return out;
}

// The relative links of a markdown file that do not resolve: "target (why)".
std::vector<std::string> broken_links(const fs::path& file) {
  static const std::regex link(R"(\]\(([^)\s]+)\))");
  const std::string text = tandem::test::read_text(file);
  std::vector<std::string> broken;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), link); it != std::sregex_iterator();
       ++it) {
    const std::string target = (*it)[1].str();
    if (target.find("://") != std::string::npos || target.starts_with("mailto:")) continue;
    const size_t hash = target.find('#');
    const std::string path = target.substr(0, hash);
    const fs::path resolved = path.empty() ? file : file.parent_path() / path;
    if (!fs::exists(resolved)) {
      broken.push_back(target + " (no such file)");
      continue;
    }
    if (hash == std::string::npos) continue;
    const std::string anchor = target.substr(hash + 1);
    bool found = false;
    for (const std::string& h : headings(tandem::test::read_text(resolved)))
      found |= anchor_of(h) == anchor;
    if (!found) broken.push_back(target + " (no such heading)");
  }
  return broken;
}

}  // namespace

TEST_CASE("the dated heading check finds dated and numbered run headings only", "[unit]") {
  const std::string page =
      "# Page\n## Numbers\nMeasured 2026-12-02 in run 3.\n"
      "### Run 16 (2026-12-02 08:33 UTC): why\n### Re-measured quietly, 2026-12-02\n"
      "### Runs 4 to 7\n```\n# 2026-12-02 in a code block\n```\n## Running 2 ranks\n";
  CHECK(dated_headings(page) == std::vector<std::string>{"### Run 16 (2026-12-02 08:33 UTC): why",
                                                         "### Re-measured quietly, 2026-12-02",
                                                         "### Runs 4 to 7"});
}

TEST_CASE("no page of docs outside docs/bench has dated lab diary headings", "[unit]") {
  const fs::path docs = fs::path(TANDEM_SOURCE_DIR) / "docs";
  int pages = 0;
  for (const auto& entry : fs::directory_iterator(docs)) {
    if (entry.path().extension() != ".md") continue;
    ++pages;
    INFO(entry.path().string() << ": move dated sections to docs/bench/log.md");
    CHECK(dated_headings(tandem::test::read_text(entry.path())) == std::vector<std::string>{});
  }
  CHECK(pages > 10);
}

TEST_CASE("the anchor check reads GitHub anchors and finds broken links", "[unit]") {
  CHECK(anchor_of("## Held-out eval") == "held-out-eval");
  CHECK(anchor_of("## The data-parallel GRPO job") == "the-data-parallel-grpo-job");
  CHECK(anchor_of("### `score`: logprobs (f32)") == "score-logprobs-f32");
  const fs::path dir = fs::temp_directory_path() / "tandem-test-docs-links";
  fs::create_directories(dir);
  std::ofstream(dir / "a.md") << "# A\n## Real one\n[ok](a.md#real-one) [x](b.md) [y](#gone) "
                                 "[web](https://example.com/x.md)\n";
  CHECK(broken_links(dir / "a.md") ==
        std::vector<std::string>{"b.md (no such file)", "#gone (no such heading)"});
  fs::remove_all(dir);
}

TEST_CASE("the links of the README and docs point at files and headings that exist", "[unit]") {
  const fs::path repo = TANDEM_SOURCE_DIR;
  std::vector<fs::path> files{repo / "README.md"};
  for (const auto& entry : fs::recursive_directory_iterator(repo / "docs"))
    if (entry.path().extension() == ".md") files.push_back(entry.path());
  for (const fs::path& file : files) {
    INFO(file.string());
    CHECK(broken_links(file) == std::vector<std::string>{});
  }
}
