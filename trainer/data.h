// Prompt data for GRPO jobs: JSONL datasets with configurable field names, a seeded and stable
// train/eval split, a resumable PromptStream of batches over shuffled epochs, and render_prompt,
// which turns an example into prompt token ids with the model's chat format.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "model/chat_template.h"
#include "model/loader.h"
#include "model/prompt.h"
#include "model/tokenizer.h"

namespace tandem::trainer {

// How to read a dataset (filled by the config layer's [data] section). Field names are top-level
// keys of each JSONL line.
struct DataOptions {
  std::string path;       // JSONL file: one JSON object per line; blank lines are skipped
  std::string eval_path;  // when set, the held-out eval split is this file (eval_fraction unused)
  // The prompt, as text (a string) or as chat messages ([{"role": .., "content": ..}, ...]).
  // The prompt field is used when a line has it, the messages field otherwise; either name may
  // be empty to turn that form off.
  std::string prompt_field = "prompt";
  std::string messages_field = "messages";
  // The reference answer: a string or a number (kept as its JSON text). Empty name: no answer.
  std::string answer_field = "answer";
  bool require_answer = true;  // a line without the answer field is an error
  // An optional example id (string or integer); without one the id is "<file name>:<line>".
  std::string id_field = "id";
  // Fields passed through to rewards in Example::extra, each required on every line. "*" passes
  // every field that is not the prompt, messages, answer or id.
  std::vector<std::string> extra_fields;
  double eval_fraction = 0.05;  // share of examples held out for eval, in [0, 1)
  uint64_t seed = 0;            // split and shuffle seed
  bool shuffle = true;          // PromptStream shuffles each epoch
};

// Members have default initializers so designated initializers may name any subset.
struct Example {
  std::string id = {};
  std::string prompt = {};                          // the prompt text, when given as text
  std::vector<model::ChatMessage> messages = {};    // the prompt, when given as chat messages
  std::string answer = {};                          // reference answer ("" when none)
  nlohmann::json extra = nlohmann::json::object();  // pass-through fields for rewards

  // The prompt as a conversation: `messages`, or one user message holding `prompt`.
  std::vector<model::ChatMessage> conversation() const;
};

bool operator==(const Example& a, const Example& b);

// Every example of one JSONL file, in file order. Any bad line (not JSON, not an object, a
// missing or mistyped field) throws one tandem::Error "<path>:<line>: field '<name>': expected
// ..., found ..."; an unreadable or empty file throws naming the path.
std::vector<Example> read_jsonl(const std::string& path, const DataOptions& opt);

// Writes examples one per line in the form read_jsonl reads with the same options: id, prompt
// (or messages), answer, and each key of `extra` as a top-level field.
void write_jsonl(const std::string& path, std::span<const Example> examples,
                 const DataOptions& opt = {});

// The split key: the example's content (prompt or messages, and answer), so identical examples
// share a split and an example's split does not depend on the other lines or their order.
std::string split_key(const Example& ex);
// Whether an example belongs to the held-out split: a 64-bit hash of split_key mixed with the
// seed, mapped to [0, 1), is below `eval_fraction`. The eval share is eval_fraction on average.
bool in_eval_split(const Example& ex, double eval_fraction, uint64_t seed);

struct Dataset {
  std::vector<Example> train;  // in file order
  std::vector<Example> eval;   // in file order
};
// Splits examples (order kept within each part). Throws when eval_fraction is outside [0, 1).
Dataset split_dataset(std::vector<Example> examples, double eval_fraction, uint64_t seed);
// Reads opt.path, and opt.eval_path when set, else splits opt.path by opt.eval_fraction.
// Throws when the train split ends up empty.
Dataset load_dataset(const DataOptions& opt);

// Batches of B examples over endless epochs. Each epoch visits every example once in an order
// drawn from (seed, epoch) (file order when shuffle is off); a batch that runs past the end of an
// epoch continues with the start of the next one, so every batch has exactly B examples. The
// position (epoch, index into the epoch's order) is the whole state: restore(state()) on a stream
// over the same examples yields the same batches from there on.
class PromptStream {
 public:
  PromptStream(std::vector<Example> examples, uint64_t seed, bool shuffle = true);

  std::vector<Example> next_batch(int64_t B);
  // Like next_batch, but the positions of the examples in the constructor's vector.
  std::vector<int64_t> next_indices(int64_t B);

  int64_t epoch() const { return epoch_; }
  int64_t index() const { return index_; }  // next position in this epoch's order
  int64_t size() const { return static_cast<int64_t>(examples_.size()); }
  const std::vector<Example>& examples() const { return examples_; }
  // The order of this epoch: positions in examples().
  const std::vector<int64_t>& order() const { return order_; }

  // {"epoch", "index", "seed", "shuffle", "size", "fingerprint"}; the fingerprint is a hash of
  // the examples' split keys, so a state is not restored onto different data.
  nlohmann::json state() const;
  // Moves to a saved position. Throws naming the field when the state is malformed or was saved
  // by a stream over other data, seed or shuffle setting.
  void restore(const nlohmann::json& state);

 private:
  void start_epoch(int64_t epoch);

  std::vector<Example> examples_;
  uint64_t seed_;
  bool shuffle_;
  uint64_t fingerprint_;
  int64_t epoch_ = 0;
  int64_t index_ = 0;
  std::vector<int64_t> order_;
};

// How the job turns an example into the model's input, and the prompt it renders
// (model/prompt.h).
using model::prompt_format;
using model::PromptFormat;
using model::RenderedPrompt;

// The prompt of an example (its text or its messages; model::render_prompt says how).
RenderedPrompt render_prompt(const model::Tokenizer& tok, const Example& ex,
                             const PromptFormat& format);

// The token ids of render_prompt under the model's own template (chat) or none.
std::vector<int32_t> render_prompt(const model::Tokenizer& tok, const Example& ex, bool chat,
                                   const std::string& system_prompt = "");

}  // namespace tandem::trainer
