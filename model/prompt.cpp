// prompt_format and render_prompt: a job's or a worker's prompts in the model's chat format.
#include "model/prompt.h"

#include <fstream>
#include <iterator>

#include "core/error.h"

namespace tandem::model {

PromptFormat prompt_format(const Tokenizer& tok, const std::string& chat_template,
                           const std::string& system_prompt) {
  PromptFormat f;
  f.system_prompt = system_prompt;
  if (chat_template == "auto") {
    f.style = chat_style(tok.data());
  } else if (chat_template == "none") {
    f.chat = false;
  } else if (chat_template == "chatml") {
    f.style.format = ChatFormat::chatml;
  } else if (chat_template == "llama3") {
    f.style.format = ChatFormat::llama3;
  } else if (chat_template == "plain") {
    f.style.format = ChatFormat::plain;
  } else {
    std::ifstream in(chat_template, std::ios::binary);
    TANDEM_CHECK(in.good(),
                 "model.chat_template '{}' is not \"auto\", \"none\", \"chatml\", \"llama3\", "
                 "\"plain\" nor a readable template file",
                 chat_template);
    const std::string jinja((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    f.style.format = detect_chat_format(jinja);
    TANDEM_CHECK(f.style.format != ChatFormat::plain,
                 "model.chat_template '{}': the template is neither ChatML (<|im_start|>) nor "
                 "Llama 3 (<|start_header_id|>), the formats tandem renders without Jinja; set "
                 "\"plain\" or \"none\" instead",
                 chat_template);
    f.style.default_system = default_system_prompt(jinja);
  }
  return f;
}

RenderedPrompt render_prompt(const Tokenizer& tok, const std::string& text,
                             std::span<const ChatMessage> messages, const PromptFormat& format) {
  std::vector<ChatMessage> conversation(messages.begin(), messages.end());
  if (conversation.empty()) conversation.push_back(ChatMessage{"user", text});
  const std::string& system = format.system_prompt;
  if (!system.empty() && conversation.front().role != "system") {
    conversation.insert(conversation.begin(), ChatMessage{"system", system});
  }
  RenderedPrompt p;
  if (format.chat) {
    p.text =
        apply_chat_template(format.style.format, conversation, true, format.style.default_system);
  } else if (messages.empty()) {
    p.text = system.empty() ? text : system + "\n\n" + text;
  } else {
    p.text = apply_chat_template(ChatFormat::plain, conversation, true);
  }
  p.tokens = tok.encode(p.text, /*parse_special=*/format.chat);
  if (tok.add_bos() && tok.bos_id() >= 0 && (p.tokens.empty() || p.tokens.front() != tok.bos_id()))
    p.tokens.insert(p.tokens.begin(), tok.bos_id());
  return p;
}

}  // namespace tandem::model
