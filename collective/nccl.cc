// The NCCL group: GPU replicas of one process, one communicator per GPU (ncclCommInitAll).
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
// NCCL is loaded with dlopen on first use, not linked: libnccl is 200 MB, most programs never
// make a GPU group, and a build made here must start where NCCL is not installed.
//
// Unlike the in-process group, ranks do not compare their calls (that would need a host
// rendezvous on every call): NCCL with mismatched counts hangs, and the timeout reports it.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include <cuda_runtime_api.h>
#include <nccl.h>


#include "tandem/base/spin.h"
#include "tandem/collective/communicator.h"
#include "tandem/collective/detail/common.h"
#include "tandem/devices/detail/cuda_check.h"
#include "tandem/devices/device.h"

// TANDEM_NCCL_CHECK(expr, where, comm): every NCCL call goes through this. A failure throws with
// the call, file:line, NCCL's error string and its last error message for `comm` (may be null),
// and `where` (the rank and its GPU). Bad arguments are InvalidArgument, a peer or the system
// failing Unavailable, anything else Internal.
#define TANDEM_NCCL_CHECK(expr, where, comm)                                                          \
  do {                                                                                                \
    const ncclResult_t tandem_nccl_status = (expr);                                                   \
    if (tandem_nccl_status != ncclSuccess) [[unlikely]] {                                             \
      ::tandem::collective::throw_nccl_error(tandem_nccl_status, #expr, __FILE__, __LINE__, (where), \
                                             (comm));                                                 \
    }                                                                                                 \
  } while (0)

