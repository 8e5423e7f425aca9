// Math answers: extraction (GSM8K "#### n", \boxed{...}, the last number) and equivalence.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace tandem::rewards {

// s without leading and trailing white space.
std::string_view trim(std::string_view s);

// The text after the last "####" up to the end of its line, trimmed; nullopt when there is none
// or it is empty. GSM8K reference answers end with "#### 72".
std::optional<std::string> extract_gsm8k_answer(std::string_view text);

// The contents of the last \boxed{...} (or \fbox{...}), braces matched with nesting:
// "\boxed{\frac{1}{2}}" gives "\frac{1}{2}"; "\boxed 5" gives "5" (the next word). nullopt when
// there is none or it is not closed.
std::optional<std::string> extract_boxed(std::string_view text);

// The last number in the text as written: "-1,234.5", "3/4", "0.75", "12%"; nullopt if none.
std::optional<std::string> extract_last_number(std::string_view text);

struct NumberFormat {
  bool allow_percent = true;  // "50%" reads as 50
};

// The value of a written number: thousands separators ("1,000"), decimals ("1000.0", ".5"),
// signs ("-3", "−3", "+3"), fractions ("3/4", "\frac{3}{4}", "\dfrac34" not), a trailing
// percent sign (when allowed), dollar signs and LaTeX math delimiters around it. nullopt when the
// whole text is not one number.
std::optional<double> parse_number(std::string_view text, const NumberFormat& format = {});

// Whether two numbers are the same answer: equal up to a relative 1e-9 (so 3/4 == 0.75).
bool numbers_equal(double a, double b);

// Whether a predicted answer matches a reference one: numerically when both read as numbers
// (the prediction falling back to its last number: "x = 5", "18 dollars"), otherwise as
// text with spaces, "$" and case ignored.
bool answers_match(std::string_view predicted, std::string_view reference,
                   const NumberFormat& format = {});

}  // namespace tandem::rewards
