// Schema-driven TOML configs on toml++: parsing, overrides, validation with source positions,
// printing back as TOML and the Markdown reference (see config.h).
#include "core/config.h"

#include <fmt/format.h>

#include <toml++/toml.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"

namespace tandem::config {

std::string_view type_name(Type t) {
  switch (t) {
    case Type::kBool:
      return "boolean";
    case Type::kInt:
      return "integer";
    case Type::kFloat:
      return "float";
    case Type::kString:
      return "string";
    case Type::kStringList:
      return "array of strings";
    case Type::kTableArray:
      return "array of tables";
  }
  return "?";
}

namespace {

bool value_has_type(const Value& v, Type t) {
  switch (t) {
    case Type::kBool:
      return std::holds_alternative<bool>(v);
    case Type::kInt:
      return std::holds_alternative<int64_t>(v);
    case Type::kFloat:
      return std::holds_alternative<double>(v);
    case Type::kString:
      return std::holds_alternative<std::string>(v);
    case Type::kStringList:
      return std::holds_alternative<std::vector<std::string>>(v);
    case Type::kTableArray:
      return false;
  }
  return false;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          out += fmt::format("\\u{:04X}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string format_bound(double x, Type t) {
  if (t == Type::kInt) return fmt::format("{}", static_cast<int64_t>(x));
  return fmt::format("{}", x);
}

// ">= 1", "> 0 and <= 1"
std::string range_text(const Field& f) {
  std::string s;
  if (f.min) s += fmt::format("{} {}", f.min_exclusive ? ">" : ">=", format_bound(*f.min, f.type));
  if (f.max) s += fmt::format("{}<= {}", f.min ? " and " : "", format_bound(*f.max, f.type));
  return s;
}

// "an integer >= 1", "a number > 0 and <= 1"
std::string expected_text(const Field& f) {
  return fmt::format("{} {}", f.type == Type::kInt ? "an integer" : "a number", range_text(f));
}

std::string choices_text(const std::vector<std::string>& choices) {
  std::string s;
  for (size_t i = 0; i < choices.size(); ++i) s += (i ? ", " : "") + quote(choices[i]);
  return s;
}

// Checks a value against the field's range and choices; returns the problem or "".
std::string check_rules(const Field& f, const Value& v) {
  if (f.type == Type::kInt || f.type == Type::kFloat) {
    double x =
        f.type == Type::kInt ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
    if (!std::isfinite(x))
      return fmt::format("expected a finite number, found {}", to_toml_value(v));
    bool low = f.min && (f.min_exclusive ? !(x > *f.min) : !(x >= *f.min));
    bool high = f.max && !(x <= *f.max);
    if (low || high)
      return fmt::format("expected {}, found {}", expected_text(f), to_toml_value(v));
  }
  if (f.type == Type::kString && !f.choices.empty()) {
    const auto& s = std::get<std::string>(v);
    if (std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end())
      return fmt::format("expected one of {}, found {}", choices_text(f.choices), quote(s));
  }
  return "";
}

std::string describe_node(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "the string " + quote(*n.value<std::string>());
    case toml::node_type::integer:
      return fmt::format("the integer {}", *n.value<int64_t>());
    case toml::node_type::floating_point:
      return fmt::format("the float {}", *n.value<double>());
    case toml::node_type::boolean:
      return fmt::format("the boolean {}", *n.value<bool>());
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    default:
      return "nothing";
  }
}

// The node as a value of the field's type, or the reason it is not one.
std::variant<Value, std::string> convert(const toml::node& n, const Field& f) {
  auto wrong = [&] {
    return fmt::format("expected {}, found {}", f.type == Type::kFloat ? "a number" : [&] {
      auto name = type_name(f.type);
      std::string article = (name[0] == 'a' || name[0] == 'i') ? "an " : "a ";
      return article + std::string(name);
    }(), describe_node(n));
  };
  switch (f.type) {
    case Type::kBool:
      if (auto b = n.value_exact<bool>()) return Value{*b};
      return wrong();
    case Type::kInt:
      if (auto i = n.value_exact<int64_t>()) return Value{*i};
      return wrong();
    case Type::kFloat:
      if (n.is_integer()) return Value{static_cast<double>(*n.value_exact<int64_t>())};
      if (auto d = n.value_exact<double>()) return Value{*d};
      return wrong();
    case Type::kString:
      if (auto s = n.value_exact<std::string>()) return Value{*s};
      return wrong();
    case Type::kStringList: {
      const auto* arr = n.as_array();
      if (!arr) return wrong();
      std::vector<std::string> out;
      for (size_t i = 0; i < arr->size(); ++i) {
        auto s = (*arr)[i].value_exact<std::string>();
        if (!s)
          return fmt::format("expected an array of strings, found {} at index {}",
                             describe_node((*arr)[i]), i);
        out.push_back(*s);
      }
      return Value{std::move(out)};
    }
    case Type::kTableArray:
      return wrong();
  }
  return wrong();
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string suggestion(const Schema& schema, std::string_view key) {
  std::string best;
  size_t best_d = std::max<size_t>(2, key.size() / 3) + 1;
  auto last = [](std::string_view k) {
    auto p = k.rfind('.');
    return p == std::string_view::npos ? k : k.substr(p + 1);
  };
  for (const auto& f : schema.fields()) {
    size_t d = std::min(edit_distance(key, f.key), edit_distance(last(key), last(f.key)) + 1);
    if (d < best_d) best_d = d, best = f.key;
  }
  return best.empty() ? "" : fmt::format(" (did you mean '{}'?)", best);
}

bool is_section(const Schema& schema, std::string_view prefix) {
  std::string p = std::string(prefix) + ".";
  for (const auto& f : schema.fields())
    if (f.key.starts_with(p)) return true;
  return false;
}

std::string position(const std::string& source, const toml::source_region& r) {
  return fmt::format("{}:{}:{}", source, r.begin.line, r.begin.column);
}

std::string section_of(const std::string& key) {
  auto p = key.rfind('.');
  return p == std::string::npos ? "" : key.substr(0, p);
}

void check_default(const Field& f) {
  if (f.type == Type::kTableArray) {
    TANDEM_CHECK(f.items != nullptr, "config field '{}': a table array needs an item schema",
                 f.key);
    return;
  }
  TANDEM_CHECK(value_has_type(f.default_value, f.type), "config field '{}': default is not a {}",
               f.key, type_name(f.type));
  if (!f.required) {
    auto problem = check_rules(f, f.default_value);
    TANDEM_CHECK(problem.empty(), "config field '{}': default breaks its rules: {}", f.key,
                 problem);
  }
}

}  // namespace

std::string to_toml_value(const Value& v) {
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto* i = std::get_if<int64_t>(&v)) return fmt::format("{}", *i);
  if (auto* d = std::get_if<double>(&v)) {
    if (std::isnan(*d)) return "nan";
    if (std::isinf(*d)) return *d > 0 ? "inf" : "-inf";
    std::string s = fmt::format("{}", *d);
    if (s.find_first_of(".e") == std::string::npos) s += ".0";
    return s;
  }
  if (auto* s = std::get_if<std::string>(&v)) return quote(*s);
  const auto& list = std::get<std::vector<std::string>>(v);
  std::string out = "[";
  for (size_t i = 0; i < list.size(); ++i) out += (i ? ", " : "") + quote(list[i]);
  return out + "]";
}

// ---- Fields and schema -----------------------------------------------------------------------

namespace {
Field make(std::string key, Type type, Value def, std::string doc) {
  Field f;
  f.key = std::move(key);
  f.type = type;
  f.default_value = std::move(def);
  f.doc = std::move(doc);
  return f;
}
}  // namespace

Field boolean(std::string key, bool def, std::string doc) {
  return make(std::move(key), Type::kBool, def, std::move(doc));
}
Field integer(std::string key, int64_t def, std::string doc) {
  return make(std::move(key), Type::kInt, def, std::move(doc));
}
Field real(std::string key, double def, std::string doc) {
  return make(std::move(key), Type::kFloat, def, std::move(doc));
}
Field text(std::string key, std::string def, std::string doc) {
  return make(std::move(key), Type::kString, std::move(def), std::move(doc));
}
Field text_list(std::string key, std::vector<std::string> def, std::string doc) {
  return make(std::move(key), Type::kStringList, std::move(def), std::move(doc));
}
Field table_array(std::string key, std::shared_ptr<const Schema> items, std::string doc) {
  Field f = make(std::move(key), Type::kTableArray, false, std::move(doc));
  f.items = std::move(items);
  return f;
}

Field& Schema::add(Field field) {
  TANDEM_CHECK(!field.key.empty() && !find(field.key), "config schema: duplicate or empty key '{}'",
               field.key);
  check_default(field);
  fields_.push_back(std::move(field));
  return fields_.back();
}

void Schema::describe(std::string section, std::string doc) {
  sections_.emplace_back(std::move(section), std::move(doc));
}

const Field* Schema::find(std::string_view key) const {
  for (const auto& f : fields_)
    if (f.key == key) return &f;
  return nullptr;
}

// ---- Config ----------------------------------------------------------------------------------

const Value& Config::value(std::string_view key, Type expected) const {
  const Field* f = schema_->find(key);
  TANDEM_CHECK(f && f->type == expected, "config: no {} key '{}' in the schema",
               type_name(expected), key);
  return values_.find(key)->second;
}

bool Config::get_bool(std::string_view key) const {
  return std::get<bool>(value(key, Type::kBool));
}
int64_t Config::get_int(std::string_view key) const {
  return std::get<int64_t>(value(key, Type::kInt));
}
double Config::get_float(std::string_view key) const {
  return std::get<double>(value(key, Type::kFloat));
}
const std::string& Config::get_string(std::string_view key) const {
  return std::get<std::string>(value(key, Type::kString));
}
const std::vector<std::string>& Config::get_strings(std::string_view key) const {
  return std::get<std::vector<std::string>>(value(key, Type::kStringList));
}
const std::vector<Config>& Config::get_tables(std::string_view key) const {
  const Field* f = schema_->find(key);
  TANDEM_CHECK(f && f->type == Type::kTableArray, "config: no table array '{}' in the schema", key);
  return tables_.find(key)->second;
}

bool Config::is_set(std::string_view key) const {
  auto it = origins_.find(key);
  return it != origins_.end() && it->second.explicit_value;
}

std::string Config::where(std::string_view key) const {
  auto it = origins_.find(key);
  if (it == origins_.end() || !it->second.explicit_value) return source_ + " (default)";
  return it->second.text;
}

void Config::fail(std::string_view key, std::string_view message) const {
  throw Error(fmt::format("{}: {}: {}", where(key), key, message));
}

void Config::set(std::string_view key, Value value) {
  const Field* f = schema_->find(key);
  TANDEM_CHECK(f && value_has_type(value, f->type),
               "config: '{}' is not a key of the schema of this value's type", key);
  auto problem = check_rules(*f, value);
  TANDEM_CHECK(problem.empty(), "config: {}: {}", key, problem);
  values_[std::string(key)] = std::move(value);
  origins_[std::string(key)] = Origin{"set in code", true};
}

void Config::set_tables(std::string_view key, std::vector<Config> tables) {
  const Field* f = schema_->find(key);
  TANDEM_CHECK(f && f->type == Type::kTableArray, "config: '{}' is not a table array", key);
  tables_[std::string(key)] = std::move(tables);
  origins_[std::string(key)] = Origin{"set in code", true};
}

Config Config::defaults(std::shared_ptr<const Schema> schema, std::string source) {
  Config c;
  c.source_ = std::move(source);
  for (const auto& f : schema->fields()) {
    if (f.type == Type::kTableArray)
      c.tables_[f.key] = {};
    else
      c.values_[f.key] = f.default_value;
  }
  c.schema_ = std::move(schema);
  return c;
}

// ---- Loading ---------------------------------------------------------------------------------

class Loader {
 public:
  Loader(std::string source) : source_(std::move(source)) {}

