// The NCCL group: GPU replicas of one process, one communicator per GPU (ncclCommInitAll), or one
// rank of a group spanning processes, one GPU each (ncclCommInitRankConfig, meeting through a Store).
//
// One thread per rank. Like nccl-tests with one thread per GPU, every rank issues each collective
// from its own thread, concurrently with its peers: a rank's call enqueues NCCL's kernel on its
// communication stream and then waits for that stream, so a single thread calling the ranks in
// turn would wait forever on the first.
//
// A call: (1) the communication stream waits for the device's compute stream (the tensors were
// produced there); (2) NCCL enqueues (a span of tensors is one ncclGroupStart/End of in-place
// all-reduces: NCCL fuses them into one launch); (3) the thread polls cudaStreamQuery and
// ncclCommGetAsyncError until the stream is done, the group fails, or the call's timeout passes.
// On a timeout or an NCCL error the group fails: every rank that is waiting aborts its own
// communicator (ncclCommAbort stops kernels that wait for a peer) and throws, and every later call
// throws Unavailable. Each rank records the sequence number of the collective it last issued,
// so a timeout names the ranks that never issued it.
//
// A group across processes shares nothing but the store, so the group's state travels through it
// (keys under "tandem/nccl/<generation>/"): the first rank to fail writes "failure" (its rank, the
// kind, the message), and a rank that waits in a collective for longer than kPeerPoll reads that
// key every kPeerPoll, and the TCP store's lost keys every kLostPoll, so that one rank's abort,
// error or death ends its peers' calls too (NCCL itself would leave them waiting for the dead
// peer). A rank that fails also records how many collectives it issued, and a rank whose call times
// out surveys those records for a short grace to name the ranks that never issued it (both through
// detail/peer_records.h, shared with the Gloo communicator). Its communicator is non-blocking (config.blocking = 0), so
// that neither the initialisation nor the first collective (where NCCL connects the peers) can block past a deadline:
// NCCL calls may then return ncclInProgress, and the thread polls ncclCommGetAsyncError until the work is enqueued.
//
// NCCL is loaded with dlopen on first use, not linked: libnccl is 200 MB, most programs never
// make a GPU group, and a build made here must start where NCCL is not installed.
//
// Unlike the in-process group, ranks do not compare their calls (that would need a host
// rendezvous on every call): NCCL with mismatched counts hangs, and the timeout reports it.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "tandem/base/detail/shared_library.h"
#include "tandem/base/spin.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/detail/nccl_process_options.h"
#include "tandem/collective/detail/peer_records.h"
#include "tandem/collective/nccl.h"
#include "tandem/collective/store.h"
#include "tandem/devices/detail/cuda_check.h"
#include "tandem/devices/device.h"

// TANDEM_NCCL_CHECK(expr, where, comm): every NCCL call goes through this. A failure throws with
// the call, file:line, NCCL's error string and its last error message for `comm` (may be null),
// and `where` (the rank and its GPU). Bad arguments are InvalidArgument, a peer or the system
// failing Unavailable, anything else Internal. ncclInProgress is no failure: a non-blocking
// communicator's call has been accepted and goes on in the background (the caller then polls
// ncclCommGetAsyncError); blocking communicators never return it.
#define TANDEM_NCCL_CHECK(expr, where, comm) \
  do { \
    const ncclResult_t tandem_nccl_status = (expr); \
    if (tandem_nccl_status != ncclSuccess && tandem_nccl_status != ncclInProgress) [[unlikely]] { \
      ::tandem::collective::throw_nccl_error(tandem_nccl_status, #expr, __FILE__, __LINE__, (where), (comm)); \
    } \
  } while (0)

namespace tandem::collective {
namespace {

using devices::detail::ScopedCudaDevice;

using detail::Clock;
using detail::deadline_after;
using detail::format_duration;
using detail::OpKind;
using std::chrono::milliseconds;

// NCCL's entry points, named as in nccl.h so that checked expressions read like NCCL code.
struct NcclApi {
  decltype(&::ncclGetVersion) ncclGetVersion = nullptr;
  decltype(&::ncclCommInitAll) ncclCommInitAll = nullptr;
  decltype(&::ncclCommDestroy) ncclCommDestroy = nullptr;
  decltype(&::ncclCommAbort) ncclCommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) ncclCommGetAsyncError = nullptr;
  decltype(&::ncclGetErrorString) ncclGetErrorString = nullptr;
  decltype(&::ncclGetLastError) ncclGetLastError = nullptr;
  decltype(&::ncclAllReduce) ncclAllReduce = nullptr;
  decltype(&::ncclBroadcast) ncclBroadcast = nullptr;
  decltype(&::ncclAllGather) ncclAllGather = nullptr;
  decltype(&::ncclReduceScatter) ncclReduceScatter = nullptr;
  decltype(&::ncclSend) ncclSend = nullptr;
  decltype(&::ncclRecv) ncclRecv = nullptr;
  decltype(&::ncclGroupStart) ncclGroupStart = nullptr;
  decltype(&::ncclGroupEnd) ncclGroupEnd = nullptr;
  // Only groups across processes use these (ncclCommInitRankConfig and ncclCommFinalize arrived
  // in 2.14); null in an older libnccl, which still serves make_nccl_group.
  decltype(&::ncclGetUniqueId) ncclGetUniqueId = nullptr;
  decltype(&::ncclCommInitRankConfig) ncclCommInitRankConfig = nullptr;
  decltype(&::ncclCommFinalize) ncclCommFinalize = nullptr;
  int version = 0;
  std::string problem;  // empty when loaded
};

// ncclAvg and ncclBfloat16 arrived in 2.10.
constexpr int kOldestNccl = 21000;
// Non-blocking communicators (ncclConfig_t::blocking, ncclInProgress) arrived in 2.14.
constexpr int kOldestNonBlockingNccl = 21400;

const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    const auto library = tandem::detail::open_first_library({TANDEM_NCCL_PATH, "libnccl.so.2", "libnccl.so"});
    if (library.handle == nullptr) {
      a.problem = fmt::format("libnccl could not be loaded ({})", library.tried);
      return a;
    }
    const auto load = [&]<class Fn>(Fn& fn, const char* name) {
      tandem::detail::load_symbol(library, fn, name, "libnccl", &a.problem);
    };
    load(a.ncclGetVersion, "ncclGetVersion");
    load(a.ncclCommInitAll, "ncclCommInitAll");
    load(a.ncclCommDestroy, "ncclCommDestroy");
    load(a.ncclCommAbort, "ncclCommAbort");
    load(a.ncclCommGetAsyncError, "ncclCommGetAsyncError");
    load(a.ncclGetErrorString, "ncclGetErrorString");
    load(a.ncclGetLastError, "ncclGetLastError");
    load(a.ncclAllReduce, "ncclAllReduce");
    load(a.ncclBroadcast, "ncclBroadcast");
    load(a.ncclAllGather, "ncclAllGather");
    load(a.ncclReduceScatter, "ncclReduceScatter");
    load(a.ncclSend, "ncclSend");
    load(a.ncclRecv, "ncclRecv");
    load(a.ncclGroupStart, "ncclGroupStart");
    load(a.ncclGroupEnd, "ncclGroupEnd");
    if (!a.problem.empty()) return a;
    // Optional (see NcclApi): null when missing.
    tandem::detail::load_symbol(library, a.ncclGetUniqueId, "ncclGetUniqueId");
    tandem::detail::load_symbol(library, a.ncclCommInitRankConfig, "ncclCommInitRankConfig");
    tandem::detail::load_symbol(library, a.ncclCommFinalize, "ncclCommFinalize");
    if (a.ncclGetVersion(&a.version) != ncclSuccess || a.version < kOldestNccl) {
      a.problem = fmt::format("libnccl is version code {}; tandem needs {} (2.10) or later", a.version, kOldestNccl);
    }
    return a;
  }();
  return api;
}

