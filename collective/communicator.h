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
//
// The backends, each made by a factory declared in its own header (a caller includes only the
// backend it makes): in_process.h (replica threads of one process), shared_memory.h (processes of
// one machine), gloo.h (processes over TCP), nccl.h (GPUs, in one process or across processes)
// and hierarchical.h (local replicas, then across workers). tests/collective/contract/ checks
// every one of them against this contract.
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

// How long a rank of a group across processes (Gloo, NCCL) whose call failed reads its peers'
// reports in the store before it decides whom to name: the ranks of one collective start it up to
// this far apart and still count as arrived.
inline constexpr std::chrono::milliseconds kFailureReportGrace = std::chrono::seconds(2);

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
  // "in-process", "shared-memory", "gloo", "nccl", "hierarchical".
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

}  // namespace tandem::collective