  // Fills `out` (a defaults config of `schema`) from `table`; keys are shown as prefix + key.
  void walk(const toml::table& table, const std::string& path, const std::string& shown_prefix,
            Config& out) {
    const Schema& schema = *out.schema_;
    for (const auto& [k, node] : table) {
      std::string key = path.empty() ? std::string(k.str()) : path + "." + std::string(k.str());
      std::string shown = shown_prefix + key;
      std::string at = position(source_, node.source());
      const Field* f = schema.find(key);
      if (!f) {
        if (node.is_table() && is_section(schema, key)) {
          walk(*node.as_table(), key, shown_prefix, out);
        } else {
          errors_.push_back(fmt::format("{}: unknown key '{}'{}", position(source_, k.source()),
                                        shown, suggestion(schema, key)));
        }
        continue;
      }
      if (f->type == Type::kTableArray) {
        const auto* arr = node.as_array();
        if (!arr || !arr->is_array_of_tables()) {
          errors_.push_back(fmt::format("{}: {}: expected an array of tables ([[{}]]), found {}",
                                        at, shown, key, describe_node(node)));
          continue;
        }
        std::vector<Config> items;
        for (size_t i = 0; i < arr->size(); ++i) {
          Config item = Config::defaults(f->items, source_);
          const auto& t = *(*arr)[i].as_table();
          walk(t, "", fmt::format("{}[{}].", shown, i), item);
          check_required(item, fmt::format("{}[{}].", shown, i), position(source_, t.source()));
          items.push_back(std::move(item));
        }
        out.tables_[key] = std::move(items);
        out.origins_[key] = Origin{at, true};
        continue;
      }
      store(*f, node, shown, at, out);
    }
  }