// Loads NCCL or throws FailedPrecondition saying why not.
const NcclApi& nccl_or_throw(std::string_view what) {
  const NcclApi& api = nccl();
  TANDEM_REQUIRE(api.problem.empty(), FailedPrecondition, "{}: {}", what, api.problem);
  return api;
}

// A waiting rank polls its stream this long, then sleeps between polls (doubling up to 1 ms).
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr auto kLongestNap = std::chrono::microseconds(1000);
constexpr int kPollsPerQuery = 64;
// A group across processes: a call that has waited this long reads the store for a peer's failure
// (one request), and again every as long; the lost keys of the TCP store (one request per peer)
// are read every kLostPoll.
constexpr auto kPeerPoll = milliseconds(100);
constexpr auto kLostPoll = milliseconds(1000);
// How often a joining rank reads NCCL's progress, and a rank whose NCCL call failed its peers'
// records.
constexpr auto kInitPoll = milliseconds(1);
constexpr auto kPeerRecheck = milliseconds(20);
// How long a healthy non-blocking communicator may take to finalize before it is aborted instead.
constexpr auto kFinalizeGrace = std::chrono::seconds(10);

std::vector<char> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<char>& v) { return {v.begin(), v.end()}; }

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8: return ncclUint8;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
  }
  throw Internal(fmt::format("no NCCL type for dtype {}", static_cast<int>(dtype)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMean: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  throw Internal("unknown ReduceOp");
}

// How a group across processes reaches its peers.
struct ProcessPeers {
  int rank = 0;                            // this process's rank
  std::vector<std::string> labels;         // one per rank, or empty ("rank r of n")
  milliseconds timeout = kDefaultTimeout;  // for calls that keep CallOptions' default
  // The store under the group's prefix ("tandem/nccl/<generation>/"): the peers' failure and
  // progress records, their lost keys, and whom to blame.
  detail::PeerRecords records;
};

// What the ranks share: their communicators (destroyed together, when the last rank's
// Communicator goes), what each rank issued last, and the failure that ended the group. The ranks
// held here are the group's "local" ranks: all of them for make_nccl_group, this process's one
// for a group across processes (whose peers are reached through the store).
class NcclGroup {
 public:
  enum class FailureKind { kAbort, kTimeout, kError };

  // GPU replicas of one process: rank i on devices[i].
  explicit NcclGroup(std::vector<int> devices) : size_(static_cast<int>(devices.size())), devices_(std::move(devices)) {
    for (int r = 0; r < size_; ++r) ranks_.push_back(r);
    allocate();
  }
  // One rank of a group across processes, on `device`; its communicator comes with set_comm.
  NcclGroup(int size, int device, ProcessPeers peers) : size_(size), devices_{device}, peers_(std::move(peers)) {
    ranks_.push_back(peers_->rank);
    allocate();
  }

  ~NcclGroup() {
    // Destroying a communicator flushes its pending work; after a failure that work may wait
    // for a peer forever, so a failed group aborts instead. One thread destroys all of them in
    // turn, as nccl-tests does for a clique made by ncclCommInitAll.
    const NcclApi& api = nccl();
    for (std::size_t i = 0; i < comms_.size(); ++i) {
      if (comms_[i] == nullptr || aborted_[i]) continue;
      if (failed()) {
        api.ncclCommAbort(comms_[i]);
      } else if (blocking_) {
        api.ncclCommDestroy(comms_[i]);
      } else {
        finalize_and_destroy(comms_[i]);
      }
    }
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  // The whole group's size; local ranks are indexed from 0 (as comms()).
  int size() const { return size_; }
  int rank(int local) const { return ranks_[static_cast<std::size_t>(local)]; }
  int device(int local) const { return devices_[static_cast<std::size_t>(local)]; }
  ncclComm_t* comms() { return comms_.data(); }
  ncclComm_t comm(int local) const { return comms_[static_cast<std::size_t>(local)]; }
  // A group across processes: its initialised (non-blocking) communicator.
  void set_comm(ncclComm_t comm) {
    comms_[0] = comm;
    blocking_ = false;
  }
  bool across_processes() const { return peers_.has_value(); }
  bool has_labels() const { return peers_ && !peers_->labels.empty(); }
  milliseconds default_timeout() const { return peers_ ? peers_->timeout : kDefaultTimeout; }

  // "rank 1 of 2", or its label.
  std::string label(int rank) const {
    if (peers_ && !peers_->labels.empty()) return peers_->labels[static_cast<std::size_t>(rank)];
    return fmt::format("rank {} of {}", rank, size_);
  }
  // "rank 1 of 4" / "ranks 1, 3 of 4", or their labels.
  std::string names(const std::vector<int>& ranks) const {
    return detail::rank_names(peers_ ? peers_->labels : std::vector<std::string>{}, ranks, size_);
  }

  // Called by a rank's own thread once it has aborted its communicator.
  void mark_aborted(int local) { aborted_[static_cast<std::size_t>(local)] = true; }
  bool is_aborted(int local) const { return aborted_[static_cast<std::size_t>(local)]; }

  void record_issue(int local, std::uint64_t seq) {
    issued_[static_cast<std::size_t>(local)].store(seq + 1, std::memory_order_relaxed);
  }

  // Why collective `call` (number `seq`, waited for `timeout` on `where`) did not complete: the
  // ranks that never issued it, or that it did not complete although all did. A group across
  // processes asks the store (this takes up to kFailureReportGrace).
  std::string diagnose_timeout(std::uint64_t seq, const std::string& call, milliseconds timeout,
                               std::string_view where) {
    if (peers_) return diagnose_through_store(seq, call, timeout, where);
    std::vector<int> missing;
    for (int q = 0; q < size(); ++q) {
      if (issued_[static_cast<std::size_t>(q)].load(std::memory_order_relaxed) < seq + 1) missing.push_back(q);
    }
    if (missing.empty()) {
      return fmt::format("every rank issued it, but it did not complete on {} within {} ms", where, timeout.count());
    }
    return fmt::format("{} did not arrive within {} ms", names(missing), timeout.count());
  }

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Records the group's failure (the first one stays). Any thread. `call` and `seq` name the call
  // that failed (not for aborts); `message` is the abort's reason, or what went wrong. A group
  // across processes tells its peers through the store (once), unless the failure came from a
  // peer (`origin`: the peer that failed) or was seen in the store by every rank alike
  // (`tell_peers` false: a lost process, an unreachable store). Every failure here publishes how
  // many collectives this rank issued, for a peer whose call timed out.
  void fail(FailureKind kind, std::uint64_t seq, std::string call, std::string message, std::string origin = {},
            bool tell_peers = true) {
    const bool first_here = origin.empty() && tell_peers;
    std::string published;
    {
      std::lock_guard lock(mutex_);
      if (failed_.load(std::memory_order_relaxed)) return;
      failure_kind_ = kind;
      failure_seq_ = seq;
      failure_call_ = std::move(call);
      failure_message_ = std::move(message);
      failure_origin_ = std::move(origin);
      if (peers_ && first_here) published = failure_message_;
      failed_.store(true, std::memory_order_release);
    }
    if (!peers_) return;
    peers_->records.record_failure(issued_here(), cause_of(kind));
    if (first_here) publish_failure(kind, published);
  }
  // The error a call `call` (number `seq`) throws once the group has failed: DeadlineExceeded
  // when it is the collective that timed out here, else Unavailable.
  [[noreturn]] void throw_failure(const std::string& call, std::uint64_t seq) const {
    std::lock_guard lock(mutex_);
    if (!failure_origin_.empty()) {
      if (failure_kind_ == FailureKind::kAbort) {
        throw Unavailable(fmt::format("{}: the group was aborted by {}: {}", call, failure_origin_, failure_message_));
      }
      throw Unavailable(fmt::format("{}: the group failed at {}: {}", call, failure_origin_, failure_message_));
    }
    switch (failure_kind_) {
      case FailureKind::kTimeout:
        if (failure_seq_ == seq) throw DeadlineExceeded(fmt::format("{}: {}", call, failure_message_));
        throw Unavailable(fmt::format("{}: the group failed at {}: {}", call, failure_call_, failure_message_));
      case FailureKind::kError: throw Unavailable(fmt::format("{}: the group failed: {}", call, failure_message_));
      case FailureKind::kAbort: break;
    }
    throw Unavailable(fmt::format("{}: the group was aborted: {}", call, failure_message_));
  }

  // A group across processes: whether a peer failed (its record in the store) or, with
  // `with_lost`, died (the TCP store's lost key); such a failure becomes this group's. Only this
  // process's rank thread calls it, while it waits.
  void check_peers(bool with_lost) {
    if (!peers_ || failed()) return;
    Store& store = peers_->records.store();
    try {
      const std::string key = peers_->records.prefix() + "failure";
      if (store.check(key)) {
        const std::string record = string_of(store.get(key, kPeerPoll));
        // "<rank>\n<a|e|t>\n<message>"
        const auto first = record.find('\n');
        const auto second = first == std::string::npos ? first : record.find('\n', first + 1);
        if (second != std::string::npos) {
          const int q = std::atoi(record.substr(0, first).c_str());
          const char kind = record[first + 1];
          if (q != peers_->rank && q >= 0 && q < size_) {
            fail(kind == 'a' ? FailureKind::kAbort : FailureKind::kError, 0, "", record.substr(second + 1), label(q));
            return;
          }
        }
      }
      if (!with_lost) return;
      const std::vector<int> lost = peers_->records.lost_peers();
      if (!lost.empty()) {
        fail(FailureKind::kError, 0, "", peers_->records.lost_message(lost), "", /*tell_peers=*/false);
      }
    } catch (const std::exception& e) {
      fail(FailureKind::kError, 0, "", store_unreachable_message(e.what()), "", /*tell_peers=*/false);
    }
  }

  // After an NCCL error: whether a peer failed or died, read for up to kFailureReportGrace (the
  // store's server may record a death a moment after NCCL noticed the closed connection).
  void look_for_peer_failure() {
    const auto deadline = Clock::now() + kFailureReportGrace;
    for (;;) {
      check_peers(/*with_lost=*/true);
      if (failed() || Clock::now() >= deadline) return;
      std::this_thread::sleep_for(kPeerRecheck);
    }
  }

 private:
  void allocate() {
    comms_.assign(devices_.size(), nullptr);
    aborted_.assign(devices_.size(), false);
    issued_ = std::make_unique<std::atomic<std::uint64_t>[]>(devices_.size());
  }

  // A healthy non-blocking communicator: ncclCommFinalize flushes its work (in the background),
  // then ncclCommDestroy frees it without waiting for anyone; one that does not finalize within
  // kFinalizeGrace (a peer gone meanwhile) is aborted.
  static void finalize_and_destroy(ncclComm_t comm) {
    const NcclApi& api = nccl();
    const ncclResult_t started = api.ncclCommFinalize(comm);
    ncclResult_t state = started;
    if (started == ncclSuccess || started == ncclInProgress) {
      const auto deadline = Clock::now() + kFinalizeGrace;
      while (api.ncclCommGetAsyncError(comm, &state) == ncclSuccess && state == ncclInProgress &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(kInitPoll);
      }
    }
    if (state == ncclSuccess) {
      api.ncclCommDestroy(comm);
    } else {
      api.ncclCommAbort(comm);
    }
  }

  static detail::FailureCause cause_of(FailureKind kind) {
    switch (kind) {
      case FailureKind::kAbort: return detail::FailureCause::kAborted;
      case FailureKind::kTimeout: return detail::FailureCause::kTimeout;
      case FailureKind::kError: break;
    }
    return detail::FailureCause::kError;
  }

  std::uint64_t issued_here() const { return issued_[0].load(std::memory_order_relaxed); }

  // "failure" = "<rank>\n<a|e|t>\n<message>", written by the first rank to fail (an atomic
  // counter decides), once per process. Never throws.
  void publish_failure(FailureKind kind, const std::string& message) {
    if (published_.exchange(true)) return;
    try {
      Store& store = peers_->records.store();
      if (store.add(peers_->records.prefix() + "failures", 1) != 1) return;
      const char k = kind == FailureKind::kAbort ? 'a' : kind == FailureKind::kTimeout ? 't' : 'e';
      store.set(peers_->records.prefix() + "failure", bytes_of(fmt::format("{}\n{}\n{}", peers_->rank, k, message)));
    } catch (const std::exception&) {
    }
  }

  std::string store_unreachable_message(std::string_view error) const {
    return peers_->records.store_unreachable_message(fmt::format(" ({})", error));
  }

  // Publishes this rank's progress and its timeout (so that peers waiting in the same call fail
  // now and record theirs), then surveys the peers' records for a short grace.
  std::string diagnose_through_store(std::uint64_t seq, const std::string& call, milliseconds timeout,
                                     std::string_view where) {
    peers_->records.record_failure(issued_here(), detail::FailureCause::kTimeout);
    publish_failure(FailureKind::kTimeout, fmt::format("{} timed out there after {}", call, format_duration(timeout)));
    const milliseconds grace = std::min(kFailureReportGrace, std::max(timeout, milliseconds(200)));
    const detail::PeerSurvey survey = peers_->records.survey(seq, grace, /*stop_at_culprit=*/false);
    if (!survey.store_reachable) {
      return fmt::format("it did not complete on {} within {} ms, and {}", where, timeout.count(),
                         store_unreachable_message(survey.store_error));
    }
    const std::string late = fmt::format("{} did not arrive within {} ms", names(survey.behind), timeout.count());
    if (!survey.lost.empty()) {
      const std::string lost = peers_->records.lost_message(survey.lost);
      return survey.behind.empty() ? lost : fmt::format("{}; {}", lost, late);
    }
    if (!survey.behind.empty()) return late;
    return fmt::format("every rank issued it, but it did not complete on {} within {} ms", where, timeout.count());
  }

  int size_;
  std::vector<int> devices_;  // per local rank
  std::vector<int> ranks_;    // per local rank: its rank in the group
  std::vector<ncclComm_t> comms_;
  std::vector<bool> aborted_;  // per local rank, written by its own thread (or at construction)
  std::unique_ptr<std::atomic<std::uint64_t>[]> issued_;
  bool blocking_ = true;  // ncclCommInitAll's communicators block; a process group's do not
  std::optional<ProcessPeers> peers_;
  std::atomic<bool> published_{false};
  mutable std::mutex mutex_;
  std::atomic<bool> failed_{false};
  FailureKind failure_kind_ = FailureKind::kAbort;  // the failure fields are guarded by mutex_
  std::uint64_t failure_seq_ = 0;
  std::string failure_call_;
  std::string failure_message_;
  std::string failure_origin_;  // the peer that failed first, when one did ("rank 0 of 2")
};

[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* expr, const char* file, int line,
                                   std::string_view where, ncclComm_t comm) {
  const NcclApi& api = nccl();
  const char* text = api.ncclGetErrorString != nullptr ? api.ncclGetErrorString(status) : "?";
  const char* last = comm != nullptr && api.ncclGetLastError != nullptr ? api.ncclGetLastError(comm) : nullptr;
  const std::string message = fmt::format("{}:{}: NCCL call `{}` failed on {}: {}{}{}", file, line, expr, where, text,
                                          last != nullptr && last[0] != '\0' ? ": " : "", last != nullptr ? last : "");
  switch (status) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: throw InvalidArgument(message);
    case ncclRemoteError:
    case ncclSystemError: throw Unavailable(message);
    default: throw Internal(message);
  }
}

// How messages name a rank: "rank 1 of 2 (GPU:1)", "worker 1 (rank 1 of 2, GPU:0)".
std::string describe_rank(const NcclGroup& group, int rank, int ordinal) {
  if (group.has_labels()) {
    return fmt::format("{} (rank {} of {}, GPU:{})", group.label(rank), rank, group.size(), ordinal);
  }
  return fmt::format("rank {} of {} (GPU:{})", rank, group.size(), ordinal);
}

class NcclCommunicator final : public Communicator {
 public:
  // The group's local rank `local` (its only one, for a group across processes).
  NcclCommunicator(std::shared_ptr<NcclGroup> group, int local)
      : group_(std::move(group)),
        local_(local),
        rank_(group_->rank(local)),
        ordinal_(group_->device(local)),
        comm_(group_->comm(local)),
        where_(describe_rank(*group_, rank_, ordinal_)),
        device_(&devices::get_device(fmt::format("GPU:{}", ordinal_))) {
    ScopedCudaDevice guard(ordinal_, where_);
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where_);
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), where_);
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&outputs_ready_, cudaEventDisableTiming), where_);
    TANDEM_CUDA_CHECK(cudaMalloc(&barrier_word_, sizeof(std::int32_t)), where_);
    TANDEM_CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof(std::int32_t)), where_);
  }

  // Calls other than all_reduce_on_device wait for their work; work queued on the device may
  // still be pending, and cudaStreamDestroy lets it finish before the stream's resources go.
  ~NcclCommunicator() override {
    ScopedCudaDevice guard(ordinal_, where_);
    cudaFree(barrier_word_);
    cudaEventDestroy(inputs_ready_);
    cudaEventDestroy(outputs_ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::uint64_t sequence_number() const override { return seq_.load(std::memory_order_relaxed); }
  std::string_view backend() const override { return "nccl"; }

  // Within one process only: a group across processes runs non-blocking communicators, whose
  // calls may return before NCCL has accepted them (ncclInProgress), which a recording cannot hold.
  bool enqueues_on_device() const override { return !group_->across_processes(); }

 protected:
  void do_all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) override {
    const Call call = begin(OpKind::kAllReduce, options);
    check_all_reduce_arguments(call, tensors);
    run(call, [&] { enqueue_all_reduce(tensors, op); });
  }

  void do_all_reduce_on_device(std::span<Tensor> tensors, ReduceOp op) override {
    TANDEM_REQUIRE(enqueues_on_device(), Unimplemented,
                   "nccl on {}: all-reduces queued on the device need a group within one process", where_);
    const Call call = begin(OpKind::kAllReduce, {});
    check_all_reduce_arguments(call, tensors);
    // compute -> communication stream -> compute: the fork and join a recording keeps.
    issue(call, [&] {
      enqueue_all_reduce(tensors, op);
      TANDEM_CUDA_CHECK(cudaEventRecord(outputs_ready_, stream_), where_);
      TANDEM_CUDA_CHECK(
          cudaStreamWaitEvent(static_cast<cudaStream_t>(device_->compute_stream().native_handle()), outputs_ready_, 0),
          where_);
    });
  }

  void do_broadcast(Tensor& tensor, int root, const CallOptions& options) override {
    const Call call = begin(OpKind::kBroadcast, options);
    check_arguments(call, [&] {
      check_on_device(call, tensor, "the tensor");
      TANDEM_REQUIRE(root >= 0 && root < size(), InvalidArgument, "{} on {}: root {} is not a rank of this group of {}",
                     call.label(), where_, root, size());
    });
    run(call, [&] {
      TANDEM_NCCL_CHECK(
          nccl().ncclBroadcast(tensor.raw_data(), tensor.raw_data(), static_cast<std::size_t>(tensor.num_elements()),
                               nccl_dtype(tensor.dtype()), root, comm_, stream_),
          where_, comm_);
    });
  }

  void do_all_gather(const Tensor& input, Tensor& output, const CallOptions& options) override {
    const Call call = begin(OpKind::kAllGather, options);
    check_arguments(call, [&] {
      check_on_device(call, input, "the input");
      check_on_device(call, output, "the output");
      check_same_dtype(call, input, output);
      const auto problem = detail::check_all_gather_shapes(input.shape(), output.shape(), size());
      TANDEM_REQUIRE(!problem, InvalidArgument, "{} on {}: {}", call.label(), where_, problem.value_or(""));
    });
    run(call, [&] {
      TANDEM_NCCL_CHECK(
          nccl().ncclAllGather(input.raw_data(), output.raw_data(), static_cast<std::size_t>(input.num_elements()),
                               nccl_dtype(input.dtype()), comm_, stream_),
          where_, comm_);
    });
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) override {
    const Call call = begin(OpKind::kReduceScatter, options);
    check_arguments(call, [&] {
      check_on_device(call, input, "the input");
      check_on_device(call, output, "the output");
      check_same_dtype(call, input, output);
      const auto problem = detail::check_reduce_scatter_shapes(input.shape(), output.shape(), size());
      TANDEM_REQUIRE(!problem, InvalidArgument, "{} on {}: {}", call.label(), where_, problem.value_or(""));
    });
    run(call, [&] {
      TANDEM_NCCL_CHECK(
          nccl().ncclReduceScatter(input.raw_data(), output.raw_data(), static_cast<std::size_t>(output.num_elements()),
                                   nccl_dtype(input.dtype()), nccl_op(op), comm_, stream_),
          where_, comm_);
    });
  }

  // An all-reduce of one int32 on the device: NCCL has no barrier of its own.
  void do_barrier(const CallOptions& options) override {
    const Call call = begin(OpKind::kBarrier, options);
    run(call, [&] {
      TANDEM_NCCL_CHECK(nccl().ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, stream_),
                        where_, comm_);
    });
  }

  // ncclSend / ncclRecv on the communication stream, both halves of a send_recv in one
  // ncclGroupStart/End (NCCL runs them together: neighbours exchanging both ways cannot
  // deadlock), waited for, failed and timed out as a collective is. A point-to-point call does not
  // take a sequence number. NCCL cannot tell a message that does not fit the receiver's tensor
  // (no descriptor travels: the tensors stay on the device): as with mismatched collectives, the
  // peers' counts must agree, or the call hangs until its timeout.
  void do_send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                    const CallOptions& options) override {
    const std::string_view op = detail::point_to_point_name(send_peer, recv_peer);
    const bool receiving = recv_peer >= 0;
    const int peer = receiving ? recv_peer : send_peer;
    const std::uint64_t number =
        receiving ? received_from_[static_cast<std::size_t>(recv_peer)] : sent_to_[static_cast<std::size_t>(send_peer)];
    Call call = begin_point_to_point(
        detail::point_to_point_label(op, receiving, number, group_->label(peer), group_->label(rank_)), options);
    check_arguments(call, [&] {
      if (send_peer >= 0) check_on_device(call, send_tensor, "the tensor to send");
      if (recv_peer >= 0) check_on_device(call, recv_tensor, "the tensor to receive into");
    });
    call.timeout_text = fmt::format("{} {} within {}", group_->label(peer),
                                    receiving ? "sent nothing (or not all of it)" : "did not receive it",
                                    format_duration(call.timeout));
    run(call, [&] {
      const NcclApi& api = nccl();
      TANDEM_NCCL_CHECK(api.ncclGroupStart(), where_, comm_);
      if (send_peer >= 0) {
        TANDEM_NCCL_CHECK(api.ncclSend(send_tensor.raw_data(), static_cast<std::size_t>(send_tensor.num_elements()),
                                       nccl_dtype(send_tensor.dtype()), send_peer, comm_, stream_),
                          where_, comm_);
      }
      if (recv_peer >= 0) {
        TANDEM_NCCL_CHECK(api.ncclRecv(recv_tensor.raw_data(), static_cast<std::size_t>(recv_tensor.num_elements()),
                                       nccl_dtype(recv_tensor.dtype()), recv_peer, comm_, stream_),
                          where_, comm_);
      }
      TANDEM_NCCL_CHECK(api.ncclGroupEnd(), where_, comm_);
    });
    if (send_peer >= 0) ++sent_to_[static_cast<std::size_t>(send_peer)];
    if (recv_peer >= 0) ++received_from_[static_cast<std::size_t>(recv_peer)];
  }

 public:
  // Marks the group failed; every rank's waiting call sees it at its next poll, aborts its own
  // communicator and throws (a communicator is not thread-safe, so only its rank aborts it).
  void abort(const std::string& reason) override { group_->fail(NcclGroup::FailureKind::kAbort, 0, "", reason); }

 private:
  // A collective, or a point-to-point call (point_to_point: its label is `name`, its seq
  // kPointToPointSeq, and it is left out of the ranks' issued collectives).
  struct Call {
    OpKind kind = OpKind::kBarrier;
    std::uint64_t seq = 0;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout{0};
    bool point_to_point = false;
    std::string name;          // point-to-point: "recv #3 from rank 0 of 2 on rank 1 of 2"
    std::string timeout_text;  // point-to-point: what its timeout says happened
    std::string label() const { return point_to_point ? name : detail::call_label(kind, seq); }
  };

  // The seq of every point-to-point call: no collective's, so that the DeadlineExceeded a
  // point-to-point timeout records is thrown by the calls waiting then, not by later ones.
  static constexpr std::uint64_t kPointToPointSeq = ~std::uint64_t{0};

  Call begin_point_to_point(std::string name, const CallOptions& options) {
    Call call;
    call.point_to_point = true;
    call.name = std::move(name);
    call.seq = kPointToPointSeq;
    call.timeout = options.timeout == kDefaultTimeout ? group_->default_timeout() : options.timeout;
    call.deadline = deadline_after(call.timeout);
    if (group_->failed()) {
      abort_own_communicator();
      // (Not call.seq: a point-to-point call that timed out earlier would be this one.)
      group_->throw_failure(call.label(), kPointToPointSeq - 1);
    }
    return call;
  }

  Call begin(OpKind kind, const CallOptions& options) {
    Call call;
    call.kind = kind;
    // A call that keeps the default timeout gets the group's (NcclProcessOptions::timeout).
    call.timeout = options.timeout == kDefaultTimeout ? group_->default_timeout() : options.timeout;
    call.deadline = deadline_after(call.timeout);
    call.seq = seq_.fetch_add(1, std::memory_order_relaxed);
    if (group_->failed()) {
      abort_own_communicator();
      group_->throw_failure(call.label(), call.seq);
    }
    return call;
  }

  // Runs a rank's argument checks; a rank that throws here never issues the collective, so it
  // fails the group first: its peers then stop waiting for it and throw Unavailable with its reason.
  template <class Checks>
  void check_arguments(const Call& call, Checks&& checks) {
    try {
      checks();
    } catch (const Error& e) {
      group_->fail(NcclGroup::FailureKind::kError, call.seq, call.label(), e.what());
      throw;
    }
  }

  void check_on_device(const Call& call, const Tensor& t, std::string_view what) const {
    TANDEM_REQUIRE(t.defined(), InvalidArgument, "{} on {}: {} is undefined", call.label(), where_, what);
    TANDEM_REQUIRE(&t.device() == device_, InvalidArgument,
                   "{} on {}: {} is on {}; this rank's communicator runs on {}", call.label(), where_, what,
                   t.device().short_name(), device_->short_name());
  }

  void check_same_dtype(const Call& call, const Tensor& input, const Tensor& output) const {
    TANDEM_REQUIRE(input.dtype() == output.dtype(), InvalidArgument, "{} on {}: the output has dtype {}, the input {}",
                   call.label(), where_, output.dtype(), input.dtype());
  }

  void check_all_reduce_arguments(const Call& call, std::span<Tensor> tensors) {
    check_arguments(call, [&] {
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        check_on_device(call, tensors[i], fmt::format("tensor {} of {}", i, tensors.size()));
        TANDEM_REQUIRE(tensors[i].dtype() == tensors[0].dtype(), InvalidArgument,
                       "{} on {}: tensor {} of {} has dtype {}, tensor 0 has {}; one all_reduce reduces one dtype",
                       call.label(), where_, i, tensors.size(), tensors[i].dtype(), tensors[0].dtype());
      }
    });
  }

  // The tensors' all-reduces on the communication stream, grouped into one launch.
  void enqueue_all_reduce(std::span<Tensor> tensors, ReduceOp op) {
    const NcclApi& api = nccl();
    TANDEM_NCCL_CHECK(api.ncclGroupStart(), where_, comm_);
    for (Tensor& t : tensors) {
      TANDEM_NCCL_CHECK(api.ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<std::size_t>(t.num_elements()),
                                          nccl_dtype(t.dtype()), nccl_op(op), comm_, stream_),
                        where_, comm_);
    }
    TANDEM_NCCL_CHECK(api.ncclGroupEnd(), where_, comm_);
  }

  // Orders the call after the compute stream's work, enqueues it, and waits for it.
  template <class Enqueue>
  void run(const Call& call, Enqueue&& enqueue) {
    issue(call, std::forward<Enqueue>(enqueue));
    wait(call);
  }

  // Orders the call after the compute stream's work and enqueues it, without waiting. Any failure
  // fails the group, so that the peers stop waiting for this rank.
  template <class Enqueue>
  void issue(const Call& call, Enqueue&& enqueue) {
    ScopedCudaDevice guard(ordinal_, where_);
    if (!call.point_to_point) group_->record_issue(local_, call.seq);
    try {
      auto compute = static_cast<cudaStream_t>(device_->compute_stream().native_handle());
      TANDEM_CUDA_CHECK(cudaEventRecord(inputs_ready_, compute), where_);
      TANDEM_CUDA_CHECK(cudaStreamWaitEvent(stream_, inputs_ready_, 0), where_);
      enqueue();
    } catch (const std::exception& e) {
      group_->fail(NcclGroup::FailureKind::kError, call.seq, call.label(),
                   fmt::format("{} failed on {}: {}", call.label(), where_, e.what()));
      abort_own_communicator();
      throw;
    }
  }

  // Polls the communication stream until it is done, the group fails, or the deadline passes. A
  // non-blocking communicator (a group across processes) may still be enqueueing the call in the
  // background (ncclInProgress): until it has, the stream says nothing. A group across processes
  // also reads the store for its peers' failures once the call has waited kPeerPoll.
  void wait(const Call& call) {
    const NcclApi& api = nccl();
    const auto start = Clock::now();
    const auto spin_until = start + (spin_allowed() ? spin_budget(kSpin) : std::chrono::microseconds(0));
    auto next_peer_poll = start + kPeerPoll;
    auto next_lost_poll = start + kLostPoll;
    auto nap = std::chrono::microseconds(10);
    while (true) {
      ncclResult_t async = ncclSuccess;
      const bool queried = api.ncclCommGetAsyncError(comm_, &async) == ncclSuccess;
      if (!queried || async != ncclInProgress) {
        const cudaError_t status = cudaStreamQuery(stream_);
        if (status == cudaSuccess) return;
        if (status != cudaErrorNotReady) {
          group_->fail(NcclGroup::FailureKind::kError, call.seq, call.label(),
                       fmt::format("{} failed on {}: CUDA error {}", call.label(), where_, cudaGetErrorString(status)));
          abort_own_communicator();
          TANDEM_CUDA_CHECK(status, where_);
        }
      }
      if (queried && async != ncclSuccess && async != ncclInProgress) {
        const std::string message = fmt::format("{} on {}: NCCL reported {}: {}", call.label(), where_,
                                                api.ncclGetErrorString(async), api.ncclGetLastError(comm_));
        // Across processes, a peer that died or failed explains NCCL's error better than NCCL does.
        if (group_->across_processes()) {
          group_->look_for_peer_failure();
          if (group_->failed()) {
            abort_own_communicator();
            group_->throw_failure(call.label(), call.seq);
          }
        }
        group_->fail(NcclGroup::FailureKind::kError, call.seq, call.label(), message);
        abort_own_communicator();
        throw Unavailable(message);
      }
      const auto now = Clock::now();
      if (group_->across_processes() && now >= next_peer_poll) {
        const bool with_lost = now >= next_lost_poll;
        group_->check_peers(with_lost);
        next_peer_poll = now + kPeerPoll;
        if (with_lost) next_lost_poll = now + kLostPoll;
      }
      if (group_->failed()) {
        abort_own_communicator();
        group_->throw_failure(call.label(), call.seq);
      }
      if (now >= call.deadline) {
        const std::string message = call.point_to_point
                                        ? call.timeout_text
                                        : group_->diagnose_timeout(call.seq, call.label(), call.timeout, where_);
        group_->fail(NcclGroup::FailureKind::kTimeout, call.seq, call.label(), message);
        abort_own_communicator();
        // A peer's failure may have arrived while this rank diagnosed its own: then fail() kept
        // that one, and this call reports it.
        group_->throw_failure(call.label(), call.seq);
      }
      if (now < spin_until) {
        for (int i = 0; i < kPollsPerQuery; ++i) cpu_relax();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, kLongestNap);
      }
    }
  }

  // ncclCommAbort also stops this rank's kernels that wait for peers. Only this rank's thread
  // calls it, and at most once.
  void abort_own_communicator() {
    if (group_->is_aborted(local_)) return;
    nccl().ncclCommAbort(comm_);
    group_->mark_aborted(local_);
  }

  std::shared_ptr<NcclGroup> group_;
  const int local_;  // index among the group's local ranks
  const int rank_;
  const int ordinal_;
  ncclComm_t comm_;
  const std::string where_;  // "rank 1 of 2 (GPU:1)", "worker 1 (rank 1 of 2, GPU:0)"
  devices::Device* device_;
  std::atomic<std::uint64_t> seq_{0};
  // Point-to-point: the messages this rank sent to / received from each peer (the pairs' message
  // numbers). This rank's thread only.
  std::vector<std::uint64_t> sent_to_ = std::vector<std::uint64_t>(static_cast<std::size_t>(group_->size()));
  std::vector<std::uint64_t> received_from_ = std::vector<std::uint64_t>(static_cast<std::size_t>(group_->size()));
  cudaStream_t stream_ = nullptr;  // the communication stream
  cudaEvent_t inputs_ready_ = nullptr;
  cudaEvent_t outputs_ready_ = nullptr;  // all_reduce_on_device's result, for the compute stream
  void* barrier_word_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& cuda_devices) {
  const std::string what = fmt::format("make_nccl_group over CUDA devices [{}]", fmt::join(cuda_devices, ", "));
  const NcclApi& api = nccl_or_throw(what);
  TANDEM_REQUIRE(!cuda_devices.empty(), InvalidArgument, "{}: a group needs at least one device", what);
  const int gpus = devices::num_gpus();
  TANDEM_REQUIRE(gpus > 0, FailedPrecondition, "{}: no usable GPU ({})", what, devices::gpu_discovery_message());
  std::set<int> seen;
  for (int ordinal : cuda_devices) {
    TANDEM_REQUIRE(ordinal >= 0 && ordinal < gpus, InvalidArgument, "{}: there is no CUDA device {} ({} GPUs)", what,
                   ordinal, gpus);
    TANDEM_REQUIRE(seen.insert(ordinal).second, InvalidArgument, "{}: device {} is listed twice", what, ordinal);
  }
  auto group = std::make_shared<NcclGroup>(cuda_devices);
  TANDEM_NCCL_CHECK(api.ncclCommInitAll(group->comms(), group->size(), cuda_devices.data()), what, nullptr);
  std::vector<std::unique_ptr<Communicator>> communicators;
  communicators.reserve(cuda_devices.size());
  for (int rank = 0; rank < group->size(); ++rank) {
    communicators.push_back(std::make_unique<NcclCommunicator>(group, rank));
  }
  return communicators;
}

