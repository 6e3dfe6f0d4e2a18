// tandem/strategy/cluster_resolver.h — who this process is in a multi-worker job.
//
// MultiWorkerMirroredStrategy runs the same program on every worker process. Each process learns
// from its environment which training rank it is, how many there are, and where the chief serves
// the rendezvous store (collective/store.h) that the workers meet through. Three launchers are
// understood, as TensorFlow and PyTorch do:
//
//   TF_CONFIG  {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
//               "task": {"type": "worker", "index": 0}}                      (TFConfigClusterResolver)
//   torchrun   MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, ... (TorchrunClusterResolver)
//   SLURM      srun's SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST, ...  (SlurmClusterResolver)
//
// resolve_cluster() picks the one the environment asks for, or a single local worker.
//
// Ranks: the training processes are the chief (if any) and the "worker" tasks. They get ranks
// 0..num_workers()-1: the chief is rank 0 and worker i is rank i+1; with no chief job, worker 0
// is the chief (rank 0) and worker i is rank i (TF's multi_worker_util rule). An "evaluator" task
// is not training: its rank is -1.
//
// Everything here only reads the environment: nothing blocks, nothing connects. A malformed
// environment throws InvalidArgument whose message starts with the source ("TF_CONFIG: ",
// "torchrun: ", "SLURM: ") and quotes the offending part, e.g.
//   TF_CONFIG: task.index 3 is out of range: cluster.worker has 2 tasks
//   TF_CONFIG: cluster.worker[1] "localhost" is not host:port (no port)
// Whatever a variable holds, the answer is that InvalidArgument (never a crash, never another
// exception), and its message quotes at most a few hundred bytes, with control characters
// escaped. The limits: TF_CONFIG at most 1 MiB and JSON nested at most 32 levels (refused while
// parsing: a deeper value is never built, so nothing walks it recursively), numbers within
// double's range; host names at most 253 bytes with labels of at most 63 (RFC 1035), IPv6
// addresses at most 61 characters with their %zone; job names and task types at most 64 bytes.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/base/env.h"

namespace tandem::strategy {

// Reads one variable of the process environment (std::nullopt when unset). Tests pass a map
// instead (map_environment), so that no test has to change its own process's environment.
using EnvironmentLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The real environment (getenv). Cheap; reads happen when the returned function is called.
EnvironmentLookup process_environment();
// An environment holding exactly these variables (a copy of the map).
EnvironmentLookup map_environment(std::map<std::string, std::string> variables);

// tools/tandem-run sets this in a worker it restarts after a failure: 0 on the first start.
// Parsed by base/env's rule for integers.
inline constexpr std::string_view kRestartCountVariable = env::kRestartCount.name;
// Under SLURM the chief's rendezvous port comes from TANDEM_RENDEZVOUS_PORT, else MASTER_PORT,
// else this one (torchrun's default master port: sites often open it between nodes). It stands
// in for MASTER_PORT, so it is read as MASTER_PORT is, with the launcher's name in the error.
inline constexpr std::string_view kRendezvousPortVariable = env::kRendezvousPort.name;
inline constexpr int kDefaultSlurmPort = 29500;
// A single local worker (no launcher) serves its store on an ephemeral port.
inline constexpr std::string_view kLocalRendezvousAddress = "127.0.0.1:0";

// job name -> task addresses ("host:port") in task-index order, as TF's ClusterSpec. An empty
// address means "not known to this process" (torchrun and SLURM only know the chief's).
struct ClusterSpec {
  std::map<std::string, std::vector<std::string>> jobs;

  // Tasks in job; 0 when the job is absent.
  int num_tasks(std::string_view job) const;
  // The address of task `index` of `job`; InvalidArgument naming both when there is no such task.
  const std::string& task_address(std::string_view job, int index) const;
  // {"chief":["h:p"],"worker":["h:p",...]}: the "cluster" part of a TF_CONFIG.
  std::string to_json() const;

  friend bool operator==(const ClusterSpec&, const ClusterSpec&) = default;
};

// An address split into its parts. IPv6 hosts are written in brackets ("[::1]:2222"); host holds
// them without ("::1"), ready for getaddrinfo.
struct HostPort {
  std::string host;
  int port = 0;
};
// Splits "host:port" / "[v6]:port". InvalidArgument quoting the address and saying what is wrong
// (empty host, no port, a port that is not a number in 1..65535, a character no host name has).
HostPort split_host_port(std::string_view address);
// The inverse: "host:port", or "[host]:port" when host is an IPv6 address.
std::string join_host_port(std::string_view host, int port);

// Expands SLURM's compressed host list: "n[1-3,5],gpu07" -> n1 n2 n3 n5 gpu07; ranges keep the
// lower bound's zero padding ("node[001-010]" -> node001..node010); several bracket groups in one
// name expand as a product, first group outermost ("a[1-2]-b[3-4]" -> a1-b3 a1-b4 a2-b3 a2-b4).
// Order is kept and duplicates are not removed. InvalidArgument quoting the list for unbalanced
// or nested brackets, empty names, reversed or non-numeric ranges, more than kMaxSlurmNodes,
// names over 253 bytes or over 64 MiB of names in all (checked before anything is expanded).
inline constexpr int kMaxSlurmNodes = 1'000'000;
std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist);
// Expands SLURM's tasks-per-node syntax: "2(x3),1" -> {2, 2, 2, 1}. InvalidArgument quoting it
// when malformed.
std::vector<int> expand_slurm_tasks_per_node(std::string_view tasks_per_node);

