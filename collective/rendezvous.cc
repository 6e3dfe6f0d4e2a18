// The rendezvous: rank 0 serves the store; every rank connects (announcing its rank), claims its
// rank with a counter (a second claim in the same run is a duplicate even if the first claimant
// has gone), publishes who it is, and waits for every rank's key.
#include "tandem/collective/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <random>
#include <thread>

#include "tandem/base/errors.h"
#include "tandem/collective/detail/common.h"

namespace tandem::collective {
namespace {

using detail::Clock;
using detail::format_duration;

std::vector<char> to_bytes(std::string_view s) { return std::vector<char>(s.begin(), s.end()); }

std::string this_process() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return fmt::format("pid {} on {}", ::getpid(), host[0] != '\0' ? host : "an unnamed host");
}

std::string rank_key(int rank) { return fmt::format("rendezvous/rank/{}", rank); }
// Under rank_key: only the rank's own client may write them (tcp_store.h's keys that belong to a
// rank).
std::string claim_key(int rank) { return fmt::format("rendezvous/rank/{}/claims", rank); }
// Which call of rendezvous() claimed the rank: its own retry is no duplicate.
std::string claimant_key(int rank) { return fmt::format("rendezvous/rank/{}/claimant", rank); }
// The chief's setup ("<world_size> <setup>"), read by every other rank as soon as the chief has
// arrived.
constexpr const char* kWorldSizeKey = "rendezvous/world_size";
// Arrivals in order ("<rank> <world_size> <setup>"), counted by kArrivalsKey, read by the chief as
// they come: a rank of another world size may have an index the chief does not wait for.
constexpr const char* kArrivalsKey = "rendezvous/arrivals";
std::string arrival_key(std::int64_t n) { return fmt::format("rendezvous/arrival/{}", n); }
// How often a waiting chief looks at new arrivals.
constexpr auto kArrivalScanInterval = std::chrono::milliseconds(200);
// Pause between two attempts at a store that was stale or went away.
constexpr auto kRetryPause = std::chrono::milliseconds(500);

std::string string_of(const std::vector<char>& bytes) { return std::string(bytes.begin(), bytes.end()); }

int int_of(std::string_view text) {
  int value = -1;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

// "world_size 3" or "world_size 3 (--nnodes 3 --nproc_per_node 1)", from "<world_size> <setup>".
std::string describe_setup(std::string_view record) {
  const std::size_t space = record.find(' ');
  const std::string_view world = record.substr(0, space);
  const std::string_view setup = space == std::string_view::npos ? "" : record.substr(space + 1);
  return setup.empty() ? fmt::format("world_size {}", world) : fmt::format("world_size {} ({})", world, setup);
}

// Thrown inside one attempt when this rank must leave the store and look for it again: it went
// away, or it belongs to an earlier run.
struct RetryLater {
  std::string why;
};

class Names {
 public:
  explicit Names(const RendezvousOptions& options) : options_(options) {}

  // "worker 2", or "rank 2" without labels.
  std::string label(int rank) const {
    const auto r = static_cast<std::size_t>(rank);
    if (r < options_.task_labels.size() && !options_.task_labels[r].empty()) return options_.task_labels[r];
    return fmt::format("rank {}", rank);
  }
  // "worker 2 (expected at 10.0.0.3:2222)".
  std::string label_and_address(int rank) const {
    const auto r = static_cast<std::size_t>(rank);
    // A label that already shows the address ("worker 2 (10.0.0.3:2222)") is not repeated.
    if (r < options_.task_addresses.size() && !options_.task_addresses[r].empty() &&
        label(rank).find(options_.task_addresses[r]) == std::string::npos) {
      return fmt::format("{} (expected at {})", label(rank), options_.task_addresses[r]);
    }
    return label(rank);
  }

 private:
  const RendezvousOptions& options_;
};

void validate(const RendezvousOptions& options) {
  const std::string& where = options.address;
  TANDEM_REQUIRE(options.world_size >= 1, InvalidArgument, "rendezvous at {}: world_size is {}; it must be at least 1",
                 where, options.world_size);
  TANDEM_REQUIRE(options.rank >= 0 && options.rank < options.world_size, InvalidArgument,
                 "rendezvous at {}: rank {} is not in 0..{} (world_size {})", where, options.rank,
                 options.world_size - 1, options.world_size);
  const auto world = static_cast<std::size_t>(options.world_size);
  TANDEM_REQUIRE(options.task_labels.empty() || options.task_labels.size() == world, InvalidArgument,
                 "rendezvous at {}: {} task labels for world_size {} (give one per rank, or none)", where,
                 options.task_labels.size(), options.world_size);
  TANDEM_REQUIRE(options.task_addresses.empty() || options.task_addresses.size() == world, InvalidArgument,
                 "rendezvous at {}: {} task addresses for world_size {} (give one per rank, or none)", where,
                 options.task_addresses.size(), options.world_size);
  TANDEM_REQUIRE(!options.run_id.empty(), InvalidArgument, "rendezvous at {}: the run id is empty", where);
}

}  // namespace

namespace {

// One rendezvous, from connecting to everybody's arrival: rendezvous() below retries it while a
// store is stale or vanishes.
class Meeting {
 public:
  Meeting(const RendezvousOptions& options, Clock::time_point deadline, std::chrono::milliseconds timeout)
      : options_(options),
        names_(options),
        deadline_(deadline),
        timeout_(timeout),
        me_(fmt::format("{} (rank {} of {})", names_.label(options.rank), options.rank, options.world_size)),
        prefix_(fmt::format("rendezvous at {}: ", options.address)),
        who_(this_process()),
        token_(fmt::format("{:x}", std::random_device{}()) + fmt::format("{:x}", std::random_device{}())) {}

