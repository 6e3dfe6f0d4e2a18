// tandem/collective/rendezvous.h — how the worker processes of one job find each other.
//
// Every rank calls rendezvous() once at start-up with the same address, world size and run id.
// Rank 0 (the chief) serves a TcpStoreServer on the address's port, unless a launcher serves it
// already (tandem-run does: RendezvousOptions::store_served_by_launcher); every rank, the chief
// too, connects to it, announces its rank (so the store notices when its process dies: see
// tcp_store.h) and waits until all world_size ranks have arrived. What they then share is the
// run's store: the Gloo communicator, NCCL's unique id and any other start-up exchange go
// through Rendezvous::store.
//
// Restarts. Under tandem-run the run id is the restart round the launchers agreed on, so a
// restarted group never meets its predecessor's keys. Under other launchers a restarted worker
// may find the previous run's store still up (its chief has not noticed the failure yet) or see
// it vanish while it waits: it then reconnects until the deadline, and meets the new chief's
// store. A store is "stale" when this rank's index was claimed there by a process that has since
// died (the store's lost key for the rank is set).
//
// World sizes are compared as soon as two ranks meet, not after everybody has arrived: every
// rank publishes its world size with its arrival; the chief checks each arrival, every other
// rank checks the chief's, so a rank started with another world size fails on both sides at
// once, each naming both sizes.
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
  // Keys of one run (the launchers' agreed restart round) do not mix with an earlier run's.
  std::string run_id = "0";
  // The store at `address` is served by the launcher (tandem-run) for the whole job: rank 0
  // connects to it like every rank instead of starting a server.
  bool store_served_by_launcher = false;
  // What else every rank must have been started with, compared like the world size and quoted
  // in the error ("--nnodes 2 --nproc_per_node 1 --max_restarts 3" for tandem-run's launchers).
  // Empty: the world size alone.
  std::string setup;
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
//   - a store that goes away while this rank waits, or a stale one (above), is retried until the
//     deadline; DeadlineExceeded then says so.
// InvalidArgument for bad options (rank not in 0..world_size-1, world_size < 1, address not
// host:port, label/address lists of the wrong length, empty run id), for two live processes
// claiming one rank (named), and for ranks started with different world sizes (both named).
// AlreadyExists on rank 0 when the port is taken.
// Destroying the result: the store says goodbye (a clean exit, no lost key); rank 0's server
// stops, so rank 0 should be the last to let go.
Rendezvous rendezvous(const RendezvousOptions& options);

}  // namespace tandem::collective
