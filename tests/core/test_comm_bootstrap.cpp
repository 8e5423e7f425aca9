// Rank bootstrap: the launchers' variables (tandem launch/torchrun, mpirun, srun), Slurm node
// lists, and their errors; then real ranks under mpirun and with Slurm-style variables.
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <map>
#include <string>

#include "core/error.h"
#include "core/rendezvous.h"
#include "tests/testutil.h"
#include "trainer/job_config.h"

namespace {

using tandem::rendezvous::detect_rank_info;
using tandem::rendezvous::expand_slurm_nodelist;
using tandem::rendezvous::RankInfo;

RankInfo detect(const std::map<std::string, std::string>& env, const std::string& master = "") {
  return detect_rank_info(
      [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      master);
}

std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    detect(env);
  } catch (const tandem::Error& e) {
    return e.what();
  }
  return "";
}

std::string worker() { return std::string(TANDEM_BIN_DIR) + "/tandem_comm_worker"; }

}  // namespace

TEST_CASE("Slurm node lists expand ranges lists and zero padding", "[unit]") {
  CHECK(expand_slurm_nodelist("node07") == std::vector<std::string>{"node07"});
  CHECK(expand_slurm_nodelist("node[1-3,5],gpu07") ==
        std::vector<std::string>{"node1", "node2", "node3", "node5", "gpu07"});
  CHECK(expand_slurm_nodelist("n[08-10]-ib") ==
        std::vector<std::string>{"n08-ib", "n09-ib", "n10-ib"});
  CHECK(expand_slurm_nodelist("a[2],b[3-4]") == std::vector<std::string>{"a2", "b3", "b4"});
  CHECK_THROWS_WITH(expand_slurm_nodelist("node[1-3"), Catch::Contains("unbalanced"));
  CHECK_THROWS_WITH(expand_slurm_nodelist("node[3-1]"), Catch::Contains("not a range"));
}

TEST_CASE("torchrun-style variables give rank world and coordinator", "[unit]") {
  const auto info = detect({{"RANK", "3"},
                            {"WORLD_SIZE", "4"},
                            {"LOCAL_RANK", "1"},
                            {"MASTER_ADDR", "10.0.0.2"},
                            {"MASTER_PORT", "1234"}});
  CHECK(info.launcher == "torchrun");
  CHECK(info.rank == 3);
  CHECK(info.world_size == 4);
  CHECK(info.local_rank == 1);
  CHECK(info.master() == "10.0.0.2:1234");
  // --master overrides the variables.
  CHECK(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "x"}}, "y:99").master() ==
        "y:99");
}

TEST_CASE("Open MPI variables give rank world and a local coordinator on one node", "[unit]") {
  const auto info = detect({{"OMPI_COMM_WORLD_RANK", "1"},
                            {"OMPI_COMM_WORLD_SIZE", "2"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(info.launcher == "mpirun");
  CHECK(info.rank == 1);
  CHECK(info.world_size == 2);
  CHECK(info.master() == fmt::format("127.0.0.1:{}", tandem::rendezvous::kDefaultMasterPort));
  // Several nodes: Open MPI does not name rank 0's host, so the user must.
  CHECK_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "1"},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
             Catch::Contains("set MASTER_ADDR"));
}

TEST_CASE("Slurm variables take the coordinator from the node list", "[unit]") {
  const auto info = detect({{"SLURM_PROCID", "5"},
                            {"SLURM_NTASKS", "8"},
                            {"SLURM_LOCALID", "1"},
                            {"SLURM_NODEID", "2"},
                            {"SLURM_JOB_ID", "4242"},
                            {"SLURM_JOB_NODELIST", "other[1-9]"},
                            {"SLURM_STEP_NODELIST", "gpu[03-04,07]"}});
  CHECK(info.launcher == "srun");
  CHECK(info.rank == 5);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.node_rank == 2);
  CHECK(info.master() == fmt::format("gpu03:{}", tandem::rendezvous::kDefaultMasterPort + 242));
}

TEST_CASE("out-of-range and malformed launcher variables are named in the error", "[unit]") {
  CHECK_THAT(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}),
             Catch::Contains("rank 2 is out of range for world size 2"));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), Catch::Contains("WORLD_SIZE=0"));
  CHECK_THAT(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}),
             Catch::Contains("RANK='x' is not an integer"));
  CHECK_THAT(error_of({{"RANK", "0"}}), Catch::Contains("set both RANK and WORLD_SIZE"));
  CHECK_THAT(error_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}),
             Catch::Contains("rank 4 is out of range"));
  CHECK_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
             Catch::Contains("MASTER_PORT=70000 is out of range"));
  const auto single = detect({});
  CHECK(single.launcher == "single");
  CHECK(single.world_size == 1);
}

