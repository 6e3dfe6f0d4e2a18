// The shared-memory communicator: the ranks are processes of one machine that map one POSIX
// shared-memory segment.
//
// The segment:
//   group header   magic, layout version, size, slot_bytes (checked by every rank that maps it);
//                  the doorbell (the futex word sleepers wait on), the count of sleepers, and a
//                  flag raised once any rank's failure record is set.
//   rank headers   one per rank, cache-line aligned: its arrival counter (the barriers it has
//                  arrived at; its own cache line, written only by its rank), its pid and process
//                  start time (liveness), two call descriptors (double-buffered by barrier parity)
//                  and its failure record.
//   slots          size x slot_bytes: rank r's staging slot, written only by rank r.
//   result         slot_bytes: the reduced piece of an all-reduce, each rank writing its own part.
//
// Nobody ever touches another process's private memory: each rank copies its tensors into its
// slot and copies results out of the segment itself. So a rank that fails, returns early or dies
// can never corrupt a peer's tensors, and a peer can give up on a call (timeout, abort) at any
// barrier without waiting for anyone.
//
// Barriers. Rank r arrives at its k-th barrier by storing k into its arrival counter; the barrier
// is complete when every counter is >= k. Whoever completes it (sees all counters after its own
// store) rings the doorbell if someone sleeps. A waiter polls briefly (only when ranks <= usable
// cores: otherwise polling only delays the ranks it waits for), then sleeps on the doorbell with
// FUTEX_WAIT (shared, not FUTEX_PRIVATE_FLAG: the word lives in a segment mapped by several
// processes), in slices of at most kLivenessInterval: between slices it checks the deadline, the
// failure flag, and every kLivenessInterval whether the peers' processes still exist (a pid that is
// gone, a zombie, or a pid reused by a process with another start time is a dead rank).
//
// A call is:
//   publish   the rank writes its call descriptor (operation, reduction, dtype, elements, root,
//             sequence number, and what is wrong with its own arguments, if anything) and copies
//             its first piece of data into its slot;
//   entry     the first barrier; then every rank compares every descriptor with rank 0's and
//             reaches the same verdict from the same bytes: on any disagreement all throw
//             InvalidArgument, and the group stays usable;
//   pieces    all_reduce, per piece of slot_bytes: barrier A; rank r reduces its 64-byte-aligned
//             part of every slot, in rank order, into the result area (MEAN divides there);
//             barrier B; every rank copies the whole result piece out, then its next piece in.
//             broadcast, all_gather and reduce_scatter use the same two barriers per piece.
// Why two barriers per piece suffice: slots are read only between a piece's A and B, and written
// (by their owner) only after B or before the call's entry; the result area is written only
// between A and B and read only after B, before the owner's next arrival (the next A, or the next
// call's entry), which the writers of the next piece must wait for. So a fast rank can be at most
// one barrier ahead and never overwrites what a slow one still reads. Descriptors are read right
// after the entry barrier; a rank writes the next call's descriptor into the other buffer, and
// cannot come back to this one before every rank has passed the next barrier.
//
// Failures. A rank that times out, or finds a dead peer, writes its verdict into its failure
// record, raises the group's failure flag and rings the doorbell: every waiting rank wakes and
// throws the same verdict (ranks that time out in the same call all name the ranks that the first
// one found missing). abort() writes an abort record. After that, every call on every rank throws
// Unavailable naming the first failure. A destroyed communicator writes a "left the group" record,
// so that peers that call again fail at once instead of at their timeout.
//
// Costs. An all-reduce moves each byte three times (copy in, reduce, copy out), with no system
// call while the ranks keep pace (a barrier is a store and a few loads of other ranks' cache
// lines). Pieces are small enough (SharedMemoryOptions::slot_bytes) to stay in L2 from one pass to
// the next. A span of tensors is copied tensor by tensor straight into and out of the slot: no
// staging buffer, and no allocation per call.
//
// The segment's name is removed from /dev/shm by every rank that knows it once all have mapped it,
// or when the meeting fails (the first removal wins). It is left behind only if rank 0 dies
// between creating it and publishing its name, or every rank that knows it dies during the
// meeting.
#include "tandem/collective/shared_memory.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <optional>
#include <random>
#include <thread>
#include <type_traits>

#include "tandem/base/spin.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/detail/peer_records.h"
#include "tandem/collective/detail/reduce_kernels.h"
#include "tandem/devices/device.h"

namespace tandem::collective {
namespace {

using detail::Clock;
using detail::combine2;
using detail::combine_into;
using detail::dispatch_reduction;
using detail::divide;
using detail::format_duration;
using detail::OpKind;
using detail::part_of;
using detail::reducible;
using std::chrono::milliseconds;

// How tensor-check messages name this backend: "... works on host memory (CPU devices)".
constexpr std::string_view kBackendName = "the shared-memory communicator";

constexpr std::uint64_t kMagic = 0x4853'6d65'646e'6174;  // "tandemSH", little-endian
constexpr std::uint32_t kLayoutVersion = 2;              // 2: point-to-point channels
// Reduction parts start on multiples of 64 bytes (a cache line): two ranks never write into the
// same line of the result, and the vector loops start aligned.
constexpr std::size_t kAlignBytes = 64;
// The n-way reduction works through blocks that stay in L1 with their inputs.
constexpr std::size_t kBlockBytes = 4096;
// How long an early rank polls before it sleeps. Short: ranks are processes that may have other
// work (their intra-op threads) for the core.
constexpr auto kSpin = std::chrono::microseconds(20);
// A sleeping waiter wakes at least this often to check the deadline and its peers' processes.
constexpr auto kLivenessInterval = milliseconds(20);
// Texts carried in the segment, truncated to fit.
constexpr std::size_t kProblemBytes = 512;
constexpr std::size_t kFailureTextBytes = 1024;
constexpr std::size_t kCallLabelBytes = 64;
// Point-to-point: each ordered pair's channel holds this many pieces of this many bytes.
constexpr std::size_t kChannelPieces = 2;
constexpr std::size_t kChannelPieceBytes = std::size_t{16} << 10;
// Attempts at a fresh random segment name before giving up.
constexpr int kCreateAttempts = 8;

static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free,
              "the segment's counters must be lock-free to work between processes");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "the doorbell is a futex word");

// --- the segment's layout ----------------------------------------------------------------------

// What one rank says it is doing in one call. Plain bytes: the entry barrier orders them.
struct Descriptor {
  std::uint64_t seq = 0;
  std::int64_t elements = 0;  // the buffer (all_reduce, broadcast) or the input (all_gather, reduce_scatter)
  std::int32_t root = 0;
  std::uint8_t kind = 0;
  std::uint8_t reduce = 0;
  std::uint8_t dtype = 0;
  std::uint8_t has_reduce = 0;
  std::uint32_t problem_length = 0;  // > 0: this rank's own arguments are wrong, and why
  char problem[kProblemBytes] = {};
};

enum class FailureKind : std::uint32_t { kNone, kAborted, kDeadline, kLost, kLeft };

// Why a rank failed. Written once (state 0 -> 1 -> 2) by its rank, read by all once state is 2.
struct FailureRecord {
  std::atomic<std::uint32_t> state{0};
  FailureKind kind = FailureKind::kNone;
  std::uint64_t seq = 0;  // kDeadline: the call that timed out
  std::uint32_t call_length = 0;
  std::uint32_t text_length = 0;
  char call[kCallLabelBytes] = {};  // kDeadline: "all_reduce #7"
  char text[kFailureTextBytes] = {};
};

struct alignas(kAlignBytes) RankHeader {
  alignas(kAlignBytes) std::atomic<std::uint64_t> arrived{0};  // barriers this rank arrived at
  alignas(kAlignBytes) std::int32_t pid = 0;
  std::uint64_t start_time = 0;  // /proc/<pid>/stat field 22; 0 when unknown
  Descriptor descriptors[2];
  FailureRecord failure;
};

