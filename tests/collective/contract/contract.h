// tests/collective/contract/contract.h — one conformance suite for the Communicator contract
// (collective/communicator.h), run against every backend.
//
// Two tables meet here:
//   - the backends (backends.cc): one entry per factory, saying how to make a group (threads of
//     this process, or one worker process per rank) and what the backend supports (Traits);
//   - the contract's sections (one file per collective or failure: all_reduce.cc, broadcast.cc,
//     ..., killed_process.cc), each a Section: what every rank does (body), what the ranks'
//     outcomes must show (verdict), and for process backends what the test process does meanwhile
//     (drive: kill a worker).
// Every section runs on every backend it applies to, so a new backend gets the whole contract by
// adding its entry to the table, and a new part of the contract (point-to-point send/recv) is one
// more section file. CTest runs each backend as its own test (collective_contract_<name>); a
// backend that cannot run here (no GPU, no NCCL) exits 77, which CTest reports as skipped.
//
// A body runs on every rank at once: on threads for thread backends, in worker processes (this
// program started again, tests/common/worker_processes.h) for process backends. It throws
// ContractViolation when a result is wrong, and records in steps what the calls whose failure
// the contract describes threw (type, message, how long they took); the verdict, in the test
// process, reads those outcomes with doctest's CHECKs. The ranks of one run share a Store (an
// in-memory one for threads, the test process's TCP store for workers) through which a rank can
// stay out of the collectives until the others are done (hold) or tell the driver it is ready.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/collective/store.h"
#include "tandem/devices/device.h"
#include "tandem/graph/detail/low_precision_types.h"
#include "tandem/graph/dtype.h"
#include "tandem/graph/tensor.h"

namespace tandem::testing::contract {

using namespace std::chrono_literals;
using collective::Communicator;
using collective::ReduceOp;
using Group = std::vector<std::unique_ptr<Communicator>>;

inline constexpr ReduceOp kReduceOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin};

// How a backend reports calls that disagree across ranks (operation, dtype, count, reduction,
// root). Whatever it is, a rank's own bad arguments are InvalidArgument on that rank.
enum class MismatchReport {
  kInvalidArgument,  // every rank compares: InvalidArgument on every rank naming both sides, and
                     // the group stays usable (bad arguments too: every rank names them)
  kTimeout,          // not compared, but disagreeing calls never mix their data: the ranks left
                     // waiting throw at their timeout, and no rank waits longer (Gloo without
                     // TANDEM_CHECK_COLLECTIVES, the hierarchical group)
  kUnchecked,        // not compared, and not run (NCCL: mismatched calls may hang the device or
                     // corrupt); only a rank's own bad arguments are checked
};

// What a backend supports and promises beyond the common contract.
struct Traits {
  std::string backend;               // what Communicator::backend() says
  std::vector<DType> reduce_dtypes;  // all_reduce and reduce_scatter dtypes
  std::vector<int> sizes;            // group sizes of the data sections
  int failure_size = 3;              // group size of the failure sections
  bool rank_order = false;           // results bitwise equal to the rank-order reference
                                     // ((x0 op x1) op x2 ...), checked on fractional inputs;
                                     // otherwise inputs are small integers (exact in any order)
  bool flat_span = false;            // ranks may split an all_reduce span differently
  MismatchReport mismatch = MismatchReport::kInvalidArgument;
  bool names_missing_rank = true;  // a timeout names the ranks that did not arrive
  // An abort ends every pending call promptly, even one that waits for a rank that stays away;
  // false: only calls that would reach the aborting rank (hierarchical: a rank waiting for a local
  // peer learns of another worker's abort at its next cross-worker step).
  bool abort_reaches_waiting_ranks = true;
  // Point-to-point calls between any two ranks; false: only some pairs (the hierarchical group:
  // replicas of one worker, and the workers' replicas 0), checked by a section of their own.
  bool point_to_point_any_pair = true;
};

// One backend factory. Thread backends set make_group, process backends make_rank.
struct Backend {
  std::string name;  // CTest's collective_contract_<name>; --backend=<name>
  Traits traits;
  // The whole group, rank r at index r, made by the calling thread.
  std::function<Group(int size)> make_group;
  // Rank `rank` of a group of `size`, in a worker process, meeting its peers through `store`.
  std::function<std::unique_ptr<Communicator>(int rank, int size, std::shared_ptr<collective::Store> store)> make_rank;
  // Why a group of `size` cannot run here (no GPU, too few GPUs, no NCCL); "" when it can.
  std::function<std::string(int size)> unavailable = [](int) { return std::string(); };
  // Where rank r keeps its tensors.
  std::function<devices::Device&(int rank)> device = [](int) -> devices::Device& {
    return devices::default_cpu_device();
  };

