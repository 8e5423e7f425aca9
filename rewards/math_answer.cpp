// Extraction and numeric equivalence of math answers.
#include "rewards/math_answer.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>

#include "rewards/regex.h"

namespace tandem::rewards {
namespace {

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size()))
    s.replace(pos, from.size(), to);
}

bool strip_wrapper(std::string& s, std::string_view open, std::string_view close) {
  if (s.size() >= open.size() + close.size() && s.starts_with(open) && s.ends_with(close)) {
    s = s.substr(open.size(), s.size() - open.size() - close.size());
    return true;
  }
  return false;
}

// A plain decimal: [digits][.digits] with at least one digit, or an exponent form; all of s.
std::optional<double> parse_decimal(std::string_view s) {
  if (s.empty()) return std::nullopt;
  const bool has_digit = std::any_of(
      s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  if (!has_digit) return std::nullopt;
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// "1,234,567.5" -> "1234567.5"; commas only as thousands separators; nullopt otherwise.
std::optional<std::string> drop_thousands(std::string_view s) {
  if (s.find(',') == std::string_view::npos) return std::string(s);
  const size_t dot = std::min(s.find('.'), s.size());
  const std::string_view whole = s.substr(0, dot);
  std::string out;
  size_t group = 0;
  bool first = true;
  for (char c : whole) {
    if (c == ',') {
      if ((first && (group == 0 || group > 3)) || (!first && group != 3)) return std::nullopt;
      first = false;
      group = 0;
      continue;
    }
    out.push_back(c);
    ++group;
  }
  if (!first && group != 3) return std::nullopt;
  out.append(s.substr(dot));
  return out;
}

std::optional<double> parse_unsigned(std::string_view s) {
  if (s.empty() || s.front() == '-' || s.front() == '+') return std::nullopt;
  const auto plain = drop_thousands(s);
  if (!plain) return std::nullopt;
  return parse_decimal(*plain);
}

const Regex& number_regex() {
  static const Regex regex(
      R"((?<![\d.])[-−]?(?=\.?\d)(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:(?<=\d)/\d+)?%?)", {},
      "the number extractor");
  return regex;
}

}  // namespace

std::optional<std::string> extract_gsm8k_answer(std::string_view text) {
  const size_t pos = text.rfind("####");
  if (pos == std::string_view::npos) return std::nullopt;
  std::string_view rest = text.substr(pos + 4);
  rest = rest.substr(0, std::min(rest.find('\n'), rest.size()));
  rest = trim(rest);
  if (rest.empty()) return std::nullopt;
  return std::string(rest);
}

std::optional<std::string> extract_boxed(std::string_view text) {
  size_t best = std::string_view::npos;
  size_t after = 0;  // just past the command's name
  for (std::string_view command : {std::string_view("\\boxed"), std::string_view("\\fbox")}) {
    const size_t pos = text.rfind(command);
    if (pos != std::string_view::npos && (best == std::string_view::npos || pos > best)) {
      best = pos;
      after = pos + command.size();
    }
  }
  if (best == std::string_view::npos || after >= text.size()) return std::nullopt;
  if (text[after] == ' ') {  // "\boxed 5": the next word, up to a space or a "$"
    std::string_view rest = text.substr(after);
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
    const size_t stop = std::min(rest.find_first_of(" \t\n$"), rest.size());
    if (stop == 0) return std::nullopt;
    return std::string(rest.substr(0, stop));
  }
  if (text[after] != '{') return std::nullopt;
  const size_t open = after + 1;
  int depth = 1;
  for (size_t i = open; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size()) {  // \{ and \} are literal braces
      ++i;
      continue;
    }
    if (text[i] == '{') ++depth;
    if (text[i] == '}' && --depth == 0) return std::string(trim(text.substr(open, i - open)));
  }
  return std::nullopt;
}

std::optional<std::string> extract_last_number(std::string_view text) {
  const auto matches = number_regex().find_all(text);
  if (matches.empty()) return std::nullopt;
  const RegexMatch& m = matches.back();
  return std::string(text.substr(m.begin, m.end - m.begin));
}

std::optional<double> parse_number(std::string_view text, const NumberFormat& format) {
  std::string s(trim(text));
  // Delimiters and decorations around the number: $...$, \(...\), \[...\], \$, \%, \!, \, and
  // spaces, a trailing full stop, the Unicode minus sign.
  if (!strip_wrapper(s, "\\(", "\\)")) strip_wrapper(s, "\\[", "\\]");
  replace_all(s, "\\$", "");
  replace_all(s, "$", "");
  replace_all(s, "\\%", "%");
  replace_all(s, "\\!", "");
  replace_all(s, "\\,", "");
  replace_all(s, "−", "-");
  replace_all(s, "\\dfrac", "\\frac");
  replace_all(s, "\\tfrac", "\\frac");
  std::erase_if(s, [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
  if (s.ends_with('.')) s.pop_back();
  if (format.allow_percent && s.ends_with('%')) s.pop_back();
  if (s.empty()) return std::nullopt;
  double sign = 1.0;
  if (s.front() == '-' || s.front() == '+') {
    sign = s.front() == '-' ? -1.0 : 1.0;
    s.erase(0, 1);
  }
  if (s.starts_with("\\frac{") && s.ends_with('}')) {
    const size_t mid = s.find("}{");
    if (mid == std::string::npos) return std::nullopt;
    const auto num = parse_number(s.substr(6, mid - 6), format);
    const auto den = parse_number(s.substr(mid + 2, s.size() - mid - 3), format);
    if (!num || !den || *den == 0.0) return std::nullopt;
    return sign * *num / *den;
  }
  const size_t slash = s.find('/');
  if (slash != std::string::npos) {
    const auto num = parse_unsigned(std::string_view(s).substr(0, slash));
    const auto den = parse_unsigned(std::string_view(s).substr(slash + 1));
    if (!num || !den || *den == 0.0) return std::nullopt;
    return sign * *num / *den;
  }
  const auto v = parse_unsigned(s);
  if (!v || !std::isfinite(*v)) return std::nullopt;
  return sign * *v;
}

bool numbers_equal(double a, double b) {
  return std::fabs(a - b) <= 1e-9 * std::max({1.0, std::fabs(a), std::fabs(b)});
}

bool answers_match(std::string_view predicted, std::string_view reference,
                   const NumberFormat& format) {
  const auto as_number = [&](std::string_view s) -> std::optional<double> {
    if (auto v = parse_number(s, format)) return v;
    if (auto last = extract_last_number(s)) return parse_number(*last, format);
    return std::nullopt;
  };
  const auto ref = parse_number(reference, format);
  if (ref) {
    const auto pred = as_number(predicted);
    return pred && numbers_equal(*pred, *ref);
  }
  const auto normalise = [](std::string_view s) {
    std::string out;
    for (char c : s)
      if (!std::isspace(static_cast<unsigned char>(c)) && c != '$')
        out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    return out;
  };
  return normalise(predicted) == normalise(reference);
}

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace tandem::rewards
