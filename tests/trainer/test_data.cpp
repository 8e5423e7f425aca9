// Prompt data: JSONL parsing and its errors, the seeded stable eval split, PromptStream epochs and
// exact resume, synthetic arithmetic and format tasks, and render_prompt with SmolLM2's tokenizer.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "core/error.h"
#include "model/loader.h"
#include "model/tokenizer.h"
#include "tests/testutil.h"
#include "trainer/data.h"
#include "trainer/synthetic.h"

using namespace tandem;
using namespace tandem::trainer;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using tandem::test::TempDir;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// n distinct text-prompt lines.
std::string numbered_lines(int n, int first = 0) {
  std::string s;
  for (int i = first; i < first + n; ++i) {
    s += json{{"prompt", fmt::format("question {}", i)}, {"answer", i}}.dump() + "\n";
  }
  return s;
}

// An evaluator written apart from the generator's: multiplications folded first, then + and -
// left to right, over the space-separated tokens of the expression.
int64_t evaluate_text(const std::string& expr, int* operands) {
  std::istringstream in(expr);
  std::vector<std::string> tokens;
  for (std::string t; in >> t;) tokens.push_back(t);
  REQUIRE(tokens.size() % 2 == 1);
  std::vector<int64_t> terms = {std::stoll(tokens[0])};
  std::vector<char> signs = {'+'};
  for (size_t i = 1; i < tokens.size(); i += 2) {
    REQUIRE(tokens[i].size() == 1);
    const int64_t v = std::stoll(tokens[i + 1]);
    if (tokens[i] == "*") {
      terms.back() *= v;
    } else {
      REQUIRE((tokens[i] == "+" || tokens[i] == "-"));
      terms.push_back(v);
      signs.push_back(tokens[i][0]);
    }
  }
  *operands = static_cast<int>(tokens.size() / 2 + 1);
  int64_t total = 0;
  for (size_t i = 0; i < terms.size(); ++i) total += signs[i] == '+' ? terms[i] : -terms[i];
  return total;
}

fs::path smollm2_dir() { return fs::path(TANDEM_SOURCE_DIR) / "tests/golden/smollm2"; }

}  // namespace

TEST_CASE("jsonl datasets read text prompts chat messages answers and extra fields", "[unit]") {
  TempDir dir("parse");
  const std::string path = dir.write(
      "d.jsonl",
      R"({"id": "a1", "prompt": "What is 2 + 2?", "answer": 4, "level": 1, "tags": ["x"]})"
      "\n\n"
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "answer": "hello", "level": 2, "tags": []})"
      "\r\n"
      R"({"id": 7, "prompt": "Say \"yes\"", "answer": "yes", "level": 3, "tags": null, "junk": true})"
      "\n");
  DataOptions opt;
  opt.extra_fields = {"level", "tags"};
  const auto examples = read_jsonl(path, opt);
  REQUIRE(examples.size() == 3);
  CHECK(examples[0].id == "a1");
  CHECK(examples[0].prompt == "What is 2 + 2?");
  CHECK(examples[0].messages.empty());
  CHECK(examples[0].answer == "4");
  CHECK(examples[0].extra == json{{"level", 1}, {"tags", {"x"}}});
  CHECK(examples[0].conversation().size() == 1);
  CHECK(examples[0].conversation()[0].role == "user");
  CHECK(examples[1].id == "d.jsonl:3");  // no id field: file name and line (blank line 2)
  CHECK(examples[1].prompt.empty());
  REQUIRE(examples[1].messages.size() == 2);
  CHECK(examples[1].messages[0].role == "system");
  CHECK(examples[1].messages[1].content == "Hi");
  CHECK(examples[1].answer == "hello");
  CHECK(examples[2].id == "7");
  CHECK(examples[2].prompt == "Say \"yes\"");
  CHECK(examples[2].extra == json{{"level", 3}, {"tags", nullptr}});

  SECTION("star passes every other field") {
    opt.extra_fields = {"*"};
    const auto all = read_jsonl(path, opt);
    CHECK(all[2].extra == json{{"level", 3}, {"tags", nullptr}, {"junk", true}});
  }
  SECTION("renamed fields") {
    const std::string other =
        dir.write("o.jsonl", R"({"question": "q?", "solution": "s", "conv": []})"
                             "\n"
                             R"({"conv": [{"role": "user", "content": "c"}], "solution": 1.5})"
                             "\n");
    DataOptions o;
    o.prompt_field = "question";
    o.messages_field = "conv";
    o.answer_field = "solution";
    const auto ex = read_jsonl(other, o);
    REQUIRE(ex.size() == 2);
    CHECK(ex[0].prompt == "q?");  // the prompt field wins over messages
    CHECK(ex[0].answer == "s");
    CHECK(ex[1].messages.size() == 1);
    CHECK(ex[1].answer == "1.5");
  }
  SECTION("answers may be optional") {
    const std::string other = dir.write("n.jsonl", R"({"prompt": "p"})"
                                                   "\n");
    opt.extra_fields.clear();
    opt.require_answer = false;
    CHECK(read_jsonl(other, opt)[0].answer.empty());
  }
}

