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
