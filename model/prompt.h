// Prompts as the model sees them: the chat format of a job or a rollout worker (model.chat_template
// resolved against the tokenizer, and a system prompt) and render_prompt, which turns a text
// prompt or chat messages into the prompt's text and token ids.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/chat_template.h"
#include "model/loader.h"
#include "model/tokenizer.h"

namespace tandem::model {

// How a prompt becomes the model's input: model.chat_template resolved against the tokenizer,
// and a system prompt.
struct PromptFormat {
  bool chat = true;           // false: the prompt text as it is ("none")
  ChatStyle style{};          // the chat format and its default system prompt, when chat
  std::string system_prompt;  // inserted as the first message when the conversation has none
};

// model.chat_template:
//  "auto"    the model's own template (chat_style of the tokenizer)
//  "none"    no template: the prompt text as it is (see render_prompt)
//  "chatml" | "llama3" | "plain"   that format, without a default system prompt
//  a path    a Jinja template file, recognised by its markers as ChatML or Llama 3 (tandem renders
//            those formats without Jinja), with the default system prompt it holds.
// Throws naming the value when a file is missing or is neither format.
PromptFormat prompt_format(const Tokenizer& tok, const std::string& chat_template,
                           const std::string& system_prompt = "");

// A prompt ready for the engine: the text the model sees (what reward functions get as the
// prompt) and its token ids.
struct RenderedPrompt {
  std::string text;
  std::vector<int32_t> tokens;  // (T)
};

// The prompt of `messages`, or of `text` (one user message) when messages is empty.
//  format.chat: the conversation (with the system prompt first when it is not empty and the
//    conversation has none; else the format's default system prompt) rendered in format.style
//    with the assistant generation prompt, special tokens parsed. For a text prompt and no system
//    prompt under "auto" the tokens equal encode_prompt(tok, text, true).
//  otherwise: the text as it is (prefixed by the system prompt and a blank line when given);
//    chat messages (with the system prompt as above) are rendered in the plain "role: content"
//    format. Special tokens are not parsed.
// bos first when the tokenizer asks for it.
RenderedPrompt render_prompt(const Tokenizer& tok, const std::string& text,
                             std::span<const ChatMessage> messages, const PromptFormat& format);

}  // namespace tandem::model
