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
const i32 PROTOCOL_VERSION = 2

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
  // Per token, the weights that produced it (a sample running across a weight update continues
  // on the new weights: a partial rollout, its tokens of two or more versions in order).
  8: list<i64> token_versions
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

// Weights over the wire, the trainer's push to a worker (docs/serve.md, "Weights over the
// wire"): begin_weight_push(version), then buckets of at most max_bucket_bytes of data, each a run
// of tensor pieces packed one after another, then commit_weight_push. The worker receives into a
// copy of its own, generating under its weights meanwhile, and swaps the copy in between two
// engine steps at the commit; a push that never commits leaves it on the weights it has.

// The element type of a bucket's data (little-endian).
enum WeightDType {
  F32 = 1,
  BF16 = 2
}

// What in a push the worker refused.
enum WeightPushFault {
  VERSION = 1,     // not newer than the worker's, or not the version of the push in progress
  NAME = 2,        // a tensor the worker's model does not have
  SIZE = 3,        // a piece outside its tensor, or data of another length than its pieces
  DTYPE = 4,       // data in a type the worker does not take (its own, or F32, cast on arrival)
  CHECKSUM = 5,    // data whose XXH3-64 is not the bucket's xxh3
  OVERLAP = 6,     // a piece of a tensor that another bucket of the push carried already
  INCOMPLETE = 7,  // a commit before every tensor, or every bucket, arrived
  NO_PUSH = 8      // a bucket or commit without a push begun (never begun, committed, or ended)
}

// A run of `elements` elements of tensor `name` (its Hugging Face name, e.g.
// "model.layers.0.self_attn.q_proj.weight"; row-major) from element `offset` on.
struct WeightPiece {
  1: string name = ""
  2: i64 offset = 0
  3: i64 elements = 0
}

struct WeightPushBegin {
  1: i64 version = 0               // must exceed the worker's; a push in progress is ended
  2: string token = ""
}

struct WeightPushReady {
  1: i64 worker_version = 0        // the weights it serves
  2: WeightDType dtype = WeightDType.F32  // of its weights: data in it is copied, F32 data cast
  // What one bucket may carry at most: its data, and each piece as its name's bytes + 32 (the
  // frame of limits.max_message_bytes less 4 KiB).
  3: i64 max_bucket_bytes = 0
  // The worker's data channel (rollout/service/weight_channel.h): a plain TCP port on the same host
  // that takes this push's buckets straight into place, each read once (no Thrift frame); absent
  // or 0: send them by push_weight_bucket.
  4: optional i32 data_port
}

struct WeightBucket {
  1: i64 version = 0               // the push's
  2: i32 index = 0                 // 0, 1, ...: a bucket sent again (a retry) is taken once
  3: WeightDType dtype = WeightDType.F32
  4: list<WeightPiece> pieces      // their data packed one after another in `data`
  5: binary data
  // 6: retired (the CRC-32C of earlier builds)
  7: string token = ""
  8: i64 xxh3 = 0                   // XXH3-64 (seed 0) of data, its 64 bits as an i64
}

struct WeightPushCommit {
  1: i64 version = 0
  2: i32 buckets = 0               // buckets the push sent; each must have arrived
  3: string token = ""
  // Samples already started when the new weights are taken: true, they go on under the new
  // weights from the next engine step (a partial rollout: per-token versions); false, they finish
  // under the old ones, and samples not started wait for them (the worker reports the new version
  // from the commit on).
  4: bool partial = true
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

// A push of weights (or a piece of one) the worker refused; the message names what is wrong.
exception WeightPushRefused {
  1: string message
  2: WeightPushFault fault
  3: i64 worker_version = 0        // the weights it serves, which it keeps
  4: string tensor = ""            // the tensor at fault, if one is
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

  // Weights over the wire (above). Commit returns the new version, in use for every later step.
  WeightPushReady begin_weight_push(1: WeightPushBegin push)
      throws (1: WeightPushRefused refused, 2: Unauthorized unauthorized)
  void push_weight_bucket(1: WeightBucket bucket)
      throws (1: WeightPushRefused refused, 2: Unauthorized unauthorized)
  i64 commit_weight_push(1: WeightPushCommit push)
      throws (1: WeightPushRefused refused, 2: Unauthorized unauthorized, 3: Internal internal)

  i64 weight_version(1: string token) throws (1: Unauthorized unauthorized)

  // Generates one token of a one-token prompt; true when it did.
  bool health(1: string token) throws (1: Unauthorized unauthorized, 2: Internal internal)

  Stats stats(1: string token) throws (1: Unauthorized unauthorized)

  ServerInfo info(1: string token) throws (1: Unauthorized unauthorized)
}
