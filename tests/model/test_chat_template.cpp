// Chat templates: format detection, default system prompts, the plain format, and parity with
// HF's apply_chat_template for SmolLM2, Qwen2.5 and Llama 3 (tests/golden/smollm2/chat.json).
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/chat_template.h"
#include "model/tokenizer.h"

using namespace tandem::model;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
fs::path golden_dir() { return fs::path(TANDEM_SOURCE_DIR) / "tests/golden/smollm2"; }
}  // namespace

TEST_CASE("chat formats are detected by their markers", "[unit]") {
  CHECK(detect_chat_format("{{ '<|im_start|>' + message['role'] }}") == ChatFormat::chatml);
  CHECK(detect_chat_format("{{ '<|start_header_id|>' }}") == ChatFormat::llama3);
  CHECK(detect_chat_format("") == ChatFormat::plain);
  CHECK(detect_chat_format("[INST] {{ message }} [/INST]") == ChatFormat::plain);
  CHECK(std::string(chat_format_name(ChatFormat::llama3)) == "llama3");
}

TEST_CASE("default system prompts are read from literal template text only", "[unit]") {
  CHECK(default_system_prompt("{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}") == "Be brief.");
  CHECK(default_system_prompt(
            R"({{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{{- '<|im_start|>system\nYou are X.<|im_end|>\n' }})") == "You are X.");
  CHECK(default_system_prompt("{{ '<|im_start|>' + message['role'] + '\n' }}").empty());
  CHECK(default_system_prompt("").empty());
}

TEST_CASE("plain and llama3 formats lay out roles and trim as documented", "[unit]") {
  const std::vector<ChatMessage> chat = {{"user", "Hi"}, {"assistant", " Hello \n"}};
  CHECK(apply_chat_template(ChatFormat::plain, chat, true) ==
        "user: Hi\nassistant:  Hello \n\nassistant: ");
  CHECK(apply_chat_template(ChatFormat::plain, chat, false, "Sys") ==
        "system: Sys\nuser: Hi\nassistant:  Hello \n");
  CHECK(apply_chat_template(ChatFormat::plain, {}, true) == "assistant: ");
  CHECK(apply_chat_template(ChatFormat::llama3, chat, false) ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>");
  CHECK(apply_chat_template(ChatFormat::chatml, chat, false, "S") ==
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n Hello \n<|im_end|>\n");
  const std::vector<ChatMessage> with_system = {{"system", "Own"}, {"user", "Hi"}};
  CHECK(
      apply_chat_template(ChatFormat::chatml, with_system, true, "Default") ==
      "<|im_start|>system\nOwn<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("chat templates render as hugging face for smollm2 qwen2.5 and llama3", "[interop]") {
  const TokenizerData data = tokenizer_data_from_hf(golden_dir().string());
  const json golden = json::parse(std::ifstream(golden_dir() / "chat.json"));
  struct Family {
    ChatFormat format;
    std::string default_system;
  };
  const std::map<std::string, std::string> templates = {{"smollm2", data.chat_template},
                                                        {"qwen2.5", golden.at("qwen2.5_template")},
                                                        {"llama3", golden.at("llama3_template")}};
  std::map<std::string, Family> families;
  for (const auto& [name, jinja] : templates)
    families[name] = {detect_chat_format(jinja), default_system_prompt(jinja)};
  CHECK(families["smollm2"].format == ChatFormat::chatml);
  CHECK(families["smollm2"].default_system ==
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  CHECK(families["qwen2.5"].format == ChatFormat::chatml);
  CHECK(families["qwen2.5"].default_system ==
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  CHECK(families["llama3"].format == ChatFormat::llama3);
  CHECK(families["llama3"].default_system.empty());

  int checked = 0;
  for (const auto& chat : golden.at("chats")) {
    std::vector<ChatMessage> messages;
    for (const auto& m : chat.at("messages")) messages.push_back({m.at("role"), m.at("content")});
    const Family& family = families.at(chat.at("family"));
    INFO(chat.at("family").get<std::string>() << " " << chat.at("messages").dump());
    CHECK(apply_chat_template(family.format, messages, chat.at("add_generation_prompt"),
                              family.default_system) == chat.at("text").get<std::string>());
    ++checked;
  }
  CHECK(checked == 24);
}