// One piece of a point-to-point message, as its sender describes it.
struct PieceHeader {
  std::uint64_t message = 0;  // the pair's message number
  std::int64_t elements = 0;  // the whole message's
  std::uint64_t bytes = 0;    // this piece's
  std::uint8_t dtype = 0;
};

// The channel of one ordered pair (sender, receiver): a ring of kChannelPieces pieces. Piece k
// lives in place k % kChannelPieces; the sender writes it once written - taken < kChannelPieces,
// the receiver copies it out once written > k. Each counter is written by one side only.
struct alignas(kAlignBytes) Channel {
  alignas(kAlignBytes) std::atomic<std::uint64_t> written{0};  // pieces the sender put in
  alignas(kAlignBytes) std::atomic<std::uint64_t> taken{0};    // pieces the receiver copied out
  alignas(kAlignBytes) PieceHeader pieces[kChannelPieces];
};

struct alignas(kAlignBytes) GroupHeader {
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::int32_t size = 0;
  std::int64_t slot_bytes = 0;
  alignas(kAlignBytes) std::atomic<std::uint32_t> doorbell{0};  // the futex word
  std::atomic<std::uint32_t> sleepers{0};
  std::atomic<std::uint32_t> failed{0};  // some rank's failure record is set
};

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

struct Layout {
  std::size_t ranks_offset = 0;
  std::size_t slots_offset = 0;
  std::size_t result_offset = 0;
  std::size_t channels_offset = 0;      // size x size channels, rank s to rank r at s x size + r
  std::size_t channel_data_offset = 0;  // their pieces' bytes, in the same order
  std::size_t total = 0;
};

Layout layout_of(int size, std::int64_t slot_bytes) {
  Layout l;
  l.ranks_offset = round_up(sizeof(GroupHeader), kAlignBytes);
  const std::size_t page = 4096;
  l.slots_offset = round_up(l.ranks_offset + sizeof(RankHeader) * static_cast<std::size_t>(size), page);
  l.result_offset = l.slots_offset + static_cast<std::size_t>(slot_bytes) * static_cast<std::size_t>(size);
  const auto pairs = static_cast<std::size_t>(size) * static_cast<std::size_t>(size);
  l.channels_offset = round_up(l.result_offset + static_cast<std::size_t>(slot_bytes), kAlignBytes);
  l.channel_data_offset = round_up(l.channels_offset + sizeof(Channel) * pairs, page);
  l.total = l.channel_data_offset + kChannelPieces * kChannelPieceBytes * pairs;
  return l;
}

// The memory the group's state lives in: a shared mapping, or (a group of one) this process's heap.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* base, std::size_t length, bool mapped) : base_(base), length_(length), mapped_(mapped) {}
  Mapping(Mapping&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), length_(other.length_), mapped_(other.mapped_) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      release();
      base_ = std::exchange(other.base_, nullptr);
      length_ = other.length_;
      mapped_ = other.mapped_;
    }
    return *this;
  }
  ~Mapping() { release(); }
  std::byte* base() const { return static_cast<std::byte*>(base_); }

 private:
  void release() {
    if (base_ == nullptr) return;
    if (mapped_) {
      munmap(base_, length_);
    } else {
      ::operator delete(base_, std::align_val_t(kAlignBytes));
    }
    base_ = nullptr;
  }

  void* base_ = nullptr;
  std::size_t length_ = 0;
  bool mapped_ = false;
};

// Constructs the headers in fresh memory (rank 0, before anyone else can see it).
void initialize(std::byte* base, const Layout& layout, int size, std::int64_t slot_bytes) {
  auto* group = new (base) GroupHeader();
  for (int q = 0; q < size; ++q) {
    new (base + layout.ranks_offset + sizeof(RankHeader) * static_cast<std::size_t>(q)) RankHeader();
  }
  // (A group of one has no peers, and its memory no channels.)
  for (std::size_t pair = 0; size > 1 && pair < static_cast<std::size_t>(size) * static_cast<std::size_t>(size);
       ++pair) {
    new (base + layout.channels_offset + sizeof(Channel) * pair) Channel();
  }
  group->size = size;
  group->slot_bytes = slot_bytes;
  group->version = kLayoutVersion;
  group->magic = kMagic;
}

// --- waiting -----------------------------------------------------------------------------------

