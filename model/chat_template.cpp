// Chat templates without Jinja: format detection by marker, default system prompts read from the
// template text, and the ChatML, Llama 3 and plain renderings.
#include "model/chat_template.h"

#include <spdlog/spdlog.h>

#include <string_view>

namespace tandem::model {
namespace {

// Jinja's trim filter (Python's str.strip()) on ASCII whitespace.
std::string_view trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  const size_t begin = s.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  return s.substr(begin, s.find_last_not_of(kSpace) - begin + 1);
}

}  // namespace

const char* chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::chatml:
      return "chatml";
    case ChatFormat::llama3:
      return "llama3";
    case ChatFormat::plain:
      return "plain";
  }
  return "?";
}

ChatFormat detect_chat_format(const std::string& jinja_template) {
  if (jinja_template.find("<|im_start|>") != std::string::npos) return ChatFormat::chatml;
  if (jinja_template.find("<|start_header_id|>") != std::string::npos) return ChatFormat::llama3;
  if (jinja_template.empty())
    spdlog::info("chat template: none given, using the plain format (role: content)");
  else
    spdlog::warn(
        "chat template: neither ChatML nor Llama 3 markers found, using the plain format "
        "(role: content); tandem does not run Jinja templates");
  return ChatFormat::plain;
}

std::string default_system_prompt(const std::string& jinja_template) {
  constexpr std::string_view kStart = "<|im_start|>system";
  constexpr std::string_view kEnd = "<|im_end|>";
  for (size_t at = jinja_template.find(kStart); at != std::string::npos;
       at = jinja_template.find(kStart, at + 1)) {
    size_t text = at + kStart.size();
    // The newline is a real one or Jinja's escape "\n" inside a string literal.
    if (jinja_template.compare(text, 1, "\n") == 0)
      text += 1;
    else if (jinja_template.compare(text, 2, "\\n") == 0)
      text += 2;
    else
      continue;
    const size_t end = jinja_template.find(kEnd, text);
    if (end == std::string::npos) break;
    const std::string_view prompt = std::string_view(jinja_template).substr(text, end - text);
    // A literal prompt lies inside one string literal: no quotes, no Jinja syntax.
    if (prompt.empty() || prompt.find_first_of("'\"{}") != std::string_view::npos) continue;
    if (prompt.find("\\n") != std::string_view::npos) continue;
    return std::string(prompt);
  }
  return "";
}

std::string apply_chat_template(ChatFormat format, std::span<const ChatMessage> messages,
                                bool add_generation_prompt, const std::string& default_system) {
  const bool add_system =
      !default_system.empty() && (messages.empty() || messages[0].role != "system");
  std::string out;
  switch (format) {
    case ChatFormat::chatml: {
      auto put = [&](std::string_view role, std::string_view content) {
        out += "<|im_start|>";
        out += role;
        out += '\n';
        out += content;
        out += "<|im_end|>\n";
      };
      // SmolLM2's template adds its default inside the loop: nothing for an empty conversation.
      if (add_system && !messages.empty()) put("system", default_system);
      for (const ChatMessage& m : messages) put(m.role, m.content);
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    }
    case ChatFormat::llama3: {
      // Meta's template puts bos before the first message: none for an empty conversation.
      if (add_system || !messages.empty()) out += "<|begin_of_text|>";
      auto put = [&](std::string_view role, std::string_view content) {
        out += "<|start_header_id|>";
        out += role;
        out += "<|end_header_id|>\n\n";
        out += trim(content);
        out += "<|eot_id|>";
      };
      if (add_system) put("system", default_system);
      for (const ChatMessage& m : messages) put(m.role, m.content);
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case ChatFormat::plain: {
      bool first = true;
      auto put = [&](std::string_view role, std::string_view content) {
        if (!first) out += '\n';
        first = false;
        out += role;
        out += ": ";
        out += content;
      };
      if (add_system) put("system", default_system);
      for (const ChatMessage& m : messages) put(m.role, m.content);
      if (add_generation_prompt) out += first ? "assistant: " : "\nassistant: ";
      break;
    }
  }
  return out;
}

}  // namespace tandem::model
