// tandem/collective/communicator.h — collective operations among the replicas of a group.
//
// A Communicator is one rank's handle on a group of `size()` ranks (replica threads of one
// process, GPUs, or processes). Every rank of the group must issue the same collectives in the
// same order, with tensors of the same dtype and element count; each call carries a sequence
// number (the count of calls this rank issued before it) so that a mismatch or a missing rank is
// reported precisely. Who calls: each rank's own thread, one call at a time per rank. Every call
// blocks until the collective is complete on this rank, or its timeout passes: then it throws
// DeadlineExceeded naming the operation, its sequence number and the ranks that did not arrive.
// If any rank aborts the group (a replica failed), pending and later calls on every rank throw
// Unavailable with the abort's reason, promptly.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tandem/collective/store.h"
#include "tandem/graph/tensor.h"

namespace tandem::collective {

enum class ReduceOp { kSum, kMean, kMax, kMin };
std::string_view reduce_op_name(ReduceOp op);

// How long a collective waits for the other ranks by default.
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(5);

struct CallOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Collectives this rank has issued (the next call's sequence number).
  virtual std::uint64_t sequence_number() const = 0;
  // "in-process", "nccl", "gloo".
  virtual std::string_view backend() const = 0;

  // Combines the tensors of all ranks element-wise, in place: afterwards every rank holds the
  // result. The span is one logical buffer (the tensors concatenated, all of one dtype): a
  // gradient bucket is reduced in one collective without being copied into a flat buffer.
  virtual void all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options = {}) = 0;
  void all_reduce(Tensor& tensor, ReduceOp op, const CallOptions& options = {}) {
    all_reduce(std::span<Tensor>(&tensor, 1), op, options);
  }
  // Device-side all-reduce, for work recorded in a CUDA graph (a trainer's whole step): queues
  // the all-reduce of `tensors` (as all_reduce: one logical buffer, one dtype, on this rank's
  // device) after the work queued so far on the device's compute stream, makes the compute
  // stream wait for its result, and returns at once: its completion, and a peer's failure, show
  // only through the compute stream, which the caller waits for. Every rank must make the same
  // calls in the same order. Backends that cannot (all but NCCL within one process) throw
  // Unimplemented; enqueues_on_device() tells beforehand.
  virtual bool enqueues_on_device() const { return false; }
  virtual void all_reduce_on_device(std::span<Tensor> tensors, ReduceOp op);

  // Copies root's tensor into every other rank's tensor (same dtype and element count).
  virtual void broadcast(Tensor& tensor, int root, const CallOptions& options = {}) = 0;
  // Every rank's input concatenated along dimension 0, in rank order, into output
  // (output's first dimension = size() x input's).
  virtual void all_gather(const Tensor& input, Tensor& output, const CallOptions& options = {}) = 0;
  // The reduction of every rank's input, split along dimension 0 into size() equal parts: rank r
  // receives part r in output.
  virtual void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options = {}) = 0;
  // Returns once every rank has called barrier.
  virtual void barrier(const CallOptions& options = {}) = 0;

  // Fails the group: every rank's pending and later calls throw Unavailable(reason). Any rank (or
  // any thread of its owner) may call it; it does not block.
  virtual void abort(const std::string& reason) = 0;
};

// The ranks of one process's replica threads: shared memory, no copies through a single device.
// all_reduce is a reduce-scatter then an all-gather over chunks, each rank summing its own chunk
// of every rank's buffer and then copying the other ranks' chunks. Returns one communicator per
// rank (rank i at index i); they share the group's state.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size);

// GPU replicas of one process: NCCL (ncclCommInitAll over these CUDA device ordinals). Only in
// builds with CUDA; elsewhere throws Unimplemented. Calls are enqueued on each device's
// communication stream and synchronised before returning.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& cuda_devices);
bool nccl_available();

// One rank of an NCCL group spanning processes, one GPU each (a multi-worker job whose workers
// have one GPU replica apiece, or one process per GPU). The ranks meet through `store`: rank 0
// calls ncclGetUniqueId and publishes the id there; every rank announces its arrival, reads the id
// and joins with a non-blocking ncclCommInitRankConfig on its device, polled against the timeout
// (NCCL 2.14 or later). Keys live under "tandem/nccl/<generation>/" (each rank counts the
// communicators it made with this store, so the k-th communicator of every rank meets the others'
// k-th).
// Collectives then behave as make_nccl_group's (communication stream, polling with a deadline,
// ncclCommAbort on failure), with one difference: a rank's failure reaches its peers through the
// store. A rank that fails (timeout, NCCL error, bad arguments, abort()) records it there; every
// rank waiting in a collective looks every ~100 ms and then throws Unavailable naming the rank and
// its reason. A rank that times out publishes how many collectives it issued, reads the others'
// counts for up to kFailureReportGrace (gloo.h), and names in its DeadlineExceeded the ranks that
// never issued the call, and those whose process died (the TCP store's lost_rank_key, tcp_store.h).
struct NcclProcessOptions {
  int rank = 0;
  int size = 1;
  // This process's GPU (CUDA device ordinal).
  int cuda_device = 0;
  // Every rank's handle on the same store (carries NCCL's unique id). Required.
  std::shared_ptr<Store> store;
  // Joining, and every collective whose CallOptions keep the default timeout (kDefaultTimeout); a
  // call that passes another timeout uses its own.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // How messages name rank r ("worker 1 (10.0.0.2:2222)"). Empty: "rank r of size".
  std::vector<std::string> rank_labels;
};
// Who calls: every rank, once, with the same store, size and timeout. Blocks until every rank has
// joined, or options.timeout: DeadlineExceeded naming the ranks that did not reach the store (or
// saying that NCCL's initialisation did not finish although all did). InvalidArgument for bad
// options (rank out of range, no store, non-positive timeout, a label count that is not size, a
// CUDA device this machine does not have), checked before CUDA or NCCL is touched;
// FailedPrecondition when NCCL cannot be loaded or is older than 2.14, or no GPU is usable;
// Unavailable when the store cannot be reached. Builds without NCCL throw Unimplemented (after
// the option checks).
std::unique_ptr<Communicator> make_nccl_process_communicator(NcclProcessOptions options);

// The replicas of a multi-worker job (hierarchical.cc): each worker process has L local replicas;
// `local` holds one communicator per local replica (local[i] has rank i of L, e.g. from
// make_in_process_group(L)), and `cross_worker` is this worker's communicator to the other
// workers (one rank per process, e.g. make_gloo_communicator; used only by local replica 0).
// Returns L communicators (backend "hierarchical"); replica i's has rank
// cross_worker->rank() * L + i of num_workers * L. Collectives compose the levels: all_reduce is
// a local all-reduce, the cross-worker all-reduce by replica 0, then a local broadcast (MEAN
// divides once, by the global size); broadcast, all_gather, reduce_scatter and barrier likewise.
// A failure at either level reaches every local replica: when replica 0's cross-worker call
// throws, the local group is aborted with that error as the reason (replica 0 rethrows the
// original), and when a local call throws on replica 0 the cross-worker communicator is aborted
// so that the other workers fail promptly too. abort() aborts both levels.
// Who calls: every worker, once, with the same L. Blocks for one cross-worker all-gather of L:
// InvalidArgument naming two workers whose L differ (on every worker), and InvalidArgument for
// local communicators that are not ranks 0..L-1 of one group of L.
std::vector<std::unique_ptr<Communicator>> make_hierarchical_group(std::vector<std::unique_ptr<Communicator>> local,
                                                                   std::unique_ptr<Communicator> cross_worker);

}  // namespace tandem::collective