namespace tandem::collective {
namespace {

using devices::detail::ScopedCudaDevice;

using detail::OpKind;
using detail::Clock;
using detail::deadline_after;

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
  decltype(&::ncclGroupStart) ncclGroupStart = nullptr;
  decltype(&::ncclGroupEnd) ncclGroupEnd = nullptr;
  int version = 0;
  std::string problem;  // empty when loaded
};

// ncclAvg and ncclBfloat16 arrived in 2.10.
constexpr int kOldestNccl = 21000;

const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    void* handle = nullptr;
    std::string tried;
    for (const char* path : {TANDEM_NCCL_PATH, "libnccl.so.2", "libnccl.so"}) {
      if (path[0] == '\0') continue;
      handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      const char* why = dlerror();
      tried += fmt::format("{}{}", tried.empty() ? "" : "; ", why != nullptr ? why : path);
    }
    if (handle == nullptr) {
      a.problem = fmt::format("libnccl could not be loaded ({})", tried);
      return a;
    }
    bool complete = true;
    const auto load = [&]<class Fn>(Fn& fn, const char* name) {
      fn = reinterpret_cast<Fn>(dlsym(handle, name));
      if (fn == nullptr) {
        complete = false;
        a.problem = fmt::format("libnccl has no {}", name);
      }
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
    load(a.ncclGroupStart, "ncclGroupStart");
    load(a.ncclGroupEnd, "ncclGroupEnd");
    if (!complete) return a;
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

// What the ranks share: their communicators (destroyed together, when the last rank's
// Communicator goes), what each rank issued last, and the failure that ended the group.
class NcclGroup {
 public:
  explicit NcclGroup(std::vector<int> devices)
      : devices_(std::move(devices)),
        comms_(devices_.size(), nullptr),
        aborted_(devices_.size(), false),
        issued_(std::make_unique<std::atomic<std::uint64_t>[]>(devices_.size())) {}

  ~NcclGroup() {
    // Destroying a communicator flushes its pending work; after a failure that work may wait
    // for a peer forever, so a failed group aborts instead. One thread destroys all of them in
    // turn, as nccl-tests does for a clique made by ncclCommInitAll.
    const NcclApi& api = nccl();
    for (std::size_t i = 0; i < comms_.size(); ++i) {
      if (comms_[i] == nullptr || aborted_[i]) continue;
      if (failed()) {
        api.ncclCommAbort(comms_[i]);
      } else {
        api.ncclCommDestroy(comms_[i]);
      }
    }
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_[static_cast<std::size_t>(rank)]; }
  ncclComm_t* comms() { return comms_.data(); }
  ncclComm_t comm(int rank) const { return comms_[static_cast<std::size_t>(rank)]; }

  // Called by a rank's own thread once it has aborted its communicator.
  void mark_aborted(int rank) { aborted_[static_cast<std::size_t>(rank)] = true; }
  bool is_aborted(int rank) const { return aborted_[static_cast<std::size_t>(rank)]; }

  void record_issue(int rank, std::uint64_t seq) {
    issued_[static_cast<std::size_t>(rank)].store(seq + 1, std::memory_order_relaxed);
  }
  // The ranks that have not issued collective number `seq`.
  std::vector<int> missing(std::uint64_t seq) const {
    std::vector<int> ranks;
    for (int q = 0; q < size(); ++q) {
      if (issued_[static_cast<std::size_t>(q)].load(std::memory_order_relaxed) < seq + 1) ranks.push_back(q);
    }
    return ranks;
  }

  enum class FailureKind { kAbort, kTimeout, kError };

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Records the group's failure (the first one stays). Any thread. `call` and `seq` name the call
  // that failed (not for aborts); `message` is the abort's reason, or what went wrong.
  void fail(FailureKind kind, std::uint64_t seq, std::string call, std::string message) {
    std::lock_guard lock(mutex_);
    if (failed_.load(std::memory_order_relaxed)) return;
    failure_kind_ = kind;
    failure_seq_ = seq;
    failure_call_ = std::move(call);
    failure_message_ = std::move(message);
    failed_.store(true, std::memory_order_release);
  }
  // The error a call `call` (number `seq`) throws once the group has failed: DeadlineExceeded
  // when it is the collective that timed out, else Unavailable.
  [[noreturn]] void throw_failure(const std::string& call, std::uint64_t seq) const {
    std::lock_guard lock(mutex_);
    switch (failure_kind_) {
      case FailureKind::kTimeout:
        if (failure_seq_ == seq) throw DeadlineExceeded(fmt::format("{}: {}", call, failure_message_));
        throw Unavailable(fmt::format("{}: the group failed at {}: {}", call, failure_call_, failure_message_));
      case FailureKind::kError:
        throw Unavailable(fmt::format("{}: the group failed: {}", call, failure_message_));
      case FailureKind::kAbort:
        break;
    }
    throw Unavailable(fmt::format("{}: the group was aborted: {}", call, failure_message_));
  }

 private:
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  std::vector<bool> aborted_;  // per rank, written by its own thread (or at construction)
  std::unique_ptr<std::atomic<std::uint64_t>[]> issued_;
  mutable std::mutex mutex_;
  std::atomic<bool> failed_{false};
  FailureKind failure_kind_ = FailureKind::kAbort;  // the failure fields are guarded by mutex_
  std::uint64_t failure_seq_ = 0;
  std::string failure_call_;
  std::string failure_message_;
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

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroup> group, int rank)
      : group_(std::move(group)),
        rank_(rank),
        ordinal_(group_->device(rank)),
        comm_(group_->comm(rank)),
        where_(fmt::format("rank {} of {} (GPU:{})", rank, group_->size(), ordinal_)),
        device_(&devices::get_device(fmt::format("GPU:{}", ordinal_))) {
    ScopedCudaDevice guard(ordinal_, where_);
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where_);
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), where_);
    TANDEM_CUDA_CHECK(cudaMalloc(&barrier_word_, sizeof(std::int32_t)), where_);
    TANDEM_CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof(std::int32_t)), where_);
  }

  // Every call waits for its work, so the stream is idle here.
  ~NcclCommunicator() override {
    ScopedCudaDevice guard(ordinal_, where_);
    cudaFree(barrier_word_);
    cudaEventDestroy(inputs_ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::uint64_t sequence_number() const override { return seq_.load(std::memory_order_relaxed); }
  std::string_view backend() const override { return "nccl"; }

  void all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) override {
    const Call call = begin(OpKind::kAllReduce, options);
    check_arguments(call, [&] {
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        check_on_device(call, tensors[i], fmt::format("tensor {} of {}", i, tensors.size()));
        TANDEM_REQUIRE(tensors[i].dtype() == tensors[0].dtype(), InvalidArgument,
                       "{} on {}: tensor {} of {} has dtype {}, tensor 0 has {}; one all_reduce reduces one dtype",
                       call.label(), where_, i, tensors.size(), tensors[i].dtype(), tensors[0].dtype());
      }
    });
    run(call, [&] {
      const NcclApi& api = nccl();
      TANDEM_NCCL_CHECK(api.ncclGroupStart(), where_, comm_);
      for (Tensor& t : tensors) {
        TANDEM_NCCL_CHECK(api.ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<std::size_t>(t.num_elements()),
                                            nccl_dtype(t.dtype()), nccl_op(op), comm_, stream_),
                          where_, comm_);
      }
      TANDEM_NCCL_CHECK(api.ncclGroupEnd(), where_, comm_);
    });
  }

  void broadcast(Tensor& tensor, int root, const CallOptions& options) override {
    const Call call = begin(OpKind::kBroadcast, options);
    check_arguments(call, [&] {
      check_on_device(call, tensor, "the tensor");
      TANDEM_REQUIRE(root >= 0 && root < size(), InvalidArgument,
                     "{} on {}: root {} is not a rank of this group of {}", call.label(), where_, root, size());
    });
    run(call, [&] {
      TANDEM_NCCL_CHECK(nccl().ncclBroadcast(tensor.raw_data(), tensor.raw_data(),
                                             static_cast<std::size_t>(tensor.num_elements()),
                                             nccl_dtype(tensor.dtype()), root, comm_, stream_),
                        where_, comm_);
    });
  }

  void all_gather(const Tensor& input, Tensor& output, const CallOptions& options) override {
    const Call call = begin(OpKind::kAllGather, options);
    check_arguments(call, [&] {
      check_on_device(call, input, "the input");
      check_on_device(call, output, "the output");
      check_same_dtype(call, input, output);
      const auto problem = detail::check_all_gather_shapes(input.shape(), output.shape(), size());
      TANDEM_REQUIRE(!problem, InvalidArgument, "{} on {}: {}", call.label(), where_, problem.value_or(""));
    });
    run(call, [&] {
      TANDEM_NCCL_CHECK(nccl().ncclAllGather(input.raw_data(), output.raw_data(),
                                             static_cast<std::size_t>(input.num_elements()),
                                             nccl_dtype(input.dtype()), comm_, stream_),
                        where_, comm_);
    });
  }

  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) override {
    const Call call = begin(OpKind::kReduceScatter, options);
    check_arguments(call, [&] {
      check_on_device(call, input, "the input");
      check_on_device(call, output, "the output");
      check_same_dtype(call, input, output);
      const auto problem = detail::check_reduce_scatter_shapes(input.shape(), output.shape(), size());
      TANDEM_REQUIRE(!problem, InvalidArgument, "{} on {}: {}", call.label(), where_, problem.value_or(""));
    });
    run(call, [&] {
      TANDEM_NCCL_CHECK(nccl().ncclReduceScatter(input.raw_data(), output.raw_data(),
                                                 static_cast<std::size_t>(output.num_elements()),
                                                 nccl_dtype(input.dtype()), nccl_op(op), comm_, stream_),
                        where_, comm_);
    });
  }

  // An all-reduce of one int32 on the device: NCCL has no barrier of its own.
  void barrier(const CallOptions& options) override {
    const Call call = begin(OpKind::kBarrier, options);
    run(call, [&] {
      TANDEM_NCCL_CHECK(nccl().ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, stream_),
                        where_, comm_);
    });
  }

  // Marks the group failed; every rank's waiting call sees it at its next poll, aborts its own
  // communicator and throws (a communicator is not thread-safe, so only its rank aborts it).
  void abort(const std::string& reason) override { group_->fail(NcclGroup::FailureKind::kAbort, 0, "", reason); }

 private:
  struct Call {
    OpKind kind = OpKind::kBarrier;
    std::uint64_t seq = 0;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout{0};
    std::string label() const { return detail::call_label(kind, seq); }
  };

  Call begin(OpKind kind, const CallOptions& options) {
    Call call;
    call.kind = kind;
    call.deadline = deadline_after(options.timeout);
    call.timeout = options.timeout;
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
    TANDEM_REQUIRE(&t.device() == device_, InvalidArgument, "{} on {}: {} is on {}; this rank's communicator runs on {}",
                   call.label(), where_, what, t.device().short_name(), device_->short_name());
  }

  void check_same_dtype(const Call& call, const Tensor& input, const Tensor& output) const {
    TANDEM_REQUIRE(input.dtype() == output.dtype(), InvalidArgument, "{} on {}: the output has dtype {}, the input {}",
                   call.label(), where_, output.dtype(), input.dtype());
  }

  // Orders the call after the compute stream's work, enqueues it, and waits for it. Any failure
  // fails the group, so that the peers stop waiting for this rank.
  template <class Enqueue>
  void run(const Call& call, Enqueue&& enqueue) {
    ScopedCudaDevice guard(ordinal_, where_);
    group_->record_issue(rank_, call.seq);
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
    wait(call);
  }

  // Polls the communication stream until it is done, the group fails, or the deadline passes.
  void wait(const Call& call) {
    const NcclApi& api = nccl();
    const auto spin_until = Clock::now() + kSpin;
    auto nap = std::chrono::microseconds(10);
    while (true) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) {
        group_->fail(NcclGroup::FailureKind::kError, call.seq, call.label(),
                     fmt::format("{} failed on {}: CUDA error {}", call.label(), where_, cudaGetErrorString(status)));
        abort_own_communicator();
        TANDEM_CUDA_CHECK(status, where_);
      }
      ncclResult_t async = ncclSuccess;
      if (api.ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
        const std::string message = fmt::format("{} on {}: NCCL reported {}: {}", call.label(), where_,
                                                api.ncclGetErrorString(async), api.ncclGetLastError(comm_));
        group_->fail(NcclGroup::FailureKind::kError, call.seq, call.label(), message);
        abort_own_communicator();
        throw Unavailable(message);
      }
      if (group_->failed()) {
        abort_own_communicator();
        group_->throw_failure(call.label(), call.seq);
      }
      const auto now = Clock::now();
      if (now >= call.deadline) {
        const std::vector<int> missing = group_->missing(call.seq);
        const std::string message =
            missing.empty()
                ? fmt::format("every rank issued it, but it did not complete on {} within {} ms", where_,
                              call.timeout.count())
                : fmt::format("{} did not arrive within {} ms", detail::ranks_of(missing, size()), call.timeout.count());
        group_->fail(NcclGroup::FailureKind::kTimeout, call.seq, call.label(), message);
        abort_own_communicator();
        throw DeadlineExceeded(fmt::format("{}: {}", call.label(), message));
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
    if (group_->is_aborted(rank_)) return;
    nccl().ncclCommAbort(comm_);
    group_->mark_aborted(rank_);
  }

  std::shared_ptr<NcclGroup> group_;
  const int rank_;
  const int ordinal_;
  ncclComm_t comm_;
  const std::string where_;  // "rank 1 of 2 (GPU:1)"
  devices::Device* device_;
  std::atomic<std::uint64_t> seq_{0};
  cudaStream_t stream_ = nullptr;  // the communication stream
  cudaEvent_t inputs_ready_ = nullptr;
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

bool nccl_available() { return nccl().problem.empty() && devices::num_gpus() > 0; }

}  // namespace tandem::collective
