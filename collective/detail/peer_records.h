// tandem/collective/detail/peer_records.h — which rank to blame, for the backends whose ranks are
// processes that share nothing but a Store (Gloo, NCCL across processes; the shared-memory group
// uses its meeting helpers). Not part of the public contract.
//
// A rank of such a group cannot see its peers: when its call fails (a timeout, a closed
// connection, an NCCL error) it learns who is to blame from what the peers left in the store:
//   progress/<rank>   "<collectives issued> <cause>": written by a rank when it fails, so that a
//                     rank whose call timed out can tell the peers that reached the call (and
//                     failed in it too) from those that never did;
//   aborted/<rank>    the reason a rank gave to abort();
//   tandem/lost/<rank> (tcp_store.h's lost_rank_key, outside the group's prefix) set by the TCP
//                     store's server when that rank's process died;
//   tandem/failed_call/<rank> (store.h's failed_call_key, outside the group's prefix too) the call
//                     a rank failed in, in words, so that a peer of another group of the same
//                     job (a strategy's control group beside its gradient group) can tell "it
//                     never reached this call" from "it was waiting in another call".
// PeerRecords writes and reads these keys under the group's prefix and words the verdicts the
// backends share ("lost rank 2 of 3: its process died ..."). Writes never throw (a store that cannot
// be reached is itself a finding); reads throw what the store throws, except survey(), which
// reports an unreachable store in its result. Who calls: a rank's own thread while it fails or
// waits; survey() blocks for up to its grace.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/collective/store.h"

namespace tandem::collective::detail {

// "tandem/<backend>/<generation>/": the keys of this rank's k-th communicator of `backend` made
// with this store. Each rank counts its own communicators, so the k-th of every rank meets the
// others' k-th, and a replacement group never reads its predecessor's keys. Throws what the store
// throws.
std::string group_prefix(Store& store, std::string_view backend, int rank);

// Waits until key_of(q) exists for every rank q of `size`. Returns the ranks whose key is still
// missing at the timeout (empty: every rank is there). Throws what the store throws, but not its
// DeadlineExceeded.
std::vector<int> wait_for_ranks(Store& store, const std::function<std::string(int)>& key_of, int size,
                                std::chrono::milliseconds timeout);

// Why a rank failed, as it records it for its peers.
enum class FailureCause { kTimeout, kConnection, kError, kAborted };

// What a failed rank learned from its peers' records about one call (PeerRecords::survey).
struct PeerSurvey {
  bool store_reachable = true;
  std::string store_error;                             // why not, when unreachable
  std::vector<int> lost;                               // died (in rank order)
  std::vector<std::pair<int, std::string>> aborted;    // aborted the group, with their reasons
  std::vector<int> behind;                             // neither reached the call nor died nor aborted
  std::vector<std::pair<int, std::string>> elsewhere;  // of `behind`: failed in another call (named)
  bool peer_timed_out = false;                         // a peer that reached the call timed out in it
};

class PeerRecords {
 public:
  // `labels`: how messages name the ranks (empty: "rank r of size"); `chief`: how they name rank 0,
  // whose process serves the store in a tandem job.
  PeerRecords(std::shared_ptr<Store> store, std::string prefix, int rank, int size, std::vector<std::string> labels,
              std::string chief);

  Store& store() const { return *store_; }
  const std::string& prefix() const { return prefix_; }

  // Lost keys already set now were left by an earlier process of that rank (the key stays for the
  // store's lifetime): they say nothing about this group. Call once every rank has arrived.
  void forget_earlier_losses();

  // Records that this rank failed after issuing `issued` collectives (the failed one included),
  // and why; `call`, when given, names the call for peers of other groups (failed_call_key).
  // False when the store cannot be reached.
  bool record_failure(std::uint64_t issued, FailureCause cause, std::string_view call = {}) noexcept;
  // Records that this rank aborted the group with `reason`, having issued `issued` collectives.
  void record_abort(std::uint64_t issued, std::string_view reason) noexcept;

  // Whether a peer recorded a failure or an abort, or died.
  bool peer_failed();
  // The peers that died since the group formed.
  std::vector<int> lost_peers();

  // Reads the peers' records about call number `seq` for up to `grace`, until every peer is
  // accounted for (it reached the call, died, aborted, or failed in another group's call), or, with
  // stop_at_culprit, until one died or aborted.
  PeerSurvey survey(std::uint64_t seq, std::chrono::milliseconds grace, bool stop_at_culprit);

  // "rank 1 of 3", "ranks 1, 2 of 3", "worker 1, worker 2".
  std::string names(const std::vector<int>& ranks) const;
  // "lost rank 2 of 3: its process died (the store saw its connection close)".
  std::string lost_message(const std::vector<int>& lost) const;
  // "the store at 10.0.0.1:2222 is unreachable<how>, so the process serving it (chief in a tandem
  // job, the chief) has probably died".
  std::string store_unreachable_message(std::string_view how) const;

 private:
  std::string key(std::string_view what, int rank) const;
  bool lost_now(int rank);

  std::shared_ptr<Store> store_;
  std::string prefix_;
  int rank_;
  int size_;
  std::vector<std::string> labels_;
  std::string chief_;
  std::vector<bool> earlier_losses_;  // per rank: its lost key was set before the group formed
};

}  // namespace tandem::collective::detail
