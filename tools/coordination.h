// tools/coordination.h — how the launchers of one job (tandem-run, one per node) restart in step.
// Private to tandem-run.
//
// Node 0's launcher serves the job's store (collective::TcpStoreServer) on master_addr:master_port
// for the whole job, restarts included; every launcher, node 0's too, connects to it, and so do
// the workers (TANDEM_LAUNCHER_STORE=1: the chief worker does not serve a store of its own). The
// job runs in rounds, as torchrun's rendezvous does:
//   1. every node's launcher meets the others (collective::rendezvous under run "launcher-<r>",
//      its node rank among nnodes, and a setup string "--nnodes M --nproc_per_node N
//      --max_restarts K" that every node must share: a node started otherwise fails at once,
//      and so does the node it met, each naming both setups);
//   2. each starts its workers with TANDEM_RESTART_COUNT=r; they meet under run "r" of the same
//      store, so a round never sees its predecessor's keys and every node counts the same r;
//   3. a launcher whose worker fails records the round's failure; a watcher thread in every
//      launcher sees it within ~0.5 s and wakes the launcher's poll loop, which stops its workers;
//      then every launcher goes on to round r + 1, or exits with the failed worker's code when
//      r = max_restarts;
//   4. a launcher whose workers all succeeded records that its node is done and waits until every
//      node is (success) or the round failed (a restart for every node, this one too);
//   5. a launcher that dies (its connection to the store closes without goodbye) fails the round
//      for the others, and one stopped by a signal records the failure before it exits.
//
// Who calls: the launcher's thread; the watcher runs on a thread of its own and writes
// kWakeByte into the launcher's self-pipe. Errors: CoordinationError (the launcher exits 1).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "tandem/collective/rendezvous.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::tools {

// The byte the watcher writes into the self-pipe (0 is no signal number).
inline constexpr unsigned char kWakeByte = 0;

class CoordinationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CoordinationOptions {
  std::string master_addr;
  int master_port = 0;
  int node_rank = 0;
  int nnodes = 1;
  int processes = 1;                  // every node's launcher and workers: the store's connections
  std::string setup;                  // compared across nodes, quoted in errors
  std::chrono::milliseconds timeout;  // each round's meeting (TANDEM_RENDEZVOUS_TIMEOUT)
  int wake_fd = -1;                   // the launcher's self-pipe
};

class Coordinator {
 public:
  // Node 0: starts serving the job's store (CoordinationError when the port is taken).
  explicit Coordinator(CoordinationOptions options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Blocks until every node's launcher has arrived for `round` (CoordinationError naming the
  // missing nodes at the timeout, or both setups of a mismatch), then watches the round.
  void meet(int round);

  // What the watcher saw in the current round.
  enum class Event { kNone, kFailed, kAllDone, kStoreLost };
  Event event() const { return event_.load(); }
  // The round's failure as recorded by the node that saw it, and the exit code to end with.
  std::string failure() const;
  int failure_exit_code() const;

  // Records that this node's worker failed (the first record of a round wins). Never throws; bounded.
  void report_failure(const std::string& reason, int exit_code) noexcept;
  // Records that every worker of this node exited 0.
  void report_done() noexcept;
  // After kAllDone: node 0 keeps the store up until every node has seen it (bounded); the others
  // say they have.
  void finish() noexcept;

 private:
  void watch(std::shared_ptr<collective::Store> store);
  // A node whose launcher's connection closed without goodbye (the store's lost key), or -1.
  int lost_node(collective::Store& store) const;
  void stop_watching();
  void wake() const;

  CoordinationOptions options_;
  std::unique_ptr<collective::TcpStoreServer> server_;  // node 0
  collective::Rendezvous round_;                        // the current round's store
  std::thread watcher_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_reported_{false};
  std::atomic<Event> event_{Event::kNone};
  mutable std::mutex mutex_;
  std::string failure_;  // guarded by mutex_
  int failure_exit_code_ = 1;
};

}  // namespace tandem::tools
