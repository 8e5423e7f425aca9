// Synthetic prompt tasks, so a demo job needs no download: integer arithmetic of configurable
// difficulty, and format following with a checkable spec. Seeded and deterministic: example i of
// a seed is the same whatever the count, so a generator can be streamed or written as JSONL.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "trainer/data.h"

namespace tandem::trainer {

// "37 + 48 * 5": operands drawn with a digit count in [min_digits, max_digits] (no leading
// zeros), operators from `operations` ("+", "-", "*"), evaluated with the usual precedence
// (* before + and -, left to right). The answer is the integer result in decimal.
struct ArithmeticOptions {
  int min_operands = 2;  // 2..8
  int max_operands = 2;
  int min_digits = 1;  // 1..9; the result must fit in 64 bits (checked)
  int max_digits = 2;
  std::string operations = "+-";
  bool allow_negative = true;  // false: redraw expressions whose result is below zero
  // The prompt text; "{question}" is replaced by the expression.
  std::string instruction = "What is {question}? Give the final answer after ####.";
};

// Throws naming the option when an ArithmeticOptions value is out of range.
void check_arithmetic_options(const ArithmeticOptions& opt);

// Example `index` of the stream for `seed`: id "arithmetic-<index>", the prompt text, the answer,
// extra {"task": "arithmetic", "expression": "37 + 48"}.
Example arithmetic_example(const ArithmeticOptions& opt, uint64_t seed, int64_t index);
// Examples 0..count-1 of the stream for `seed`.
std::vector<Example> make_arithmetic(const ArithmeticOptions& opt, int64_t count, uint64_t seed);

// Format following. Each example asks for one of `kinds`:
//  "uppercase_words": "Name <n> <things>. Answer with exactly <n> words in uppercase, and
//     nothing else." spec {"kind", "words": n, "case": "upper"}; answer "".
//  "answer_tag": "What is <a> + <b>? Wrap your final answer in <answer></answer>." spec {"kind",
//     "tag": "answer"}; answer the sum, which check_format looks for between the tags.
//  "lowercase_sentence": "Describe <thing> in one sentence of lowercase letters only, ending with
//     a period." spec {"kind", "case": "lower", "sentences": 1}; answer "".
// The spec is extra["spec"]; extra["task"] = "format".
struct FormatOptions {
  std::vector<std::string> kinds = {"uppercase_words", "answer_tag", "lowercase_sentence"};
  int min_words = 2;  // word counts for uppercase_words, 1..10
  int max_words = 4;
};

void check_format_options(const FormatOptions& opt);
// Example `index` of the stream for `seed` (id "format-<index>").
Example format_example(const FormatOptions& opt, uint64_t seed, int64_t index);
std::vector<Example> make_format(const FormatOptions& opt, int64_t count, uint64_t seed);

// One synthetic task by name, for the config layer: "arithmetic" or "format".
struct SyntheticOptions {
  std::string task = "arithmetic";
  int64_t count = 1000;  // examples generated (then split by split_dataset, say)
  ArithmeticOptions arithmetic;
  FormatOptions format;
};
// Examples 0..count-1 of the task's stream for `seed`. Throws naming the task when unknown.
std::vector<Example> make_synthetic(const SyntheticOptions& opt, uint64_t seed);

// Whether a completion follows a format spec (extra["spec"] of a format example), and for
// "answer_tag" holds `answer` between the tags (whitespace trimmed). Throws on an unknown spec.
bool check_format(const nlohmann::json& spec, const std::string& completion,
                  const std::string& answer = "");

}  // namespace tandem::trainer
