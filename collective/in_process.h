// tandem/collective/in_process.h — the replica threads of one process as a group (host memory).
//
// MirroredStrategy on CPU devices, and each worker's local replicas under
// MultiWorkerMirroredStrategy, reduce through this group. Who calls: the thread that sets up the
// replicas, once per group; make_in_process_group does not block. Each returned communicator is
// then used by its rank's own thread, as communicator.h says (every call blocks until all ranks
// have made it). InvalidArgument for a size outside 1 .. 2^24 - 1.
#pragma once

#include <memory>
#include <vector>

#include "tandem/collective/communicator.h"

namespace tandem::collective {

// The ranks of one process's replica threads: shared memory, no copies through a single device.
// all_reduce is a reduce-scatter then an all-gather over chunks, each rank summing its own chunk
// of every rank's buffer and then copying the other ranks' chunks. Returns one communicator per
// rank (rank i at index i); they share the group's state. Every rank checks every call against
// rank 0's: mismatched calls throw InvalidArgument on every rank, and the group stays usable.
// Point-to-point calls go through a mailbox per ordered pair holding a copy of each message:
// send never waits; a recv that times out fails nothing.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size);

}  // namespace tandem::collective