  const std::string& me() const { return me_; }
  const std::string& prefix() const { return prefix_; }

  std::chrono::milliseconds remaining() const {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::ceil<std::chrono::milliseconds>(deadline_ - Clock::now()));
  }

  // Connects to the store at store_address and meets the others there. `own_server`: this rank
  // serves that store (it cannot be stale, and losing it is not worth a retry).
  std::shared_ptr<Store> attempt(const std::string& store_address, bool own_server) {
    const std::string run_prefix = fmt::format("run/{}/", options_.run_id);
    TcpStoreOptions store_options;
    store_options.connect_timeout = remaining();
    store_options.label_of_server = options_.store_served_by_launcher ? "the launcher" : names_.label(0);
    store_options.rank = options_.rank;
    store_options.lost_key_prefix = run_prefix;
    std::shared_ptr<Store> client;
    try {
      client = connect_tcp_store(store_address, store_options);
    } catch (const DeadlineExceeded& e) {
      throw DeadlineExceeded(
          fmt::format("{}{} could not reach {}: {}", prefix_, me_, names_.label_and_address(0), e.what()));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}{}: {}", prefix_, me_, e.what()));
    } catch (const Unavailable& e) {
      if (own_server) throw Unavailable(fmt::format("{}{}: {}", prefix_, me_, e.what()));
      throw RetryLater{e.what()};
    }
    auto store = make_prefix_store(client, run_prefix);
    try {
      meet(*store);
    } catch (const Unavailable& e) {
      if (own_server) throw;
      throw RetryLater{fmt::format("lost the store while waiting for the other workers: {}", e.what())};
    }
    return store;
  }

 private:
  void meet(Store& store) {
    const int rank = options_.rank;
    const int world_size = options_.world_size;
    claim(store);
    const std::string mine = fmt::format("{} {}", world_size, options_.setup);
    // The arrival record ("<rank> <setup>") before the rank key: once the chief sees every rank
    // key, it has seen every arrival record too.
    const auto arrive = [&] {
      const std::int64_t n = store.add(kArrivalsKey, 1);
      store.set(arrival_key(n), to_bytes(fmt::format("{} {}", rank, mine)));
    };
    if (rank == 0) {
      store.set(kWorldSizeKey, to_bytes(mine));
    } else {
      // The chief's setup as soon as the chief is there, and before this rank shows itself: the
      // chief, seeing a mismatched arrival, gives up at once and takes the store with it, so this
      // rank must know the verdict by then.
      std::vector<char> bytes;
      try {
        bytes = store.get(kWorldSizeKey, remaining());
      } catch (const DeadlineExceeded&) {
        throw_missing(store);
      }
      const std::string chief = string_of(bytes);
      if (chief != mine) {
        arrive();  // so that the chief fails too, naming this rank
        throw InvalidArgument(
            fmt::format("{}{} was started with {}, but {} with {}: every task must be given the "
                        "same cluster",
                        prefix_, me_, describe_setup(mine), names_.label(0), describe_setup(chief)));
      }
    }
    arrive();
    store.set(rank_key(rank), to_bytes(who_));
    std::vector<std::string> keys;
    for (int r = 0; r < world_size; ++r) keys.push_back(rank_key(r));
    std::int64_t next_arrival = 1;
    for (;;) {
      if (rank == 0) next_arrival = check_arrivals(store, next_arrival);
      const auto left = remaining();
      try {
        store.wait(keys, rank == 0 ? std::min(left, std::chrono::milliseconds(kArrivalScanInterval)) : left);
        break;
      } catch (const DeadlineExceeded&) {
        if (remaining() > std::chrono::milliseconds(0)) continue;
        throw_missing(store);
        break;  // everybody arrived right at the deadline: a success
      }
    }
    if (rank == 0) check_arrivals(store, next_arrival);
  }

