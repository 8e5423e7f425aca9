// The rollout service: a tandem rollout worker (`tandem serve`) generates completions with token
// ids, logprobs and the weight version that produced them, and takes new weights between steps.
//
// Transport: framed (TFramedTransport) over TCP, binary protocol (TBinaryProtocol). Workers bind
// 127.0.0.1 unless told otherwise; one bound to any other address requires a token. Every call
// carries the token (empty when the worker has none). docs/serve.md has the semantics and
// examples/python/rollout_client.py a client to start from.

namespace cpp tandem.rollout.rpc
namespace py tandem_rollout

// Raised when this file changes incompatibly; info() reports the worker's.
const i32 PROTOCOL_VERSION = 1

// One chat message; a conversation is rendered with the worker's chat template
// (model.chat_template of its config) and the assistant's generation prompt.
struct Message {
  1: string role = ""              // "system", "user", "assistant", ...
  2: string content = ""
}

// How to sample (rollout/engine.h: SamplingParams).
struct SamplingParams {
  1: i32 n = 1                     // samples of the prompt, prefilled once; 1..limits.max_n
  2: double temperature = 1.0      // 0: greedy
  3: double top_p = 1.0            // in (0, 1]
  4: double min_p = 0.0            // in [0, 1]
  5: i32 top_k = 0                 // 0: off
  6: i32 max_tokens = 128          // completion tokens per sample, 1..limits.max_new_tokens
  7: list<i32> stop_token_ids      // the sample ends after one of these (it is kept)
  8: list<string> stop             // stop strings (cut off the text)
  9: i64 seed = 0                  // sample i draws from the Philox stream seed + i
  10: bool logprobs = true         // report each sampled token's logprob
  11: bool stop_at_eos = true      // the model's end-of-sequence ids are stop ids too
}

// Exactly one of prompt_tokens, prompt_text and messages holds the prompt.
struct GenerateRequest {
  1: string request_id = ""        // chosen by the client; abort() names it; echoed back
  2: list<i32> prompt_tokens       // token ids, as they are
  3: string prompt_text = ""       // text, tokenized as it is (no template; bos when the model
                                   // asks for it)
  4: list<Message> messages        // a conversation, rendered with the chat template
  5: SamplingParams params
  // StaleWeights unless the worker's weights are at least this version.
  6: i64 min_weight_version = 0
  7: string token = ""
}

enum FinishReason {
  STOP = 1,                        // a stop id or stop string
  LENGTH = 2,                      // max_tokens
  ABORT = 3                        // abort() ended it
}

struct Sample {
  1: list<i32> tokens              // completion token ids
  2: string text                   // completion text (a stop string cut off)
  3: list<double> logprobs         // per token (empty when params.logprobs is false)
  4: FinishReason finish_reason
  5: string stop_string = ""       // the stop string that ended it, if one did
  6: i64 weight_version = 0        // the weights that produced the last token
  7: i64 first_weight_version = 0  // the weights that produced the first token
}

struct GenerateResponse {
  1: string request_id = ""
  2: list<i32> prompt_tokens       // the prompt as the model saw it
  3: string prompt_text = ""       // its text, when the request gave text or messages
  4: list<Sample> samples          // n of them, sample i at index i
  5: bool aborted = false          // abort() ended the request
  6: i64 cached_prompt_tokens = 0  // prompt tokens found in the prefix cache
}

struct AbortRequest {
  1: string request_id = ""        // "": every request in flight
  2: string token = ""
}

// Weights in two phases: begin pauses generation (requests in flight stay, and go on under the
// new weights after commit); commit loads the checkpoint, stamps `version` and resumes.
struct WeightUpdate {
  1: i64 version = 0               // must exceed the worker's current version (commit)
  // A Hugging Face directory (or .safetensors / GGUF file) of the same model shapes, read by the
  // worker (commit).
  2: string checkpoint_path = ""
  3: string token = ""
}

struct Stats {
  1: i64 queue_depth = 0           // requests waiting for their first step
  2: i64 running_sequences = 0     // sequences holding KV blocks
  3: i64 free_kv_blocks = 0
  4: i64 total_kv_blocks = 0
  5: double tokens_per_s = 0.0     // prefill + decode tokens per second over the last seconds
  6: i64 in_flight = 0             // generate calls admitted and not yet answered
  7: i64 generated = 0             // generate calls answered with samples since the start
  8: i64 overloaded = 0            // generate calls refused with Overloaded
  9: i64 weight_version = 0
  10: bool paused = false
  // Weight updates that ended without new weights: the commit failed, none came within
  // limits.weight_update_timeout_s of the begin, or resume() ended it. The worker serves the
  // weights it had; the last one's reason is last_weight_update_error.
  11: optional i64 weight_updates_abandoned
  12: optional string last_weight_update_error
}

struct ServerInfo {
  1: string name = ""
  2: string version = ""           // tandem's
  3: i32 protocol_version = PROTOCOL_VERSION
  4: string model = ""             // the model path the worker loaded
  5: i32 tp_size = 1               // devices one replica spans (tensor parallel)
  6: i32 vocab_size = 0
  7: list<i32> eos_token_ids
  8: i32 max_in_flight = 0         // generate calls admitted at once; more are Overloaded
  9: i32 max_prompt_tokens = 0
  10: i32 max_new_tokens = 0
  11: i32 max_n = 0
  12: i64 max_message_bytes = 0
}

// The request is malformed or over a bound; retrying it will not help.
exception InvalidRequest {
  1: string message
}

// The worker is busy (max_in_flight) or shutting down; retry after a pause, or elsewhere.
exception Overloaded {
  1: string message
}

// The worker's weights are older than the request's min_weight_version.
exception StaleWeights {
  1: string message
  2: i64 have_version = 0
  3: i64 want_version = 0
}

// The token is missing or wrong.
exception Unauthorized {
  1: string message
}

// The worker failed; the message says why.
exception Internal {
  1: string message
}

service RolloutService {
  GenerateResponse generate(1: GenerateRequest request)
      throws (1: InvalidRequest invalid, 2: Overloaded overloaded, 3: StaleWeights stale,
              4: Unauthorized unauthorized, 5: Internal internal)

  // Ends the request(s); their generate calls return what was generated (aborted = true).
  // Returns how many requests it ended.
  i32 abort(1: AbortRequest request) throws (1: Unauthorized unauthorized)

  // Pause stops stepping (calls in flight wait; new ones queue within max_in_flight); resume
  // goes on.
  void pause(1: string token) throws (1: Unauthorized unauthorized)
  void resume(1: string token) throws (1: Unauthorized unauthorized)

  void begin_weight_update(1: WeightUpdate update)
      throws (1: InvalidRequest invalid, 2: Unauthorized unauthorized)
  // Returns the new version.
  i64 commit_weight_update(1: WeightUpdate update)
      throws (1: InvalidRequest invalid, 2: Unauthorized unauthorized, 3: Internal internal)

  i64 weight_version(1: string token) throws (1: Unauthorized unauthorized)

  // Generates one token of a one-token prompt; true when it did.
  bool health(1: string token) throws (1: Unauthorized unauthorized, 2: Internal internal)

  Stats stats(1: string token) throws (1: Unauthorized unauthorized)

  ServerInfo info(1: string token) throws (1: Unauthorized unauthorized)
}
