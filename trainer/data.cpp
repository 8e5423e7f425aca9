// JSONL prompt datasets, the seeded train/eval split, PromptStream and render_prompt.
#include "trainer/data.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/loader.h"

namespace tandem::trainer {

using json = nlohmann::json;

namespace {

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform integer in [0, n) from a 64-bit random value (multiply-high; the bias is < n / 2^64).
uint64_t bounded(uint64_t r, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(r) * n) >> 64);
}

std::string type_of(const json& j) { return j.type_name(); }

[[noreturn]] void fail_line(const std::string& path, int64_t line, const std::string& field,
                            const std::string& what) {
  if (field.empty()) throw Error(fmt::format("{}:{}: {}", path, line, what));
  throw Error(fmt::format("{}:{}: field '{}': {}", path, line, field, what));
}

// The text of a string or number field (answers and ids may be either).
std::string scalar_text(const json& v, const std::string& path, int64_t line,
                        const std::string& field) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number()) return v.dump();
  fail_line(path, line, field,
            fmt::format("expected a string or a number, found {} {}", type_of(v), v.dump()));
}

std::vector<model::ChatMessage> parse_messages(const json& v, const std::string& path, int64_t line,
                                               const std::string& field) {
  if (!v.is_array() || v.empty()) {
    fail_line(path, line, field,
              fmt::format("expected a non-empty array of {{\"role\", \"content\"}} objects, found "
                          "{}",
                          v.is_array() ? "an empty array" : type_of(v)));
  }
  std::vector<model::ChatMessage> messages;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& m = v[i];
    const std::string where = fmt::format("{}[{}]", field, i);
    if (!m.is_object()) {
      fail_line(path, line, where, fmt::format("expected an object, found {}", type_of(m)));
    }
    model::ChatMessage msg;
    for (const char* key : {"role", "content"}) {
      auto it = m.find(key);
      if (it == m.end()) fail_line(path, line, where + "." + key, "missing");
      if (!it->is_string()) {
        fail_line(path, line, where + "." + key,
                  fmt::format("expected a string, found {}", type_of(*it)));
      }
      (std::string(key) == "role" ? msg.role : msg.content) = it->get<std::string>();
    }
    messages.push_back(std::move(msg));
  }
  return messages;
}

Example parse_line(const std::string& text, const std::string& path, int64_t line,
                   const DataOptions& opt) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    fail_line(path, line, "", fmt::format("not valid JSON ({})", e.what()));
  }
  if (!j.is_object()) {
    fail_line(path, line, "", fmt::format("expected a JSON object, found {}", type_of(j)));
  }
  Example ex;
  const std::string name = std::filesystem::path(path).filename().string();
  ex.id = fmt::format("{}:{}", name, line);
  if (!opt.id_field.empty()) {
    if (auto it = j.find(opt.id_field); it != j.end()) {
      ex.id = scalar_text(*it, path, line, opt.id_field);
    }
  }
  const auto prompt_it = opt.prompt_field.empty() ? j.end() : j.find(opt.prompt_field);
  const auto messages_it = opt.messages_field.empty() ? j.end() : j.find(opt.messages_field);
  if (prompt_it != j.end()) {
    if (!prompt_it->is_string()) {
      fail_line(path, line, opt.prompt_field,
                fmt::format("expected the prompt text (a string), found {}", type_of(*prompt_it)));
    }
    ex.prompt = prompt_it->get<std::string>();
  } else if (messages_it != j.end()) {
    ex.messages = parse_messages(*messages_it, path, line, opt.messages_field);
  } else {
    std::vector<std::string> names;
    if (!opt.prompt_field.empty()) names.push_back(fmt::format("'{}'", opt.prompt_field));
    if (!opt.messages_field.empty()) names.push_back(fmt::format("'{}'", opt.messages_field));
    fail_line(path, line,
              names.empty()              ? ""
              : opt.prompt_field.empty() ? opt.messages_field
                                         : opt.prompt_field,
              names.empty() ? "no prompt field configured (set data.prompt_field or "
                              "data.messages_field)"
                            : fmt::format("missing: the line has no prompt (expected field {})",
                                          fmt::join(names, " or ")));
  }
  if (!opt.answer_field.empty()) {
    if (auto it = j.find(opt.answer_field); it != j.end()) {
      ex.answer = scalar_text(*it, path, line, opt.answer_field);
    } else if (opt.require_answer) {
      fail_line(path, line, opt.answer_field,
                "missing (set data.answer_field, or data.require_answer = false)");
    }
  }
  for (const std::string& field : opt.extra_fields) {
    if (field == "*") {
      for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string& k = it.key();
        if (k == opt.prompt_field || k == opt.messages_field || k == opt.answer_field ||
            k == opt.id_field) {
          continue;
        }
        ex.extra[k] = it.value();
      }
      continue;
    }
    auto it = j.find(field);
    if (it == j.end()) fail_line(path, line, field, "missing (listed in data.extra_fields)");
    ex.extra[field] = *it;
  }
  return ex;
}