TEST_CASE("bad jsonl lines give one error naming the file line and field", "[unit]") {
  TempDir dir("bad");
  const std::string good = R"({"prompt": "p", "answer": "a", "meta": 1})";
  struct Case {
    std::string line;
    std::string field;  // "" when the error is about the whole line
    std::string says;
  };
  const std::vector<Case> cases = {
      {R"({"prompt": "p", "answer": )", "", "not valid JSON"},
      {R"(["prompt", "answer"])", "", "expected a JSON object, found array"},
      {R"({"answer": "a", "meta": 1})", "prompt", "missing"},
      {R"({"prompt": 3, "answer": "a", "meta": 1})", "prompt", "found number"},
      {R"({"messages": "hi", "answer": "a", "meta": 1})", "messages", "found string"},
      {R"({"messages": [], "answer": "a", "meta": 1})", "messages", "empty array"},
      {R"({"messages": [{"role": "user"}], "answer": "a", "meta": 1})", "messages[0].content",
       "missing"},
      {R"({"messages": [{"role": 1, "content": "c"}], "answer": "a", "meta": 1})",
       "messages[0].role", "found number"},
      {R"({"prompt": "p", "meta": 1})", "answer", "missing"},
      {R"({"prompt": "p", "answer": {"v": 1}, "meta": 1})", "answer", "found object"},
      {R"({"prompt": "p", "answer": "a"})", "meta", "missing"},
      {R"({"prompt": "p", "answer": "a", "meta": 1, "id": [1]})", "id", "found array"},
  };
  DataOptions opt;
  opt.extra_fields = {"meta"};
  for (const Case& c : cases) {
    // The bad line is line 3, after a good line and a blank one.
    const std::string path = dir.write("bad.jsonl", good + "\n\n" + c.line + "\n" + good + "\n");
    const std::string what = error_of([&] { read_jsonl(path, opt); });
    INFO(c.line << " -> " << what);
    CHECK(what.find(path + ":3:") == 0);
    if (!c.field.empty()) CHECK(what.find("field '" + c.field + "'") != std::string::npos);
    CHECK(what.find(c.says) != std::string::npos);
  }
  CHECK(error_of([&] {
          read_jsonl((dir.path / "none.jsonl").string(), opt);
        }).find("none.jsonl' cannot be opened (no such file)") != std::string::npos);
  const std::string empty = dir.write("empty.jsonl", "\n  \n");
  CHECK(error_of([&] { read_jsonl(empty, opt); }).find("holds no examples") != std::string::npos);
}

