// Synthetic arithmetic and format-following examples, drawn from a seeded counter-based stream.
#include "trainer/synthetic.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>

#include "core/error.h"

namespace tandem::trainer {

using json = nlohmann::json;

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The draws of one example: a splitmix64 sequence keyed by (seed, task, index), the same on every
// platform (unlike std:: distributions).
class Draw {
 public:
  Draw(uint64_t seed, uint64_t task, int64_t index)
      : state_(splitmix64(splitmix64(seed ^ splitmix64(task)) ^ static_cast<uint64_t>(index))) {}
  uint64_t next() { return state_ = splitmix64(state_); }
  // Uniform in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) {
    const auto n = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(range(0, static_cast<int64_t>(v.size()) - 1))];
  }

 private:
  uint64_t state_;
};

constexpr uint64_t kArithmeticTask = 1;
constexpr uint64_t kFormatTask = 2;

int64_t pow10(int d) {
  int64_t p = 1;
  for (int i = 0; i < d; ++i) p *= 10;
  return p;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) {
    s.replace(at, from.size(), to);
  }
  return s;
}

// Value of operands joined by ops with * before + and -.
int64_t evaluate(const std::vector<int64_t>& operands, const std::vector<char>& ops) {
  int64_t total = 0;
  int64_t term = operands[0];
  char sign = '+';
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i] == '*') {
      term *= operands[i + 1];
    } else {
      total += sign == '+' ? term : -term;
      sign = ops[i];
      term = operands[i + 1];
    }
  }
  return total + (sign == '+' ? term : -term);
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::vector<std::string> split_words(const std::string& s) {
  std::vector<std::string> words;
  std::string w;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!w.empty()) words.push_back(std::move(w));
      w.clear();
    } else {
      w += c;
    }
  }
  if (!w.empty()) words.push_back(std::move(w));
  return words;
}

const std::vector<std::string> kThings = {"colors",  "animals", "fruits", "countries",
                                          "metals",  "planets", "trees",  "musical instruments",
                                          "flowers", "sports"};
const std::vector<std::string> kSubjects = {"the sea",  "a cat",    "the moon", "a forest",
                                            "winter",   "a city",   "bread",    "a river",
                                            "the wind", "a library"};
const std::vector<std::string> kFormatKinds = {"uppercase_words", "answer_tag",
                                               "lowercase_sentence"};

}  // namespace

void check_arithmetic_options(const ArithmeticOptions& opt) {
  TANDEM_CHECK(
      opt.min_operands >= 2 && opt.min_operands <= opt.max_operands && opt.max_operands <= 8,
      "arithmetic: operands must satisfy 2 <= min_operands <= max_operands <= 8, found "
      "min_operands {} max_operands {}",
      opt.min_operands, opt.max_operands);
  TANDEM_CHECK(opt.min_digits >= 1 && opt.min_digits <= opt.max_digits && opt.max_digits <= 9,
               "arithmetic: digits must satisfy 1 <= min_digits <= max_digits <= 9, found "
               "min_digits {} max_digits {}",
               opt.min_digits, opt.max_digits);
  TANDEM_CHECK(
      !opt.operations.empty() && opt.operations.find_first_not_of("+-*") == std::string::npos,
      "arithmetic: operations must be a non-empty string of '+', '-' and '*', found '{}'",
      opt.operations);
  // The largest magnitude: every operand multiplied (< 10^(digits * operands)).
  if (opt.operations.find('*') != std::string::npos) {
    TANDEM_CHECK(opt.max_digits * opt.max_operands <= 18,
                 "arithmetic: max_digits {} x max_operands {} with '*' can overflow 64 bits: keep "
                 "their product <= 18",
                 opt.max_digits, opt.max_operands);
  }
  TANDEM_CHECK(opt.instruction.find("{question}") != std::string::npos,
               "arithmetic: instruction '{}' has no {{question}} placeholder", opt.instruction);
}

Example arithmetic_example(const ArithmeticOptions& opt, uint64_t seed, int64_t index) {
  check_arithmetic_options(opt);
  Draw draw(seed, kArithmeticTask, index);
  std::vector<char> op_set(opt.operations.begin(), opt.operations.end());
  for (int attempt = 0;; ++attempt) {
    const int n = static_cast<int>(draw.range(opt.min_operands, opt.max_operands));
    std::vector<int64_t> operands;
    std::vector<char> ops;
    for (int i = 0; i < n; ++i) {
      const int digits = static_cast<int>(draw.range(opt.min_digits, opt.max_digits));
      operands.push_back(draw.range(digits == 1 ? 0 : pow10(digits - 1), pow10(digits) - 1));
      if (i > 0) ops.push_back(draw.pick(op_set));
    }
    const int64_t value = evaluate(operands, ops);
    // Results below zero are redrawn (from the same sequence, so still deterministic).
    if (!opt.allow_negative && value < 0) {
      if (attempt < 64) continue;
      TANDEM_CHECK(false,
                   "arithmetic: allow_negative = false but operations '{}' keep giving "
                   "negative results",
                   opt.operations);
    }
    std::string expr = std::to_string(operands[0]);
    for (size_t i = 0; i < ops.size(); ++i) {
      expr += fmt::format(" {} {}", ops[i], operands[i + 1]);
    }
    Example ex;
    ex.id = fmt::format("arithmetic-{}", index);
    ex.prompt = replace_all(opt.instruction, "{question}", expr);
    ex.answer = std::to_string(value);
    ex.extra = {{"task", "arithmetic"}, {"expression", expr}};
    return ex;
  }
}