TEST_CASE("ranks bootstrap under mpirun", "[multiproc]") {
  const auto res = tandem::test::run_shell(fmt::format(
      "MASTER_PORT={} timeout -k 2 60 mpirun --allow-run-as-root --oversubscribe -np 2 {} info "
      "2>&1",
      tandem::test::free_port(), worker()));
  INFO(res.out);
  REQUIRE(res.status == 0);
  CHECK(res.out.find("rank 0 world 2 local 0 node 0 launcher mpirun") != std::string::npos);
  CHECK(res.out.find("rank 1 world 2 local 1 node 0 launcher mpirun") != std::string::npos);
  CHECK(res.out.find("sum 3") != std::string::npos);
}

TEST_CASE("ranks bootstrap from Slurm-style variables", "[multiproc]") {
  std::string script = "pids=''; ";
  const int port = tandem::test::free_port();
  for (int r = 0; r < 2; ++r)
    script += fmt::format(
        "SLURM_PROCID={} SLURM_NTASKS=2 SLURM_LOCALID={} SLURM_NODEID=0 "
        "SLURM_STEP_NODELIST=localhost MASTER_PORT={} timeout -k 2 60 {} info & pids=\"$pids "
        "$!\"; ",
        r, r, port, worker());
  script += "for p in $pids; do wait $p || echo failed $?; done";
  const auto res = tandem::test::run_shell("bash -c '" + script + "' 2>&1");
  INFO(res.out);
  CHECK(res.out.find("failed") == std::string::npos);
  CHECK(res.out.find(fmt::format("rank 0 world 2 local 0 node 0 launcher srun master localhost:{} "
                                 "sum 3",
                                 port)) != std::string::npos);
  CHECK(res.out.find("rank 1 world 2 local 1 node 0 launcher srun") != std::string::npos);
}

TEST_CASE("ranks bootstrap from torchrun-style variables", "[multiproc]") {
  std::string script = "pids=''; ";
  const int port = tandem::test::free_port();
  for (int r = 0; r < 3; ++r)
    script += fmt::format(
        "RANK={} WORLD_SIZE=3 LOCAL_RANK={} MASTER_ADDR=127.0.0.1 MASTER_PORT={} timeout -k 2 60 "
        "{} info & pids=\"$pids $!\"; ",
        r, r, port, worker());
  script += "for p in $pids; do wait $p || echo failed $?; done";
  const auto res = tandem::test::run_shell("bash -c '" + script + "' 2>&1");
  INFO(res.out);
  CHECK(res.out.find("failed") == std::string::npos);
  for (int r = 0; r < 3; ++r)
    CHECK(res.out.find(fmt::format("rank {} world 3 local {} node 0 launcher torchrun master "
                                   "127.0.0.1:{} sum 6",
                                   r, r, port)) != std::string::npos);
}

TEST_CASE("the distributed section of a job takes tcp or a file store and refuses others",
          "[unit]") {
  const std::string job =
      "[model]\npath = \"m.gguf\"\n[[rewards]]\nname = \"correct\"\nfunction = \"math_match\"\n";
  const auto defaults = tandem::trainer::parse_job_config(job, "job.toml");
  CHECK(defaults.distributed.store == "tcp");
  CHECK(defaults.distributed.timeout_s == 300);
  const std::vector<std::string> file_store{"distributed.store=file:/shared/run1",
                                            "distributed.master=node0:29400"};
  const auto shared = tandem::trainer::parse_job_config(job, "job.toml", file_store);
  CHECK(shared.distributed.store == "file:/shared/run1");
  CHECK(shared.distributed.master == "node0:29400");
  for (const std::string bad : {"distributed.store=redis", "distributed.store=file:"}) {
    const std::vector<std::string> overrides{bad};
    CHECK_THROWS_WITH(tandem::trainer::parse_job_config(job, "job.toml", overrides),
                      Catch::Contains("distributed.store") &&
                          Catch::Contains("expected \"tcp\" or \"file:/shared/dir\""));
  }
  const std::vector<std::string> zero{"distributed.timeout_s=0"};
  CHECK_THROWS_WITH(tandem::trainer::parse_job_config(job, "job.toml", zero),
                    Catch::Contains("distributed.timeout_s"));
}