TEST_CASE("the eval split is seeded and stable whatever the other lines", "[unit]") {
  TempDir dir("split");
  const std::string base = numbered_lines(400);
  DataOptions opt;
  opt.path = dir.write("a.jsonl", base);
  opt.eval_fraction = 0.2;
  opt.seed = 11;
  const Dataset d = load_dataset(opt);
  CHECK(d.train.size() + d.eval.size() == 400);
  CHECK(d.eval.size() > 50);  // 80 expected; the hash makes it approximate
  CHECK(d.eval.size() < 110);
  std::set<std::string> eval_prompts;
  for (const auto& ex : d.eval) eval_prompts.insert(ex.prompt);

  // The same examples reversed, interleaved with 300 new ones: each old example keeps its split.
  std::vector<std::string> lines;
  std::istringstream in(base + numbered_lines(300, 1000));
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::mt19937 rng(5);
  std::shuffle(lines.begin(), lines.end(), rng);
  std::string shuffled;
  for (const auto& l : lines) shuffled += l + "\n";
  DataOptions opt2 = opt;
  opt2.path = dir.write("b.jsonl", shuffled);
  const Dataset d2 = load_dataset(opt2);
  int old_in_eval = 0;
  for (const auto& ex : d2.eval) {
    if (std::stoi(ex.prompt.substr(9)) >= 1000) continue;  // one of the new lines
    CHECK(eval_prompts.count(ex.prompt) == 1);
    ++old_in_eval;
  }
  CHECK(old_in_eval == static_cast<int>(eval_prompts.size()));

  // Another seed gives another split; fraction 0 holds nothing out.
  opt.seed = 12;
  std::set<std::string> other;
  for (const auto& ex : load_dataset(opt).eval) other.insert(ex.prompt);
  CHECK(other != eval_prompts);
  opt.eval_fraction = 0;
  CHECK(load_dataset(opt).eval.empty());
  opt.eval_fraction = 1;
  CHECK(error_of([&] { load_dataset(opt); }).find("data.eval_fraction") != std::string::npos);

  // An explicit eval file replaces the split.
  opt.eval_fraction = 0.5;
  opt.eval_path = dir.write("e.jsonl", numbered_lines(3, 5000));
  const Dataset d3 = load_dataset(opt);
  CHECK(d3.train.size() == 400);
  REQUIRE(d3.eval.size() == 3);
  CHECK(d3.eval[0].prompt == "question 5000");
}

TEST_CASE("prompt stream visits every example once per epoch in a seeded order", "[unit]") {
  std::vector<Example> examples;
  for (int i = 0; i < 10; ++i) examples.push_back(Example{.id = std::to_string(i)});
  PromptStream s(examples, 3);
  std::vector<int64_t> seen;
  for (int b = 0; b < 10; ++b) {  // 30 = three epochs in batches of 3
    const auto batch = s.next_batch(3);
    REQUIRE(batch.size() == 3);
    for (const auto& ex : batch) seen.push_back(std::stoll(ex.id));
  }
  CHECK(s.epoch() == 2);
  CHECK(s.index() == 10);
  std::vector<std::vector<int64_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    std::vector<int64_t> order(seen.begin() + e * 10, seen.begin() + e * 10 + 10);
    epochs.push_back(order);
    std::sort(order.begin(), order.end());
    for (int i = 0; i < 10; ++i) CHECK(order[static_cast<size_t>(i)] == i);
  }
  CHECK(epochs[0] != epochs[1]);
  CHECK(epochs[1] != epochs[2]);

  // The same seed repeats the sequence (batches crossing epochs included); another seed does not.
  PromptStream again(examples, 3);
  PromptStream other(examples, 4);
  std::vector<int64_t> a, o;
  for (int b = 0; b < 7; ++b) {
    for (int64_t i : again.next_indices(4)) a.push_back(i);
    for (int64_t i : other.next_indices(4)) o.push_back(i);
  }
  CHECK(std::vector<int64_t>(a.begin(), a.begin() + 28) ==
        std::vector<int64_t>(seen.begin(), seen.begin() + 28));
  CHECK(a != o);

  PromptStream plain(examples, 3, /*shuffle=*/false);
  for (int i = 0; i < 25; ++i) CHECK(plain.next_indices(1)[0] == i % 10);
  CHECK_THROWS_AS(plain.next_batch(0), Error);
}

