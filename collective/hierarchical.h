// tandem/collective/hierarchical.h — the replicas of a multi-worker job as one group: local
// replicas first, then across workers.
//
// MultiWorkerMirroredStrategy composes each worker's local group (in_process.h, or nccl.h for GPU
// replicas) with its cross-worker communicator (gloo.h, shared_memory.h or nccl.h) through
// make_hierarchical_group. Who calls, what blocks and what throws: below.
#pragma once

#include <memory>
#include <vector>

#include "tandem/collective/communicator.h"

namespace tandem::collective {

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
// Point-to-point calls reach two kinds of pairs: replicas of one worker (through the local group)
// and two workers' replicas 0 (through the cross-worker communicator). Any other pair, and a
// send_recv whose halves need different levels, throws Unimplemented before anything is sent.
// Who calls: every worker, once, with the same L. Blocks for one cross-worker all-gather of L:
// InvalidArgument naming two workers whose L differ (on every worker), and InvalidArgument for
// local communicators that are not ranks 0..L-1 of one group of L.
std::vector<std::unique_ptr<Communicator>> make_hierarchical_group(std::vector<std::unique_ptr<Communicator>> local,
                                                                   std::unique_ptr<Communicator> cross_worker);

// The stats of the cross-worker communicator under `member` (one of make_hierarchical_group's
// communicators; the same for every replica of a worker): what this worker itself sent to and
// received from the other workers, counted with N = the number of workers. The member's own
// stats() count its collectives at the group's level (N = every replica); the local level is
// counted by the local communicators alone, and nothing adds the levels together.
// Any thread may call it. InvalidArgument when `member` is not a hierarchical group's.
CommunicationStats cross_worker_stats(const Communicator& member);

}  // namespace tandem::collective
