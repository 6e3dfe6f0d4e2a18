// tandem/collective/shared_memory.h — collectives between processes of one machine, through shared
// memory.
//
// One Communicator per process, like the Gloo communicator (gloo.h), for the ranks of a job that
// all run on one machine (`tandem-run --nproc_per_node N` on a CPU machine): instead of copying
// every byte through loopback TCP, the ranks map one POSIX shared-memory segment and reduce in it.
// An all-reduce moves each byte through memory three times (into the segment, the reduction, back
// out), with no system calls on the data path.
//
// The ranks meet through a Store (store.h): rank 0 creates the segment and publishes its name,
// the others map it, and once all have, the name is removed from /dev/shm (the memory lives until
// the last process unmaps it or exits), so nothing is left behind however the processes end.
//
// Who calls: every rank (a process on this machine), once, with the same store, size and
// slot_bytes; make_shared_memory_communicator blocks until every rank has mapped the segment.
// Collectives then follow communicator.h: every rank issues the same ones in the same order; each
// call blocks until it completes on this rank. One call at a time per communicator; abort() may
// come from any thread.
//
// all_reduce reduces float32, float64, int32 and int64 (SUM, MAX, MIN; MEAN is a SUM divided by
// size), element by element in rank order (((x0 op x1) op x2) ...), so every rank receives bitwise
// the same result. broadcast and all_gather move bytes (any dtype); reduce_scatter reduces like
// all_reduce. Tensors must be in host memory. Calls larger than slot_bytes per rank go through the
// segment in pieces of slot_bytes; the steady state allocates nothing.
//
// Errors name ranks by SharedMemoryOptions::rank_labels and the call ("shared-memory all_reduce #12
// (float32, 262144 elements) on worker 0: ..."):
//   - a rank that does not arrive within the timeout: DeadlineExceeded naming the ranks that did
//     not arrive (every rank waiting in that call reports the same list);
//   - a rank whose process died (it no longer exists, or is a zombie): Unavailable "lost worker 1:
//     its process died", within ~20 ms of a peer starting to wait for it;
//   - a rank that aborted: Unavailable "worker 1 aborted the group: <reason>" (on the aborting rank
//     itself: "the group was aborted: <reason>");
//   - a rank whose own arguments are wrong (dtype, device, shapes, root): InvalidArgument on every
//     rank, naming that rank and the problem;
//   - calls that disagree across ranks (operation, reduction, dtype, element count, root, sequence
//     number): InvalidArgument on every rank naming rank 0's call and the first disagreeing rank's.
// Argument errors and mismatches leave the communicator usable (every rank threw the same). Any
// other failure fails the group: later calls on every rank throw Unavailable naming the first
// failure. Destroying a communicator tells the peers too: their later calls fail at once.
//
// Limits: the ranks must share /dev/shm and a PID namespace (liveness is checked through /proc),
// which processes of one machine, or of one container, do. The segment takes (size + 1) x
// slot_bytes, plus size² x 32 KiB for the point-to-point channels, plus a few KiB of shared
// memory, reserved when it is made: a /dev/shm too small (64 MiB in a default Docker container) is
// a ResourceExhausted then, not a crash later.
//
// Point-to-point (send, recv, send_recv) goes through a channel per ordered pair of two 16 KiB
// pieces: a message that fits them does not wait for its recv; a larger one makes its sender
// wait for the receiver piece by piece. A timeout that moved nothing of its message leaves the
// group usable (a late message is the next recv's); one midway through a message fails the group.
#pragma once

#include <chrono>
#include <optional>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/collective/store.h"

namespace tandem::collective {

// The smallest SharedMemoryOptions::slot_bytes: a reduce_scatter gives each rank a part of a slot.
inline constexpr std::int64_t kMinSlotBytes = 4096;

struct SharedMemoryOptions {
  int rank = 0;
  int size = 1;
  // Every rank's handle on the same store (to exchange the segment's name). Required.
  std::shared_ptr<Store> store;
  // Meeting, and every collective whose CallOptions keep the default timeout (kDefaultTimeout); a
  // call that passes another timeout uses its own.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Meeting only, when set: a start-up bounds it by its own deadline (the rendezvous timeout).
  std::optional<std::chrono::milliseconds> connect_timeout;
  // How messages name rank r ("worker 1 (127.0.0.1:2223)"). Empty: "rank r".
  std::vector<std::string> rank_labels;
  // Each rank's staging slot in the segment; larger calls go through it in pieces, two barriers
  // per piece. Pieces that stay in the cores' L2 caches between the copy in, the reduction and the
  // copy out are the fastest: on a 2-core VM (2 MiB of L2 per core) 256-512 KiB slots all-reduce
  // 16-64 MiB at 3.3-4 GB/s, 8 MiB slots at 2.4 GB/s (bench_collectives); much smaller ones pay
  // for their barriers. At least kMinSlotBytes; rounded down to a multiple of 64.
  std::int64_t slot_bytes = std::int64_t{512} << 10;
};

// Maps rank options.rank into the group's segment and returns its communicator (backend
// "shared-memory"). Blocks until every rank has mapped the segment: DeadlineExceeded naming the
// ranks that did not within options.timeout; InvalidArgument for bad options (rank out of range,
// no store, a label count that is not size, slot_bytes below kMinSlotBytes) and for ranks whose
// size or slot_bytes differ from rank 0's; ResourceExhausted when /dev/shm cannot hold the
// segment; Unavailable when the store cannot be reached or the segment cannot be made or opened.
// A group of one needs no segment and does its collectives locally.
std::unique_ptr<Communicator> make_shared_memory_communicator(SharedMemoryOptions options);

}  // namespace tandem::collective