std::unique_ptr<Communicator> make_nccl_process_communicator(NcclProcessOptions options) {
  // Everything that needs no GPU first, so that a bad option is the same error in every build.
  detail::check_nccl_process_options(options);
  const int rank = options.rank;
  const int size = options.size;
  const int ordinal = options.cuda_device;
  const auto label = [&](int r) {
    return options.rank_labels.empty() ? fmt::format("rank {} of {}", r, size)
                                       : options.rank_labels[static_cast<std::size_t>(r)];
  };
  const std::string who = fmt::format("make_nccl_process_communicator on {} (CUDA device {})", label(rank), ordinal);
  const NcclApi& api = nccl_or_throw(who);
  TANDEM_REQUIRE(api.version >= kOldestNonBlockingNccl && api.ncclGetUniqueId != nullptr &&
                     api.ncclCommInitRankConfig != nullptr && api.ncclCommFinalize != nullptr,
                 FailedPrecondition,
                 "{}: libnccl is version code {}; a group across processes needs {} (2.14) or later, whose "
                 "non-blocking initialisation a timeout can stop",
                 who, api.version, kOldestNonBlockingNccl);
  const int gpus = devices::num_gpus();
  TANDEM_REQUIRE(gpus > 0, FailedPrecondition, "{}: no usable GPU ({})", who, devices::gpu_discovery_message());
  TANDEM_REQUIRE(ordinal < gpus, InvalidArgument, "{}: there is no CUDA device {} ({} GPUs)", who, ordinal, gpus);
  const auto deadline = deadline_after(options.timeout);
  const auto remaining = [&] {
    return std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
  };

  // Rank 0's unique id says where NCCL's own bootstrap listens: made before the store is touched,
  // so that an NCCL failure is not mistaken for the store's.
  ncclUniqueId id{};
  if (rank == 0) TANDEM_NCCL_CHECK(api.ncclGetUniqueId(&id), who, nullptr);

  Store& store = *options.store;
  std::optional<detail::PeerRecords> records;
  try {
    const std::string prefix = detail::group_prefix(store, "nccl", rank);
    // The id before the arrival: once rank 0 has arrived, its id is there.
    if (rank == 0) store.set(prefix + "id", std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    const auto arrived = [&](int q) { return prefix + fmt::format("arrived/{}", q); };
    store.set(arrived(rank), bytes_of(label(rank)));
    const std::vector<int> missing = detail::wait_for_ranks(store, arrived, size, remaining());
    if (!missing.empty()) {
      throw DeadlineExceeded(fmt::format("{}: {} did not arrive at the store {} within {}{}", who,
                                         detail::rank_names(options.rank_labels, missing, size), store.address(),
                                         format_duration(options.timeout),
                                         store.check(prefix + "id") ? "" : " (rank 0 publishes NCCL's unique id)"));
    }
    if (rank != 0) {
      const std::vector<char> value = store.get(prefix + "id", remaining());
      TANDEM_REQUIRE(value.size() == sizeof(id.internal), DataLoss,
                     "{}: NCCL's unique id under \"{}id\" in the store {} has {} bytes; it has {}", who, prefix,
                     store.address(), value.size(), sizeof(id.internal));
      std::memcpy(id.internal, value.data(), sizeof(id.internal));
    }
    records.emplace(options.store, prefix, rank, size, options.rank_labels, label(0));
    records->forget_earlier_losses();
  } catch (const Unavailable& e) {
    throw Unavailable(fmt::format("{}: the store is unreachable: {}", who, e.what()));
  }

  auto group = std::make_shared<NcclGroup>(
      size, ordinal,
      ProcessPeers{
          .rank = rank, .labels = options.rank_labels, .timeout = options.timeout, .records = std::move(*records)});
  const std::string where = describe_rank(*group, rank, ordinal);
  ncclComm_t comm = nullptr;
  {
    ScopedCudaDevice guard(ordinal, where);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // A failure here fails the group (its peers, joining too, stop waiting) and frees the
    // communicator; the message is taken before that (ncclGetLastError reads the communicator).
    const auto fail_group = [&](NcclGroup::FailureKind kind, const std::string& message) {
      group->fail(kind, 0, who, message);
      if (comm != nullptr) api.ncclCommAbort(comm);
    };
    const auto check = [&](ncclResult_t status, const char* expr) {
      if (status == ncclSuccess || status == ncclInProgress) return;
      try {
        throw_nccl_error(status, expr, __FILE__, __LINE__, where, comm);
      } catch (const Error& e) {
        fail_group(NcclGroup::FailureKind::kError, e.what());
        throw;
      }
    };
    check(api.ncclCommInitRankConfig(&comm, size, id, rank, &config),
          "ncclCommInitRankConfig(&comm, size, id, rank, &config)");
    auto next_peer_poll = Clock::now() + kPeerPoll;
    auto next_lost_poll = Clock::now() + kLostPoll;
    while (true) {
      ncclResult_t state = ncclInProgress;
      check(api.ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError(comm, &state)");
      if (state == ncclSuccess) break;
      check(state, "ncclCommInitRankConfig (in the background)");
      const auto now = Clock::now();
      if (now >= next_peer_poll) {
        const bool with_lost = now >= next_lost_poll;
        group->check_peers(with_lost);
        next_peer_poll = now + kPeerPoll;
        if (with_lost) next_lost_poll = now + kLostPoll;
      }
      if (group->failed()) {
        api.ncclCommAbort(comm);
        group->throw_failure(who, 0);
      }
      if (now >= deadline) {
        const std::string message = fmt::format(
            "NCCL's initialisation did not complete within {}, though every rank reached the store {} (can the "
            "ranks' hosts reach each other on NCCL's interface? NCCL_DEBUG=INFO tells)",
            format_duration(options.timeout), store.address());
        fail_group(NcclGroup::FailureKind::kTimeout, message);
        throw DeadlineExceeded(fmt::format("{}: {}", who, message));
      }
      std::this_thread::sleep_for(kInitPoll);
    }
  }
  group->set_comm(comm);
  return std::make_unique<NcclCommunicator>(group, 0);
}

bool nccl_available() { return nccl().problem.empty() && devices::num_gpus() > 0; }

}  // namespace tandem::collective