  bool processes() const { return static_cast<bool>(make_rank); }
};

// The table (backends.cc).
const std::vector<Backend>& backends();

// A wrong result: the body throws it, the rank's outcome carries it, the verdict fails.
class ContractViolation : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How long a call that the contract expects to end early (by an abort, a peer's death) may wait at
// most: far beyond "prompt", far below the default five minutes.
inline constexpr auto kLongTimeout = std::chrono::milliseconds(30s);
// How long each rank of a process backend may take for a whole run.
inline constexpr auto kRunLimit = std::chrono::seconds(120);

// What one call threw ("none" when it returned), and how long it took.
struct Step {
  std::string name;
  std::string type;  // "none", an ErrorCode name ("InvalidArgument"), or "std::exception"
  std::string message;
  long long ms = 0;
};

// Everything one rank reported: its steps, then "body" (what the body itself threw), and a note
// (the body's summary of its results, e.g. a digest). A worker that was killed reports nothing.
struct Outcome {
  int rank = 0;
  bool reported = false;
  std::vector<Step> steps;
  std::string note;

  // The step called `name`; FAILs (and returns an empty step) when the rank has none.
  const Step& step(std::string_view name) const;
};

// What one run of a section is: the backend, the group's size, the section's parameter.
struct Run {
  const Backend& backend;
  int size = 1;
  int param = 0;
};

// A rank's view of a run, for the body.
class RankContext {
 public:
  RankContext(Communicator& comm, collective::Store& store, const Run& run, int rank, Outcome& outcome)
      : comm_(comm), store_(store), run_(run), rank_(rank), outcome_(outcome) {}

  Communicator& comm() const { return comm_; }
  const Traits& traits() const { return run_.backend.traits; }
  int rank() const { return rank_; }
  int size() const { return run_.size; }
  int param() const { return run_.param; }
  devices::Device& device() const { return run_.backend.device(rank_); }

  // Runs fn and records what it threw (or "none", unless !record_success) as step `name`; never
  // throws. Returns whether fn returned.
  bool step(std::string_view name, const std::function<void()>& fn, bool record_success = true);
  // The body's summary of its results, compared across ranks by the verdict.
  void note(std::string text) { outcome_.note = std::move(text); }

  // Stays out of the collectives until every other rank has finished its body or holds too.
  void hold();
  // Tells the driver this rank has reached its steady state (killed_process.cc).
  void ready();
  // The run's store: every rank's and the driver's.
  collective::Store& store() const { return store_; }

  // A tensor of `values` on this rank's device.
  template <class T>
  Tensor tensor(const std::vector<T>& values, const Shape& shape) const {
    return Tensor::from_vector<T>(values, shape, device());
  }

 private:
  Communicator& comm_;
  collective::Store& store_;
  const Run& run_;
  int rank_;
  Outcome& outcome_;
};

// What the test process may do to the workers of a process backend while they run.
class Workers {
 public:
  virtual ~Workers() = default;
  virtual collective::Store& store() = 0;
  virtual void kill(int rank) = 0;
};

// One part of the contract.
struct Section {
  std::string name;  // unique: how a worker process finds it
  // Whether it applies to a backend (default: every one).
  std::function<bool(const Backend&)> applies = [](const Backend&) { return true; };
  // The group sizes it runs with (default: the backend's data sizes).
  std::function<std::vector<int>(const Backend&)> sizes = [](const Backend& b) { return b.traits.sizes; };
  // The runs per size, each with a fresh group and its own param (default: one, param 0).
  std::function<std::vector<int>(const Backend&, int size)> params = [](const Backend&, int) {
    return std::vector<int>{0};
  };
  std::function<void(RankContext&)> body;
  // Default: every rank's body returned, and every rank noted the same summary.
  std::function<void(const Run&, const std::vector<Outcome>&)> verdict;
  // Process backends: what the test process does while the workers run.
  std::function<void(const Run&, Workers&)> drive;
};

// Registers a section (at static initialisation: every section file does it once).
const Section& add_section(Section section);
// Runs the section on the backends selected on the command line (--backend=NAME; all that can
// run here without it), with every size and param; the verdicts CHECK. A TEST_CASE's body.
void check_contract(const Section& section);

// --- verdict helpers ---------------------------------------------------------------------------

// Every rank's body returned, and (when notes are given) every rank noted the same.
void every_rank_succeeds(const Run& run, const std::vector<Outcome>& outcomes);
// CHECKs that `step` threw `type` and that its message contains every one of `parts`.
void check_step(const Step& step, std::string_view type, const std::vector<std::string>& parts = {});
// "rank 2 of 3" / "ranks 1, 2 of 3": how messages without labels name ranks.
std::string ranks_named(const std::vector<int>& ranks, int size);

// --- data ----------------------------------------------------------------------------------------

using ReducibleTypes = graph::TypeList<float, double, std::int32_t, std::int64_t, graph::float16, graph::bfloat16>;

// splitmix64's finaliser: inputs from (call, rank, index) alone, cheap enough for a million
// elements of every rank on every rank.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Rank `rank`'s inputs to call `call`: fractions in [-10, 10) (so that the order of a sum shows in
// its bits) for rank-order backends, else integers in [-8, 8] (every sum exact in every dtype,
// bfloat16 included, whatever the order); integer dtypes use [-1000, 1000].
template <class T>
std::vector<T> values(std::int64_t n, int rank, int call, bool fractional) {
  const std::uint64_t seed = mix(static_cast<std::uint64_t>(call) * 1000003u + static_cast<std::uint64_t>(rank));
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::uint64_t u = mix(seed + i);
    if constexpr (std::is_integral_v<T>) {
      v[i] = static_cast<T>(static_cast<int>(u % 2001) - 1000);
    } else if (fractional) {
      v[i] = static_cast<T>(static_cast<float>(u >> 40) * 0x1p-24f * 20.0f - 10.0f);
    } else {
      v[i] = static_cast<T>(static_cast<int>(u % 17) - 8);
    }
  }
  return v;
}

