// `tandem generate`, `tandem score` and `tandem convert`: a model from a GGUF file or an HF
// directory, run through the same Decoder the trainer uses.
#include "apps/model_commands.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/memory_available.h"
#include "kernels/ops.h"
#include "model/decoder.h"
#include "model/hf.h"
#include "model/loader.h"
#include "rollout/engine.h"
#include "rollout/engine_memory.h"

namespace tandem::apps {
namespace {

namespace fs = std::filesystem;

struct GenerateArgs {
  std::string model, prompt, prompts;
  bool chat = false;
  // n, max_tokens, temperature (0 here: greedy), top_k, top_p and seed from the flags.
  rollout::SamplingParams sampling = [] {
    rollout::SamplingParams sp;
    sp.temperature = 0.0f;
    return sp;
  }();
  std::string dtype = "f32";
} gen;

struct ScoreArgs {
  std::string model, input;
  bool chat = false;
  float temperature = 1.0f;
} score;

struct ConvertArgs {
  std::string model, out, dtype = "f32";
  std::string random_init;  // a config.json: random weights of its shape, --model's tokenizer
  uint64_t seed = 0;
  bool overwrite = false;
} convert;

CLI::App* gen_cmd = nullptr;
CLI::App* score_cmd = nullptr;
CLI::App* convert_cmd = nullptr;

DType parse_dtype(const std::string& s) {
  if (s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  TANDEM_CHECK(false, "--dtype '{}': use f32 or bf16", s);
  return DType::f32;
}

std::vector<int32_t> ids_field(const nlohmann::json& j, const char* key, const std::string& where);

// One JSONL line as an object; errors name `where` (file:line).
nlohmann::json parse_object(const std::string& line, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    TANDEM_CHECK(false, "{}: not a JSON object: {}", where, e.what());
  }
  TANDEM_CHECK(j.is_object(), "{}: expected a JSON object", where);
  return j;
}

// The requests of `tandem generate`: --prompt, or one per line of --prompts (JSONL with
// "prompt" text or "prompt_ids", and an optional "id").
std::vector<rollout::Request> generate_requests(const model::LoadedModel& m) {
  rollout::SamplingParams sp = gen.sampling;
  sp.stop_token_ids = m.stop_ids();
  std::vector<rollout::Request> requests;
  if (gen.prompts.empty()) {
    requests.push_back({"prompt", model::encode_prompt(m.tok(), gen.prompt, gen.chat), sp});
    return requests;
  }
  std::ifstream in(gen.prompts);
  TANDEM_CHECK(in.good(), "{}: cannot open", gen.prompts);
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", gen.prompts, lineno);
    const nlohmann::json j = parse_object(line, where);
    rollout::Request r;
    r.id = j.contains("id") ? (j["id"].is_string() ? j["id"].get<std::string>() : j["id"].dump())
                            : std::to_string(lineno);
    if (j.contains("prompt_ids")) {
      r.prompt = ids_field(j, "prompt_ids", where);
    } else {
      TANDEM_CHECK(j.contains("prompt") && j["prompt"].is_string(),
                   "{}: expected a string field 'prompt' (or 'prompt_ids')", where);
      r.prompt = model::encode_prompt(m.tok(), j["prompt"].get<std::string>(), gen.chat);
    }
    r.params = sp;
    requests.push_back(std::move(r));
  }
  TANDEM_CHECK(!requests.empty(), "{}: no prompts", gen.prompts);
  return requests;
}

int run_generate() {
  TANDEM_CHECK(gen.prompt.empty() != gen.prompts.empty(),
               "give exactly one of --prompt and --prompts");
  model::LoadedModel m = model::load_model(gen.model, parse_dtype(gen.dtype));
  std::vector<rollout::Request> requests = generate_requests(m);
  int64_t longest = 0, kv_tokens = 0;
  for (const auto& r : requests) {
    longest =
        std::max<int64_t>(longest, static_cast<int64_t>(r.prompt.size()) + gen.sampling.max_tokens);
    kv_tokens += static_cast<int64_t>(r.prompt.size()) +
                 int64_t{gen.sampling.n} * (gen.sampling.max_tokens + 16);
  }
  rollout::EngineOptions eo;
  eo.max_context =
      std::min<int64_t>(std::max<int64_t>(longest, 1), m.config().max_position_embeddings);
  // KV blocks for every sample at once, within 2 GiB and half the memory available; fewer means
  // preemption, not failure.
  const double available = memory_available(m.weights->device());
  const int64_t block_bytes =
      static_cast<int64_t>(rollout::BlockManager::bytes_per_block(m.config(), eo.block_size));
  const int64_t budget_bytes =
      available > 0 ? std::min<int64_t>(int64_t{2} << 30, static_cast<int64_t>(available / 2))
                    : int64_t{2} << 30;
  const int64_t budget = std::max<int64_t>(budget_bytes, block_bytes * 64) / block_bytes;
  eo.num_blocks = std::clamp<int64_t>(kv_tokens / eo.block_size + 64, 64, budget);
  eo.max_seqs = std::max<int64_t>(eo.max_seqs, gen.sampling.n);
  rollout::check_engine_memory(
      m.config(), eo, available,
      {"-n or --max-tokens (the KV cache holds every sample at once)",
       fmt::format("the model's size (tandem generate computes {} tokens a step)",
                   eo.max_batch_tokens)});
  rollout::Engine engine(*m.weights, eo, &m.tok());

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<rollout::RequestOutput> outs = engine.generate(std::move(requests));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t tokens = 0, failed = 0;
  for (const auto& o : outs) {
    if (o.status == rollout::RequestStatus::error) {
      ++failed;
      std::fprintf(stderr, "tandem: request %s: %s\n", o.id.c_str(), o.error.c_str());
    }
    for (const auto& smp : o.samples) tokens += static_cast<int64_t>(smp.tokens.size());
    if (gen.prompts.empty()) {
      for (const auto& smp : o.samples) {
        if (o.samples.size() > 1) std::printf("--- sample %d ---\n", smp.index);
        std::printf("%s\n", smp.text.c_str());
      }
      continue;
    }
    nlohmann::ordered_json j;
    j["id"] = o.id;
    j["prompt_tokens"] = o.prompt.size();
    j["status"] = rollout::request_status_name(o.status);
    if (!o.error.empty()) j["error"] = o.error;
    j["samples"] = nlohmann::json::array();
    for (const auto& smp : o.samples) {
      j["samples"].push_back({{"index", smp.index},
                              {"text", smp.text},
                              {"tokens", smp.tokens},
                              {"logprobs", smp.logprobs},
                              {"finish_reason", rollout::finish_reason_name(smp.finish_reason)}});
    }
    // A completion may end inside a UTF-8 character: U+FFFD there.
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  const rollout::EngineStats& st = engine.stats();
  std::fprintf(stderr,
               "tandem: %s (%s, %lld parameters) loaded in %.2f s; %zu requests x %d samples, "
               "%lld tokens in %.2f s: %.1f tokens/s (%lld prefill tokens, %lld from the "
               "prefix cache, %lld preemptions)\n",
               gen.model.c_str(), model::architecture_name(m.config().arch),
               static_cast<long long>(m.weights->num_parameters()), m.load_seconds, outs.size(),
               gen.sampling.n, static_cast<long long>(tokens), seconds,
               static_cast<double>(tokens) / std::max(seconds, 1e-9),
               static_cast<long long>(st.prefill_tokens),
               static_cast<long long>(st.cached_prompt_tokens),
               static_cast<long long>(st.preemptions));
  return failed == 0 ? 0 : 1;
}

std::vector<int32_t> ids_field(const nlohmann::json& j, const char* key, const std::string& where) {
  TANDEM_CHECK(j[key].is_array(), "{}: '{}' must be an array of token ids", where, key);
  std::vector<int32_t> ids;
  for (const auto& v : j[key]) {
    TANDEM_CHECK(v.is_number_integer(), "{}: '{}' must hold integers, found {}", where, key,
                 v.dump());
    ids.push_back(v.get<int32_t>());
  }
  return ids;
}

int run_score() {
  model::LoadedModel m = model::load_model(score.model, DType::f32);
  std::ifstream in(score.input);
  TANDEM_CHECK(in.good(), "{}: cannot open", score.input);
  // score() grows the activation arena to each line's scoring plan (linear in its length).
  model::Decoder decoder(*m.weights, {.max_tokens = 1});
  const int64_t V = m.config().vocab_size;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", score.input, lineno);
    const nlohmann::json j = parse_object(line, where);
    std::vector<int32_t> prompt, completion;
    if (j.contains("prompt_ids") || j.contains("completion_ids")) {
      prompt = ids_field(j, "prompt_ids", where);
      completion = ids_field(j, "completion_ids", where);
    } else {
      TANDEM_CHECK(j.contains("prompt") && j["prompt"].is_string(),
                   "{}: expected a string field 'prompt' (or 'prompt_ids')", where);
      TANDEM_CHECK(j.contains("completion") && j["completion"].is_string(),
                   "{}: expected a string field 'completion' (or 'completion_ids')", where);
      prompt = model::encode_prompt(m.tok(), j["prompt"].get<std::string>(), score.chat);
      completion = m.tok().encode(j["completion"].get<std::string>(), /*parse_special=*/false);
    }
    const int64_t context = m.config().max_position_embeddings;
    const size_t tokens = prompt.size() + completion.size();
    TANDEM_CHECK(static_cast<int64_t>(tokens) <= context,
                 "{}: {} tokens (prompt {} + completion {}) do not fit the model's context of {} "
                 "tokens (max_position_embeddings): shorten the line or leave it out",
                 where, tokens, prompt.size(), completion.size(), context);
    TANDEM_CHECK(!prompt.empty(), "{}: the prompt has no tokens", where);
    TANDEM_CHECK(!completion.empty(), "{}: the completion has no tokens", where);
    for (const auto* ids : {&prompt, &completion}) {
      for (int32_t t : *ids) {
        TANDEM_CHECK(t >= 0 && t < V, "{}: token id {} is outside the vocabulary [0, {})", where, t,
                     V);
      }
    }
    std::vector<int32_t> seq = prompt;
    seq.insert(seq.end(), completion.begin(), completion.end());
    const std::vector<std::vector<int32_t>> seqs{seq};
    model::PackedBatch batch = model::PackedBatch::from_sequences(seqs);
    // Only the completion's rows go through the head.
    for (size_t k = 0; k < completion.size(); ++k)
      batch.head_rows.push_back(
          static_cast<int32_t>(batch.row_of(0, static_cast<int64_t>(prompt.size() + k))));
    Tensor logprob = Tensor::empty({batch.num_tokens()}, DType::f32);
    Tensor entropy = Tensor::empty({batch.num_tokens()}, DType::f32);
    decoder.score(batch, logprob, entropy, score.temperature);
    nlohmann::json out;
    out["line"] = lineno;
    if (j.contains("id")) out["id"] = j["id"];
    out["prompt_tokens"] = prompt.size();
    out["completion_ids"] = completion;
    std::vector<float> lp, ent;
    double sum = 0;
    for (size_t k = 0; k < completion.size(); ++k) {
      const int64_t row = batch.row_of(0, static_cast<int64_t>(prompt.size() + k));
      lp.push_back(logprob.data_as<float>()[row]);
      ent.push_back(entropy.data_as<float>()[row]);
      sum += lp.back();
    }
    out["logprobs"] = lp;
    out["entropies"] = ent;
    out["sum_logprob"] = sum;
    std::fputs((out.dump() + "\n").c_str(), stdout);
  }
  return 0;
}

// Written by convert into every output, recording the name and size of each file it wrote:
// --overwrite replaces a directory only when it holds this file and nothing but files of
// convert's own names (convert_writes) of the sizes recorded there.
constexpr const char* kConvertMarker = ".tandem-convert.json";

// The names of the files convert writes: save_hf's (config, generation config, the weights in one
// file or in shards with their index), hf_tokenizer_files' and the marker. A marker found in --out
// may be anyone's; --overwrite never deletes a file of another name, whatever it lists.
bool convert_writes(const std::string& name) {
  static const std::set<std::string> kFixed = {kConvertMarker,
                                               "config.json",
                                               "generation_config.json",
                                               "model.safetensors",
                                               "tokenizer.json",
                                               "tokenizer_config.json",
                                               "special_tokens_map.json",
                                               "model.safetensors.index.json"};
  if (kFixed.count(name) != 0) return true;
  // model-00001-of-00003.safetensors
  const auto digits = [&](size_t at) {
    return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(at),
                       name.begin() + static_cast<std::ptrdiff_t>(at + 5),
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  return name.size() == 32 && name.starts_with("model-") && name.ends_with(".safetensors") &&
         name.substr(11, 4) == "-of-" && digits(6) && digits(15);
}

// Refuses an --out that convert must not replace: a file, a directory holding anything without
// --overwrite, and with it anything but a previous convert output whose files are all of
// convert's names and of the sizes its marker recorded.
void check_convert_target(const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(out, ec))) return;
  TANDEM_CHECK(fs::is_directory(out, ec),
               "--out '{}' exists and is not a directory: tandem convert never replaces a file; "
               "choose another --out",
               out.string());
  std::vector<std::string> entries;
  for (const fs::directory_entry& e : fs::directory_iterator(out, ec))
    entries.push_back(e.path().filename().string());
  std::sort(entries.begin(), entries.end());
  if (entries.empty()) return;
  TANDEM_CHECK(convert.overwrite,
               "--out '{}' is a directory that is not empty (it holds '{}'{}): tandem convert "
               "writes into a new or empty directory; choose another --out, or pass --overwrite "
               "to replace the output of a previous tandem convert",
               out.string(), entries[0], entries.size() > 1 ? " and more" : "");
  std::map<std::string, int64_t> recorded;
  try {
    std::ifstream in(out / kConvertMarker);
    const nlohmann::json j = nlohmann::json::parse(in);
    for (const auto& [name, bytes] : j.at("files").items()) recorded[name] = bytes.get<int64_t>();
  } catch (const std::exception&) {
    TANDEM_FAIL(
        "--out '{}' is not the output of a tandem convert (it has no readable {} recording the "
        "names and sizes of the files convert wrote): --overwrite replaces only those; choose "
        "another --out, or empty the directory yourself",
        out.string(), kConvertMarker);
  }
  for (const std::string& e : entries) {
    if (e == kConvertMarker) continue;
    const fs::path p = out / e;
    const bool regular = fs::is_regular_file(fs::symlink_status(p, ec));
    const auto it = recorded.find(e);
    const bool ours = convert_writes(e) && regular && it != recorded.end() &&
                      static_cast<int64_t>(fs::file_size(p, ec)) == it->second && !ec;
    TANDEM_CHECK(ours,
                 "--out '{}' holds '{}', which tandem convert did not write (convert writes "
                 "only files of its own names, of the sizes {} records): --overwrite replaces "
                 "only what it wrote; move that file away or choose another --out",
                 out.string(), e, kConvertMarker);
  }
}

