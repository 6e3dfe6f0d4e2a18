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
// Elastic jobs (--nnodes MIN:MAX, MIN < MAX) choose each round's nodes before step 1, as torchrun's
// rendezvous does: every launcher announces itself for the round under "elastic/<r>/joined/<n>";
// node 0's launcher waits until all MAX nodes are there, or, once MIN are, for at most
// join_timeout more (and for every node of the last round whose launcher did not die, up to the
// rendezvous timeout: it may still be stopping its workers), and writes the round's nodes
// ("elastic/<r>/nodes", ascending) and the round ("elastic/current"). The nodes of a round get dense ranks 0..k-1 in
// their original order (node 0 is always rank 0: it serves the store, so a job that loses it ends) and meet as in step
// 1 with world size k. Fewer than MIN by the rendezvous timeout: every launcher fails naming the missing nodes. A
// launcher that arrives after the round's nodes were chosen (started again after its node was lost) waits, without a
// deadline but not past the job's end, for the next round, which the next failure starts.
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
#include <vector>

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
  int node_rank = 0;  // as started: how messages name the node, whatever its rank in a round
  int min_nodes = 1;  // --nnodes MIN:MAX (MIN = MAX: every node in every round)
  int max_nodes = 1;
  std::chrono::milliseconds join_timeout{};  // elastic: the last call once MIN nodes have arrived
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

  // The nodes of one round: `nodes` holds their node ranks as started, ascending; this node's
  // rank in the round is `rank` (its index there).
  struct Membership {
    int round = 0;
    std::vector<int> nodes;
    int rank = 0;
  };

  // Blocks until every node's launcher has arrived for `round` (elastic: until the round's nodes
  // are chosen; a launcher that joins a running job gets a later round), then watches the round.
  // CoordinationError naming the missing nodes at the timeout, or both setups of a mismatch.
  Membership meet(int round);

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
  // Elastic: the round's nodes, chosen by node 0 (above).
  Membership join(int round);
  Membership choose_nodes(collective::Store& elastic, int round);
  void watch(std::shared_ptr<collective::Store> store);
  // A node whose launcher's connection closed without goodbye (the store's lost key), or -1.
  int lost_node(collective::Store& store) const;
  void stop_watching();
  void wake() const;

  CoordinationOptions options_;
  std::unique_ptr<collective::TcpStoreServer> server_;  // node 0
  collective::Rendezvous round_;                        // the current round's store
  std::shared_ptr<collective::Store> elastic_;          // elastic: the "elastic/" keys, for the job
  Membership membership_;                               // the current round's nodes
  std::vector<int> expected_;                           // node 0: the last round's nodes still alive
  std::string token_;                                   // elastic: this launcher's, in its "joined" keys
  std::thread watcher_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_reported_{false};
  std::atomic<Event> event_{Event::kNone};
  mutable std::mutex mutex_;
  std::string failure_;  // guarded by mutex_
  int failure_exit_code_ = 1;
};

}  // namespace tandem::tools