TEST_CASE("prompt stream resumes exactly from its saved state", "[unit]") {
  std::vector<Example> examples;
  for (int i = 0; i < 13; ++i) {
    examples.push_back(Example{.id = std::to_string(i), .prompt = fmt::format("p{}", i)});
  }
  PromptStream s(examples, 99);
  for (int b = 0; b < 6; ++b) s.next_batch(5);  // mid epoch 2
  const std::string saved = s.state().dump();
  std::vector<Example> expected;
  for (int b = 0; b < 9; ++b) {
    for (auto& ex : s.next_batch(5)) expected.push_back(ex);
  }

  PromptStream resumed(examples, 99);
  resumed.restore(json::parse(saved));
  CHECK(resumed.epoch() == 2);
  CHECK(resumed.index() == 4);
  std::vector<Example> got;
  for (int b = 0; b < 9; ++b) {
    for (auto& ex : resumed.next_batch(5)) got.push_back(ex);
  }
  CHECK(got == expected);

  // States of other data, seeds or shuffle settings, and malformed ones, are refused by name.
  auto fewer = examples;
  fewer.pop_back();
  PromptStream small(fewer, 99);
  CHECK(error_of([&] { small.restore(json::parse(saved)); }).find("'size'") != std::string::npos);
  auto changed = examples;
  changed[4].prompt = "changed";
  PromptStream edited(changed, 99);
  CHECK(error_of([&] { edited.restore(json::parse(saved)); }).find("'fingerprint'") !=
        std::string::npos);
  PromptStream seeded(examples, 98);
  CHECK(error_of([&] { seeded.restore(json::parse(saved)); }).find("'seed'") != std::string::npos);
  PromptStream unshuffled(examples, 99, false);
  CHECK(error_of([&] { unshuffled.restore(json::parse(saved)); }).find("'shuffle'") !=
        std::string::npos);
  json bad = json::parse(saved);
  bad["index"] = 14;
  CHECK(error_of([&] { resumed.restore(bad); }).find("'index'") != std::string::npos);
  bad.erase("epoch");
  CHECK(error_of([&] { resumed.restore(bad); }).find("'epoch' missing") != std::string::npos);
}

TEST_CASE("synthetic arithmetic is deterministic and its answers are right", "[unit]") {
  ArithmeticOptions opt;
  opt.min_operands = 2;
  opt.max_operands = 4;
  opt.min_digits = 1;
  opt.max_digits = 3;
  opt.operations = "+-*";
  const auto examples = make_arithmetic(opt, 300, 42);
  REQUIRE(examples.size() == 300);
  std::set<int> operand_counts;
  std::set<std::string> ops_seen;
  std::set<std::string> prompts;
  for (const auto& ex : examples) {
    INFO(ex.prompt);
    const std::string head = "What is ", tail = "? Give the final answer after ####.";
    REQUIRE(ex.prompt.rfind(head, 0) == 0);
    REQUIRE(ex.prompt.size() > head.size() + tail.size());
    REQUIRE(ex.prompt.substr(ex.prompt.size() - tail.size()) == tail);
    const std::string expr =
        ex.prompt.substr(head.size(), ex.prompt.size() - head.size() - tail.size());
    int n = 0;
    CHECK(std::to_string(evaluate_text(expr, &n)) == ex.answer);
    CHECK(n >= 2);
    CHECK(n <= 4);
    operand_counts.insert(n);
    std::istringstream in(expr);
    int k = 0;
    for (std::string t; in >> t; ++k) {
      if (k % 2 == 1) {
        ops_seen.insert(t);
      } else {
        CHECK(t.size() <= 3);
        CHECK((t.size() == 1 || t[0] != '0'));
      }
    }
    CHECK(ex.extra["expression"] == expr);
    CHECK(ex.extra["task"] == "arithmetic");
    prompts.insert(ex.prompt);
  }
  CHECK(operand_counts == std::set<int>{2, 3, 4});
  CHECK(ops_seen == std::set<std::string>{"+", "-", "*"});
  CHECK(prompts.size() > 290);

  // Example i of a seed does not depend on the count; other seeds give other examples.
  const auto few = make_arithmetic(opt, 20, 42);
  CHECK(std::equal(few.begin(), few.end(), examples.begin()));
  CHECK(arithmetic_example(opt, 42, 123) == examples[123]);
  CHECK(!(make_arithmetic(opt, 20, 43) == few));

  // Non-negative results and a custom instruction.
  opt.operations = "-";
  opt.allow_negative = false;
  opt.instruction = "Compute {question}. End with: The answer is N.";
  for (const auto& ex : make_arithmetic(opt, 100, 1)) {
    CHECK(std::stoll(ex.answer) >= 0);
    CHECK(ex.prompt.rfind("Compute ", 0) == 0);
    CHECK(ex.prompt.find("{question}") == std::string::npos);
  }

  ArithmeticOptions bad;
  bad.max_operands = 1;
  CHECK(error_of([&] { make_arithmetic(bad, 1, 0); }).find("max_operands 1") != std::string::npos);
  bad = {};
  bad.operations = "+/";
  CHECK(error_of([&] { make_arithmetic(bad, 1, 0); }).find("'+/'") != std::string::npos);
  bad = {};
  bad.operations = "*";
  bad.max_digits = 9;
  bad.max_operands = 3;
  CHECK(error_of([&] { make_arithmetic(bad, 1, 0); }).find("overflow") != std::string::npos);
  bad = {};
  bad.instruction = "What is it?";
  CHECK(error_of([&] { make_arithmetic(bad, 1, 0); }).find("placeholder") != std::string::npos);
}

