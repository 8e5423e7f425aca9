// The NCCL backend of the Communicator (CUDA tensors): one rank on one GPU in this process, and
// two ranks on two GPUs as processes, against the same references as Gloo; a stuck peer is
// reported at the timeout after the communicator is aborted. Skipped (77) without the GPUs.
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "core/comm.h"
#include "core/device.h"
#include "tests/testutil.h"

namespace {

void skip_without_two_gpus() {
  tandem::test::skip_without_gpu();
  if (tandem::cuda_device_count() >= 2) return;
  std::printf("SKIPPED: two ranks of NCCL need two GPUs; %s\n", tandem::gpu_summary().c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

std::string two_ranks(const std::string& scenario, const std::string& env) {
  return fmt::format(
      "{}/tandem launch --nproc 2 -- env TANDEM_TEST_DEVICE=cuda {} {}/tandem_comm_worker {} 2>&1",
      TANDEM_BIN_DIR, env, TANDEM_BIN_DIR, scenario);
}

}  // namespace

TEST_CASE("NCCL collectives of one rank on one GPU leave the tensors as they are", "[gpu]") {
  tandem::test::skip_without_gpu();
  tandem::rendezvous::RankInfo info;
  info.master_addr = "127.0.0.1";
  info.master_port = tandem::test::free_port();
  tandem::CommOptions options;
  options.timeout_s = 60;
  options.device = tandem::Device::cuda(0);
  auto comm = tandem::Communicator::create(info, options);
  const tandem::Tensor host = tandem::test::random_tensor({1000}, tandem::DType::f32, 3);
  tandem::Tensor t = host.to(options.device);
  comm->all_reduce(t);
  comm->broadcast(t, 0);
  tandem::Tensor out = tandem::Tensor::empty({1000}, tandem::DType::f32, options.device);
  comm->all_gather(t, out);
  comm->reduce_scatter(out, t, tandem::ReduceOp::max);
  comm->barrier();
  CHECK(tandem::test::bitwise_equal(t.to(tandem::Device::cpu()), host));
  // CPU tensors of the same communicator still go over Gloo.
  tandem::Tensor cpu = host.to(tandem::Device::cpu());
  comm->all_reduce(cpu);
  CHECK(tandem::test::bitwise_equal(cpu, host));
}

TEST_CASE("NCCL collectives at world size 2 match a plain reference", "[gpu]") {
  skip_without_two_gpus();
  const auto res = tandem::test::run_shell(two_ranks("cuda", "TANDEM_TEST_TIMEOUT_S=60"));
  INFO(res.out);
  CHECK(res.status == 0);
  CHECK(res.out.find("[rank 0] ok rank 0 of 2") != std::string::npos);
  CHECK(res.out.find("[rank 1] ok rank 1 of 2") != std::string::npos);
}

TEST_CASE("a stuck rank makes NCCL time out and abort naming the collective", "[gpu]") {
  skip_without_two_gpus();
  // Rank 1 sleeps; rank 0 reports the timeout and exits 3, and tandem launch stops rank 1.
  const auto res =
      tandem::test::run_shell("timeout -k 5 60 " + two_ranks("stuck 1", "TANDEM_TEST_TIMEOUT_S=5"));
  INFO(res.out);
  CHECK(res.status == 3);
  CHECK(res.out.find("all_reduce on group 'world' (rank 0 of 2, 16384 bytes) (NCCL on cuda:0)") !=
        std::string::npos);
  CHECK(res.out.find("the NCCL communicator was aborted") != std::string::npos);
}
