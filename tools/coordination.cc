// The launchers' rounds (coordination.h): the meeting of each round, the watcher, and the keys
// through which a launcher tells the others that its node failed or is done. The keys live in the
// round's own part of the store ("run/launcher-<r>/"):
//   launcher/failed     "<exit code> <reason>" of the first failure any node saw in the round
//   launcher/done/<n>   node n's workers all exited 0
//   launcher/ack/<n>    node n saw every node done (node 0 may then stop serving the store)
#include "coordination.h"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <future>
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

std::string address_of(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

std::vector<char> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }

}  // namespace

Coordinator::Coordinator(CoordinationOptions options) : options_(std::move(options)) {
  if (options_.node_rank != 0) return;
  try {
    server_ =
        collective::TcpStoreServer::start(options_.master_addr, options_.master_port,
                                          {.max_connections = collective::store_connections_for(options_.processes)});
  } catch (const Error& e) {
    throw CoordinationError(fmt::format("cannot serve the job's store on {}: {}",
                                        address_of(options_.master_addr, options_.master_port), e.what()));
  }
}

Coordinator::~Coordinator() { stop_watching(); }

void Coordinator::meet(int round) {
  stop_watching();
  round_ = {};  // the previous round's connection says goodbye
  collective::RendezvousOptions rv;
  rv.address = address_of(options_.master_addr, options_.master_port);
  rv.rank = options_.node_rank;
  rv.world_size = options_.nnodes;
  for (int n = 0; n < options_.nnodes; ++n) rv.task_labels.push_back(fmt::format("node {}", n));
  rv.timeout = options_.timeout;
  rv.run_id = fmt::format("launcher-{}", round);
  rv.store_served_by_launcher = true;  // node 0 serves it above, for every round
  rv.setup = options_.setup;
  try {
    round_ = collective::rendezvous(rv);
  } catch (const Error& e) {
    throw CoordinationError(fmt::format("round {}: {}", round, e.what()));
  }
  {
    std::lock_guard lock(mutex_);
    failure_.clear();
    failure_exit_code_ = 1;
  }
  event_ = Event::kNone;
  done_reported_ = false;
  stop_ = false;
  watcher_ = std::thread([this, store = round_.store] { watch(store); });
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
        failure_ = fmt::format("the launcher of node {} exited without a word (killed?)", gone);
        event_ = Event::kFailed;
        break;
      }
      if (!done_reported_) continue;
      bool all_done = true;
      try {
        for (int n = 0; n < options_.nnodes && all_done; ++n) all_done = store->check(done_key(n));
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
    for (int n = 0; n < options_.nnodes; ++n) {
      if (n != options_.node_rank && store.check(collective::lost_rank_key(n))) return n;
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
    round_.store->set(done_key(options_.node_rank), bytes_of("done"));
  } catch (const std::exception&) {
    // The watcher reports the lost store.
  }
  done_reported_ = true;
}

void Coordinator::finish() noexcept {
  stop_watching();
  try {
    if (options_.node_rank != 0) {
      round_.store->set(ack_key(options_.node_rank), bytes_of("ack"));
      return;
    }
    std::vector<std::string> acks;
    for (int n = 1; n < options_.nnodes; ++n) acks.push_back(ack_key(n));
    round_.store->wait(acks, kAckTimeout);
  } catch (const std::exception&) {
    // A node that does not acknowledge has finished anyway (it reported done).
  }
}

}  // namespace tandem::tools