  // Claims this rank with a counter: a second claim in the same run is a duplicate, unless the
  // first claimant was this very process (an earlier attempt) or has died there (the store is
  // an earlier run's: leave it and look again).
  void claim(Store& store) {
    const int rank = options_.rank;
    if (store.add(claim_key(rank), 1) == 1) {
      store.set(claimant_key(rank), to_bytes(token_));
      return;
    }
    if (store.check(claimant_key(rank)) &&
        string_of(store.get(claimant_key(rank), std::chrono::milliseconds(0))) == token_) {
      return;
    }
    std::string first = "another process";
    if (store.check(rank_key(rank))) first = string_of(store.get(rank_key(rank), std::chrono::milliseconds(0)));
    if (store.check(lost_rank_key(rank))) {
      throw RetryLater{fmt::format(
          "the store belongs to an earlier run: rank {} was claimed there by {}, which has died", rank, first)};
    }
    throw InvalidArgument(
        fmt::format("{}rank {} ({}) was claimed twice in run \"{}\" (first by {}, again by {}): "
                    "two processes were started as rank {}; each task needs its own index",
                    prefix_, rank, names_.label(rank), options_.run_id, first, who_, rank));
  }

  // The chief compares the world size of every rank that arrived since `next`; returns the next
  // arrival to look at.
  std::int64_t check_arrivals(Store& store, std::int64_t next) {
    while (store.check(arrival_key(next))) {
      const std::string record = string_of(store.get(arrival_key(next), std::chrono::milliseconds(0)));
      const std::size_t space = record.find(' ');
      const int rank = int_of(record.substr(0, space));
      const std::string theirs = space == std::string::npos ? "" : record.substr(space + 1);
      const std::string mine = fmt::format("{} {}", options_.world_size, options_.setup);
      if (theirs != mine) {
        throw InvalidArgument(fmt::format(
            "{}{} was started with {}, but rank {} ({}) arrived with {}: every task must be given the same cluster",
            prefix_, me_, describe_setup(mine), rank,
            rank >= 0 && rank < options_.world_size ? names_.label(rank) : "a task outside this cluster",
            describe_setup(theirs)));
      }
      ++next;
    }
    return next;
  }

  [[noreturn]] void throw_missing(Store& store) {
    std::vector<int> missing;
    for (int r = 0; r < options_.world_size; ++r) {
      if (r != options_.rank && !store.check(rank_key(r))) missing.push_back(r);
    }
    std::string list;
    for (const int r : missing) {
      if (!list.empty()) list += ", ";
      list += names_.label_and_address(r);
    }
    throw DeadlineExceeded(fmt::format("{}{} of {} workers did not arrive within {}: {}", prefix_, missing.size(),
                                       options_.world_size, format_duration(timeout_), list));
  }

  const RendezvousOptions& options_;
  const Names names_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
  const std::string me_;
  const std::string prefix_;
  const std::string who_;
  const std::string token_;  // this call's, to recognise its own claim after a retry
};

}  // namespace

Rendezvous rendezvous(const RendezvousOptions& options) {
  validate(options);
  HostPort target;
  try {
    target = parse_host_port(options.address);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("rendezvous: the chief's {}", e.what()));
  }
  // Port 0 would let rank 0 pick a port nobody else knows.
  TANDEM_REQUIRE(target.port != 0 || options.world_size == 1, InvalidArgument,
                 "rendezvous at {}: port 0 cannot be found by the other {} rank(s); give the chief a fixed port",
                 options.address, options.world_size - 1);

  const auto timeout = std::clamp(options.timeout, std::chrono::milliseconds(0), detail::kMaxTimeout);
  Meeting meeting(options, Clock::now() + timeout, timeout);

  Rendezvous result;
  result.rank = options.rank;
  result.world_size = options.world_size;

  std::string store_address = options.address;
  const bool own_server = options.rank == 0 && !options.store_served_by_launcher;
  if (own_server) {
    try {
      result.server = TcpStoreServer::start(target.host, target.port,
                                            {.max_connections = store_connections_for(options.world_size)});
    } catch (const AlreadyExists& e) {
      throw AlreadyExists(fmt::format("{}{}: {}", meeting.prefix(), meeting.me(), e.what()));
    } catch (const Unavailable& e) {
      throw Unavailable(fmt::format("{}{}: {}", meeting.prefix(), meeting.me(), e.what()));
    }
    // The address it is bound to (loopback when it listens on every interface): reachable even
    // where the cluster's name for this machine does not route back to it.
    store_address = result.server->local_address();
  }

  std::string retried;  // why the last attempt had to look again, if it did
  const auto no_usable_store = [&] {
    return DeadlineExceeded(fmt::format("{}{} found no usable store within {}; last: {}", meeting.prefix(),
                                        meeting.me(), format_duration(timeout), retried));
  };
  for (;;) {
    try {
      result.store = meeting.attempt(store_address, own_server);
      return result;
    } catch (const RetryLater& retry) {
      // A restarted worker met the previous run's store, or the store went away: the chief is being
      // restarted too. Look again until the deadline.
      retried = retry.why;
      const auto pause = std::min<std::chrono::milliseconds>(kRetryPause, meeting.remaining());
      if (pause <= std::chrono::milliseconds(0)) throw no_usable_store();
      std::this_thread::sleep_for(pause);
    } catch (const DeadlineExceeded&) {
      // After a retry, why it looked again says more than the last attempt's timeout.
      if (!retried.empty()) throw no_usable_store();
      throw;
    }
  }
}

}  // namespace tandem::collective