void check_fraction(double eval_fraction) {
  TANDEM_CHECK(std::isfinite(eval_fraction) && eval_fraction >= 0 && eval_fraction < 1,
               "data.eval_fraction: expected a number in [0, 1), found {}", eval_fraction);
}

uint64_t fingerprint(const std::vector<Example>& examples) {
  uint64_t h = splitmix64(examples.size());
  for (const Example& ex : examples) h = splitmix64(h ^ fnv1a64(split_key(ex)));
  return h;
}

}  // namespace

std::vector<model::ChatMessage> Example::conversation() const {
  if (!messages.empty()) return messages;
  return {model::ChatMessage{"user", prompt}};
}

bool operator==(const Example& a, const Example& b) {
  auto same = [](const std::vector<model::ChatMessage>& x,
                 const std::vector<model::ChatMessage>& y) {
    return std::equal(x.begin(), x.end(), y.begin(), y.end(), [](const auto& p, const auto& q) {
      return p.role == q.role && p.content == q.content;
    });
  };
  return a.id == b.id && a.prompt == b.prompt && same(a.messages, b.messages) &&
         a.answer == b.answer && a.extra == b.extra;
}

std::vector<Example> read_jsonl(const std::string& path, const DataOptions& opt) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(fmt::format("dataset '{}' cannot be opened ({}): set data.path to a JSONL file",
                            path, std::filesystem::exists(path) ? "not readable" : "no such file"));
  }
  std::vector<Example> examples;
  std::string text;
  int64_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    examples.push_back(parse_line(text, path, line, opt));
  }
  if (in.bad()) throw Error(fmt::format("dataset '{}': read error after line {}", path, line));
  if (examples.empty()) throw Error(fmt::format("dataset '{}' holds no examples", path));
  return examples;
}