void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto ns = std::max<std::int64_t>(timeout.count(), 0);
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(ns % 1'000'000'000);
  // EAGAIN (the word moved on), EINTR and ETIMEDOUT all mean: look again.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// --- liveness ----------------------------------------------------------------------------------

struct ProcessState {
  char state = '?';
  std::uint64_t start_time = 0;
};

// The state and start time of process `pid` from /proc/<pid>/stat; nullopt when it does not exist
// (errno ENOENT) or cannot be read.
std::optional<ProcessState> read_process_state(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char text[1024];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  const int saved = errno;
  ::close(fd);
  errno = saved;
  if (n <= 0) return std::nullopt;
  text[n] = '\0';
  // "pid (comm) S ppid ...": the command may hold spaces and parentheses, so fields are counted
  // from the last ')'. The state is field 3, the start time field 22.
  const char* p = std::strrchr(text, ')');
  if (p == nullptr) return std::nullopt;
  ProcessState s;
  int field = 2;
  for (++p; *p != '\0';) {
    while (*p == ' ') ++p;
    if (*p == '\0') break;
    ++field;
    if (field == 3) s.state = *p;
    if (field == 22) {
      s.start_time = std::strtoull(p, nullptr, 10);
      break;
    }
    while (*p != ' ' && *p != '\0') ++p;
  }
  return s;
}

std::uint64_t own_start_time() {
  const auto s = read_process_state(::getpid());
  return s ? s->start_time : 0;
}

// Whether the process that mapped the segment as `header` still runs.
bool process_alive(const RankHeader& header) {
  const pid_t pid = header.pid;
  if (pid == ::getpid()) return true;
  errno = 0;
  const auto s = read_process_state(pid);
  if (!s) {
    if (errno == ENOENT || errno == ESRCH) return false;
    return !(::kill(pid, 0) == -1 && errno == ESRCH);  // no /proc to read: ask the kernel
  }
  if (s->state == 'Z' || s->state == 'X') return false;
  return header.start_time == 0 || s->start_time == 0 || s->start_time == header.start_time;
}

// --- reduction (the element-wise kernels are in detail/reduce_kernels.h) -------------------------

// out[i] = ((in[0][i] op in[1][i]) op in[2][i]) ... for `count` elements, block by block so that
// the output block stays in L1 while every input is folded into it. MEAN divides by n at the end.
template <class T, class Op, bool kMean>
void reduce_into(void* out_bytes, const void* const* inputs, int n, std::int64_t count) {
  constexpr std::int64_t kBlock = static_cast<std::int64_t>(kBlockBytes / sizeof(T));
  T* out = static_cast<T*>(out_bytes);
  const auto in = [&](int q, std::int64_t base) { return static_cast<const T*>(inputs[q]) + base; };
  for (std::int64_t base = 0; base < count; base += kBlock) {
    const std::int64_t len = std::min(kBlock, count - base);
    if (n == 1) {
      std::memmove(out + base, in(0, base), static_cast<std::size_t>(len) * sizeof(T));
    } else {
      combine2<T, Op>(out + base, in(0, base), in(1, base), len);
      for (int q = 2; q < n; ++q) combine_into<T, Op>(out + base, in(q, base), len);
    }
    if constexpr (kMean) divide<T>(out + base, static_cast<T>(n), len);
  }
}

using ReduceFn = void (*)(void*, const void* const*, int, std::int64_t);

ReduceFn reduce_function(DType dtype, ReduceOp op) {
  ReduceFn fn = nullptr;
  dispatch_reduction(dtype, op, "shared-memory reduction",
                     [&]<class T, class Op, bool kMean>() { fn = &reduce_into<T, Op, kMean>; });
  return fn;
}

std::string not_reducible(DType dtype) {
  return fmt::format(
      "{} tensors cannot be reduced; the shared-memory communicator reduces float32, float64, float16, bfloat16, int32 "
      "and int64",
      dtype);
}

// A position in the logical buffer of a span of tensors (their bytes concatenated).
struct SpanCursor {
  std::size_t index = 0;
  std::size_t offset = 0;  // within tensors[index]
};

// Copies the next `bytes` bytes of the span's buffer into dst (to_span = false) or from src into
// the span (to_span = true), advancing the cursor.
void copy_span(std::span<Tensor> tensors, SpanCursor& c, std::byte* segment, std::size_t bytes, bool to_span) {
  while (bytes > 0) {
    const Tensor& t = tensors[c.index];
    const std::size_t available = t.nbytes() - c.offset;
    if (available == 0) {
      ++c.index;
      c.offset = 0;
      continue;
    }
    const std::size_t n = std::min(available, bytes);
    std::byte* tensor = static_cast<std::byte*>(t.raw_data()) + c.offset;
    if (to_span) {
      std::memcpy(tensor, segment, n);
    } else {
      std::memcpy(segment, tensor, n);
    }
    segment += n;
    bytes -= n;
    c.offset += n;
  }
}

void copy_text(char* dst, std::uint32_t& length, std::size_t capacity, std::string_view text) {
  const std::size_t n = std::min(text.size(), capacity);
  std::memcpy(dst, text.data(), n);
  length = static_cast<std::uint32_t>(n);
}

// "all_reduce SUM float32 x 1290", "broadcast float32 x 4 from root 0", "barrier"; with the
// sequence number when asked.
std::string describe_descriptor(const Descriptor& d, bool with_seq) {
  const auto kind = static_cast<OpKind>(d.kind);
  std::string text(detail::op_kind_name(kind));
  if (with_seq) text += fmt::format(" #{}", d.seq);
  if (kind == OpKind::kBarrier) return text;
  if (d.has_reduce) text += fmt::format(" {}", reduce_op_name(static_cast<ReduceOp>(d.reduce)));
  text += fmt::format(" {} x {}", static_cast<DType>(d.dtype), d.elements);
  if (kind == OpKind::kBroadcast) text += fmt::format(" from root {}", d.root);
  return text;
}

bool same_call(const Descriptor& a, const Descriptor& b) {
  // The dtype of an empty buffer does not matter.
  return a.seq == b.seq && a.kind == b.kind && a.elements == b.elements && a.root == b.root &&
         a.has_reduce == b.has_reduce && a.reduce == b.reduce && (a.dtype == b.dtype || a.elements == 0);
}

// --- one rank's communicator ---------------------------------------------------------------------

struct Config {
  int rank = 0;
  int size = 1;
  milliseconds timeout{0};
  std::vector<std::string> labels;
  std::int64_t slot_bytes = 0;
};

class SharedMemoryCommunicator final : public Communicator {
 public:
  SharedMemoryCommunicator(Config config, Mapping mapping, const Layout& layout)
      : config_(std::move(config)),
        mapping_(std::move(mapping)),
        group_(reinterpret_cast<GroupHeader*>(mapping_.base())),
        ranks_(reinterpret_cast<RankHeader*>(mapping_.base() + layout.ranks_offset)),
        slots_(mapping_.base() + layout.slots_offset),
        result_(mapping_.base() + layout.result_offset),
        channels_(config_.size > 1 ? reinterpret_cast<Channel*>(mapping_.base() + layout.channels_offset) : nullptr),
        channel_data_(config_.size > 1 ? mapping_.base() + layout.channel_data_offset : nullptr),
        spin_(spin_budget(kSpin, config_.size, devices::usable_cpu_cores())),
        inputs_(static_cast<std::size_t>(config_.size)),
        sent_to_(static_cast<std::size_t>(config_.size)),
        received_from_(static_cast<std::size_t>(config_.size)) {
    phase_ = me().arrived.load(std::memory_order_relaxed);
  }

  ~SharedMemoryCommunicator() override {
    // Peers that call again would wait for this rank until their timeout: tell them. Every peer
    // has passed the last barrier this rank took part in, so none is failed mid-call by this.
    if (config_.size > 1) {
      set_failure(FailureKind::kLeft, "", 0,
                  fmt::format("{} left the group (its communicator was destroyed)", label(config_.rank)));
    }
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::uint64_t sequence_number() const override { return seq_.load(std::memory_order_relaxed); }
  std::string_view backend() const override { return "shared-memory"; }

 protected:
  void do_all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) override {
    Call call = begin(OpKind::kAllReduce, options);
    call.reduce = op;
    call.has_reduce = true;
    call.dtype = tensors.empty() ? kFloat32 : tensors[0].dtype();
    std::string problem;  // formatted only when there is one: the steady state allocates nothing
    for (std::size_t i = 0; i < tensors.size() && problem.empty(); ++i) {
      if (!usable(tensors[i])) {
        problem =
            detail::host_tensor_problem(tensors[i], fmt::format("tensor {} of {}", i, tensors.size()), kBackendName);
      } else if (tensors[i].dtype() != call.dtype) {
        problem = fmt::format("tensor {} of {} has dtype {}, tensor 0 has {}; one all_reduce reduces one dtype", i,
                              tensors.size(), tensors[i].dtype(), call.dtype);
      }
      call.elements += tensors[i].num_elements();
    }
    if (problem.empty() && !reducible(call.dtype)) problem = not_reducible(call.dtype);
    if (config_.size == 1) {
      if (!problem.empty()) throw InvalidArgument(fmt::format("{}: {}", describe(call), problem));
      return;  // MEAN of one rank divides by 1
    }
    const std::size_t esize = dtype_size(call.dtype);
    const std::int64_t per_piece = config_.slot_bytes / static_cast<std::int64_t>(esize);
    SpanCursor in, out;
    publish(call, problem);
    if (problem.empty() && call.elements > 0) {
      copy_span(tensors, in, slot(config_.rank), piece_bytes(call.elements, 0, per_piece, esize), false);
    }
    enter(call);
    if (call.elements == 0) return;
    const ReduceFn reduce = reduce_function(call.dtype, op);
    const std::int64_t align = static_cast<std::int64_t>(kAlignBytes / esize);
    for (std::int64_t begin = 0;;) {
      const std::int64_t len = std::min(per_piece, call.elements - begin);
      const auto [part_begin, part_end] = part_of(len, config_.size, config_.rank, align);
      if (part_begin < part_end) {
        const std::size_t offset = static_cast<std::size_t>(part_begin) * esize;
        for (int q = 0; q < config_.size; ++q) inputs_[static_cast<std::size_t>(q)] = slot(q) + offset;
        reduce(result_ + offset, inputs_.data(), config_.size, part_end - part_begin);
      }
      arrive_and_wait(call);
      copy_span(tensors, out, result_, static_cast<std::size_t>(len) * esize, true);
      begin += len;
      if (begin >= call.elements) break;
      copy_span(tensors, in, slot(config_.rank), piece_bytes(call.elements, begin, per_piece, esize), false);
      arrive_and_wait(call);
    }
  }

  void do_broadcast(Tensor& tensor, int root, const CallOptions& options) override {
    Call call = begin(OpKind::kBroadcast, options);
    call.root = root;
    call.dtype = tensor.dtype();
    std::string problem = detail::host_tensor_problem(tensor, "the tensor", kBackendName);
    if (problem.empty()) call.elements = tensor.num_elements();
    if (problem.empty() && (root < 0 || root >= config_.size)) {
      problem = fmt::format("root {} is not a rank of this group of {}", root, config_.size);
    }
    if (config_.size == 1) {
      if (!problem.empty()) throw InvalidArgument(fmt::format("{}: {}", describe(call), problem));
      return;
    }
    const std::size_t bytes = problem.empty() ? tensor.nbytes() : 0;
    const std::size_t per_piece = static_cast<std::size_t>(config_.slot_bytes);
    auto* data = static_cast<std::byte*>(problem.empty() ? tensor.raw_data() : nullptr);
    const bool is_root = config_.rank == root;
    publish(call, problem);
    if (is_root && bytes > 0) std::memcpy(slot(root), data, std::min(bytes, per_piece));
    enter(call);
    for (std::size_t begin = 0; begin < bytes;) {
      const std::size_t len = std::min(per_piece, bytes - begin);
      if (!is_root) std::memcpy(data + begin, slot(root), len);
      arrive_and_wait(call);
      begin += len;
      if (begin >= bytes) break;
      if (is_root) std::memcpy(slot(root), data + begin, std::min(per_piece, bytes - begin));
      arrive_and_wait(call);
    }
  }

  void do_all_gather(const Tensor& input, Tensor& output, const CallOptions& options) override {
    Call call = begin(OpKind::kAllGather, options);
    call.dtype = input.dtype();
    std::string problem = detail::in_out_problem(input, output, kBackendName);
    if (problem.empty()) {
      call.elements = input.num_elements();
      problem = detail::check_all_gather_shapes(input.shape(), output.shape(), config_.size).value_or("");
    }
    const std::size_t bytes = problem.empty() ? input.nbytes() : 0;
    if (config_.size == 1) {
      if (!problem.empty()) throw InvalidArgument(fmt::format("{}: {}", describe(call), problem));
      if (bytes > 0 && output.raw_data() != input.raw_data()) std::memmove(output.raw_data(), input.raw_data(), bytes);
      return;
    }
    const std::size_t per_piece = static_cast<std::size_t>(config_.slot_bytes);
    const auto* source = static_cast<const std::byte*>(problem.empty() ? input.raw_data() : nullptr);
    auto* destination = static_cast<std::byte*>(problem.empty() ? output.raw_data() : nullptr);
    publish(call, problem);
    if (bytes > 0) std::memcpy(slot(config_.rank), source, std::min(bytes, per_piece));
    enter(call);
    for (std::size_t begin = 0; begin < bytes;) {
      const std::size_t len = std::min(per_piece, bytes - begin);
      for (int q = 0; q < config_.size; ++q) {
        std::memcpy(destination + static_cast<std::size_t>(q) * bytes + begin, slot(q), len);
      }
      arrive_and_wait(call);
      begin += len;
      if (begin >= bytes) break;
      std::memcpy(slot(config_.rank), source + begin, std::min(per_piece, bytes - begin));
      arrive_and_wait(call);
    }
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) override {
    Call call = begin(OpKind::kReduceScatter, options);
    call.reduce = op;
    call.has_reduce = true;
    call.dtype = input.dtype();
    std::string problem = detail::in_out_problem(input, output, kBackendName);
    if (problem.empty()) {
      call.elements = input.num_elements();
      problem = detail::check_reduce_scatter_shapes(input.shape(), output.shape(), config_.size).value_or("");
    }
    if (problem.empty() && !reducible(call.dtype)) problem = not_reducible(call.dtype);
    const int n = config_.size;
    const std::size_t esize = dtype_size(call.dtype);
    const std::int64_t part = problem.empty() ? output.num_elements() : 0;  // this rank's share
    const auto* source = static_cast<const std::byte*>(problem.empty() ? input.raw_data() : nullptr);
    auto* destination = static_cast<std::byte*>(problem.empty() ? output.raw_data() : nullptr);
    if (n == 1) {
      if (!problem.empty()) throw InvalidArgument(fmt::format("{}: {}", describe(call), problem));
      const void* only = source;
      if (part > 0) reduce_function(call.dtype, op)(destination, &only, 1, part);
      return;
    }
    // Each piece carries `per_rank` elements of every rank's part: a slot holds n of them, the
    // one for rank q at q * per_rank; rank r reduces the r-th of every slot.
    std::int64_t per_rank = std::max<std::int64_t>(1, config_.slot_bytes / n / static_cast<std::int64_t>(esize));
    const std::int64_t align = static_cast<std::int64_t>(kAlignBytes / esize);
    if (per_rank >= align) per_rank = per_rank / align * align;
    const auto fill = [&](std::int64_t begin) {
      const std::int64_t len = std::min(per_rank, part - begin);
      for (int q = 0; q < n; ++q) {
        std::memcpy(slot(config_.rank) + static_cast<std::size_t>(q * len) * esize,
                    source + static_cast<std::size_t>(q * part + begin) * esize, static_cast<std::size_t>(len) * esize);
      }
    };
    publish(call, problem);
    if (part > 0) fill(0);
    enter(call);
    if (part == 0) return;
    const ReduceFn reduce = reduce_function(call.dtype, op);
    for (std::int64_t begin = 0;;) {
      const std::int64_t len = std::min(per_rank, part - begin);
      for (int q = 0; q < n; ++q) {
        inputs_[static_cast<std::size_t>(q)] = slot(q) + static_cast<std::size_t>(config_.rank * len) * esize;
      }
      reduce(destination + static_cast<std::size_t>(begin) * esize, inputs_.data(), n, len);
      arrive_and_wait(call);
      begin += len;
      if (begin >= part) break;
      fill(begin);
      arrive_and_wait(call);
    }
  }

  void do_barrier(const CallOptions& options) override {
    Call call = begin(OpKind::kBarrier, options);
    if (config_.size == 1) return;
    publish(call, "");
    enter(call);
  }

  // Point-to-point, through the pair's channel: the sender copies piece after piece in while there
  // is room, the receiver copies them out into its tensor. A send_recv moves both halves in one
  // loop, so neighbours exchanging both ways never wait for each other; a message larger than the
  // channel makes its sender wait for the receiver.
  void do_send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                    const CallOptions& options) override {
    PointToPoint call;
    call.op = detail::point_to_point_name(send_peer, recv_peer);
    call.timeout = options.timeout == kDefaultTimeout ? config_.timeout : options.timeout;
    Outgoing out{.peer = send_peer};
    Incoming in{.peer = recv_peer};
    if (send_peer >= 0) {
      out.number = sent_to_[static_cast<std::size_t>(send_peer)];
      out.dtype = send_tensor.dtype();
      out.elements = send_tensor.num_elements();
      out.bytes = send_tensor.nbytes();
      out.data = static_cast<const std::byte*>(usable(send_tensor) ? send_tensor.raw_data() : nullptr);
    }
    if (recv_peer >= 0) {
      in.number = received_from_[static_cast<std::size_t>(recv_peer)];
      in.dtype = recv_tensor.dtype();
      in.elements = recv_tensor.num_elements();
      in.data = static_cast<std::byte*>(usable(recv_tensor) ? recv_tensor.raw_data() : nullptr);
    }
    // This rank's own arguments: checked before anything is sent.
    if (call.timeout <= milliseconds(0)) {
      throw InvalidArgument(
          fmt::format("{}: the timeout must be positive, got {} ms", describe(call, out, in), call.timeout.count()));
    }
    if (send_peer >= 0 && !usable(send_tensor)) {
      throw InvalidArgument(fmt::format("{}: {}", describe(call, out, in),
                                        detail::host_tensor_problem(send_tensor, "the tensor to send", kBackendName)));
    }
    if (recv_peer >= 0 && !usable(recv_tensor)) {
      throw InvalidArgument(
          fmt::format("{}: {}", describe(call, out, in),
                      detail::host_tensor_problem(recv_tensor, "the tensor to receive into", kBackendName)));
    }
    call.deadline = detail::deadline_after(call.timeout);
    if (group_->failed.load(std::memory_order_acquire) != 0) {
      throw Unavailable(fmt::format("{}: {}", describe(call, out, in), failure_summary()));
    }
    while (!out.done() || !in.done()) {
      bool moved = false;
      while (!out.done() && push(out)) moved = true;
      while (!in.done() && pull(in)) moved = true;
      if (!moved && (!out.done() || !in.done())) wait_for_channels(call, out, in);
    }
    if (in.mismatch) {
      throw InvalidArgument(fmt::format("{}: {}", describe_half(call, true, in.peer, in.number),
                                        detail::point_to_point_mismatch(in.peer, in.sent_dtype, in.sent_elements,
                                                                        config_.rank, in.dtype, in.elements)));
    }
  }

 public:
  void abort(const std::string& reason) override { set_failure(FailureKind::kAborted, "", 0, reason); }

 private:
  struct Call {
    OpKind kind = OpKind::kBarrier;
    std::uint64_t seq = 0;
    milliseconds timeout{0};
    Clock::time_point deadline;
    DType dtype = kFloat32;
    std::int64_t elements = 0;
    ReduceOp reduce = ReduceOp::kSum;
    bool has_reduce = false;
    int root = 0;
    std::uint64_t entry_phase = 0;  // the number of the call's first barrier
  };

  // --- point-to-point ----------------------------------------------------------------------------

  struct PointToPoint {
    std::string_view op;  // "send", "recv", "send_recv"
    milliseconds timeout{0};
    Clock::time_point deadline;
  };

  // The sending half of a call: the message, and how far it went into the channel.
  struct Outgoing {
    int peer = -1;
    std::uint64_t number = 0;  // the pair's message number
    DType dtype = kFloat32;
    std::int64_t elements = 0;
    std::size_t bytes = 0;
    const std::byte* data = nullptr;
    std::size_t offset = 0;  // bytes put in
    std::uint64_t pieces = 0;
    bool done() const { return peer < 0 || (pieces > 0 && offset == bytes); }
  };

  // The receiving half: the tensor, and what came out of the channel so far.
  struct Incoming {
    int peer = -1;
    std::uint64_t number = 0;
    DType dtype = kFloat32;
    std::int64_t elements = 0;
    std::byte* data = nullptr;
    DType sent_dtype = kFloat32;  // the message's, from its first piece
    std::int64_t sent_elements = 0;
    std::size_t bytes = 0;  // the message's
    std::size_t offset = 0;
    std::uint64_t pieces = 0;
    bool mismatch = false;  // the message does not fit: its pieces are drained, not copied
    bool done() const { return peer < 0 || (pieces > 0 && offset == bytes); }
  };

  Channel& channel(int sender, int receiver) const { return channels_[sender * config_.size + receiver]; }
  std::byte* piece_data(int sender, int receiver, std::uint64_t piece) const {
    const auto pair = static_cast<std::size_t>(sender * config_.size + receiver);
    return channel_data_ + (pair * kChannelPieces + piece % kChannelPieces) * kChannelPieceBytes;
  }

  bool can_push(const Outgoing& out) const {
    const Channel& ch = channel(config_.rank, out.peer);
    return ch.written.load(std::memory_order_relaxed) - ch.taken.load(std::memory_order_acquire) < kChannelPieces;
  }
  bool can_pull(const Incoming& in) const {
    const Channel& ch = channel(in.peer, config_.rank);
    return ch.written.load(std::memory_order_acquire) > ch.taken.load(std::memory_order_relaxed);
  }

  // Puts the message's next piece into the channel if there is room; returns whether it did.
  bool push(Outgoing& out) {
    if (!can_push(out)) return false;
    Channel& ch = channel(config_.rank, out.peer);
    const std::uint64_t k = ch.written.load(std::memory_order_relaxed);
    const std::size_t len = std::min(kChannelPieceBytes, out.bytes - out.offset);
    ch.pieces[k % kChannelPieces] = {
        .message = out.number, .elements = out.elements, .bytes = len, .dtype = static_cast<std::uint8_t>(out.dtype)};
    if (len > 0) std::memcpy(piece_data(config_.rank, out.peer, k), out.data + out.offset, len);
    out.offset += len;
    ++out.pieces;
    if (out.done()) ++sent_to_[static_cast<std::size_t>(out.peer)];
    ch.written.store(k + 1, std::memory_order_seq_cst);
    wake_sleepers();
    return true;
  }

  // Copies the message's next piece out of the channel if it is there; returns whether it did.
  bool pull(Incoming& in) {
    if (!can_pull(in)) return false;
    Channel& ch = channel(in.peer, config_.rank);
    const std::uint64_t k = ch.taken.load(std::memory_order_relaxed);
    const PieceHeader& piece = ch.pieces[k % kChannelPieces];
    if (piece.message != in.number) {
      throw Internal(fmt::format("shared-memory recv on {}: message #{} from {} arrived while #{} was expected",
                                 label(config_.rank), piece.message, label(in.peer), in.number));
    }
    if (in.pieces == 0) {
      in.sent_dtype = static_cast<DType>(piece.dtype);
      in.sent_elements = piece.elements;
      in.bytes = static_cast<std::size_t>(piece.elements) * dtype_size(in.sent_dtype);
      in.mismatch = in.sent_dtype != in.dtype || in.sent_elements != in.elements;
    }
    if (!in.mismatch && piece.bytes > 0)
      std::memcpy(in.data + in.offset, piece_data(in.peer, config_.rank, k), piece.bytes);
    in.offset += piece.bytes;
    ++in.pieces;
    if (in.done()) ++received_from_[static_cast<std::size_t>(in.peer)];
    ch.taken.store(k + 1, std::memory_order_seq_cst);
    wake_sleepers();
    return true;
  }

  // A sleeper counts itself before it looks at the channel again (both seq_cst): either it sees
  // our piece, or we see it and ring.
  void wake_sleepers() {
    if (group_->sleepers.load(std::memory_order_seq_cst) != 0) ring();
  }

  // Waits until either half can move, as wait() waits for a barrier: polling, then the doorbell,
  // checking the group's failure flag, the peers' processes and the deadline.
  void wait_for_channels(const PointToPoint& call, const Outgoing& out, const Incoming& in) {
    const auto ready = [&] { return (!out.done() && can_push(out)) || (!in.done() && can_pull(in)); };
    const auto failed = [&] { return group_->failed.load(std::memory_order_seq_cst) != 0; };
    if (spin_.count() > 0) poll_for(spin_, [&] { return ready() || failed(); });
    auto next_liveness_check = Clock::now() + kLivenessInterval;
    while (true) {
      if (ready()) return;
      if (failed()) throw Unavailable(fmt::format("{}: {}", describe(call, out, in), failure_summary()));
      const auto now = Clock::now();
      if (now >= next_liveness_check) {
        check_peer_alive(call, out, in);
        next_liveness_check = now + kLivenessInterval;
      }
      if (now >= call.deadline) time_out(call, out, in);
      const std::uint32_t bell = group_->doorbell.load(std::memory_order_seq_cst);
      group_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (!ready() && !failed()) {
        futex_wait(group_->doorbell, bell, std::min<std::chrono::nanoseconds>(kLivenessInterval, call.deadline - now));
      }
      group_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void check_peer_alive(const PointToPoint& call, const Outgoing& out, const Incoming& in) {
    for (const int peer : {out.done() ? -1 : out.peer, in.done() ? -1 : in.peer}) {
      if (peer < 0 || process_alive(ranks_[peer])) continue;
      set_failure(FailureKind::kLost, "", 0, fmt::format("lost {}: its process died", names({peer})));
      throw Unavailable(fmt::format("{}: {}", describe(call, out, in), failure_summary()));
    }
  }

  // The deadline passed. A half that moved part of its message leaves the pair's channel in the
  // middle of it: the group fails then. A half that moved nothing leaves it as it was: the late
  // message is the next call's, and the group goes on.
  [[noreturn]] void time_out(const PointToPoint& call, const Outgoing& out, const Incoming& in) {
    const bool receiving = !in.done();
    const int peer = receiving ? in.peer : out.peer;
    const bool midway = (!out.done() && out.pieces > 0) || (!in.done() && in.pieces > 0);
    const std::string what = describe_half(call, receiving, peer, receiving ? in.number : out.number);
    const std::string text =
        fmt::format("timed out after {}: {} {}", format_duration(call.timeout), label(peer),
                    receiving ? (in.pieces > 0 ? "sent only part of the message" : "sent nothing")
                              : (out.pieces > 0 ? "received only part of the message" : "did not receive it"));
    if (midway)
      set_failure(FailureKind::kAborted, "", 0, fmt::format("{}: {}, midway through the message", what, text));
    throw DeadlineExceeded(fmt::format("{}: {}", what, text));
  }

  // "shared-memory recv #3 from rank 0 on rank 1"; a send_recv is named by its receiving half
  // when it has one.
  std::string describe(const PointToPoint& call, const Outgoing& out, const Incoming& in) const {
    if (in.peer >= 0 && (out.peer < 0 || !in.done())) return describe_half(call, true, in.peer, in.number);
    return describe_half(call, false, out.peer, out.number);
  }
  std::string describe_half(const PointToPoint& call, bool receiving, int peer, std::uint64_t number) const {
    return fmt::format("shared-memory {}",
                       detail::point_to_point_label(call.op, receiving, number, label(peer), label(config_.rank)));
  }

  RankHeader& me() { return ranks_[config_.rank]; }
  RankHeader& rank_header(int q) { return ranks_[q]; }
  std::byte* slot(int q) const {
    return slots_ + static_cast<std::size_t>(q) * static_cast<std::size_t>(config_.slot_bytes);
  }
  static std::size_t piece_bytes(std::int64_t elements, std::int64_t begin, std::int64_t per_piece, std::size_t esize) {
    return static_cast<std::size_t>(std::min(per_piece, elements - begin)) * esize;
  }
  static bool usable(const Tensor& t) { return t.defined() && t.device().host_accessible(); }

  std::string label(int rank) const { return detail::rank_label(config_.labels, rank); }

  // "rank 2 of 3", "ranks 1, 2 of 3", or the labels.
  std::string names(const std::vector<int>& ranks) const {
    return detail::rank_names(config_.labels, ranks, config_.size);
  }

  // "shared-memory all_reduce #12 (float32, 262144 elements) on worker 0".
  std::string describe(const Call& call) const {
    std::string details;
    if (call.kind != OpKind::kBarrier) details = fmt::format(" ({}, {} elements)", call.dtype, call.elements);
    return fmt::format("shared-memory {}{} on {}", detail::call_label(call.kind, call.seq), details,
                       label(config_.rank));
  }

  // Starts a call: its timeout and deadline, its sequence number; throws Unavailable when the
  // group has failed. A non-positive timeout is this rank's own mistake: it throws before the call
  // takes a sequence number, so the peers can still meet this rank's next call.
  Call begin(OpKind kind, const CallOptions& options) {
    Call call;
    call.kind = kind;
    call.timeout = options.timeout == kDefaultTimeout ? config_.timeout : options.timeout;
    if (call.timeout <= milliseconds(0)) {
      call.seq = seq_.load(std::memory_order_relaxed);
      throw InvalidArgument(
          fmt::format("{}: the timeout must be positive, got {} ms", describe(call), call.timeout.count()));
    }
    call.deadline = detail::deadline_after(call.timeout);
    call.seq = seq_.fetch_add(1, std::memory_order_relaxed);
    if (group_->failed.load(std::memory_order_acquire) != 0) {
      throw Unavailable(fmt::format("{}: {}", describe(call), failure_summary()));
    }
    return call;
  }

  // Writes this rank's descriptor for the call's entry barrier (the next one).
  void publish(Call& call, std::string_view problem) {
    call.entry_phase = phase_ + 1;
    Descriptor& d = me().descriptors[call.entry_phase & 1];
    d.seq = call.seq;
    d.kind = static_cast<std::uint8_t>(call.kind);
    d.elements = call.kind == OpKind::kBarrier ? 0 : call.elements;
    d.dtype = call.kind == OpKind::kBarrier ? 0 : static_cast<std::uint8_t>(call.dtype);
    d.has_reduce = call.has_reduce ? 1 : 0;
    d.reduce = call.has_reduce ? static_cast<std::uint8_t>(call.reduce) : 0;
    d.root = call.kind == OpKind::kBroadcast ? call.root : 0;
    copy_text(d.problem, d.problem_length, sizeof(d.problem), problem);
  }

  // The entry barrier, then the verdict: every rank reads the same descriptors and reaches the
  // same one, so all throw or none does.
  void enter(const Call& call) {
    arrive_and_wait(call);
    const int n = config_.size;
    const std::size_t parity = call.entry_phase & 1;
    for (int q = 0; q < n; ++q) {
      const Descriptor& d = rank_header(q).descriptors[parity];
      if (d.problem_length > 0) {
        throw InvalidArgument(
            fmt::format("{}: {}: {}", describe(call), label(q), std::string_view(d.problem, d.problem_length)));
      }
    }
    const Descriptor& first = rank_header(0).descriptors[parity];
    for (int q = 1; q < n; ++q) {
      const Descriptor& other = rank_header(q).descriptors[parity];
      if (same_call(first, other)) continue;
      const bool with_seq = first.seq != other.seq || first.kind != other.kind;
      throw InvalidArgument(fmt::format("{}: collective mismatch: {} issued {} but {} issued {}", describe(call),
                                        label(0), describe_descriptor(first, with_seq), label(q),
                                        describe_descriptor(other, with_seq)));
    }
  }

  // --- barriers --------------------------------------------------------------------------------

  bool all_arrived(std::uint64_t target) const {
    for (int q = 0; q < config_.size; ++q) {
      if (ranks_[q].arrived.load(std::memory_order_seq_cst) < target) return false;
    }
    return true;
  }

  // Arrives at the next barrier and waits until every rank has, the deadline passes (throws
  // DeadlineExceeded) or the group fails (throws the failure).
  void arrive_and_wait(const Call& call) {
    const std::uint64_t target = ++phase_;
    // seq_cst here and in all_arrived: of the last ranks to arrive, at least one sees every
    // arrival, and rings.
    me().arrived.store(target, std::memory_order_seq_cst);
    if (all_arrived(target)) {
      // A sleeper counts itself before it looks at the counters again (both seq_cst): either it
      // sees our arrival, or we see it and ring.
      if (group_->sleepers.load(std::memory_order_seq_cst) != 0) ring();
      return;
    }
    wait(call, target);
  }

  void ring() {
    group_->doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(group_->doorbell);
  }

  void wait(const Call& call, std::uint64_t target) {
    const auto failed = [&] { return group_->failed.load(std::memory_order_seq_cst) != 0; };
    if (spin_.count() > 0) poll_for(spin_, [&] { return all_arrived(target) || failed(); });
    auto next_liveness_check = Clock::now() + kLivenessInterval;
    while (true) {
      if (all_arrived(target)) return;  // before the failure flag: a completed barrier goes ahead
      if (failed()) fail_from_peers(call);
      const auto now = Clock::now();
      if (now >= next_liveness_check) {
        check_peers_alive(call);
        next_liveness_check = now + kLivenessInterval;
      }
      if (now >= call.deadline) time_out(call, target);
      const std::uint32_t bell = group_->doorbell.load(std::memory_order_seq_cst);
      group_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (!all_arrived(target) && !failed()) {
        futex_wait(group_->doorbell, bell, std::min<std::chrono::nanoseconds>(kLivenessInterval, call.deadline - now));
      }
      group_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // --- failures --------------------------------------------------------------------------------

  // Sets this rank's failure record (the first one stays), raises the group's flag and wakes every
  // sleeper. Any thread; never blocks.
  void set_failure(FailureKind kind, std::string_view call_label, std::uint64_t seq, std::string_view text) {
    FailureRecord& r = me().failure;
    std::uint32_t expected = 0;
    if (!r.state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;
    r.kind = kind;
    r.seq = seq;
    copy_text(r.call, r.call_length, sizeof(r.call), call_label);
    copy_text(r.text, r.text_length, sizeof(r.text), text);
    r.state.store(2, std::memory_order_release);
    group_->failed.store(1, std::memory_order_seq_cst);
    ring();
  }

  // The set failure records, in rank order.
  struct Failure {
    int rank = 0;
    FailureKind kind = FailureKind::kNone;
    std::uint64_t seq = 0;
    std::string call;
    std::string text;
  };
  std::vector<Failure> failures() const {
    std::vector<Failure> out;
    for (int q = 0; q < config_.size; ++q) {
      const FailureRecord& r = ranks_[q].failure;
      if (r.state.load(std::memory_order_acquire) != 2) continue;
      out.push_back({q, r.kind, r.seq, std::string(r.call, r.call_length), std::string(r.text, r.text_length)});
    }
    return out;
  }

  // The group's first failure in words: an abort, else a lost process, else a timeout, else a rank
  // that left.
  std::string failure_summary() const {
    const auto all = failures();
    for (FailureKind kind : {FailureKind::kAborted, FailureKind::kLost, FailureKind::kDeadline, FailureKind::kLeft}) {
      for (const Failure& f : all) {
        if (f.kind != kind) continue;
        switch (kind) {
          case FailureKind::kAborted:
            if (f.rank == config_.rank) return fmt::format("the group was aborted: {}", f.text);
            return fmt::format("{} aborted the group: {}", label(f.rank), f.text);
          case FailureKind::kDeadline: return fmt::format("the group failed at {}: {}", f.call, f.text);
          default: return f.text;
        }
      }
    }
    return "the group failed";
  }

  // A peer failed while this rank waits in `call`: throws its verdict. Ranks that time out in the
  // same call report the same DeadlineExceeded.
  [[noreturn]] void fail_from_peers(const Call& call) {
    for (const Failure& f : failures()) {
      if (f.kind == FailureKind::kDeadline && f.seq == call.seq) {
        throw DeadlineExceeded(fmt::format("{}: {}", describe(call), f.text));
      }
    }
    throw Unavailable(fmt::format("{}: {}", describe(call), failure_summary()));
  }

  void check_peers_alive(const Call& call) {
    std::vector<int> lost;
    for (int q = 0; q < config_.size; ++q) {
      if (q != config_.rank && !process_alive(ranks_[q])) lost.push_back(q);
    }
    if (lost.empty()) return;
    const std::string text = fmt::format("lost {}: {} process died", names(lost), lost.size() == 1 ? "its" : "their");
    set_failure(FailureKind::kLost, detail::call_label(call.kind, call.seq), call.seq, text);
    // A peer may have found it first, or aborted meanwhile: report the group's first failure.
    throw Unavailable(fmt::format("{}: {}", describe(call), failure_summary()));
  }

  [[noreturn]] void time_out(const Call& call, std::uint64_t target) {
    if (group_->failed.load(std::memory_order_seq_cst) != 0) fail_from_peers(call);
    std::vector<int> missing;
    for (int q = 0; q < config_.size; ++q) {
      if (ranks_[q].arrived.load(std::memory_order_seq_cst) < target) missing.push_back(q);
    }
    const std::string text =
        fmt::format("timed out after {} waiting for {}, which {}", format_duration(call.timeout), names(missing),
                    target == call.entry_phase ? "never reached it" : "did not finish it");
    set_failure(FailureKind::kDeadline, detail::call_label(call.kind, call.seq), call.seq, text);
    fail_from_peers(call);  // ours, or the list of a peer that timed out first
  }

  const Config config_;
  Mapping mapping_;
  GroupHeader* group_;
  RankHeader* ranks_;
  std::byte* slots_;
  std::byte* result_;
  Channel* channels_;        // null in a group of one
  std::byte* channel_data_;  // null in a group of one
  const std::chrono::microseconds spin_;
  std::uint64_t phase_ = 0;  // barriers this rank has arrived at (its arrival counter)
  std::atomic<std::uint64_t> seq_{0};
  std::vector<const void*> inputs_;  // the reduction's inputs, sized once
  // Point-to-point: the messages this rank sent to / received from each peer (the pairs' message
  // numbers).
  std::vector<std::uint64_t> sent_to_;
  std::vector<std::uint64_t> received_from_;
};

// --- meeting -------------------------------------------------------------------------------------

std::vector<char> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }

// Runs a store operation; a lost store becomes an Unavailable that says so.
template <class Fn>
auto on_store(const std::string& who, Store& store, Fn&& fn) {
  try {
    return fn();
  } catch (const Unavailable& e) {
    throw Unavailable(fmt::format("{}: the store {} is unreachable: {}", who, store.address(), e.what()));
  }
}
std::string string_of(const std::vector<char>& v) { return {v.begin(), v.end()}; }

// Removes the segment's name from /dev/shm when the meeting ends, however it ends (every rank
// that knows the name does; the first removal wins).
class NameRemover {
 public:
  void set(std::string name) { name_ = std::move(name); }
  ~NameRemover() {
    if (!name_.empty()) shm_unlink(name_.c_str());
  }

 private:
  std::string name_;
};

// "/tandem-<pid>-<16 hex digits>": unique on this machine.
std::string fresh_segment_name() {
  std::random_device device;
  const std::uint64_t random = (std::uint64_t{device()} << 32) ^ device();
  return fmt::format("/tandem-{}-{:016x}", ::getpid(), random);
}

// Rank 0: creates, sizes and maps the segment; returns the mapping and sets `name`.
Mapping create_segment(const std::string& who, std::size_t bytes, std::string& name) {
  int fd = -1;
  for (int attempt = 0; attempt < kCreateAttempts && fd < 0; ++attempt) {
    name = fresh_segment_name();
    fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) {
      const int error = errno;
      name.clear();
      throw Unavailable(
          fmt::format("{}: cannot create the shared-memory segment in /dev/shm: {}", who, std::strerror(error)));
    }
  }
  if (fd < 0) {
    name.clear();
    throw Unavailable(fmt::format("{}: cannot find an unused shared-memory segment name in /dev/shm", who));
  }
  // Reserve the memory now: a /dev/shm too small would otherwise be a SIGBUS at the first touch.
  int error = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (error == 0) error = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (error != 0) {
    ::close(fd);
    shm_unlink(name.c_str());
    name.clear();
    if (error == ENOSPC || error == ENOMEM) {
      throw ResourceExhausted(fmt::format(
          "{}: /dev/shm cannot hold the {} MiB segment ({}): a container's /dev/shm is small by default (Docker: "
          "64 MiB; raise it with --shm-size), or lower SharedMemoryOptions::slot_bytes",
          who, (bytes + (1 << 20) - 1) >> 20, std::strerror(error)));
    }
    throw Unavailable(fmt::format("{}: cannot size the shared-memory segment {} to {} bytes: {}", who, name, bytes,
                                  std::strerror(error)));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    name.clear();
    throw Unavailable(fmt::format("{}: cannot map the shared-memory segment: {}", who, std::strerror(error)));
  }
  return Mapping(base, bytes, true);
}

// The other ranks: opens and maps rank 0's segment, and checks that it was made for this group.
Mapping open_segment(const std::string& who, const std::string& name, const std::string& creator, int size,
                     std::int64_t slot_bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    throw Unavailable(
        fmt::format("{}: cannot open the shared-memory segment {} made by {}: {} (is {} on another "
                    "machine, or in a container with another /dev/shm?)",
                    who, name, creator, std::strerror(errno), creator));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < sizeof(GroupHeader)) {
    ::close(fd);
    throw Unavailable(fmt::format("{}: the shared-memory segment {} made by {} is too small", who, name, creator));
  }
  const auto bytes = static_cast<std::size_t>(st.st_size);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    throw Unavailable(fmt::format("{}: cannot map the shared-memory segment {}: {}", who, name, std::strerror(error)));
  }
  Mapping mapping(base, bytes, true);
  const auto* group = reinterpret_cast<const GroupHeader*>(base);
  if (group->magic != kMagic || group->version != kLayoutVersion) {
    throw Unavailable(fmt::format("{}: {} is not a tandem shared-memory segment of this version", who, name));
  }
  if (group->size != size || group->slot_bytes != slot_bytes || bytes < layout_of(size, slot_bytes).total) {
    throw InvalidArgument(fmt::format(
        "{}: {} made the segment for {} ranks with slot_bytes {}, this rank has size {} and slot_bytes {}; every "
        "rank needs the same",
        who, creator, group->size, group->slot_bytes, size, slot_bytes));
  }
  return mapping;
}

}  // namespace