int run_convert() {
  fs::path out(convert.out);
  if (out.filename().empty()) out = out.parent_path();  // "dir/" -> "dir"
  check_convert_target(out);
  model::LoadedModel m = model::load_model(convert.model, DType::f32);
  model::SaveOptions opt;
  opt.dtype = parse_dtype(convert.dtype);
  if (m.tokenizer) opt.extra_files = model::hf_tokenizer_files(m.tokenizer->data());
  nlohmann::json marker = {{"written_by", "tandem convert"},
                           {"model", convert.model},
                           {"dtype", convert.dtype},
                           {"files", nlohmann::json::object()}};
  if (!convert.random_init.empty()) {
    const model::ModelConfig config = model::config_from_hf_file(convert.random_init);
    const int32_t tokens = m.tokenizer ? m.tokenizer->vocab_size() : 0;
    TANDEM_CHECK(m.tokenizer && tokens <= config.vocab_size,
                 "--random-init '{}': vocab_size {} cannot hold the {} tokens of --model '{}'s "
                 "tokenizer{}",
                 convert.random_init, config.vocab_size, tokens, convert.model,
                 m.tokenizer ? "" : " (it has none)");
    m.weights = std::make_unique<model::Weights>(config, DType::f32);
    model::init_random(*m.weights, convert.seed);
    marker["random_init"] = {{"config", convert.random_init}, {"seed", convert.seed}};
    std::fprintf(stderr, "tandem: %lld random parameters of %s's shape (seed %llu)\n",
                 static_cast<long long>(m.weights->num_parameters()), convert.random_init.c_str(),
                 static_cast<unsigned long long>(convert.seed));
  }
  model::save_hf(*m.weights, out.string(), opt);
  for (const fs::directory_entry& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    // A file of a name convert_writes does not know could never be replaced by --overwrite.
    TANDEM_CHECK(convert_writes(name),
                 "tandem convert wrote '{}' into '{}', a name its --overwrite check does not know: "
                 "add it to convert_writes",
                 name, out.string());
    marker["files"][name] = static_cast<int64_t>(e.file_size());
  }
  {
    std::ofstream f(out / kConvertMarker, std::ios::binary | std::ios::trunc);
    f << marker.dump(2) << "\n";
    f.close();
    TANDEM_CHECK(!f.fail(), "{}: write failed (disk full?)", (out / kConvertMarker).string());
  }
  std::fprintf(stderr, "tandem: wrote %s (HF directory, %s)\n", out.c_str(), convert.dtype.c_str());
  return 0;
}

}  // namespace