// The serial reference: every rank's values combined element by element in rank order, in T's
// own arithmetic ((x0 op x1) op x2 ...), then divided by the size for MEAN.
template <class T>
std::vector<T> reference(int size, std::int64_t n, ReduceOp op, int call, bool fractional) {
  std::vector<T> out = values<T>(n, 0, call, fractional);
  for (int q = 1; q < size; ++q) {
    const auto v = values<T>(n, q, call, fractional);
    for (std::size_t i = 0; i < out.size(); ++i) {
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMean: out[i] = static_cast<T>(out[i] + v[i]); break;
        case ReduceOp::kMax: out[i] = out[i] < v[i] ? v[i] : out[i]; break;
        case ReduceOp::kMin: out[i] = v[i] < out[i] ? v[i] : out[i]; break;
      }
    }
  }
  if (op == ReduceOp::kMean) {
    for (auto& x : out) x = static_cast<T>(x / static_cast<T>(size));
  }
  return out;
}

// Throws ContractViolation naming `what` and the first element that differs. Bitwise, except that
// a floating-point MEAN on a backend that may reduce in another order (NCCL divides before it
// sums) may differ by a few units in the last place.
template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& expected, const std::string& what,
                  bool mean_tolerance = false) {
  if (got.size() != expected.size()) {
    throw ContractViolation(fmt::format("{}: {} elements, expected {}", what, got.size(), expected.size()));
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &expected[i], sizeof(T)) == 0) continue;
    if constexpr (!std::is_integral_v<T>) {
      const auto as_double = [](T x) {
        if constexpr (std::is_same_v<T, double>)
          return x;
        else
          return static_cast<double>(static_cast<float>(x));
      };
      const double g = as_double(got[i]);
      const double e = as_double(expected[i]);
      const double ulp = std::is_same_v<T, double>           ? 0x1p-52
                         : std::is_same_v<T, float>          ? 0x1p-23
                         : std::is_same_v<T, graph::float16> ? 0x1p-10
                                                             : 0x1p-7;
      if (mean_tolerance && std::abs(g - e) <= 4 * ulp * std::max(1.0, std::abs(e))) continue;
      throw ContractViolation(fmt::format("{}: element {} is {}, expected {}", what, i, g, e));
    } else {
      throw ContractViolation(fmt::format("{}: element {} is {}, expected {}", what, i, got[i], expected[i]));
    }
  }
}

// FNV-1a over every result a rank received: equal on every rank iff the results are bitwise equal.
class Digest {
 public:
  template <class T>
  void add(const std::vector<T>& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ull;
    }
  }
  std::string text() const { return fmt::format("{:016x}", h_); }

 private:
  std::uint64_t h_ = 1469598103934665603ull;
};

}  // namespace tandem::testing::contract
