// tandem/collective/rendezvous.h — how the worker processes of one job find each other.
//
// Every rank calls rendezvous() once at start-up with the same address, world size and run id.
// Rank 0 (the chief) serves a TcpStoreServer on the address's port; every rank, the chief too,
// connects to it, announces its rank (so the store notices when its process dies: see
// tcp_store.h) and waits until all world_size ranks have arrived. What they then share is the
// run's store: the Gloo communicator, NCCL's unique id and any other start-up exchange go
// through Rendezvous::store.
//
// Keys of the run live under "run/<run_id>/" on the server; Rendezvous::store hides the prefix.
// The rendezvous itself uses "rendezvous/..." under it. A rank whose process dies shows up as the
// key lost_rank_key(rank) ("tandem/lost/<rank>") in Rendezvous::store.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective {

struct RendezvousOptions {
  // "host:port" where rank 0 serves the store (from the cluster spec). Rank 0 listens on that
  // address (every interface for 0.0.0.0); TANDEM_STORE_SECRET, when set, guards it (tcp_store.h).
  std::string address;
  int rank = 0;
  int world_size = 1;
  // How messages name each rank and where it was expected (from the cluster resolver), e.g.
  // {"chief", "worker 1"} and {"10.0.0.1:2222", "10.0.0.2:2222"}. Empty, or one per rank; empty
  // labels read "rank r".
  std::vector<std::string> task_labels;
  std::vector<std::string> task_addresses;
  // For the whole rendezvous: reaching the chief's store and waiting for every rank.
  std::chrono::milliseconds timeout = kDefaultRendezvousTimeout;
  // Keys of one run (the launcher's restart count) do not mix with an earlier run's.
  std::string run_id = "0";
};

struct Rendezvous {
  std::unique_ptr<TcpStoreServer> server;  // rank 0 only: keep alive as long as the group lives
  std::shared_ptr<Store> store;            // the run's keys (prefixed by run_id); every rank
  int rank = 0;
  int world_size = 1;
};

// Who calls: every rank, once, at start-up. Blocks until all world_size ranks have arrived, or
// options.timeout passes:
//   - DeadlineExceeded naming each missing task and the address it was expected at, e.g.
//     "rendezvous at 127.0.0.1:29500: 1 of 3 workers did not arrive within 5 s: worker 2
//     (expected at 127.0.0.1:29502)";
//   - DeadlineExceeded naming the chief and its address when this rank cannot reach the store;
//   - Unavailable when the chief's store goes away while this rank waits (the chief gave up or
//     died).
// InvalidArgument for bad options (rank not in 0..world_size-1, world_size < 1, address not
// host:port, label/address lists of the wrong length, empty run id), for two processes claiming
// one rank (named), and for ranks started with different world sizes. AlreadyExists on rank 0
// when the port is taken.
// Destroying the result: the store says goodbye (a clean exit, no lost key); rank 0's server
// stops, so rank 0 should be the last to let go.
Rendezvous rendezvous(const RendezvousOptions& options);

}  // namespace tandem::collective