void add_model_commands(CLI::App& app) {
  gen_cmd = app.add_subcommand(
      "generate", "generate completions with the rollout engine (one prompt or a JSONL file)");
  gen_cmd->add_option("--model", gen.model, "a .gguf file or a Hugging Face model directory")
      ->required();
  gen_cmd->add_option("--prompt", gen.prompt, "the prompt text");
  gen_cmd->add_option("--prompts", gen.prompts,
                      "JSONL, one request a line: {\"prompt\": text} or {\"prompt_ids\": [...]}, "
                      "optional \"id\"; prints one JSON line per request");
  gen_cmd
      ->add_option("-n,--n", gen.sampling.n, "samples per prompt (a group sharing the prompt's KV)")
      ->check(CLI::Range(1, 4096));
  gen_cmd->add_flag("--chat", gen.chat, "render the prompt as a user message (chat template)");
  gen_cmd->add_option("--max-tokens", gen.sampling.max_tokens, "tokens to generate at most")
      ->check(CLI::Range(1, 1 << 20));
  gen_cmd->add_option("--temperature", gen.sampling.temperature, "0 = greedy")
      ->check(CLI::Range(0.0, 100.0));
  gen_cmd->add_option("--top-k", gen.sampling.top_k, "0 = off")->check(CLI::NonNegativeNumber);
  gen_cmd->add_option("--top-p", gen.sampling.top_p, "1 = off")->check(CLI::Range(0.0, 1.0));
  gen_cmd->add_option("--seed", gen.sampling.seed, "sampling seed");
  gen_cmd->add_option("--dtype", gen.dtype, "weights in f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));

  score_cmd = app.add_subcommand(
      "score", "per-token logprobs and entropies of completions, as the trainer computes them");
  score_cmd->add_option("--model", score.model, "a .gguf file or a Hugging Face model directory")
      ->required();
  score_cmd
      ->add_option("--input", score.input,
                   "JSONL: {\"prompt\", \"completion\"} texts or {\"prompt_ids\", "
                   "\"completion_ids\"}")
      ->required();
  score_cmd->add_flag("--chat", score.chat, "render text prompts with the chat template");
  score_cmd->add_option("--temperature", score.temperature, "logits are divided by this")
      ->check(CLI::PositiveNumber);

  convert_cmd = app.add_subcommand("convert", "save a model as a Hugging Face directory");
  convert_cmd->add_option("--model", convert.model, "a .gguf file or a Hugging Face directory")
      ->required();
  convert_cmd
      ->add_option("--out", convert.out,
                   "the directory to write: new or empty (it must not be a file)")
      ->required();
  convert_cmd->add_flag("--overwrite", convert.overwrite,
                        "replace --out when it is the output of a previous tandem convert (it "
                        "holds .tandem-convert.json and only files of convert's names and of "
                        "the sizes recorded there)");
  convert_cmd->add_option("--dtype", convert.dtype, "f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));
  convert_cmd->add_option("--random-init", convert.random_init,
                          "a Hugging Face config.json: write random weights of its shape (norms "
                          "near 1, matrices scaled by 1/sqrt(fan-in)) with --model's tokenizer, "
                          "for memory and speed runs of a model whose weights you do not have");
  convert_cmd->add_option("--seed", convert.seed, "the --random-init seed");
}

int run_model_commands() {
  if (gen_cmd->parsed()) return run_generate();
  if (score_cmd->parsed()) return run_score();
  if (convert_cmd->parsed()) return run_convert();
  return -1;
}

}  // namespace tandem::apps