// Who this process is in a multi-worker job. Implementations are immutable after construction;
// every accessor is cheap, never blocks and never throws except where noted.
class ClusterResolver {
 public:
  virtual ~ClusterResolver() = default;

  // "TF_CONFIG", "torchrun", "SLURM", "local".
  virtual std::string_view kind() const = 0;
  // The whole cluster; for torchrun and SLURM {"worker": [chief address, "", "", ...]} with one
  // entry per rank, since only the chief's address is known.
  virtual const ClusterSpec& cluster_spec() const = 0;
  // "chief", "worker" or "evaluator" (torchrun, SLURM and local: "worker", task_id() == rank()).
  virtual std::string task_type() const = 0;
  virtual int task_id() const = 0;
  // This process's training rank, 0..num_workers()-1; -1 for an evaluator (not training).
  virtual int rank() const = 0;
  // Training processes in the job (chief + workers; an evaluator is not counted).
  virtual int num_workers() const = 0;
  // "host:port" where the chief (rank 0) serves the rendezvous store; every worker connects here.
  virtual std::string rendezvous_address() const = 0;
  // Index of this process among the training processes on its machine (0 when unknown), and how
  // many there are (1 when unknown). Used to pick this process's GPU.
  virtual int local_rank() const = 0;
  virtual int local_world_size() const = 0;
  // How often tools/tandem-run restarted this worker (TANDEM_RESTART_COUNT), else 0.
  virtual int restart_count() const;

  bool is_chief() const { return rank() == 0; }

  // How messages name a training rank: "chief (h0:2222)", "worker 1 (127.0.0.1:2223)",
  // "rank 3" (torchrun), "rank 3 (SLURM node n2)". InvalidArgument when rank is not in
  // 0..num_workers()-1.
  virtual std::string task_label(int rank) const = 0;
  // The address rank listens on per the cluster spec, "" when this resolver cannot know it.
  // InvalidArgument when rank is not in 0..num_workers()-1.
  virtual std::string expected_address(int rank) const = 0;

 protected:
  ClusterResolver() = default;
  ClusterResolver(const ClusterResolver&) = default;
  ClusterResolver& operator=(const ClusterResolver&) = default;
  ClusterResolver(ClusterResolver&&) = default;
  ClusterResolver& operator=(ClusterResolver&&) = default;

  // Reads TANDEM_RESTART_COUNT (InvalidArgument when it is not a non-negative integer).
  void read_restart_count(const EnvironmentLookup& env);
  // InvalidArgument "<kind>: rank r is out of range: n training processes" unless 0 <= r < n.
  void check_rank(int rank) const;

 private:
  int restart_count_ = 0;
};

// TF_CONFIG (TensorFlow's TFConfigClusterResolver and multi_worker_util rules). Jobs may be
// "chief" (at most one task), "worker" and "evaluator" (at most one task); "ps" is refused
// (tandem has no parameter servers), as are other job names. A job is a list of addresses, or a
// dict {"0": "h:p", "1": ...} whose indices run 0..n-1 without gaps. Addresses must be distinct
// across the cluster. "rpc_layer" and "environment" are ignored.
// local_rank / local_world_size count the training tasks whose host is spelled the same as this
// task's (so "localhost" and "127.0.0.1" count as different machines).
class TFConfigClusterResolver final : public ClusterResolver {
 public:
  // Reads TF_CONFIG; InvalidArgument when it is unset or empty, or malformed (see the top).
  explicit TFConfigClusterResolver(const EnvironmentLookup& env = process_environment());
  // Parses tf_config itself; only TANDEM_RESTART_COUNT is read from env.
  static TFConfigClusterResolver from_json(std::string_view tf_config,
                                           const EnvironmentLookup& env = process_environment());

  std::string_view kind() const override { return "TF_CONFIG"; }
  const ClusterSpec& cluster_spec() const override { return cluster_; }
  std::string task_type() const override { return task_type_; }
  int task_id() const override { return task_id_; }
  int rank() const override { return rank_; }
  int num_workers() const override { return num_workers_; }
  std::string rendezvous_address() const override;
  int local_rank() const override { return local_rank_; }
  int local_world_size() const override { return local_world_size_; }
  std::string task_label(int rank) const override;
  std::string expected_address(int rank) const override;

 private:
  struct Unparsed {};  // from_json's way to a resolver that parse() then fills
  explicit TFConfigClusterResolver(Unparsed) {}
  void parse(std::string_view tf_config, const EnvironmentLookup& env);
  // (job, index) of a training rank.
  std::pair<std::string_view, int> training_task(int rank) const;

  ClusterSpec cluster_;
  std::string task_type_;
  int task_id_ = 0;
  int rank_ = 0;
  int num_workers_ = 0;
  int local_rank_ = 0;
  int local_world_size_ = 1;
};