  void store(const Field& f, const toml::node& node, const std::string& shown,
             const std::string& at, Config& out) {
    auto converted = convert(node, f);
    if (auto* why = std::get_if<std::string>(&converted)) {
      errors_.push_back(fmt::format("{}: {}: {}", at, shown, *why));
      return;
    }
    Value v = std::get<Value>(std::move(converted));
    auto problem = check_rules(f, v);
    if (!problem.empty()) {
      errors_.push_back(fmt::format("{}: {}: {}", at, shown, problem));
      return;
    }
    out.values_[f.key] = std::move(v);
    out.origins_[f.key] = Origin{at, true};
  }

  void apply_override(const std::string& text, Config& out) {
    const Schema& schema = *out.schema_;
    std::string at = fmt::format("override '{}'", text);
    auto eq = text.find('=');
    if (eq == std::string::npos || eq == 0) {
      errors_.push_back(fmt::format("{}: expected key.sub=value", at));
      return;
    }
    std::string key = text.substr(0, eq);
    std::string raw = text.substr(eq + 1);
    key.erase(key.find_last_not_of(" \t") + 1);
    const Field* f = schema.find(key);
    if (!f) {
      errors_.push_back(fmt::format("{}: unknown key '{}'{}", at, key, suggestion(schema, key)));
      return;
    }
    if (f->type == Type::kTableArray) {
      errors_.push_back(
          fmt::format("{}: {}: [[{}]] entries can only be set in the file", at, key, key));
      return;
    }
    try {
      toml::table t = toml::parse(std::string_view("v = " + raw), std::string_view("override"));
      if (t.size() == 1 && t.contains("v")) {
        store(*f, *t.get("v"), key, at, out);
        return;
      }
    } catch (const toml::parse_error&) {
    }
    if (f->type == Type::kString) {  // a bare word: model.path=models/x.gguf
      toml::value<std::string> s(raw);
      store(*f, s, key, at, out);
      return;
    }
    errors_.push_back(fmt::format("{}: {}: expected {}, found '{}' which is not a TOML value", at,
                                  key, type_name(f->type), raw));
  }

