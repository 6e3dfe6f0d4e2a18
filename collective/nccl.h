// tandem/collective/nccl.h — GPU replicas through NCCL: the GPUs of one process, or one GPU per
// process across processes.
//
// MirroredStrategy reduces its GPU replicas through make_nccl_group; MultiWorkerMirroredStrategy
// joins the workers' GPUs with make_nccl_process_communicator. Both exist in every build: a build
// without CUDA or NCCL throws Unimplemented (after checking the options), and nccl_available()
// says beforehand whether NCCL and a GPU can be used. Who calls, what blocks and what throws:
// below, per factory; the communicators then follow communicator.h.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/collective/store.h"

namespace tandem::collective {

// GPU replicas of one process: NCCL (ncclCommInitAll over these CUDA device ordinals). Only in
// builds with CUDA; elsewhere throws Unimplemented. Calls are enqueued on each device's
// communication stream and synchronised before returning. Point-to-point calls are ncclSend /
// ncclRecv (a send_recv's halves in one NCCL group), failed like collectives; NCCL cannot tell a
// message whose count or dtype differs from the receiver's (it hangs until the timeout).
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
// counts for up to kFailureReportGrace (communicator.h), and names in its DeadlineExceeded the ranks that
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

}  // namespace tandem::collective
