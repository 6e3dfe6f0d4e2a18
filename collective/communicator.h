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
// Unavailable with the abort's reason, promptly. Point-to-point send/recv (below) are between two
// ranks only, outside the collectives' order.
//
// The backends, each made by a factory declared in its own header (a caller includes only the
// backend it makes): in_process.h (replica threads of one process), shared_memory.h (processes of
// one machine), gloo.h (processes over TCP), nccl.h (GPUs, in one process or across processes)
// and hierarchical.h (local replicas, then across workers). tests/collective/contract/ checks
// every one of them against this contract.
//
// Every communicator counts its calls and bytes (stats(), CommunicationStats below) in one place:
// the public collectives are non-virtual, count and forward to the backend's protected do_*
// functions, so a backend cannot count twice or forget to.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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

// Calls of one kind of collective on one rank, and the bytes this rank sent and received in them.
struct OpStats {
  std::int64_t calls = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;

  OpStats& operator+=(const OpStats& other);
  OpStats& operator-=(const OpStats& other);
  friend bool operator==(const OpStats&, const OpStats&) = default;
};

// What one communicator (or a sum of several: operator+=) has done since it was made or its
// reset_stats(). Calls count the collectives that returned on this rank (a call that threw is not
// counted; all_reduce_on_device counts when queued, as all_reduce: a CUDA graph that recorded it
// replays it without calling it again, so replays are not counted).
//
// Bytes follow nccl-tests' bus-bandwidth convention: what this rank sends and receives under the
// bandwidth-optimal ring algorithm in a group of N = size() ranks, whatever the backend really
// moves (Gloo's reduce_scatter is a whole all-reduce, the in-process group copies through shared
// memory; TANDEM_CHECK_COLLECTIVES' descriptors and a hierarchical group's inner levels are not
// counted here):
//   all_reduce      2(N-1)/N x the buffer's bytes (all its tensors), sent and received alike;
//   reduce_scatter  (N-1)/N x the input's bytes, sent and received;
//   all_gather      (N-1)/N x the output's bytes, sent and received;
//   broadcast       the buffer's bytes: sent by the root, received by every other rank;
//   barrier         no bytes;
//   N = 1           no bytes, for every collective;
//   send            the tensor's bytes, sent (one call per send, and per send_recv that sends);
//   recv            the tensor's bytes, received (one call per recv, and per send_recv that
//                   receives): point-to-point bytes are what really travels, at any N.
// Rounding: each op keeps the exact sum of its buffers' bytes and applies the factor once, when
// read, rounding down; so k calls of B bytes report floor(k x B x factor), the formula for k x B
// bytes exactly (with a byte size that is a multiple of N, as float32 buffers are for N = 2 or 4,
// nothing is rounded).
// A hierarchical group (hierarchical.h) counts its collectives at its own level, N = every
// replica of every worker; its local and cross-worker communicators count theirs separately
// (cross_worker_stats() there reads the latter), so a sum over the group never counts a byte twice.
struct CommunicationStats {
  OpStats all_reduce;  // all_reduce_on_device included
  OpStats reduce_scatter;
  OpStats all_gather;
  OpStats broadcast;
  OpStats barrier;
  OpStats send;  // send, and the sending half of send_recv
  OpStats recv;  // recv, and the receiving half of send_recv