  void check_required(const Config& c, const std::string& shown_prefix, const std::string& at) {
    for (const auto& f : c.schema_->fields())
      if (f.required && !c.is_set(f.key))
        errors_.push_back(
            fmt::format("{}: {}{}: required but not set ({})", at, shown_prefix, f.key, f.doc));
  }

  void finish() const {
    if (errors_.empty()) return;
    std::string msg;
    for (size_t i = 0; i < errors_.size(); ++i) msg += (i ? "\n" : "") + errors_[i];
    throw Error(msg);
  }

  std::string source_;
  std::vector<std::string> errors_;
};

Config parse(std::shared_ptr<const Schema> schema, std::string_view text, std::string source,
             std::span<const std::string> overrides) {
  Config out = Config::defaults(std::move(schema), source);
  Loader loader(source);
  toml::table table;
  try {
    table = toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw Error(
        fmt::format("{}: TOML syntax error: {}", position(source, e.source()), e.description()));
  }
  loader.walk(table, "", "", out);
  for (const auto& o : overrides) loader.apply_override(o, out);
  loader.check_required(out, "", source);
  loader.finish();
  return out;
}

Config load(std::shared_ptr<const Schema> schema, const std::string& path,
            std::span<const std::string> overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(fmt::format("{}: is a directory: expected a TOML config file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open the config file", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(fmt::format("{}: cannot read the config file", path));
  return parse(std::move(schema), ss.str(), path, overrides);
}

// ---- Printing --------------------------------------------------------------------------------

namespace {

std::string section_doc(const Schema& schema, const std::string& section) {
  for (const auto& [s, doc] : schema.sections())
    if (s == section) return doc;
  return "";
}

Value get_value(const Config& c, const Field& f) {
  switch (f.type) {
    case Type::kBool:
      return c.get_bool(f.key);
    case Type::kInt:
      return c.get_int(f.key);
    case Type::kFloat:
      return c.get_float(f.key);
    case Type::kString:
      return c.get_string(f.key);
    case Type::kStringList:
      return c.get_strings(f.key);
    case Type::kTableArray:
      break;
  }
  return false;
}

std::string key_line(const Config& c, const Field& f, size_t strip) {
  Value v = get_value(c, f);
  std::string line = fmt::format("{} = {}", f.key.substr(strip), to_toml_value(v));
  if (c.is_set(f.key) && !f.required && v != f.default_value)
    line += fmt::format("  # default: {}", to_toml_value(f.default_value));
  return line + "\n";
}

void print_section(const Config& c, const std::string& header, const std::string& section,
                   bool array, std::string& out) {
  const Schema& schema = c.schema();
  if (!header.empty()) {
    out += array ? fmt::format("\n[[{}]]\n", header) : fmt::format("\n[{}]\n", header);
    if (!array) {
      auto doc = section_doc(schema, section);
      if (!doc.empty()) out += "# " + doc + "\n";
    }
  }
  size_t strip = section.empty() ? 0 : section.size() + 1;
  for (const auto& f : schema.fields())
    if (f.type != Type::kTableArray && section_of(f.key) == section) out += key_line(c, f, strip);
}

}  // namespace

std::string print_toml(const Config& c) {
  const Schema& schema = c.schema();
  std::string out = fmt::format("# resolved config ({})\n", c.source());
  // Sections in the order their first key appears; top-level keys first (TOML needs them there).
  std::vector<std::string> order;
  for (const auto& f : schema.fields()) {
    if (f.type == Type::kTableArray) {
      order.push_back("[[" + f.key);
      continue;
    }
    auto s = section_of(f.key);
    if (std::find(order.begin(), order.end(), s) == order.end()) order.push_back(s);
  }
  print_section(c, "", "", false, out);
  for (const auto& s : order) {
    if (s.empty()) continue;
    if (s.starts_with("[[")) {
      std::string key = s.substr(2);
      auto doc = section_doc(schema, key);
      out += doc.empty() ? "" : "\n# " + doc + "\n";
      const auto& items = c.get_tables(key);
      if (items.empty()) out += fmt::format("# (no [[{}]] entries)\n", key);
      for (const auto& item : items) print_section(item, key, "", true, out);
      continue;
    }
    print_section(c, s, s, false, out);
  }
  return out;
}

namespace {

std::string md_escape(std::string s) {
  std::string out;
  for (char ch : s) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

std::string md_meaning(const Field& f) {
  std::string s = md_escape(f.doc);
  if (!f.choices.empty()) {
    s += " One of:";
    for (size_t i = 0; i < f.choices.size(); ++i) s += (i ? ", `" : " `") + f.choices[i] + "`";
    s += ".";
  }
  if (f.min || f.max) s += " Range: " + range_text(f) + ".";
  return s;
}

void md_rows(const Schema& schema, const std::string& prefix, const std::string& section,
             std::string& out) {
  out += "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const auto& f : schema.fields()) {
    if (section_of(f.key) != section) continue;
    std::string def = f.type == Type::kTableArray ? "(none)"
                      : f.required                ? "(required)"
                                                  : to_toml_value(f.default_value);
    out += fmt::format("| `{}{}` | {} | `{}` | {} |\n", prefix, f.key, type_name(f.type),
                       md_escape(def), md_meaning(f));
  }
}

}  // namespace

std::string markdown(const Schema& schema) {
  std::string out;
  std::vector<std::string> order;
  for (const auto& f : schema.fields()) {
    auto s = section_of(f.key);
    if (std::find(order.begin(), order.end(), s) == order.end()) order.push_back(s);
  }
  for (const auto& s : order) {
    out += s.empty() ? "\n## Top level\n\n" : fmt::format("\n## [{}]\n\n", s);
    auto doc = section_doc(schema, s);
    if (!doc.empty()) out += doc + "\n\n";
    md_rows(schema, "", s, out);
    for (const auto& f : schema.fields()) {
      if (f.type != Type::kTableArray || section_of(f.key) != s) continue;
      out += fmt::format("\n### [[{}]] entries\n\n{}\n\n", f.key, f.doc);
      md_rows(*f.items, f.key + "[].", "", out);
    }
  }
  return out;
}

}  // namespace tandem::config
