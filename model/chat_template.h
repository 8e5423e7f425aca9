// Chat templates without Jinja: the ChatML (SmolLM2, Qwen2.5), Llama 3 and plain formats,
// rendered byte for byte as HF's apply_chat_template renders those models' templates.
#pragma once

#include <span>
#include <string>

namespace tandem::model {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

enum class ChatFormat { chatml, llama3, plain };

// The format a Jinja chat template renders, by its markers: "<|im_start|>" -> chatml,
// "<|start_header_id|>" -> llama3, anything else (or empty) -> plain (logged).
ChatFormat detect_chat_format(const std::string& jinja_template);

// The system prompt a ChatML template inserts when the conversation has none, read from the
// template's literal "<|im_start|>system\n...<|im_end|>" text (SmolLM2: "You are a helpful AI
// assistant named SmolLM, trained by Hugging Face"; Qwen2.5: "You are Qwen, created by Alibaba
// Cloud. You are a helpful assistant."); empty when it has none.
std::string default_system_prompt(const std::string& jinja_template);

const char* chat_format_name(ChatFormat format);

// The prompt text for `messages`:
//  chatml: [<|im_start|>system\n{default_system}<|im_end|>\n when messages[0] is not a system
//          message and default_system is not empty] then <|im_start|>{role}\n{content}<|im_end|>\n
//          per message, and <|im_start|>assistant\n when add_generation_prompt.
//  llama3: <|begin_of_text|> (when there is a message) then
//  <|start_header_id|>{role}<|end_header_id|>\n\n{content,
//          whitespace-trimmed}<|eot_id|> per message (a system message {default_system} first
//          when given and there is none), and <|start_header_id|>assistant<|end_header_id|>\n\n
//          when add_generation_prompt.
//  plain:  "{role}: {content}" per message joined by "\n" (with "system: {default_system}" first
//          when given and there is none), then "\nassistant: " when add_generation_prompt.
std::string apply_chat_template(ChatFormat format, std::span<const ChatMessage> messages,
                                bool add_generation_prompt, const std::string& default_system = "");

}  // namespace tandem::model