  // Every op's calls and bytes added up.
  OpStats total() const;
  CommunicationStats& operator+=(const CommunicationStats& other);
  CommunicationStats& operator-=(const CommunicationStats& other);
  friend bool operator==(const CommunicationStats&, const CommunicationStats&) = default;
  // One line per op that was called: "all_reduce: 12 calls, 4800 B sent, 4800 B received".
  std::string to_string() const;
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
  void all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options = {});
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
  void all_reduce_on_device(std::span<Tensor> tensors, ReduceOp op);

  // Copies root's tensor into every other rank's tensor (same dtype and element count).
  void broadcast(Tensor& tensor, int root, const CallOptions& options = {});
  // Every rank's input concatenated along dimension 0, in rank order, into output
  // (output's first dimension = size() x input's).
  void all_gather(const Tensor& input, Tensor& output, const CallOptions& options = {});
  // The reduction of every rank's input, split along dimension 0 into size() equal parts: rank r
  // receives part r in output.
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options = {});
  // Returns once every rank has called barrier.
  void barrier(const CallOptions& options = {});

  // ZeRO's collectives on values split into ranges, in their own buffers (no packed copy). Tensor
  // i of every rank (same dtype, element counts and shard_elements[i] on every rank), flattened,
  // is split into size() ranges of shard_elements[i] elements, the last ones cut short or empty
  // where the tensor ends: rank r's range is [r x s, min((r + 1) x s, elements)).
  // reduce_scatter_ranges: afterwards rank r's range of each of its tensors holds the reduction
  // over every rank of that range, reduced in rank order as all_reduce and reduce_scatter reduce;
  // the rest of its tensors is unspecified. `riders` (whole tensors, the same dtype) are reduced
  // in the same call, whole on every rank. all_gather_ranges: afterwards every rank's tensors
  // hold each rank's range as that rank had it. Both count as the reduce_scatter / all_gather of
  // the packed buffer they stand for: size() parts, part r = rank r's ranges, each padded to
  // shard_elements, followed (reduce_scatter_ranges) by the riders.
  void reduce_scatter_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                             std::span<Tensor> riders, ReduceOp op, const CallOptions& options = {});
  void all_gather_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                         const CallOptions& options = {});

  // Point-to-point: one rank's tensor into another's (pipeline stages passing activations and
  // gradients). Between two ranks only: the other ranks take no part, and sequence_number() (the
  // group's collectives) does not move; each ordered pair (sender, receiver) numbers its own
  // messages from 0, and messages of one pair match in the order they were sent.
  //   - recv's tensor must have the dtype and element count of the matching send's (the shape
  //     may differ). Otherwise the recv throws InvalidArgument naming both ranks, dtypes and
  //     counts, where the backend can tell (every backend but NCCL: it sends a small descriptor
  //     first); the message is then dropped and the pair stays usable.
  //   - send MAY block until the peer posts the matching recv (NCCL may always; Gloo and the
  //     shared-memory group for messages larger than their buffers; the in-process group never
  //     does: it copies the message). A rank that both sends and receives
  //     calls send_recv, or orders its calls so that every send meets a recv: two neighbours
  //     that both send first may deadlock.
  //   - peer == rank() or outside [0, size()): InvalidArgument, before anything is sent.
  //   - a call whose peer does not come throws DeadlineExceeded at its timeout, naming the op
  //     ("send", "recv", "send_recv"), the peer and the pair's message number. What else fails
  //     with it is the backend's: in the in-process group nothing (a late message is the next
  //     recv's); in the shared-memory group the group, if the timeout cut a message in two; with
  //     Gloo and NCCL the group, as a collective's timeout does.
  //   - abort() makes a pending or later send/recv throw Unavailable promptly.
  // Stats count a send's bytes as sent and a recv's as received (CommunicationStats).
  void send(const Tensor& tensor, int peer, const CallOptions& options = {});
  void recv(Tensor& tensor, int peer, const CallOptions& options = {});
  // Sends send_tensor to send_peer and receives recv_tensor from recv_peer at once (MPI_Sendrecv),
  // so that neighbours exchanging in opposite directions never deadlock. A negative peer (-1)
  // leaves that half out: the first and last stages of a pipeline make the same call as the
  // others. Counts as a send and/or a recv.
  void send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                 const CallOptions& options = {});

  // Fails the group: every rank's pending and later calls throw Unavailable(reason). Any rank (or
  // any thread of its owner) may call it; it does not block.
  virtual void abort(const std::string& reason) = 0;

  // This rank's calls and bytes per op since it was made or reset (CommunicationStats above).
  // Any thread may read them while the rank's thread calls collectives: every counter is exact,
  // but a read during a call may see that call's count without its bytes (or the reverse).
  CommunicationStats stats() const;
  // Zeroes the counters; meant for moments when this rank has no call in flight.
  void reset_stats();

 protected:
  // The backends' collectives, called by the public ones above with their arguments as given
  // (argument checks are the backends'); they do not count (the public functions do).
  virtual void do_all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) = 0;
  // Default: Unimplemented (see enqueues_on_device).
  virtual void do_all_reduce_on_device(std::span<Tensor> tensors, ReduceOp op);
  virtual void do_broadcast(Tensor& tensor, int root, const CallOptions& options) = 0;
  virtual void do_all_gather(const Tensor& input, Tensor& output, const CallOptions& options) = 0;
  virtual void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) = 0;
  virtual void do_barrier(const CallOptions& options) = 0;
  // Default: the ranges packed into one buffer, do_reduce_scatter / do_all_gather, and the
  // results copied back (on any device). The in-process group reads and writes the ranges where
  // they are.
  virtual void do_reduce_scatter_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                        std::span<Tensor> riders, ReduceOp op, const CallOptions& options);
  virtual void do_all_gather_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                    const CallOptions& options);
  // The point-to-point calls, all three through one function, with their peers checked (in range,
  // not this rank): send_peer < 0 means no send (send_tensor is then undefined), recv_peer < 0 no
  // recv; never both. detail::point_to_point_name() says which call it is, for messages.
  // Default: Unimplemented naming the backend and the call.
  virtual void do_send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                            const CallOptions& options);

 private:
  // The counters of one op: its calls, and the bytes its calls' buffers held that count towards
  // what was sent and received, before the op's factor (CommunicationStats) is applied.
  struct Counter {
    std::atomic<std::int64_t> calls{0};
    std::atomic<std::int64_t> sent_buffer_bytes{0};
    std::atomic<std::int64_t> received_buffer_bytes{0};
  };
  enum Op : std::size_t {
    kAllReduceOp,
    kReduceScatterOp,
    kAllGatherOp,
    kBroadcastOp,
    kBarrierOp,
    kSendOp,
    kRecvOp,
    kNumOps
  };
  void count(Op op, std::int64_t sent_buffer_bytes, std::int64_t received_buffer_bytes);
  // InvalidArgument unless peer is another rank of the group (or, with allow_none, negative).
  void check_peer(std::string_view op, std::string_view role, int peer, bool allow_none) const;
  OpStats read(Op op) const;

  std::array<Counter, kNumOps> counters_;
};

}  // namespace tandem::collective