std::unique_ptr<Communicator> make_shared_memory_communicator(SharedMemoryOptions options) {
  TANDEM_REQUIRE(options.size >= 1, InvalidArgument, "make_shared_memory_communicator: size must be at least 1, got {}",
                 options.size);
  TANDEM_REQUIRE(options.rank >= 0 && options.rank < options.size, InvalidArgument,
                 "make_shared_memory_communicator: rank {} is not in [0, {})", options.rank, options.size);
  TANDEM_REQUIRE(options.store != nullptr || options.size == 1, InvalidArgument,
                 "make_shared_memory_communicator: rank {} has no store (SharedMemoryOptions::store); the ranks meet "
                 "through one",
                 options.rank);
  TANDEM_REQUIRE(options.timeout > milliseconds(0), InvalidArgument,
                 "make_shared_memory_communicator: the timeout must be positive, got {} ms", options.timeout.count());
  TANDEM_REQUIRE(options.rank_labels.empty() || static_cast<int>(options.rank_labels.size()) == options.size,
                 InvalidArgument,
                 "make_shared_memory_communicator: {} rank labels for a group of {}; give one per rank or none",
                 options.rank_labels.size(), options.size);
  TANDEM_REQUIRE(options.slot_bytes >= kMinSlotBytes, InvalidArgument,
                 "make_shared_memory_communicator: slot_bytes must be at least {} (kMinSlotBytes), got {}",
                 kMinSlotBytes, options.slot_bytes);

  Config config;
  config.rank = options.rank;
  config.size = options.size;
  config.timeout = options.timeout;
  config.labels = std::move(options.rank_labels);
  config.slot_bytes =
      options.slot_bytes / static_cast<std::int64_t>(kAlignBytes) * static_cast<std::int64_t>(kAlignBytes);
  const auto label = [&](int r) {
    return config.labels.empty() ? fmt::format("rank {}", r) : config.labels[static_cast<std::size_t>(r)];
  };
  const std::string who = fmt::format("make_shared_memory_communicator on {} of {}", label(config.rank), config.size);

  if (config.size == 1) {
    // No peers: the headers alone, in this process's memory (abort and its later errors still work).
    const Layout layout = layout_of(1, 0);
    void* base = ::operator new(layout.slots_offset, std::align_val_t(kAlignBytes));
    Mapping mapping(base, layout.slots_offset, false);
    initialize(mapping.base(), layout, 1, 0);
    reinterpret_cast<RankHeader*>(mapping.base() + layout.ranks_offset)->pid = ::getpid();
    return std::make_unique<SharedMemoryCommunicator>(std::move(config), std::move(mapping), layout);
  }

  Store& store = *options.store;
  const Layout layout = layout_of(config.size, config.slot_bytes);
  const milliseconds timeout = options.connect_timeout.value_or(config.timeout);
  NameRemover remover;
  Mapping mapping;
  // The k-th communicator of every rank meets the others' k-th under keys of its own.
  const std::string prefix = on_store(who, store, [&] { return detail::group_prefix(store, "shm", config.rank); });
  const auto mapped_key = [&](int q) { return prefix + fmt::format("mapped/{}", q); };
  std::string name;
  if (config.rank == 0) {
    try {
      mapping = create_segment(who, layout.total, name);
    } catch (const Error& e) {
      // The others would wait for the name until their timeout: give them the reason instead.
      on_store(who, store, [&] { store.set(prefix + "name", bytes_of(fmt::format("!{}", e.what()))); });
      throw;
    }
    remover.set(name);
    initialize(mapping.base(), layout, config.size, config.slot_bytes);
    on_store(who, store, [&] { store.set(prefix + "name", bytes_of(name)); });
  } else {
    try {
      name = on_store(who, store, [&] { return string_of(store.get(prefix + "name", timeout)); });
    } catch (const DeadlineExceeded&) {
      throw DeadlineExceeded(fmt::format("{}: {} did not publish the shared-memory segment in the store {} within {}",
                                         who, label(0), store.address(), format_duration(timeout)));
    }
    if (!name.empty() && name.front() == '!') {
      throw Unavailable(
          fmt::format("{}: {} could not make the shared-memory segment: {}", who, label(0), name.substr(1)));
    }
    remover.set(name);
    try {
      mapping = open_segment(who, name, label(0), config.size, config.slot_bytes);
    } catch (const Error& e) {
      // Tell the others at once, instead of letting them wait for this rank until their timeout.
      on_store(who, store, [&] { store.set(mapped_key(config.rank), bytes_of(fmt::format("!{}", e.what()))); });
      throw;
    }
  }
  auto* header = reinterpret_cast<RankHeader*>(mapping.base() + layout.ranks_offset +
                                               sizeof(RankHeader) * static_cast<std::size_t>(config.rank));
  header->pid = ::getpid();
  header->start_time = own_start_time();
  on_store(who, store, [&] { store.set(mapped_key(config.rank), bytes_of("ok")); });

  const std::vector<int> missing =
      on_store(who, store, [&] { return detail::wait_for_ranks(store, mapped_key, config.size, timeout); });
  if (!missing.empty()) {
    throw DeadlineExceeded(fmt::format("{}: {} did not map the shared-memory segment within {}", who,
                                       detail::rank_names(config.labels, missing, config.size),
                                       format_duration(timeout)));
  }
  for (int q = 0; q < config.size; ++q) {
    const std::string value = on_store(who, store, [&] { return string_of(store.get(mapped_key(q), timeout)); });
    if (!value.empty() && value.front() == '!') {
      throw InvalidArgument(fmt::format("{}: {} could not join: {}", who, label(q), value.substr(1)));
    }
  }
  // Liveness is read from /proc: a peer this rank cannot see would look dead at the first call.
  const auto* ranks = reinterpret_cast<const RankHeader*>(mapping.base() + layout.ranks_offset);
  for (int q = 0; q < config.size; ++q) {
    if (process_alive(ranks[q])) continue;
    const std::string reason = fmt::format(
        "{}: {} (pid {}) is not a process this rank can see: it died, or runs in another PID namespace (the ranks of "
        "a shared-memory group must share one)",
        who, label(q), ranks[q].pid);
    // Fail the group, so that the peers do not wait for this rank at their first call.
    SharedMemoryCommunicator(std::move(config), std::move(mapping), layout).abort(reason);
    throw Unavailable(reason);
  }
  return std::make_unique<SharedMemoryCommunicator>(std::move(config), std::move(mapping), layout);
}

}  // namespace tandem::collective