// torchrun / torch.distributed.launch: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE are
// required; LOCAL_RANK (default 0), LOCAL_WORLD_SIZE and GROUP_RANK (the node's index) are read
// when set. The rendezvous address is MASTER_ADDR:MASTER_PORT, or MASTER_PORT + 1 when
// TORCHELASTIC_USE_AGENT_STORE=True (torchrun's agent then serves PyTorch's TCPStore on
// MASTER_PORT), or TANDEM_RENDEZVOUS_PORT when set.
class TorchrunClusterResolver final : public ClusterResolver {
 public:
  // InvalidArgument naming the missing variable, or quoting one that is not a valid integer or
  // is out of range (RANK in [0, WORLD_SIZE), LOCAL_RANK in [0, LOCAL_WORLD_SIZE)).
  explicit TorchrunClusterResolver(const EnvironmentLookup& env = process_environment());

  std::string_view kind() const override { return "torchrun"; }
  const ClusterSpec& cluster_spec() const override { return cluster_; }
  std::string task_type() const override { return "worker"; }
  int task_id() const override { return rank_; }
  int rank() const override { return rank_; }
  int num_workers() const override { return world_size_; }
  std::string rendezvous_address() const override { return rendezvous_address_; }
  int local_rank() const override { return local_rank_; }
  int local_world_size() const override { return local_world_size_; }
  std::string task_label(int rank) const override;
  std::string expected_address(int rank) const override;
  // GROUP_RANK (this node's index among the nodes), -1 when unset.
  int group_rank() const { return group_rank_; }

 private:
  ClusterSpec cluster_;
  std::string rendezvous_address_;
  int rank_ = 0;
  int world_size_ = 1;
  int local_rank_ = 0;
  int local_world_size_ = 1;
  int group_rank_ = -1;
};

// srun under SLURM: rank = SLURM_PROCID, num_workers = SLURM_NTASKS, local_rank = SLURM_LOCALID.
// The chief is the first host of SLURM_STEP_NODELIST (else SLURM_NODELIST, SLURM_JOB_NODELIST);
// its port is TANDEM_RENDEZVOUS_PORT, else MASTER_PORT, else kDefaultSlurmPort. The tasks on this
// node come from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1") or
// SLURM_NTASKS_PER_NODE, and this node's index from SLURM_NODEID (else from SLURM_PROCID under
// block distribution). Rank 0 must run on the first node (block and cyclic distributions do): a
// rank 0 whose SLURMD_NODENAME is another node is refused.
class SlurmClusterResolver final : public ClusterResolver {
 public:
  // InvalidArgument naming the missing variable or quoting the malformed one.
  explicit SlurmClusterResolver(const EnvironmentLookup& env = process_environment());

  std::string_view kind() const override { return "SLURM"; }
  const ClusterSpec& cluster_spec() const override { return cluster_; }
  std::string task_type() const override { return "worker"; }
  int task_id() const override { return rank_; }
  int rank() const override { return rank_; }
  int num_workers() const override { return num_tasks_; }
  std::string rendezvous_address() const override { return rendezvous_address_; }
  int local_rank() const override { return local_rank_; }
  int local_world_size() const override { return local_world_size_; }
  std::string task_label(int rank) const override;
  std::string expected_address(int rank) const override;
  // The step's nodes, expanded, in SLURM's order.
  const std::vector<std::string>& nodes() const { return nodes_; }

 private:
  // The node rank runs on under block distribution; "" when unknown.
  std::string node_of_rank(int rank) const;

  ClusterSpec cluster_;
  std::string rendezvous_address_;
  std::vector<std::string> nodes_;
  std::vector<int> tasks_per_node_;  // empty when unknown
  bool block_distribution_ = true;
  int rank_ = 0;
  int num_tasks_ = 1;
  int local_rank_ = 0;
  int local_world_size_ = 1;
};

// No launcher: one worker, rank 0 of 1, serving its store on kLocalRendezvousAddress.
class LocalClusterResolver final : public ClusterResolver {
 public:
  explicit LocalClusterResolver(const EnvironmentLookup& env = process_environment());

  std::string_view kind() const override { return "local"; }
  const ClusterSpec& cluster_spec() const override { return cluster_; }
  std::string task_type() const override { return "worker"; }
  int task_id() const override { return 0; }
  int rank() const override { return 0; }
  int num_workers() const override { return 1; }
  std::string rendezvous_address() const override { return std::string(kLocalRendezvousAddress); }
  int local_rank() const override { return 0; }
  int local_world_size() const override { return 1; }
  std::string task_label(int rank) const override;
  std::string expected_address(int rank) const override;

 private:
  ClusterSpec cluster_;
};

// The resolver the environment asks for: TF_CONFIG when set (and not empty), else torchrun's when
// RANK and WORLD_SIZE are set, else SLURM's when SLURM_PROCID is set, else a single local worker.
// Throws what the chosen resolver's constructor throws: a malformed environment is never
// silently replaced by a local worker.
std::unique_ptr<ClusterResolver> resolve_cluster(const EnvironmentLookup& env = process_environment());

}  // namespace tandem::strategy
