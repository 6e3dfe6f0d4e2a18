// tandem/collective/store.h — the key-value store that workers meet through (rendezvous).
//
// Before processes can run collectives they must find each other. The chief (rank 0) serves a
// small key-value store on the address the cluster spec gives it; every worker connects to it
// (retrying until a deadline, since workers start in any order) and publishes what the others
// need: its Gloo TCP address, NCCL's unique id, its model's fingerprint. The store is also what
// gloo's rendezvous reads (collective/gloo.cc adapts it to gloo::rendezvous::Store).
//
// Values are bytes. Keys are strings; a key is written once per run by convention (set may
// overwrite, last write wins). Every blocking call takes a timeout and throws DeadlineExceeded
// naming the keys still missing when it passes; a lost connection to the server throws
// Unavailable naming the server's address.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::collective {

// How long workers wait for each other to arrive, by default (TF and torchrun use minutes too:
// machines of one job start seconds to minutes apart).
inline constexpr std::chrono::milliseconds kDefaultRendezvousTimeout = std::chrono::minutes(5);

// One client's handle on the store. Thread-safe: several threads of one process may share it.
class Store {
 public:
  virtual ~Store() = default;

  // Stores value under key. Does not wait for anyone.
  virtual void set(const std::string& key, const std::vector<char>& value) = 0;
  // The value of key, waiting until some client has set it (or timeout: DeadlineExceeded naming
  // the key).
  virtual std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Returns once every key exists; DeadlineExceeded names those still missing at the timeout.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Whether key exists now (never waits).
  virtual bool check(const std::string& key) = 0;
  // Adds delta to the integer counter under key (created at 0) and returns the new value:
  // atomic across clients (used to count arrivals).
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  // Where the store lives, for messages ("127.0.0.1:29500", "in-memory").
  virtual std::string address() const = 0;
};

// A store living in this process: for tests, and for a group whose ranks are threads.
std::shared_ptr<Store> make_in_memory_store();

// Keys under a prefix ("gloo/", "nccl/"): several users share one store without clashing.
std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> inner, std::string prefix);

// Keys about the whole job rather than one group, which every group of a job reads and writes
// outside its own prefix (a store that gives each group a prefix must pass them through
// unprefixed): tcp_store.h's lost_rank_key(r), and failed_call_key(r), where rank r records the
// collective call it failed in ("gloo all_reduce #938 (float32, 1024 elements) on worker 1 in the
// gradient group"), so that a peer waiting in another group of the job can say where r was.
std::string failed_call_key(int rank);
bool is_job_wide_key(std::string_view key);

}  // namespace tandem::collective
