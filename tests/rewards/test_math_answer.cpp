// Math answer extraction and numeric equivalence, as tables.
#include <catch2/catch.hpp>

#include <optional>
#include <string>

#include "rewards/builtins.h"
#include "rewards/math_answer.h"

using namespace tandem::rewards;

namespace {
const std::optional<std::string> none;
}

TEST_CASE("math answers are extracted from GSM8K lines boxes and the last number", "[unit]") {
  struct Row {
    const char* text;
    std::optional<std::string> gsm8k, boxed, last;
  };
  const Row rows[] = {
      {"Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72", none, "72"},
      {"#### 1,000\n", "1,000", none, "1,000"},
      {"so #### -5 apples", "-5 apples", none, "-5"},
      {"#### \n", none, none, none},
      {"no marker here", none, none, none},
      {"first #### 3\nthen #### 4", "4", none, "4"},
      {"The answer is \\boxed{42}.", none, "42", "42"},
      {"\\boxed{\\frac{1}{2}}", none, "\\frac{1}{2}", "2"},
      {"\\boxed{1} then \\boxed{ 2 }", none, "2", "2"},
      {"\\boxed{a{b{c}}d} 7", none, "a{b{c}}d", "7"},
      {"\\boxed{unclosed {", none, none, none},
      {"\\fbox{9}", none, "9", "9"},
      {"so $\\boxed 12$ it is", none, "12", "12"},
      {"\\boxed", none, none, none},
      {"\\boxedx{3}", none, none, "3"},
      {"\\boxed{\\{x\\}}", none, "\\{x\\}", none},
      {"It costs $18.", none, none, "18"},
      {"between 3 and 4.5 units", none, none, "4.5"},
      {"pi is .5 less", none, none, ".5"},
      {"ratio 3/4 of it", none, none, "3/4"},
      {"a -12 degree day", none, none, "-12"},
      {"rose 50% today", none, none, "50%"},
      {"1,234,567 people", none, none, "1,234,567"},
      {"version 1.2.3", none, none, "1.2"},
      {"−7 with a Unicode minus", none, none, "−7"},
  };
  for (const Row& r : rows) {
    INFO(r.text);
    CHECK(extract_gsm8k_answer(r.text) == r.gsm8k);
    CHECK(extract_boxed(r.text) == r.boxed);
    CHECK(extract_last_number(r.text) == r.last);
  }
}

TEST_CASE("written numbers parse to their values and equivalent answers match", "[unit]") {
  struct Row {
    const char* text;
    std::optional<double> value;
  };
  const Row rows[] = {
      {"1000", 1000},
      {"1,000", 1000},
      {"1000.0", 1000},
      {"1,000.50", 1000.5},
      {" 72 ", 72},
      {"-5", -5},
      {"+5", 5},
      {"−5", -5},
      {"3/4", 0.75},
      {"-3/4", -0.75},
      {"0.75", 0.75},
      {".5", 0.5},
      {"\\frac{3}{4}", 0.75},
      {"\\dfrac{1}{8}", 0.125},
      {"$18", 18},
      {"\\$18.00", 18},
      {"$-2$", -2},
      {"50%", 50},
      {"50\\%", 50},
      {"18.", 18},
      {"1e3", 1000},
      {"\\(12\\)", 12},
      {"1 000", 1000},
      {"12,34", std::nullopt},
      {"1,0000", std::nullopt},
      {"abc", std::nullopt},
      {"", std::nullopt},
      {"3/0", std::nullopt},
      {"5 apples", std::nullopt},
      {"--5", std::nullopt},
      {"1.2.3", std::nullopt},
  };
  for (const Row& r : rows) {
    INFO(r.text);
    const auto v = parse_number(r.text);
    REQUIRE(v.has_value() == r.value.has_value());
    if (v) CHECK(numbers_equal(*v, *r.value));
  }
  CHECK_FALSE(parse_number("50%", NumberFormat{.allow_percent = false}).has_value());

  struct Pair {
    const char* predicted;
    const char* reference;
    bool match;
  };
  const Pair pairs[] = {
      {"1,000", "1000", true},        {"1000.0", "1000", true}, {"3/4", "0.75", true},
      {"0.75", "\\frac{3}{4}", true}, {"-3", "-3.0", true},     {"3", "-3", false},
      {"18 dollars", "18", true},     {"x = 5", "5", true},     {"0.3333", "1/3", false},
      {"1000001", "1000000", false},  {"50%", "50", true},      {"Paris", " paris ", true},
      {"x+1", "x + 1", true},         {"Lyon", "Paris", false}, {"no number", "4", false},
  };
  for (const Pair& p : pairs) {
    INFO(p.predicted << " vs " << p.reference);
    CHECK(answers_match(p.predicted, p.reference) == p.match);
  }
}

TEST_CASE("math answer reward scores GSM8K and boxed answers and flags a missing reference",
          "[unit]") {
  MathAnswerReward reward("math", {});
  const std::vector<RewardSample> samples = {
      {.completion = "48 + 24 = 72\n#### 72", .answer = "blah\n#### 72"},
      {.completion = "so \\boxed{1,000}", .answer = "#### 1000"},
      {.completion = "I think it is 71", .answer = "#### 72"},
      {.completion = "I think it is 72", .answer = "#### 72"},
      {.completion = "\\boxed{3/4}", .answer = "\\boxed{\\frac{3}{4}}"},
      {.completion = "no idea", .answer = "#### 72"},
      {.completion = "72", .answer = ""},
  };
  const auto results = reward.score(samples);
  REQUIRE(results.size() == samples.size());
  const double expected[] = {1, 1, 0, 1, 1, 0};
  for (size_t i = 0; i < 6; ++i) {
    INFO(i);
    CHECK(results[i].ok);
    CHECK(results[i].value == expected[i]);
  }
  CHECK_FALSE(results[6].ok);
  CHECK(results[6].error.find("answer") != std::string::npos);

  MathAnswerReward strict("strict", {.last_number_fallback = false});
  CHECK(strict.score(std::span(samples).subspan(3, 1))[0].value == 0.0);
}