TEST_CASE("synthetic format tasks are deterministic and checkable", "[unit]") {
  const FormatOptions opt;
  const auto examples = make_format(opt, 60, 7);
  CHECK(make_format(opt, 60, 7) == examples);
  std::map<std::string, int> kinds;
  for (const auto& ex : examples) {
    INFO(ex.prompt);
    const json& spec = ex.extra.at("spec");
    const std::string kind = spec.at("kind");
    ++kinds[kind];
    CHECK(ex.extra["task"] == "format");
    if (kind == "uppercase_words") {
      const int n = spec.at("words");
      CHECK(ex.prompt.find(fmt::format("exactly {} words in uppercase", n)) != std::string::npos);
      std::string good;
      for (int i = 0; i < n; ++i) good += i ? " RED" : "BLUE";
      CHECK(check_format(spec, good + "\n"));
      CHECK_FALSE(check_format(spec, good + " GREEN"));
      CHECK_FALSE(check_format(spec, "blue" + good.substr(4)));
    } else if (kind == "answer_tag") {
      int a = 0, b = 0;
      REQUIRE(std::sscanf(ex.prompt.c_str(), "What is %d + %d?", &a, &b) == 2);
      CHECK(ex.answer == std::to_string(a + b));
      CHECK(check_format(spec, "Sum: <answer> " + ex.answer + " </answer>", ex.answer));
      CHECK_FALSE(
          check_format(spec, "<answer>" + std::to_string(a + b + 1) + "</answer>", ex.answer));
      CHECK_FALSE(check_format(spec, ex.answer, ex.answer));
      CHECK_FALSE(check_format(spec, "<answer>1</answer><answer>2</answer>"));
    } else {
      REQUIRE(kind == "lowercase_sentence");
      CHECK(check_format(spec, "the sea is wide and grey."));
      CHECK_FALSE(check_format(spec, "The sea is wide."));
      CHECK_FALSE(check_format(spec, "the sea is wide"));
      CHECK_FALSE(check_format(spec, "the sea. it is wide."));
    }
  }
  CHECK(kinds.size() == 3);
  FormatOptions only;
  only.kinds = {"answer_tag"};
  for (const auto& ex : make_format(only, 10, 1)) CHECK(ex.extra["spec"]["kind"] == "answer_tag");
  only.kinds = {"haiku"};
  CHECK(error_of([&] { make_format(only, 1, 1); }).find("unknown kind 'haiku'") !=
        std::string::npos);
  CHECK_THROWS_AS(check_format(json{{"kind", "haiku"}}, "x"), Error);
}

TEST_CASE("synthetic examples round trip through jsonl", "[unit]") {
  TempDir dir("roundtrip");
  auto examples = make_arithmetic({}, 5, 3);
  for (auto& ex : make_format({}, 5, 3)) examples.push_back(ex);
  examples.push_back(Example{.id = "chat",
                             .messages = {{"system", "s"}, {"user", "u"}},
                             .answer = "a",
                             .extra = {{"k", {1, 2}}}});
  DataOptions opt;
  opt.path = (dir.path / "synthetic.jsonl").string();
  write_jsonl(opt.path, examples, opt);
  opt.extra_fields = {"*"};
  CHECK(read_jsonl(opt.path, opt) == examples);
  examples[0].extra["answer"] = "x";
  CHECK(error_of([&] { write_jsonl(opt.path, examples, opt); }).find("'answer' clashes") !=
        std::string::npos);
}

