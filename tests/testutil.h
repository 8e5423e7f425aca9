// Helpers shared by the tests: seeded random tensors, comparisons, error bounds, finite
// differences, and skipping GPU tests on machines without one.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::test {

// Seeded uniform values in [lo, hi), rounded to the dtype (f32/bf16/f16), on the CPU.
Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, double lo = -1.0,
                     double hi = 1.0);
// Seeded integers in [lo, hi) (i32 or i64), on the CPU.
Tensor random_ints(const Shape& shape, DType dtype, uint64_t seed, int64_t lo, int64_t hi);
// A CPU tensor holding the given values, rounded to dtype.
Tensor tensor_from(const std::vector<double>& values, const Shape& shape, DType dtype = DType::f32);

// Every element as a double (any dtype, any device).
std::vector<double> to_f64(const Tensor& t);
bool bitwise_equal(const Tensor& a, const Tensor& b);
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b);
double max_abs(const std::vector<double>& a);
// Normalised mean squared error sum((a-b)^2) / sum(b^2), as llama.cpp's test-backend-ops uses.
double nmse(const std::vector<double>& a, const std::vector<double>& b);
bool all_finite(const Tensor& t);

// The flash-attention rule for tolerances: our result may be at most twice as far from the f64
// truth as a plain same-precision reference is (plus a few ulps of the largest value).
// Reports the case through Catch (CHECK) with `what` and both errors.
void check_within_reference_error(const Tensor& ours, const std::vector<double>& truth,
                                  const std::vector<double>& same_precision,
                                  const std::string& what);

// Central finite differences of a scalar loss at `probes` random coordinates of x (f32, CPU;
// perturbed in place and restored), against the analytic gradient.
struct FdOptions {
  int probes = 24;
  double eps = 1e-2;
  double rtol = 2e-2;  // relative to the gradient's largest entry
  uint64_t seed = 7;
};
void check_gradient(const Tensor& x, const std::function<double()>& loss, const Tensor& grad,
                    const std::string& what, const FdOptions& opt = {});

// sum(w * y) in f64: the loss whose gradient with respect to y is w.
double weighted_sum(const Tensor& y, const Tensor& w);

// Whether a CUDA device is usable; GPU tests call skip_without_gpu() first, which prints why
// and ends the test process with ctest's "skipped" code (77) when there is none.
bool gpu_available();
void skip_without_gpu();

// GPT-2's byte -> character map of byte-level BPE vocabularies, written out for tests
// (independent of the tokenizer's own table): the UTF-8 text of byte b's character.
std::string gpt2_byte_char(int b);

// The whole file at `path` as bytes ("" when it cannot be read).
std::string read_text(const std::filesystem::path& path);

// A fresh directory under the system temp dir (named after the test and the process), removed
// with everything in it when the object goes.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
  // Writes `text` (bytes as they are) into the file `name` in the directory; returns its path.
  std::string write(const std::string& name, const std::string& text) const;
};

// Runs build/bin/tandem with args through the shell, as a user would: exit status and output
// (stdout, and stderr too when merge_stderr). With timeout_s > 0 the command is killed after that
// long (status 124, or 137 when it ignored SIGTERM for 5 s more). env: shell assignments put
// before the command ("NAME=value ...").
struct CommandResult {
  int status;
  std::string out;
};
CommandResult run_tandem(const std::string& args, bool merge_stderr = true, int timeout_s = 0,
                         const std::string& env = "");
// A shell command line as it is: its exit status and stdout.
CommandResult run_shell(const std::string& cmd);

// The ranks of a multi-process test: `n` processes started at once, rank r as
// `env_of(r) timeout -k 2 limit_s command` (env_of: shell assignments, e.g. torchrun_env), all
// waited for; each rank's exit status and output (stdout and stderr).
struct RankResult {
  int status = -1;
  std::string out;
};
std::vector<RankResult> run_ranks(int n, const std::function<std::string(int)>& env_of,
                                  const std::string& command, int limit_s = 60);
// torchrun's variables for rank r of n meeting at 127.0.0.1:port.
std::string torchrun_env(int r, int n, int port);

// A child process started from argv (no shell) whose stdout the test reads line by line; its
// stderr goes to the test's. The destructor stops it (SIGTERM, then SIGKILL after 5 s) and reaps
// it, so no test leaves a process behind.
class Subprocess {
 public:
  explicit Subprocess(const std::vector<std::string>& argv);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Reads stdout until a line starting with `prefix` and returns that line; "" when the child
  // closed stdout or timeout_ms passed first. Every line read is kept in output().
  std::string wait_for_line(const std::string& prefix, int timeout_ms);
  const std::string& output() const { return output_; }
  // Sends `signal` and waits up to timeout_ms for the exit (then SIGKILL); the exit status, or
  // 128 + the signal that ended it.
  int stop(int signal = 15, int timeout_ms = 5000);
  int pid() const { return pid_; }

 private:
  int pid_ = -1;
  int out_fd_ = -1;
  std::string pending_;  // stdout read past the last full line
  std::string output_;
  int status_ = -1;
};

// The `tandem train` arguments of a short run of configs/default.toml on the bundled model (2
// steps of 2 prompts x 2 samples of 8 tokens, eval of 2 prompts at every step) into
// tmp/run (checkpoints in tmp/run/ckpt).
std::string short_default_train_args(const TempDir& tmp);

// A loopback TCP port nobody listens on right now.
int free_port();

// A Python 3 interpreter that can import the thrift package: $TANDEM_PYTHON, else python3, else
// /usr/bin/python3 (Debian's python3-thrift lives there; a pyenv or venv python3 may lack it);
// "" when none can.
std::string python_with_thrift();
// The same, failing the test with what to install when there is none.
std::string require_python_with_thrift();

}  // namespace tandem::test
