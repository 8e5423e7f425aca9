/* The C ABI of a tandem reward plugin, version 1 (tandem_reward_v1).

   A plugin is a shared library exporting the five functions below with C linkage. tandem loads it
   by path (dlopen), checks tandem_reward_abi_version() == TANDEM_REWARD_ABI_VERSION, calls
   tandem_reward_v1_init once with the config string, tandem_reward_v1_score once per batch (never
   from two threads at once for one state), and tandem_reward_v1_free at the end.

   Return codes: 0 is success; anything else is a failure, and tandem_reward_v1_last_error(state)
   says why (a NUL-terminated string owned by the plugin, valid until the next call on that state).
   After a failed init, tandem calls tandem_reward_v1_last_error with whatever init left in *state
   (possibly NULL), so the plugin must answer for NULL too, then calls tandem_reward_v1_free on a
   non-NULL state. No C++ exception may leave these functions. A score that is NaN or infinite
   counts as a failure of that sample. */
#ifndef TANDEM_REWARD_PLUGIN_H_
#define TANDEM_REWARD_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TANDEM_REWARD_ABI_VERSION 1u

/* One sample. The strings are not NUL-terminated: use the lengths. They stay valid for the call. */
typedef struct tandem_reward_sample_v1 {
  const char* prompt;
  size_t prompt_len;
  const char* completion;
  size_t completion_len;
  const char* answer; /* the dataset's reference answer, "" when there is none */
  size_t answer_len;
  const char* extra_json; /* further dataset fields as a JSON object, "{}" when there are none */
  size_t extra_json_len;
  int64_t completion_tokens;
  int32_t truncated; /* 1: generation stopped at the token limit */
} tandem_reward_sample_v1;

uint32_t tandem_reward_abi_version(void);
int tandem_reward_v1_init(const char* config, void** state);
/* Writes n scores to out_scores. */
int tandem_reward_v1_score(void* state, const tandem_reward_sample_v1* samples, size_t n,
                           double* out_scores);
const char* tandem_reward_v1_last_error(void* state);
void tandem_reward_v1_free(void* state);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_REWARD_PLUGIN_H_ */
