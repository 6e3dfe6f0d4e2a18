// The launchers' rounds (coordination.h): the meeting of each round, the watcher, and the keys
// through which a launcher tells the others that its node failed or is done. The keys live in the
// round's own part of the store ("run/launcher-<r>/"):
//   launcher/failed     "<exit code> <reason>" of the first failure any node saw in the round
//   launcher/done/<n>   node n's workers all exited 0
//   launcher/ack/<n>    node n saw every node done (node 0 may then stop serving the store)
// (n: the node's rank in the round). Elastic jobs choose each round's nodes first, under "elastic/":
//   <r>/joined/<n>      node n (as started) is waiting for round r: its launcher's token
//   conn/<token>/tandem/lost/<n>  that launcher died (set by the store: see tcp_store.h's liveness),
//                       so node 0 does not count a node that joined and died again
//   <r>/nodes           the round's nodes ("0 2 3"), or "failed <why>", written by node 0
//   current             the last round whose nodes were chosen: where a late launcher starts
#include "coordination.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <future>
#include <random>
#include <optional>
#include <vector>

#include "tandem/base/errors.h"

namespace tandem::tools {
namespace {

using namespace std::chrono_literals;

constexpr const char* kFailedKey = "launcher/failed";
std::string done_key(int node) { return fmt::format("launcher/done/{}", node); }
std::string ack_key(int node) { return fmt::format("launcher/ack/{}", node); }

// How long one wait of the watcher lasts: how late it may notice that it should stop, and how
// often it looks at the other nodes' done keys.
constexpr auto kWatchSlice = 500ms;
// A failure report to a store that does not answer (node 0 frozen or cut off) is given up after
// this long: the launcher must go on stopping its workers.
constexpr auto kReportTimeout = 5s;
// How long node 0 keeps serving after every node is done, for the others to see it.
constexpr auto kAckTimeout = 10s;
// How often node 0 looks at the launchers that joined the round it is choosing nodes for.
constexpr auto kJoinScanInterval = 100ms;
// A launcher that joins a running job waits for its next round in waits this long (there is no
// deadline: the next round comes with the next failure; the job's end closes the store).
constexpr auto kLateJoinSlice = 1h;
constexpr const char* kCurrentRoundKey = "current";
std::string joined_key(int round, int node) { return fmt::format("{}/joined/{}", round, node); }
std::string nodes_key(int round) { return fmt::format("{}/nodes", round); }
constexpr std::string_view kFailedNodes = "failed ";

std::string list_nodes(const std::vector<int>& nodes) {
  std::string list;
  for (const int n : nodes) list += fmt::format("{}node {}", list.empty() ? "" : ", ", n);
  return list;
}

std::string address_of(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

std::vector<char> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }

}  // namespace

Coordinator::Coordinator(CoordinationOptions options) : options_(std::move(options)) {
  if (options_.node_rank != 0) return;
  try {
    // Elastic launchers hold two connections (the round's and the elastic keys'), and a late one
    // may connect while its predecessor's is not yet known to be closed.
    const int processes = options_.min_nodes == options_.max_nodes ? options_.processes : 2 * options_.processes;
    server_ = collective::TcpStoreServer::start(options_.master_addr, options_.master_port,
                                                {.max_connections = collective::store_connections_for(processes)});
  } catch (const Error& e) {
    throw CoordinationError(fmt::format("cannot serve the job's store on {}: {}",
                                        address_of(options_.master_addr, options_.master_port), e.what()));
  }
}

Coordinator::~Coordinator() { stop_watching(); }

Coordinator::Membership Coordinator::meet(int round) {
  stop_watching();
  // Node 0 waits for the previous round's nodes whose launchers did not die (they are stopping
  // their workers, which may take up to --stop_timeout), and gives only newcomers the last call.
  expected_.clear();
  if (round_.store != nullptr) {
    for (int n = 0; n < static_cast<int>(membership_.nodes.size()); ++n) {
      try {
        if (!round_.store->check(collective::lost_rank_key(n)))
          expected_.push_back(membership_.nodes[static_cast<std::size_t>(n)]);
      } catch (const std::exception&) {
        break;  // the store is gone: the meeting below says so
      }
    }
  }
  round_ = {};  // the previous round's connection says goodbye
  Membership membership{.round = round, .nodes = {}, .rank = options_.node_rank};
  if (options_.min_nodes == options_.max_nodes) {
    for (int n = 0; n < options_.max_nodes; ++n) membership.nodes.push_back(n);
  } else {
    membership = join(round);
  }
  collective::RendezvousOptions rv;
  rv.address = address_of(options_.master_addr, options_.master_port);
  rv.rank = membership.rank;
  rv.world_size = static_cast<int>(membership.nodes.size());
  for (const int n : membership.nodes) rv.task_labels.push_back(fmt::format("node {}", n));
  rv.timeout = options_.timeout;
  rv.run_id = fmt::format("launcher-{}", membership.round);
  rv.store_served_by_launcher = true;  // node 0 serves it above, for every round
  rv.setup = options_.setup;
  try {
    round_ = collective::rendezvous(rv);
  } catch (const Error& e) {
    throw CoordinationError(fmt::format("round {}: {}", membership.round, e.what()));
  }
  membership_ = membership;
  {
    std::lock_guard lock(mutex_);
    failure_.clear();
    failure_exit_code_ = 1;
  }
  event_ = Event::kNone;
  done_reported_ = false;
  stop_ = false;
  watcher_ = std::thread([this, store = round_.store] { watch(store); });
  return membership;
}

Coordinator::Membership Coordinator::join(int round) {
  const std::string store_address = address_of(options_.master_addr, options_.master_port);
  const auto store_lost = [&](const std::exception& e) {
    return CoordinationError(fmt::format(
        "round {}: lost the job's store at {}: {}; node 0's launcher serves it, so an elastic job ends when node 0 "
        "is lost (or the job has finished)",
        round, store_address, e.what()));
  };
  bool late = false;  // joining a job that runs already: wait for its next round, however long
  try {
    if (elastic_ == nullptr) {
      collective::TcpStoreOptions store_options;
      store_options.connect_timeout = options_.timeout;
      store_options.label_of_server = "node 0's launcher";
      // A token of this launcher's own: its lost key does not outlive it into a later launcher of
      // the same node.
      token_ = fmt::format("{:x}{:x}", std::random_device{}(), std::random_device{}());
      store_options.rank = options_.node_rank;
      store_options.lost_key_prefix = fmt::format("elastic/conn/{}/", token_);
      elastic_ = collective::make_prefix_store(collective::connect_tcp_store(store_address, store_options), "elastic/");
      if (options_.node_rank != 0 && elastic_->check(kCurrentRoundKey)) {
        const std::vector<char> current = elastic_->get(kCurrentRoundKey, kWatchSlice);
        std::from_chars(current.data(), current.data() + current.size(), round);
        ++round;
        late = true;
      }
    }
    if (options_.node_rank == 0) return choose_nodes(*elastic_, round);
    for (;; ++round, late = true) {
      elastic_->set(joined_key(round, options_.node_rank), bytes_of(token_));
      std::vector<char> value;
      if (late) {
        fmt::print(stderr, "tandem-run: node {} waits to join the job at its next restart round ({})\n",
                   options_.node_rank, round);
        for (;;) {
          try {
            value = elastic_->get(nodes_key(round), kLateJoinSlice);
            break;
          } catch (const DeadlineExceeded&) {
          }
        }
      } else {
        try {
          value = elastic_->get(nodes_key(round), options_.timeout);
        } catch (const DeadlineExceeded&) {
          throw CoordinationError(fmt::format(
              "round {}: node 0's launcher did not choose the round's nodes within {} s (is it up, and started "
              "with the same --nnodes?)",
              round, std::chrono::duration<double>(options_.timeout).count()));
        }
      }
      const std::string record(value.begin(), value.end());
      if (record.starts_with(kFailedNodes)) throw CoordinationError(record.substr(kFailedNodes.size()));
      Membership membership{.round = round, .nodes = {}, .rank = -1};
      for (std::size_t at = 0; at < record.size();) {
        int node = 0;
        const auto [end, ec] = std::from_chars(record.data() + at, record.data() + record.size(), node);
        if (ec != std::errc()) break;
        if (node == options_.node_rank) membership.rank = static_cast<int>(membership.nodes.size());
        membership.nodes.push_back(node);
        at = static_cast<std::size_t>(end - record.data()) + 1;
      }
      if (membership.rank >= 0) return membership;
      // Arrived after node 0 chose this round's nodes: the next round, then.
    }
  } catch (const CoordinationError&) {
    throw;
  } catch (const std::exception& e) {
    throw store_lost(e);
  }
}

Coordinator::Membership Coordinator::choose_nodes(collective::Store& elastic, int round) {
  elastic.set(joined_key(round, 0), bytes_of(token_));
  // Whether node n's launcher is waiting for the round (it joined, and has not died since).
  const auto waiting = [&](int n) {
    if (!elastic.check(joined_key(round, n))) return false;
    const std::vector<char> token = elastic.get(joined_key(round, n), kWatchSlice);
    return !elastic.check(
        fmt::format("conn/{}/{}", std::string(token.begin(), token.end()), collective::lost_rank_key(n)));
  };
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  std::optional<std::chrono::steady_clock::time_point> last_call;
  Membership membership{.round = round, .nodes = {}, .rank = 0};
  for (;;) {
    membership.nodes.clear();
    std::vector<int> missing;
    for (int n = 0; n < options_.max_nodes; ++n) {
      (waiting(n) ? membership.nodes : missing).push_back(n);
    }
    const auto now = std::chrono::steady_clock::now();
    const int arrived = static_cast<int>(membership.nodes.size());
    const bool expected_arrived = std::all_of(expected_.begin(), expected_.end(), [&](int n) {
      return std::find(membership.nodes.begin(), membership.nodes.end(), n) != membership.nodes.end();
    });
    if (arrived >= options_.min_nodes && !last_call) last_call = now + options_.join_timeout;
    if (arrived == options_.max_nodes || (last_call && now >= *last_call && expected_arrived)) break;
    if (now >= deadline && arrived >= options_.min_nodes) break;
    if (now >= deadline) {
      const std::string why = fmt::format(
          "round {}: {} node(s) arrived within {} s, fewer than the {} that --nnodes {}:{} needs; missing: {}", round,
          arrived, std::chrono::duration<double>(options_.timeout).count(), options_.min_nodes, options_.min_nodes,
          options_.max_nodes, list_nodes(missing));
      elastic.set(nodes_key(round), bytes_of(std::string(kFailedNodes) + why));
      throw CoordinationError(why);
    }
    std::this_thread::sleep_for(kJoinScanInterval);
  }
  std::string record;
  for (const int n : membership.nodes) record += fmt::format("{}{}", record.empty() ? "" : " ", n);
  elastic.set(nodes_key(round), bytes_of(record));
  elastic.set(kCurrentRoundKey, bytes_of(std::to_string(round)));
  return membership;
}

void Coordinator::stop_watching() {
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
}

void Coordinator::wake() const { [[maybe_unused]] const ssize_t ignored = ::write(options_.wake_fd, &kWakeByte, 1); }

void Coordinator::watch(std::shared_ptr<collective::Store> store) {
  while (!stop_) {
    try {
      store->wait({kFailedKey}, kWatchSlice);
      const std::vector<char> value = store->get(kFailedKey, kWatchSlice);
      const std::string record(value.begin(), value.end());
      const std::size_t space = record.find(' ');
      std::lock_guard lock(mutex_);
      std::from_chars(record.data(), record.data() + std::min(space, record.size()), failure_exit_code_);
      failure_ = space == std::string::npos ? record : record.substr(space + 1);
      event_ = Event::kFailed;
      break;
    } catch (const DeadlineExceeded&) {
      if (const int gone = lost_node(*store); gone >= 0) {
        std::lock_guard lock(mutex_);
        failure_ = fmt::format("the launcher of node {} exited without a word (killed?)",
                               membership_.nodes[static_cast<std::size_t>(gone)]);
        event_ = Event::kFailed;
        break;
      }
      if (!done_reported_) continue;
      bool all_done = true;
      try {
        const int nodes = static_cast<int>(membership_.nodes.size());
        for (int n = 0; n < nodes && all_done; ++n) all_done = store->check(done_key(n));
      } catch (const std::exception&) {
        all_done = false;
      }
      if (!all_done) continue;
      event_ = Event::kAllDone;
      break;
    } catch (const std::exception& e) {
      if (stop_) return;
      std::lock_guard lock(mutex_);
      failure_ = fmt::format("lost the job's store at {} (served by node 0's launcher): {}",
                             address_of(options_.master_addr, options_.master_port), e.what());
      event_ = Event::kStoreLost;
      break;
    }
  }
  if (!stop_) wake();
}

int Coordinator::lost_node(collective::Store& store) const {
  try {
    for (int n = 0; n < static_cast<int>(membership_.nodes.size()); ++n) {
      if (n != membership_.rank && store.check(collective::lost_rank_key(n))) return n;
    }
  } catch (const std::exception&) {
    // The next wait reports a store that is gone.
  }
  return -1;
}

std::string Coordinator::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

int Coordinator::failure_exit_code() const {
  std::lock_guard lock(mutex_);
  return failure_exit_code_;
}

void Coordinator::report_failure(const std::string& reason, int exit_code) noexcept {
  // On a thread of its own, so that a store that does not answer cannot hold up stopping the
  // workers; given up after kReportTimeout (the thread then ends with the process).
  auto store = round_.store;
  if (store == nullptr) return;
  auto reported = std::make_shared<std::promise<void>>();
  std::future<void> done = reported->get_future();
  try {
    std::thread([store, reported, record = fmt::format("{} node {}: {}", exit_code, options_.node_rank, reason)] {
      try {
        if (!store->check(kFailedKey)) store->set(kFailedKey, bytes_of(record));
      } catch (const std::exception&) {
        // The store is gone: the other nodes' workers fail on their own, and their launchers see it.
      }
      reported->set_value();
    }).detach();
  } catch (const std::exception&) {
    return;
  }
  done.wait_for(kReportTimeout);
}

void Coordinator::report_done() noexcept {
  try {
    round_.store->set(done_key(membership_.rank), bytes_of("done"));
  } catch (const std::exception&) {
    // The watcher reports the lost store.
  }
  done_reported_ = true;
}

void Coordinator::finish() noexcept {
  stop_watching();
  try {
    if (membership_.rank != 0) {
      round_.store->set(ack_key(membership_.rank), bytes_of("ack"));
      return;
    }
    std::vector<std::string> acks;
    for (int n = 1; n < static_cast<int>(membership_.nodes.size()); ++n) acks.push_back(ack_key(n));
    round_.store->wait(acks, kAckTimeout);
  } catch (const std::exception&) {
    // A node that does not acknowledge has finished anyway (it reported done).
  }
}

}  // namespace tandem::tools