std::vector<Example> make_arithmetic(const ArithmeticOptions& opt, int64_t count, uint64_t seed) {
  check_arithmetic_options(opt);
  TANDEM_CHECK(count >= 0, "make_arithmetic: count must be >= 0, got {}", count);
  std::vector<Example> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.push_back(arithmetic_example(opt, seed, i));
  return out;
}

void check_format_options(const FormatOptions& opt) {
  TANDEM_CHECK(!opt.kinds.empty(), "format: kinds is empty (known: {})",
               fmt::join(kFormatKinds, ", "));
  for (const auto& k : opt.kinds) {
    TANDEM_CHECK(std::find(kFormatKinds.begin(), kFormatKinds.end(), k) != kFormatKinds.end(),
                 "format: unknown kind '{}' (known: {})", k, fmt::join(kFormatKinds, ", "));
  }
  TANDEM_CHECK(opt.min_words >= 1 && opt.min_words <= opt.max_words && opt.max_words <= 10,
               "format: words must satisfy 1 <= min_words <= max_words <= 10, found {} and {}",
               opt.min_words, opt.max_words);
}

Example format_example(const FormatOptions& opt, uint64_t seed, int64_t index) {
  check_format_options(opt);
  Draw draw(seed, kFormatTask, index);
  const std::string& kind = draw.pick(opt.kinds);
  Example ex;
  ex.id = fmt::format("format-{}", index);
  json spec = {{"kind", kind}};
  if (kind == "uppercase_words") {
    const int64_t n = draw.range(opt.min_words, opt.max_words);
    ex.prompt =
        fmt::format("Name {} {}. Answer with exactly {} words in uppercase, and nothing else.", n,
                    draw.pick(kThings), n);
    spec["words"] = n;
    spec["case"] = "upper";
  } else if (kind == "answer_tag") {
    const int64_t a = draw.range(1, 99), b = draw.range(1, 99);
    ex.prompt = fmt::format("What is {} + {}? Wrap your final answer in <answer></answer>.", a, b);
    ex.answer = std::to_string(a + b);
    spec["tag"] = "answer";
  } else {
    ex.prompt =
        fmt::format("Describe {} in one sentence of lowercase letters only, ending with a period.",
                    draw.pick(kSubjects));
    spec["case"] = "lower";
    spec["sentences"] = 1;
  }
  ex.extra = {{"task", "format"}, {"spec", spec}};
  return ex;
}

std::vector<Example> make_format(const FormatOptions& opt, int64_t count, uint64_t seed) {
  check_format_options(opt);
  TANDEM_CHECK(count >= 0, "make_format: count must be >= 0, got {}", count);
  std::vector<Example> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.push_back(format_example(opt, seed, i));
  return out;
}

std::vector<Example> make_synthetic(const SyntheticOptions& opt, uint64_t seed) {
  if (opt.task == "arithmetic") return make_arithmetic(opt.arithmetic, opt.count, seed);
  if (opt.task == "format") return make_format(opt.format, opt.count, seed);
  TANDEM_FAIL("synthetic task '{}' is unknown: expected 'arithmetic' or 'format'", opt.task);
}

bool check_format(const json& spec, const std::string& completion, const std::string& answer) {
  TANDEM_CHECK(spec.is_object() && spec.contains("kind") && spec["kind"].is_string(),
               "check_format: spec {} has no string 'kind'", spec.dump());
  const std::string kind = spec["kind"].get<std::string>();
  const std::string text = trim(completion);
  if (kind == "uppercase_words") {
    const auto words = split_words(text);
    if (static_cast<int64_t>(words.size()) != spec.value("words", int64_t{-1})) return false;
    for (const auto& w : words) {
      bool letter = false;
      for (char c : w) {
        if (std::islower(static_cast<unsigned char>(c))) return false;
        letter |= std::isupper(static_cast<unsigned char>(c)) != 0;
      }
      if (!letter) return false;
    }
    return true;
  }
  if (kind == "answer_tag") {
    const std::string tag = spec.value("tag", std::string("answer"));
    const std::string open = "<" + tag + ">", close = "</" + tag + ">";
    const size_t b = text.find(open);
    if (b == std::string::npos) return false;
    const size_t e = text.find(close, b + open.size());
    if (e == std::string::npos) return false;
    if (text.find(open, e) != std::string::npos) return false;  // exactly one tagged answer
    const std::string inside = trim(text.substr(b + open.size(), e - b - open.size()));
    return answer.empty() ? !inside.empty() : inside == trim(answer);
  }
  if (kind == "lowercase_sentence") {
    if (text.size() < 2 || text.back() != '.') return false;
    bool letter = false;
    for (size_t i = 0; i + 1 < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      if (std::isupper(c) || c == '.' || c == '!' || c == '?' || c == '\n') return false;
      letter |= std::islower(c) != 0;
    }
    return letter;
  }
  TANDEM_FAIL("check_format: unknown kind '{}' in spec {}", kind, spec.dump());
}

}  // namespace tandem::trainer
