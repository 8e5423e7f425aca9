// Schema-driven TOML configs: a schema of typed, documented keys with defaults and ranges; loading
// a file (toml++) plus dotted command-line overrides, validated as a whole before any work, with
// every error naming file:line:column or the override; the resolved config printed back as TOML;
// the schema printed as a Markdown reference.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tandem::config {

enum class Type {
  kBool,
  kInt,
  kFloat,       // a TOML integer is accepted too
  kString,      // an override that is not a TOML value is taken as a bare string
  kStringList,  // an array of strings
  kTableArray,  // [[key]] entries, each checked against the field's item schema
};
std::string_view type_name(Type t);

class Config;
class Schema;

// A resolved scalar (or string list) value. Table arrays are held as std::vector<Config>.
using Value = std::variant<bool, int64_t, double, std::string, std::vector<std::string>>;

struct Field {
  std::string key;  // dotted path: "trainer.optimizer.beta1"
  Type type = Type::kString;
  Value default_value;
  std::string doc;
  std::optional<double> min, max;       // inclusive bounds of kInt and kFloat
  bool min_exclusive = false;           // value > min instead of >= min
  std::vector<std::string> choices;     // a kString must be one of these when not empty
  bool required = false;                // no default: the file or an override must set it
  std::shared_ptr<const Schema> items;  // kTableArray: the schema of each entry

  Field& range(std::optional<double> lo, std::optional<double> hi) {
    min = lo;
    max = hi;
    return *this;
  }
  Field& above(double lo) {  // value > lo
    min = lo;
    min_exclusive = true;
    return *this;
  }
  Field& one_of(std::vector<std::string> names) {
    choices = std::move(names);
    return *this;
  }
  Field& must_set() {
    required = true;
    return *this;
  }
};

Field boolean(std::string key, bool def, std::string doc);
Field integer(std::string key, int64_t def, std::string doc);
Field real(std::string key, double def, std::string doc);
Field text(std::string key, std::string def, std::string doc);
Field text_list(std::string key, std::vector<std::string> def, std::string doc);
Field table_array(std::string key, std::shared_ptr<const Schema> items, std::string doc);

class Schema {
 public:
  // Adds a field; throws tandem::Error on a duplicate key or a default that breaks its own rules.
  Field& add(Field field);
  // A section ("trainer.optimizer") with its documentation, for print_toml and markdown.
  void describe(std::string section, std::string doc);
  const Field* find(std::string_view key) const;
  const std::vector<Field>& fields() const { return fields_; }
  const std::vector<std::pair<std::string, std::string>>& sections() const { return sections_; }

 private:
  std::vector<Field> fields_;
  std::vector<std::pair<std::string, std::string>> sections_;
};

// Where a value came from: "job.toml:12:7", "override 'rollout.n=8'" or "default".
struct Origin {
  std::string text = "default";
  bool explicit_value = false;
};

// Every key of a schema with its value (defaults filled in) and its origin.
class Config {
 public:
  bool get_bool(std::string_view key) const;
  int64_t get_int(std::string_view key) const;
  double get_float(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const std::vector<std::string>& get_strings(std::string_view key) const;
  const std::vector<Config>& get_tables(std::string_view key) const;
  // Whether the file or an override set this key.
  bool is_set(std::string_view key) const;
  // "job.toml:12:7" (the value), the override, or "<file>: default" for an unset key.
  std::string where(std::string_view key) const;
  // A tandem::Error "<where(key)>: <key>: <message>", for the cross-field checks of a caller.
  [[noreturn]] void fail(std::string_view key, std::string_view message) const;
  const Schema& schema() const { return *schema_; }
  const std::string& source() const { return source_; }

  // Replaces a value (type-checked against the schema; the origin becomes "set in code").
  void set(std::string_view key, Value value);
  void set_tables(std::string_view key, std::vector<Config> tables);
  // A config of this schema holding only defaults (required keys hold empty values).
  static Config defaults(std::shared_ptr<const Schema> schema, std::string source = "<defaults>");

 private:
  friend class Loader;
  const Value& value(std::string_view key, Type expected) const;

  std::shared_ptr<const Schema> schema_;
  std::string source_;
  std::map<std::string, Value, std::less<>> values_;
  std::map<std::string, std::vector<Config>, std::less<>> tables_;
  std::map<std::string, Origin, std::less<>> origins_;
};

// Parses `text` (named `source` in messages), applies the overrides ("key.sub=value", the value a
// TOML value, or a bare string for a string key) and validates everything: syntax, unknown keys
// (with the closest known key), types, ranges, choices, required keys. All problems are reported
// together, one per line, in one tandem::Error; nothing is returned then.
Config parse(std::shared_ptr<const Schema> schema, std::string_view text, std::string source,
             std::span<const std::string> overrides = {});
// The same for a file (an unreadable file is an error naming it).
Config load(std::shared_ptr<const Schema> schema, const std::string& path,
            std::span<const std::string> overrides = {});

// The resolved config as TOML, every key written (defaults included), sections in schema order
// with their documentation as comments; parse(print_toml(c)) gives c back.
std::string print_toml(const Config& config);
// The schema as a Markdown reference: one table per section, key, type, default, meaning.
std::string markdown(const Schema& schema);

// A value written as TOML ("1e-06", "\"x\"", "[\"a\", \"b\"]", "true").
std::string to_toml_value(const Value& v);

}  // namespace tandem::config
