// The rendezvous: rank 0 serves the store; every rank connects (announcing its rank), claims its
// rank with a counter (a second claim in the same run is a duplicate even if the first claimant
// has gone), publishes who it is, and waits for every rank's key.
#include "tandem/collective/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>

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
// Under rank_key: only the rank's own client may write it (tcp_store.h's keys that belong to a rank).
std::string claim_key(int rank) { return fmt::format("rendezvous/rank/{}/claims", rank); }
constexpr const char* kWorldSizeKey = "rendezvous/world_size";

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
  const Clock::time_point deadline = Clock::now() + timeout;
  const auto remaining = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  const Names names(options);
  const int rank = options.rank;
  const int world_size = options.world_size;
  const std::string me = fmt::format("{} (rank {} of {})", names.label(rank), rank, world_size);
  const std::string prefix = fmt::format("rendezvous at {}: ", options.address);

  Rendezvous result;
  result.rank = rank;
  result.world_size = world_size;

  std::string store_address = options.address;
  if (rank == 0) {
    try {
      result.server = TcpStoreServer::start(target.host, target.port,
                                            {.max_connections = store_connections_for(world_size)});
    } catch (const AlreadyExists& e) {
      throw AlreadyExists(fmt::format("{}{}: {}", prefix, me, e.what()));
    } catch (const Unavailable& e) {
      throw Unavailable(fmt::format("{}{}: {}", prefix, me, e.what()));
    }
    // The address it is bound to (loopback when it listens on every interface): reachable even
    // where the cluster's name for this machine does not route back to it.
    store_address = result.server->local_address();
  }

  TcpStoreOptions store_options;
  store_options.connect_timeout = remaining();
  store_options.label_of_server = names.label(0);
  store_options.rank = rank;
  const std::string run_prefix = fmt::format("run/{}/", options.run_id);
  store_options.lost_key_prefix = run_prefix;
  std::shared_ptr<Store> client;
  try {
    client = connect_tcp_store(store_address, store_options);
  } catch (const DeadlineExceeded& e) {
    throw DeadlineExceeded(
        fmt::format("{}{} could not reach {}: {}", prefix, me, names.label_and_address(0), e.what()));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}{}: {}", prefix, me, e.what()));
  } catch (const Unavailable& e) {
    throw Unavailable(fmt::format("{}{} lost {}: {}", prefix, me, names.label_and_address(0), e.what()));
  }
  result.store = make_prefix_store(client, run_prefix);
  Store& store = *result.store;

  try {
    const std::string who = this_process();
    if (store.add(claim_key(rank), 1) > 1) {
      std::string first = "another process";
      if (store.check(rank_key(rank))) {
        const auto v = store.get(rank_key(rank), std::chrono::milliseconds(0));
        first.assign(v.begin(), v.end());
      }
      throw InvalidArgument(
          fmt::format("{}rank {} ({}) was claimed twice in run \"{}\" (first by {}, again by {}): "
                      "two processes were started as rank {}; each task needs its own index",
                      prefix, rank, names.label(rank), options.run_id, first, who, rank));
    }
    if (rank == 0) store.set(kWorldSizeKey, to_bytes(std::to_string(world_size)));
    store.set(rank_key(rank), to_bytes(who));

    std::vector<std::string> keys;
    for (int r = 0; r < world_size; ++r) keys.push_back(rank_key(r));
    try {
      store.wait(keys, remaining());
    } catch (const DeadlineExceeded&) {
      std::vector<int> missing;
      for (int r = 0; r < world_size; ++r) {
        if (!store.check(rank_key(r))) missing.push_back(r);
      }
      if (!missing.empty()) {
        std::string list;
        for (const int r : missing) {
          if (!list.empty()) list += ", ";
          list += names.label_and_address(r);
        }
        throw DeadlineExceeded(fmt::format("{}{} of {} workers did not arrive within {}: {}", prefix, missing.size(),
                                           world_size, format_duration(timeout), list));
      }
      // Everybody arrived right at the deadline: that is a success.
    }

    if (rank != 0) {
      const auto bytes = store.get(kWorldSizeKey, std::max(remaining(), std::chrono::milliseconds(1000)));
      int chief_world_size = 0;
      std::from_chars(bytes.data(), bytes.data() + bytes.size(), chief_world_size);
      TANDEM_REQUIRE(chief_world_size == world_size, InvalidArgument,
                     "{}{} was started with world_size {}, but {} with world_size {}: every task must be given the "
                     "same cluster",
                     prefix, me, world_size, names.label(0), chief_world_size);
    }
  } catch (const Unavailable& e) {
    throw Unavailable(
        fmt::format("{}{} lost the store of {} while waiting for the other workers (did {} exit or give "
                    "up?): {}",
                    prefix, me, names.label_and_address(0), names.label(0), e.what()));
  }
  return result;
}

}  // namespace tandem::collective
