// One name table per enum of a setting: the names its values have in configs, flags, logs and
// docs, written once beside the enum, and the lookups both ways.
//
//   enum class Kind { a, b };
//   inline constexpr NamedValue<Kind> kKindNames[] = {{Kind::a, "a"}, {Kind::b, "b"}};
//   name_of(kKindNames, Kind::b) == "b";  value_of(kKindNames, "a") == Kind::a
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

template <class E>
struct NamedValue {
  E value;
  std::string_view name;
};

// The name of e ("?" for a value the table lacks).
template <class E, size_t N>
constexpr std::string_view name_of(const NamedValue<E> (&table)[N], E e) {
  for (const NamedValue<E>& v : table)
    if (v.value == e) return v.name;
  return "?";
}

// The value named `name`, if any.
template <class E, size_t N>
constexpr std::optional<E> value_of(const NamedValue<E> (&table)[N], std::string_view name) {
  for (const NamedValue<E>& v : table)
    if (v.name == name) return v.value;
  return std::nullopt;
}

// Every name, in the table's order.
template <class E, size_t N>
std::vector<std::string> names_of(const NamedValue<E> (&table)[N]) {
  std::vector<std::string> out;
  for (const NamedValue<E>& v : table) out.emplace_back(v.name);
  return out;
}

// The names for a message: "a, b or c".
template <class E, size_t N>
std::string names_list(const NamedValue<E> (&table)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? " or " : ", ";
    out += table[i].name;
  }
  return out;
}

}  // namespace tandem
