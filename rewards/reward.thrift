// The remote reward service: tandem sends batches of samples, the server returns one score each.
//
// Transport: framed (TFramedTransport) over TCP, binary protocol (TBinaryProtocol). Servers bind
// 127.0.0.1 unless told otherwise. docs/rewards.md ("Remote reward service") has the semantics;
// examples/python/reward_server.py and examples/reward_server/ are servers to start from.

namespace cpp tandem.rewards.rpc
namespace py tandem_reward

// Raised when this file changes incompatibly; info() reports the server's.
const i32 PROTOCOL_VERSION = 1

// One completion to score (rewards/reward.h: RewardSample).
struct Sample {
  1: string prompt = ""            // the prompt text as the model saw it (chat template applied)
  2: string completion = ""        // the generated text
  3: string answer = ""            // the dataset's reference answer ("" when there is none)
  4: string extra_json = "{}"      // further dataset fields, a JSON object
  5: i64 completion_tokens = 0
  6: bool truncated = false        // generation stopped at the token limit
}

struct ScoreRequest {
  1: string request_id = ""        // chosen by the client, echoed in the response and in logs
  2: list<Sample> samples
  3: string token = ""             // the shared token, when the server requires one
}

// The score of one sample. ok = false: the server could not judge this sample (error says why);
// tandem gives it the reward's fallback value and counts it.
struct Score {
  1: double value = 0.0
  2: bool ok = true
  3: string error = ""
}

struct ScoreResponse {
  1: list<Score> scores            // exactly one per sample, in order
  2: string request_id = ""
}

struct ServerInfo {
  1: string name = ""
  2: string version = ""
  3: i32 protocol_version = PROTOCOL_VERSION
  4: i32 max_batch_size = 0        // samples per request at most; 0: no limit stated
}

// The request is malformed or over a bound (batch size, field size); retrying it will not help.
exception InvalidRequest {
  1: string message
}

// The token is missing or wrong.
exception Unauthorized {
  1: string message
}

// The server is busy; the client may retry after a pause.
exception Overloaded {
  1: string message
}

service RewardService {
  ScoreResponse score(1: ScoreRequest request)
      throws (1: InvalidRequest invalid, 2: Unauthorized unauthorized, 3: Overloaded overloaded)

  // True when the server can score; needs no token.
  bool health()

  // Needs no token.
  ServerInfo info()
}
