// tandem/strategy/multi_worker.h — synchronous training across processes and machines
// (tf.distribute.MultiWorkerMirroredStrategy).
//
// The same program runs on every worker. Changing the strategy is the only change to the model
// code; the job is started by tools/tandem-run (or a cluster manager that sets TF_CONFIG, or
// torchrun, or SLURM):
//
//   tandem::MultiWorkerMirroredStrategy strategy;   // reads TF_CONFIG / torchrun / SLURM
//   { auto scope = strategy.scope(); model = keras::Sequential({...}); model.compile(...); }
//   model.fit(train.shuffle(60000).batch(256), {.epochs = 10});   // 256 = the global batch
//
// What the strategy does at construction (every worker must construct it; it blocks until all
// have, or the rendezvous timeout): the chief (rank 0) serves a key-value store on its address
// from the cluster spec; every worker connects to it and the workers open Gloo connections to
// each other. A worker that never arrives makes the others fail at the deadline naming it.
//
// Then, as TF does:
//   - num_replicas_in_sync() counts the replicas of every worker (workers x local devices);
//   - variables are created identically everywhere: each creation checks that every worker
//     creates the same variable (name, dtype, shape; a mismatch names both sides) and broadcasts
//     the chief's initial value;
//   - fit's dataset is the global batch; it is auto-sharded (AutoShardPolicy): under DATA each
//     worker takes its replicas' rows of every global batch, so the global batches, and the
//     gradients, are exactly those of one device; under FILE each worker reads every N-th file;
//   - gradients are all-reduced across all replicas: on the local replicas first (in-process),
//     then across workers (Gloo ring), then back to the local replicas (hierarchical);
//   - only the chief writes checkpoints, CSV logs and the progress bar.
// A worker that dies or hangs makes every other worker's pending collective fail within
// CommunicationOptions::timeout_seconds, naming the rank: never a silent hang.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/collective/store.h"
#include "tandem/strategy/cluster_resolver.h"
#include "tandem/strategy/strategy.h"

namespace tandem::strategy {

// TF's tf.distribute.experimental.CommunicationImplementation.
enum class CommunicationImplementation {
  kAuto,          // GPU replicas: NCCL; CPU replicas: shared memory when every worker runs on
                  // this machine, else RING
  kRing,          // Gloo's ring all-reduce over TCP
  kNccl,          // NCCL across processes (GPU replicas only)
  kSharedMemory,  // tandem's addition: a segment shared by the workers of one machine
};

// TF's tf.distribute.experimental.CommunicationOptions.
struct CommunicationOptions {
  CommunicationImplementation implementation = CommunicationImplementation::kAuto;
  // Gloo all-reduces larger than this are split into packs issued in turn (0: one pack). Shared
  // memory always works through its slots, piece by piece.
  std::int64_t bytes_per_pack = 0;
  // How long a collective waits for the other workers before DeadlineExceeded (0: the default,
  // collective::kDefaultTimeout, 5 minutes).
  double timeout_seconds = 0;
};

// TF's tf.data.experimental.AutoShardPolicy.
enum class AutoShardPolicy {
  kAuto,  // FILE when the dataset reads several files (Dataset::from_files), else DATA
  kFile,  // each worker reads files k, k + N, ...; its batches are its share of the step
  kData,  // every worker runs the whole pipeline and keeps its replicas' rows of each global batch
  kOff,   // no sharding: every worker trains on every element of its own pipeline
};

struct MultiWorkerOptions {
  // Who this process is; default: resolve_cluster() (TF_CONFIG, torchrun's variables, SLURM's,
  // or else a single local worker).
  std::shared_ptr<ClusterResolver> cluster_resolver;
  CommunicationOptions communication_options;
  // This worker's replica devices; default: every local GPU, or one GPU per worker (by local
  // rank) when several workers share the machine, or "CPU:0" without GPUs (TF's choices).
  // Several devices make a hierarchical all-reduce (NCCL within the worker for GPUs).
  std::vector<std::string> local_devices;
  AutoShardPolicy auto_shard_policy = AutoShardPolicy::kAuto;
  DistributionOptions distribution;
  // How long workers wait for each other at start-up (TANDEM_RENDEZVOUS_TIMEOUT, in seconds,
  // overrides the default of 5 minutes).
  std::optional<std::chrono::milliseconds> rendezvous_timeout;
  // Progress bars and per-epoch lines of the non-chief workers (quiet by default).
  bool log_on_all_workers = false;
};

class MultiWorkerMirroredStrategy final : public Strategy {
 public:
  // Blocks until every worker has constructed its strategy (see the top of this file).
  explicit MultiWorkerMirroredStrategy(MultiWorkerOptions options = {});
  MultiWorkerMirroredStrategy(std::shared_ptr<ClusterResolver> cluster_resolver,
                              CommunicationOptions communication_options = {});
  ~MultiWorkerMirroredStrategy() override;

  int num_replicas_in_sync() const override;
  int num_workers() const override;
  int worker_rank() const override;
  bool should_checkpoint() const override { return worker_rank() == 0; }
  bool should_log() const override;
  const ClusterResolver& cluster_resolver() const;
  AutoShardPolicy auto_shard_policy() const;

  void sum_across_workers(std::span<double> values) override;
  void broadcast_from_chief(std::span<Tensor> host_values) override;
  void check_workers_agree(std::string_view what,
                           const std::vector<std::pair<std::string, std::string>>& facts) override;

 protected:
  std::unique_ptr<WorkerIterator> worker_batches(const data::Dataset& dataset,
                                                 const data::IterateOptions& options) const override;
  void agree_on_variable(VariableOptions& options) override;

 private:
  struct Impl;
  MultiWorkerMirroredStrategy(MultiWorkerOptions options, std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::strategy

namespace tandem {
using strategy::MultiWorkerMirroredStrategy;
}  // namespace tandem
