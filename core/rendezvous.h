// Rank bootstrap: who this process is (rank, world, coordinator) from the launcher that started it
// (tandem launch and torchrun, mpirun, srun), and the key-value store the ranks meet in (a TCP
// store served by rank 0, or a gloo FileStore on a shared directory).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace gloo::rendezvous {
class Store;
}

namespace tandem::rendezvous {

// Where this process stands in the job.
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;       // index among the ranks of this node
  int node_rank = 0;        // index of this node
  std::string master_addr;  // the coordinator: rank 0's host, where the TCP store listens
  int master_port = 0;
  std::string launcher;  // "torchrun" (tandem launch, torchrun), "mpirun", "srun" or "single"
  // How each field was found, for error messages ("RANK=3", "OMPI_COMM_WORLD_SIZE=2").
  std::string source;

  std::string master() const;  // "HOST:PORT"
};

// The coordinator's port when no launcher variable nor --master names one.
inline constexpr int kDefaultMasterPort = 29500;

// Reads the environment through `getenv` (a test passes its own): RANK/WORLD_SIZE/LOCAL_RANK/
// MASTER_ADDR/MASTER_PORT first (tandem launch, torchrun), then OMPI_COMM_WORLD_* (mpirun), then
// SLURM_PROCID/NTASKS/LOCALID/NODEID (srun); none of them: a single process. MASTER_ADDR and
// MASTER_PORT, or `master` ("HOST:PORT", "HOST" or ":PORT") when given, name the coordinator under
// every launcher; otherwise mpirun on one node and a single process use 127.0.0.1, srun the first
// host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), with port kDefaultMasterPort (mpirun, srun:
// plus the job id modulo 1000, so that two jobs on a node rarely meet). Throws tandem::Error on
// out-of-range or malformed values, naming the variable.
using GetEnv = std::function<const char*(const char*)>;
RankInfo detect_rank_info(const GetEnv& getenv, const std::string& master = "");
RankInfo detect_rank_info_from_environment(const std::string& master = "");

// Slurm's compressed host lists: "node[1-3,5],gpu07" -> node1 node2 node3 node5 gpu07 (zero
// padding kept: "n[08-10]" -> n08 n09 n10). Throws tandem::Error on a malformed list.
std::vector<std::string> expand_slurm_nodelist(const std::string& list);

// Splits "HOST:PORT" ("[v6]:PORT" too); a missing part stays empty / 0.
std::pair<std::string, int> split_host_port(const std::string& text);

// A gloo store whose every wait is bounded: tcp (rank 0 serves it at the coordinator, every rank is
// a client of it) or file (gloo's FileStore in a shared directory).
class Store {
 public:
  virtual ~Store() = default;
  virtual gloo::rendezvous::Store& gloo() = 0;
  // The address other ranks reach this process at ("" when unknown: the caller picks one).
  virtual std::string local_address() const = 0;
  // "tcp store at HOST:PORT" or "file store in DIR", for messages.
  virtual std::string describe() const = 0;
};

// Opens distributed.store ("tcp" or "file:/shared/dir") for this rank. tcp: rank 0 binds the
// coordinator's port (an error says so when it is in use), every rank connects within
// `timeout` (an error names the address when it cannot). Every later get/wait is bounded by
// `timeout` too and names the missing keys.
std::unique_ptr<Store> open_store(const std::string& spec, const RankInfo& info,
                                  std::chrono::milliseconds timeout);

// The TCP store's server alone (rank 0 runs one inside open_store): serves until destroyed.
// Binds 0.0.0.0:port (port 0: a free port, then port() tells which).
class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  int port() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// Bounds of the TCP store's messages; a larger key or value is refused with an error.
inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoreValueBytes = size_t{64} << 20;

}  // namespace tandem::rendezvous
