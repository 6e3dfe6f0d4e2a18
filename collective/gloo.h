// tandem/collective/gloo.h — collectives between processes over TCP (Gloo).
//
// One Communicator per process: MultiWorkerMirroredStrategy gives each worker process one Gloo
// rank, and its local replicas reach the other workers through make_hierarchical_group
// (hierarchical.h). The ranks meet through a Store (store.h): each publishes its listening
// address there, then every pair of ranks connects directly (a full mesh).
//
// Who calls: every rank, once, with the same store, size and timeout; make_gloo_communicator
// blocks until all ranks have connected. Collectives then follow communicator.h: every rank issues
// the same ones in the same order; each call blocks until it completes on this rank.
//
// Errors name ranks (by GlooOptions::rank_labels) and the call ("gloo all_reduce #12 (float32,
// 262144 elements) on worker 0: ..."):
//   - a rank that does not arrive within the timeout: DeadlineExceeded naming the ranks that never
//     reached the call (each rank records in the store which call it failed in, so the others can
//     tell a hung rank from one that was merely waiting too);
//   - a rank whose process died: Unavailable naming it (the TCP store's server records a lost
//     client under "tandem/lost/<rank>"; with another store the dead rank is named as the one
//     that never reported);
//   - the store itself unreachable (its server, the chief's process, died): Unavailable saying so;
//   - a rank that aborted: Unavailable with its reason;
//   - this rank's own bad arguments: InvalidArgument here, and the group fails (the peers get
//     Unavailable at once instead of waiting for their timeout);
//   - calls that disagree across ranks: with check_consistency, InvalidArgument on every rank
//     naming the first disagreeing pair with both sides; without it, DeadlineExceeded at the
//     timeout (each call's messages are tagged with its element count, dtype, operation and root,
//     so disagreeing calls never exchange data; gloo itself would abort the process).
// Point-to-point calls (send, recv, send_recv) send a descriptor ahead of each message on slots of
// their own: a message that does not fit the receiver's tensor is InvalidArgument on the receiver
// (the pair goes on); a timeout, or a peer's abort or death, fails the communicator as a
// collective's failure does.
// After any failure the communicator is unusable: later calls throw Unavailable naming the first
// failure. Make a new one (with the same store: each generation of communicators gets its own
// keys) to continue.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/collective/store.h"

namespace tandem::collective {

// How all_reduce (and reduce_scatter, an all-reduce here) combines the ranks' values.
enum class GlooAllReduceAlgorithm {
  // Every element combined in rank order, (((x0 + x1) + x2) ...), as the in-process and
  // shared-memory groups combine it: n processes sum bitwise as n threads, whatever the network.
  // A reduce-scatter to each part's owner and an all-gather, every receive posted at the start:
  // 1.5 round trips a call at any rank count, the ring's bytes per rank.
  kRankOrdered,
  // Gloo's ring: each part's sum starts at another rank, so from 3 ranks on the last bits differ
  // from the other backends' (and between parts); about 2 (n - 1) round trips a call.
  kRing,
};

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Every rank's handle on the same store (the rendezvous). Required.
  std::shared_ptr<Store> store;
  // The address this rank listens on for its peers. Empty: the local address that routes to the
  // store's host (127.0.0.1 for a loopback job; 127.0.0.1 too for an in-memory store).
  std::string listen_host;
  // Connecting, and every collective whose CallOptions keep the default timeout (kDefaultTimeout);
  // a call that passes another timeout uses its own.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Connecting only, when set: a start-up bounds it by its own deadline (the rendezvous timeout).
  std::optional<std::chrono::milliseconds> connect_timeout;
  // How messages name rank r ("worker 1 (10.0.0.2:2222)"). Empty: "rank r".
  std::vector<std::string> rank_labels;
  // What the group is for, when a job has several ("gradient", "control"): messages then say
  // "... on worker 0 in the control group".
  std::string group_name;
  // Large all-reduces are split into packs of this many bytes, issued in turn (TF's
  // CommunicationOptions.bytes_per_pack). 0: one pack.
  std::int64_t bytes_per_pack = 0;
  GlooAllReduceAlgorithm all_reduce_algorithm = GlooAllReduceAlgorithm::kRankOrdered;
  // Before every collective, check that every rank issues the same one (operation, reduction,
  // dtype, element count, tensor count and shapes, root, sequence number). Costs one small
  // all-gather per call. Unset: on when the environment variable TANDEM_CHECK_COLLECTIVES=1.
  std::optional<bool> check_consistency;
};

// Connects rank options.rank to the others and returns its communicator (backend "gloo").
// Blocks until every rank has connected; DeadlineExceeded naming the ranks that did not arrive
// within options.connect_timeout (else options.timeout); InvalidArgument for bad options (rank out of range, no store,
// a label count that is not size); Unavailable when the store or a peer cannot be reached.
//
// all_reduce reduces float32, float64, int32 and int64 (SUM, MAX, MIN natively; MEAN is a SUM
// scaled by 1/size) with options.all_reduce_algorithm; a span of several tensors is copied through one staging buffer,
// a single tensor is reduced in place. broadcast and all_gather move bytes (any dtype). reduce_scatter is an all-reduce
// of a copy of the input of which each rank keeps its part. Tensors must be in host memory.
//
// Failures end pending calls promptly, not at their timeout: abort(reason) shuts this rank's
// connections down, which ends its own pending call (Unavailable with the reason) and the peers'
// (Unavailable naming this rank and the reason, read from the store). A rank that fails for any
// other reason does the same, and each communicator has a monitor thread that, while a call is in
// flight, interrupts it (within ~50 ms) once one of its connections has closed and the store says
// a peer failed or died. abort() waits for nothing but two store writes.
//
// Gloo writes to sockets with writev, so a peer that dies would raise SIGPIPE, whose default
// action kills the process: this function sets SIGPIPE to be ignored, process-wide, unless the
// program already installed a handler.
std::unique_ptr<Communicator> make_gloo_communicator(GlooOptions options);

}  // namespace tandem::collective