TEST_CASE("render_prompt applies the chat template and a system prompt", "[unit]") {
  const model::Tokenizer tok(model::tokenizer_data_from_hf(smollm2_dir().string()));
  const Example text{.id = "t", .prompt = "What is 2 + 3?", .answer = "5"};
  CHECK(render_prompt(tok, text, true) == model::encode_prompt(tok, text.prompt, true));
  CHECK(render_prompt(tok, text, false) == model::encode_prompt(tok, text.prompt, false));
  CHECK(tok.decode(render_prompt(tok, text, true, "You add numbers.")) ==
        "<|im_start|>system\nYou add numbers.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n");
  CHECK(tok.decode(render_prompt(tok, text, false, "You add numbers.")) ==
        "You add numbers.\n\nWhat is 2 + 3?");
  const std::vector<int32_t> with_template_default = render_prompt(tok, text, true);
  CHECK(tok.decode(with_template_default).find("named SmolLM") != std::string::npos);
  CHECK(tok.is_special(with_template_default[0]));

  const Example chat{
      .id = "c",
      .messages = {{"system", "Be terse."}, {"user", "Hi"}, {"assistant", "Yo"}, {"user", "Bye"}}};
  // A conversation's own system message wins over the system prompt.
  CHECK(tok.decode(render_prompt(tok, chat, true, "ignored")) ==
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n");
  CHECK(tok.decode(render_prompt(tok, chat, false)) ==
        "system: Be terse.\nuser: Hi\nassistant: Yo\nuser: Bye\nassistant: ");
}

TEST_CASE("model chat_template chooses the prompt format a job renders", "[unit]") {
  const model::Tokenizer tok(model::tokenizer_data_from_hf(smollm2_dir().string()));
  const Example text{.id = "t", .prompt = "What is 2 + 3?", .answer = "5"};
  // "auto": the model's own template, its default system prompt, the text rewards see.
  const RenderedPrompt automatic = render_prompt(tok, text, prompt_format(tok, "auto"));
  CHECK(automatic.tokens == model::encode_prompt(tok, text.prompt, true));
  CHECK(automatic.text.find("named SmolLM") != std::string::npos);
  CHECK(tok.decode(automatic.tokens) == automatic.text);
  // "none": the raw text, no template.
  const RenderedPrompt raw = render_prompt(tok, text, prompt_format(tok, "none"));
  CHECK(raw.text == "What is 2 + 3?");
  CHECK(raw.tokens == model::encode_prompt(tok, text.prompt, false));
  // A format by name has no default system prompt.
  CHECK(render_prompt(tok, text, prompt_format(tok, "chatml")).text ==
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n");
  CHECK(render_prompt(tok, text, prompt_format(tok, "plain")).text ==
        "user: What is 2 + 3?\nassistant: ");
  // A Jinja file recognised as ChatML, with the default system prompt it holds.
  const TempDir dir("chat-template");
  const std::string chatml = (dir.path / "chatml.jinja").string();
  std::ofstream(chatml) << "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe "
                           "brief.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>"
                           "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";
  CHECK(render_prompt(tok, text, prompt_format(tok, chatml)).text ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n");
  // A template tandem cannot render, and a missing file, are refused naming the value.
  const std::string other = (dir.path / "other.jinja").string();
  std::ofstream(other) << "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}";
  CHECK(error_of([&] { prompt_format(tok, other); }).find("neither ChatML") != std::string::npos);
  CHECK(error_of([&] { prompt_format(tok, "missing.jinja"); }).find("'missing.jinja'") !=
        std::string::npos);
}

TEST_CASE("synthetic tasks by name split into disjoint train and eval parts", "[unit]") {
  SyntheticOptions opt;
  opt.count = 500;
  opt.arithmetic.max_digits = 1;  // 200 distinct questions: many duplicates
  const Dataset d = split_dataset(make_synthetic(opt, 5), 0.2, 5);
  CHECK(d.train.size() + d.eval.size() == 500);
  CHECK(!d.eval.empty());
  std::set<std::string> train_prompts;
  for (const auto& ex : d.train) train_prompts.insert(ex.prompt);
  for (const auto& ex : d.eval) CHECK(train_prompts.count(ex.prompt) == 0);
  opt.task = "format";
  opt.count = 4;
  CHECK(make_synthetic(opt, 5) == make_format({}, 4, 5));
  opt.task = "chess";
  CHECK(error_of([&] { make_synthetic(opt, 5); }).find("'chess' is unknown") != std::string::npos);
}