void write_jsonl(const std::string& path, std::span<const Example> examples,
                 const DataOptions& opt) {
  std::string out;
  for (const Example& ex : examples) {
    json j = json::object();
    if (!opt.id_field.empty()) j[opt.id_field] = ex.id;
    if (ex.messages.empty()) {
      TANDEM_CHECK(!opt.prompt_field.empty(),
                   "write_jsonl '{}': example {} has a text prompt but "
                   "prompt_field is empty",
                   path, ex.id);
      j[opt.prompt_field] = ex.prompt;
    } else {
      TANDEM_CHECK(!opt.messages_field.empty(),
                   "write_jsonl '{}': example {} has chat messages "
                   "but messages_field is empty",
                   path, ex.id);
      json messages = json::array();
      for (const auto& m : ex.messages)
        messages.push_back({{"role", m.role}, {"content", m.content}});
      j[opt.messages_field] = std::move(messages);
    }
    if (!opt.answer_field.empty()) j[opt.answer_field] = ex.answer;
    for (auto it = ex.extra.begin(); it != ex.extra.end(); ++it) {
      TANDEM_CHECK(!j.contains(it.key()),
                   "write_jsonl '{}': example {}: extra field '{}' clashes with the id, prompt or "
                   "answer field",
                   path, ex.id, it.key());
      j[it.key()] = it.value();
    }
    out += j.dump();
    out += '\n';
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  TANDEM_CHECK(f.good(), "write_jsonl: cannot create '{}'", path);
  f << out;
  f.flush();
  TANDEM_CHECK(f.good(), "write_jsonl: write to '{}' failed", path);
}

std::string split_key(const Example& ex) {
  std::string key = ex.prompt;
  for (const auto& m : ex.messages) {
    key += '\x1e';
    key += m.role;
    key += '\x1f';
    key += m.content;
  }
  key += '\x1d';
  key += ex.answer;
  return key;
}

bool in_eval_split(const Example& ex, double eval_fraction, uint64_t seed) {
  const uint64_t h = splitmix64(fnv1a64(split_key(ex)) ^ splitmix64(seed));
  return static_cast<double>(h >> 11) * 0x1.0p-53 < eval_fraction;
}

Dataset split_dataset(std::vector<Example> examples, double eval_fraction, uint64_t seed) {
  check_fraction(eval_fraction);
  Dataset d;
  for (Example& ex : examples) {
    (in_eval_split(ex, eval_fraction, seed) ? d.eval : d.train).push_back(std::move(ex));
  }
  return d;
}

Dataset load_dataset(const DataOptions& opt) {
  TANDEM_CHECK(!opt.path.empty(), "data.path is not set: give a JSONL dataset");
  Dataset d;
  if (!opt.eval_path.empty()) {
    d.train = read_jsonl(opt.path, opt);
    d.eval = read_jsonl(opt.eval_path, opt);
  } else {
    d = split_dataset(read_jsonl(opt.path, opt), opt.eval_fraction, opt.seed);
  }
  TANDEM_CHECK(!d.train.empty(),
               "dataset '{}': every example fell into the eval split (eval_fraction {}): lower "
               "data.eval_fraction or add examples",
               opt.path, opt.eval_fraction);
  return d;
}

PromptStream::PromptStream(std::vector<Example> examples, uint64_t seed, bool shuffle)
    : examples_(std::move(examples)), seed_(seed), shuffle_(shuffle) {
  TANDEM_CHECK(!examples_.empty(), "PromptStream: no examples to stream");
  fingerprint_ = fingerprint(examples_);
  start_epoch(0);
}

void PromptStream::start_epoch(int64_t epoch) {
  epoch_ = epoch;
  index_ = 0;
  order_.resize(examples_.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int64_t>(i);
  if (!shuffle_) return;
  // Fisher-Yates with a splitmix64 sequence keyed by (seed, epoch): the same on every platform.
  uint64_t state = splitmix64(splitmix64(seed_) ^ static_cast<uint64_t>(epoch));
  for (size_t i = order_.size(); i > 1; --i) {
    state = splitmix64(state);
    std::swap(order_[i - 1], order_[bounded(state, i)]);
  }
}

std::vector<int64_t> PromptStream::next_indices(int64_t B) {
  TANDEM_CHECK(B > 0, "PromptStream: batch size must be positive, got {}", B);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(B));
  while (static_cast<int64_t>(out.size()) < B) {
    if (index_ == size()) start_epoch(epoch_ + 1);
    out.push_back(order_[static_cast<size_t>(index_++)]);
  }
  return out;
}

std::vector<Example> PromptStream::next_batch(int64_t B) {
  std::vector<Example> out;
  for (int64_t i : next_indices(B)) out.push_back(examples_[static_cast<size_t>(i)]);
  return out;
}

json PromptStream::state() const {
  return {{"epoch", epoch_},     {"index", index_}, {"seed", seed_},
          {"shuffle", shuffle_}, {"size", size()},  {"fingerprint", fingerprint_}};
}

void PromptStream::restore(const json& s) {
  TANDEM_CHECK(s.is_object(), "PromptStream state: expected a JSON object, found {}",
               s.type_name());
  auto field = [&](const char* name) -> const json& {
    auto it = s.find(name);
    TANDEM_CHECK(it != s.end(), "PromptStream state: field '{}' missing", name);
    return *it;
  };
  auto integer = [&](const char* name) {
    const json& v = field(name);
    TANDEM_CHECK(v.is_number_integer(),
                 "PromptStream state: field '{}': expected an integer, "
                 "found {}",
                 name, v.dump());
    return v;
  };
  const uint64_t seed = integer("seed").get<uint64_t>();
  TANDEM_CHECK(seed == seed_, "PromptStream state: field 'seed': saved {}, this stream has {}",
               seed, seed_);
  const json& shuffle = field("shuffle");
  TANDEM_CHECK(shuffle.is_boolean() && shuffle.get<bool>() == shuffle_,
               "PromptStream state: field 'shuffle': saved {}, this stream has {}", shuffle.dump(),
               shuffle_);
  const int64_t n = integer("size").get<int64_t>();
  TANDEM_CHECK(n == size(),
               "PromptStream state: field 'size': saved over {} examples, this stream has {} "
               "(the dataset changed?)",
               n, size());
  const uint64_t fp = integer("fingerprint").get<uint64_t>();
  TANDEM_CHECK(fp == fingerprint_,
               "PromptStream state: field 'fingerprint': the examples differ from the ones the "
               "state was saved with (the dataset or its split changed)");
  const int64_t epoch = integer("epoch").get<int64_t>();
  const int64_t index = integer("index").get<int64_t>();
  TANDEM_CHECK(epoch >= 0, "PromptStream state: field 'epoch': expected >= 0, found {}", epoch);
  TANDEM_CHECK(index >= 0 && index <= size(),
               "PromptStream state: field 'index': expected 0..{}, found {}", size(), index);
  start_epoch(epoch);
  index_ = index;
}

RenderedPrompt render_prompt(const model::Tokenizer& tok, const Example& ex,
                             const PromptFormat& format) {
  return model::render_prompt(tok, ex.prompt, ex.messages, format);
}

std::vector<int32_t> render_prompt(const model::Tokenizer& tok, const Example& ex, bool chat,
                                   const std::string& system_prompt) {
  return render_prompt(tok, ex, prompt_format(tok, chat ? "auto" : "none", system_prompt)).tokens;
}

}  // namespace tandem::trainer
