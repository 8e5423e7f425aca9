// The backend-parity table (after llama.cpp's test-backend-ops): each case makes random inputs
// on the CPU and runs one op; the runner runs it on the CPU and on CUDA with guard bytes around
// every output and compares. A new op means a new case here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::test {

struct ParityCase {
  // "<op> <what>": the op name as in kernels/ops.h first, e.g. "matmul bf16 (7, 576)x(1536, 576)".
  std::string name;
  // The inputs, on the CPU, from a seed.
  std::function<std::vector<Tensor>(uint64_t seed)> inputs;
  // The outputs' initial contents, on the CPU (zeros, or random values for ops that accumulate).
  std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)> outputs;
  // Runs the op; inputs and outputs are all on the device it should run on.
  std::function<void(const std::vector<Tensor>& in, const std::vector<Tensor>& out)> run;
  // Largest normalised MSE allowed between CUDA and CPU, per float output.
  double max_nmse = 1e-6;
  // Smallest fraction of equal elements, per integer output (sampled tokens may differ at ties).
  double min_int_match = 1.0;
};

// Adds a case to the table; returns its index.
int add_parity_case(ParityCase c);
const std::vector<ParityCase>& parity_cases();

// Runs a case on `device` with guard bytes before and after every output; checks the guards
// (CHECK) and returns the outputs copied to the CPU.
std::vector<Tensor> run_guarded(const ParityCase& c, const std::vector<Tensor>& cpu_inputs,
                                Device device);

// The ops every backend must implement: the parity table must hold a case for each.
const std::vector<std::string>& ops_with_parity();

}  // namespace tandem::test

// TANDEM_PARITY_CASES(family) { add_parity_case({...}); ... } registers a family's cases.
#define TANDEM_PARITY_CASES(family)                                      \
  static void tandem_parity_cases_##family();                            \
  [[maybe_unused]] static const bool tandem_parity_registered_##family = \
      (tandem_parity_cases_##family(), true);                            \
  static void tandem_parity_cases_##family()
