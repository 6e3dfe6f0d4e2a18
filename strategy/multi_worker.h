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
//     worker takes its replicas' rows of every global batch, the rows MirroredStrategy would give
//     the same replicas in one process; under FILE each worker reads every N-th file;
//   - gradients are all-reduced across all replicas: on the local replicas first (in-process),
//     then across workers (Gloo over TCP, or shared memory), then back to the local replicas
//     (hierarchical). With CommunicationOptions::deterministic (the default) every sum is taken in
//     global replica order, as MirroredStrategy takes it, and the logs gather every replica's
//     sums: under DATA, N workers of one replica each give bitwise the losses, logs and weights of
//     MirroredStrategy with N replicas, run after run. Not those of one device: a replica sums its
//     shard's gradient, and the shards' sums added up round differently from one sum over the
//     whole batch (MirroredStrategy differs from one device in the same last bits). Workers with
//     several local replicas add each worker's replicas first ((r0 + r1) + (r2 + r3)), which
//     equals MirroredStrategy with as many replicas to rounding only, deterministically;
//   - a training step communicates once: one collective per gradient bucket (one for a model
//     whose gradients fit DistributionOptions::first_bucket_bytes), the step's log sums and the
//     layers' moving statistics riding in the last; over Gloo each collective takes 1.5 network
//     round trips (docs/ARCHITECTURE.md lists what else communicates, and when);
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
  // Sum across workers in global replica order, (((r0 + r1) + r2) ...), as MirroredStrategy sums
  // its replicas: N workers of one replica each then train bitwise as MirroredStrategy with N
  // replicas, over TCP or shared memory alike (Gloo's rank-ordered all-reduce, 1.5 round trips a
  // collective at any worker count, the ring's bytes per worker). false: Gloo's own ring, whose
  // sums start at a different worker for each part of a buffer (from 3 workers on, the last bits
  // differ) and which takes about 2 (workers - 1) round trips. Shared memory always sums in rank
  // order; NCCL (GPU replicas) in NCCL's own order, whatever this says.
  bool deterministic = true;
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

// This worker's default replica devices (MultiWorkerOptions::local_devices left empty).
std::vector<std::string> default_worker_devices(const ClusterResolver& resolver);

// Not final: keras::distribution's DataParallel and ModelParallel are this strategy under another
// name (one worker: every local device, as MirroredStrategy; several: across workers).
class MultiWorkerMirroredStrategy : public Strategy {
 public:
  // Blocks until every worker has constructed its strategy (see the top of this file).
  explicit MultiWorkerMirroredStrategy(MultiWorkerOptions options = {});
  MultiWorkerMirroredStrategy(std::shared_ptr<ClusterResolver> cluster_resolver,
                              CommunicationOptions communication_options = {});
  ~MultiWorkerMirroredStrategy() override;

  int num_replicas_in_sync() const override;
  int num_workers() const override;
  int worker_rank() const override;
  int workers_on_this_machine() const override;
  bool should_checkpoint() const override { return worker_rank() == 0; }
  bool should_log() const override;
  const ClusterResolver& cluster_resolver() const;
  AutoShardPolicy auto_shard_policy() const;

  void sum_across_workers(std::span<double> values) override;
  void broadcast_from_chief(std::span<Tensor> host_values) override;
  void check_workers_agree(std::string_view what,
                           const std::vector<std::pair<std::string, std::string>>& facts) override;

  // Collectives this worker has issued so far on each of its two cross-worker communicators:
  // `data` (the gradient buckets, with the step's log sums and layer updates riding in the last
  // one) and `control` (between steps, on the thread that runs fit: variable agreement, log sums
  // of steps without a bucket, the FILE and OFF policies' agreement on a batch no step carried,
  // backups).
  // What a step costs in round trips is what it adds here (see docs/ARCHITECTURE.md).
  struct CollectiveCounts {
    std::uint64_t data = 0;
    std::uint64_t control = 0;
  };
  CollectiveCounts collective_counts();
  // The same two communicators' calls and bytes (collective/communicator.h's CommunicationStats,
  // N = the number of workers): `data` is the gradient communicator's own when this worker has
  // one replica, the cross-worker level's under a hierarchical group. Zeros on one worker.
  struct CrossWorkerStats {
    collective::CommunicationStats data;
    collective::CommunicationStats control;
  };
  CrossWorkerStats cross_worker_stats_per_communicator();
  // data + control.
  collective::CommunicationStats cross_worker_stats() override;

 protected:
  // For subclasses: `kind` names the strategy in messages ("DataParallel#1 (CPU:0, CPU:1)").
  MultiWorkerMirroredStrategy(std::string kind, MultiWorkerOptions options);
  std::unique_ptr<WorkerIterator> worker_batches(const data::Dataset& dataset,
                                                 const data::IterateOptions& options) const override;
  void agree_on_variable(VariableOptions& options) override;

 private:
  struct Impl;
  MultiWorkerMirroredStrategy(std::string kind, MultiWorkerOptions options, std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::strategy

namespace tandem {
using strategy::MultiWorkerMirroredStrategy;
}  // namespace tandem
