// The Gloo communicator: one rank per process, a full mesh of TCP connections (gloo's tcp
// transport), rendezvous through our Store.
//
// Gloo throws its own exceptions (IoException for timeouts and lost connections, EnforceNotMet for
// violated preconditions) whose messages name socket addresses, not ranks. Every call here catches
// them and decides, with the help of the store (detail/peer_records.h), whom to blame:
//   1. the failed rank shuts its connections down, so that every peer still inside the collective
//      fails at once instead of at its own timeout (gloo closes them itself after a timeout);
//   2. it records in the store how far it got and why it failed;
//   3. it surveys the store for a short grace period: the other ranks' records, their lost keys
//      (written by the TCP store's server when a rank's process disconnects) and their aborts;
//   4. lost ranks > aborting ranks > ranks that never reached the call (hung, or dead without a
//      TCP store to say so) > the plain gloo error.
// A store that cannot be reached during this means its server (the chief's process) is gone.
//
// Keys live under "tandem/gloo/<generation>/" (detail::group_prefix): the k-th communicator of
// every rank meets the others' k-th, and a replacement group never reads its predecessor's keys.
#include "tandem/collective/gloo.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

#include "tandem/base/env.h"
#include "tandem/base/log.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/detail/ordered_all_reduce.h"
#include "tandem/collective/detail/peer_records.h"
#include "tandem/collective/detail/peer_sockets.h"
#include "tandem/collective/detail/reduce_kernels.h"
#include "tandem/collective/tcp_store.h"
#include "tandem/devices/device.h"

namespace tandem::collective {
namespace {

using detail::Clock;
using detail::format_duration;
using detail::OpKind;
using detail::reducible;
using std::chrono::milliseconds;

// How tensor-check messages name this backend: "... works on host memory (CPU devices)".
constexpr std::string_view kBackendName = "the gloo communicator";

// Cached all-reduce setups (one per buffer and pack): a training step reduces a few buckets.
constexpr std::size_t kMaxCachedAllreduces = 64;
constexpr std::size_t kStagingAlignBytes = 64;
// How often the monitor looks at the sockets of a call in flight.
constexpr auto kMonitorInterval = milliseconds(50);
// The slot prefixes of point-to-point messages: above gloo's own (0x01 to 0x08) and the ordered
// all-reduce's (0x41, 0x42), so that they never meet a collective's. The tag is the pair's
// message number.
constexpr std::uint8_t kPointToPointDescriptorSlot = 0x51;
constexpr std::uint8_t kPointToPointDataSlot = 0x52;

// Gloo's messages start with "[file.cc:123] "; ours name the call instead.
std::string gloo_message(std::string_view what) {
  if (!what.empty() && what.front() == '[') {
    const auto end = what.find("] ");
    if (end != std::string_view::npos) what.remove_prefix(end + 2);
  }
  return std::string(what);
}

std::string not_reducible(DType dtype) {
  return fmt::format("{} tensors cannot be reduced; gloo reduces float32, float64, float16, bfloat16, int32 and int64",
                     dtype);
}

using ReduceFn = void (*)(void*, const void*, const void*, std::size_t);

ReduceFn reduce_function(DType dtype, ReduceOp op) {
  ReduceFn fn = nullptr;
  graph::dispatch<detail::ReducibleTypes>(dtype, "gloo all_reduce", [&]<class T>() {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean: fn = static_cast<ReduceFn>(&gloo::sum<T>); break;
      case ReduceOp::kMax: fn = static_cast<ReduceFn>(&gloo::max<T>); break;
      case ReduceOp::kMin: fn = static_cast<ReduceFn>(&gloo::min<T>); break;
    }
  });
  return fn;
}

void divide_in_place(void* data, std::int64_t n, DType dtype, int divisor) {
  graph::dispatch<detail::ReducibleTypes>(dtype, "gloo MEAN", [&]<class T>() {
    T* __restrict p = static_cast<T*>(data);
    const T d = static_cast<T>(divisor);
    for (std::int64_t i = 0; i < n; ++i) p[i] = p[i] / d;
  });
}

std::vector<char> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }

// Gloo writes with writev: a write to a peer that has died raises SIGPIPE, whose default action
// kills the process. Ignore it (only when nobody installed a handler) so that the write fails
// with EPIPE and becomes an Unavailable naming the peer.
void ignore_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, nullptr);
  }
}

// "host:port" or "[v6]:port" -> (host, port); nullopt when the address has another form
// ("in-memory").
std::optional<std::pair<std::string, std::string>> split_address(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const auto close = address.find("]:");
    if (close == std::string::npos) return std::nullopt;
    return std::pair{address.substr(1, close - 1), address.substr(close + 2)};
  }
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || address.find(':') != colon) return std::nullopt;
  return std::pair{address.substr(0, colon), address.substr(colon + 1)};
}

// The local address from which this machine reaches the store's host: the interface the peers
// can reach us on too (they reach the store the same way). Connecting a UDP socket sends nothing.
std::string default_listen_host(const Store& store) {
  const std::string address = store.address();
  const auto parts = split_address(address);
  if (!parts) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* result = nullptr;
  if (const int rc = getaddrinfo(parts->first.c_str(), parts->second.c_str(), &hints, &result); rc != 0) {
    throw Unavailable(fmt::format(
        "make_gloo_communicator: cannot resolve the store's host \"{}\" ({}) to find the local address to listen "
        "on; set GlooOptions::listen_host",
        parts->first, gai_strerror(rc)));
  }
  std::string host;
  for (addrinfo* ai = result; ai != nullptr && host.empty(); ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* in_addr = local.ss_family == AF_INET
                                ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                                : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, in_addr, text, sizeof(text)) != nullptr) host = text;
    }
    close(fd);
  }
  freeaddrinfo(result);
  if (host.empty()) {
    throw Unavailable(fmt::format(
        "make_gloo_communicator: no local address routes to the store's host \"{}\"; set GlooOptions::listen_host",
        parts->first));
  }
  return host;
}

// Our Store as gloo's rendezvous store, under a prefix. Gloo's own calls carry no timeout (get)
// or sometimes none (wait); ours always have one.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<collective::Store> store, std::string prefix, milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override { store_->set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override { return store_->get(prefix_ + key, timeout_); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    store_->wait(prefixed, timeout <= milliseconds(0) ? timeout_ : std::min(timeout, timeout_));
  }

 private:
  std::shared_ptr<collective::Store> store_;
  std::string prefix_;
  milliseconds timeout_;
};

// Grow-only, 64-byte aligned scratch memory: the steady state allocates nothing.
class StagingBuffer {
 public:
  std::byte* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      data_.reset(static_cast<std::byte*>(::operator new[](bytes, std::align_val_t(kStagingAlignBytes))));
      capacity_ = bytes;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t(kStagingAlignBytes)); }
  };
  std::unique_ptr<std::byte[], Free> data_;
  std::size_t capacity_ = 0;
};

// What every rank says it is about to do, exchanged before each call in check mode. Fixed size,
// no pointers: it travels as bytes.
struct Descriptor {
  std::uint64_t seq = 0;
  std::int64_t elements = 0;
  std::int64_t tensors = 0;
  std::uint64_t shapes_hash = 0;
  std::int32_t root = 0;
  std::uint8_t kind = 0;
  std::uint8_t reduce = 0;
  std::uint8_t dtype = 0;
  std::uint8_t has_reduce = 0;

  friend bool operator==(const Descriptor&, const Descriptor&) = default;
};
static_assert(std::is_trivially_copyable_v<Descriptor>);

std::uint64_t hash_shapes(std::span<const Tensor> tensors) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the dimensions, tensor by tensor
  const auto mix = [&](std::uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  for (const Tensor& t : tensors) {
    mix(static_cast<std::uint64_t>(t.shape().rank()) | 0x100);
    for (int d = 0; d < t.shape().rank(); ++d) mix(static_cast<std::uint64_t>(t.shape()[d]));
  }
  return h;
}

// "all_reduce SUM float32 x 1290 (3 tensors)", "broadcast float32 x 10 from root 1", "barrier".
std::string describe_descriptor(const Descriptor& d, bool with_seq) {
  const auto kind = static_cast<OpKind>(d.kind);
  std::string text(detail::op_kind_name(kind));
  if (with_seq) text += fmt::format(" #{}", d.seq);
  if (kind == OpKind::kBarrier) return text;
  if (d.has_reduce) text += fmt::format(" {}", reduce_op_name(static_cast<ReduceOp>(d.reduce)));
  text += fmt::format(" {} x {}", static_cast<DType>(d.dtype), d.elements);
  if (kind == OpKind::kAllReduce) text += fmt::format(" ({} tensor{})", d.tensors, d.tensors == 1 ? "" : "s");
  if (kind == OpKind::kBroadcast) text += fmt::format(" from root {}", d.root);
  return text;
}

struct Config {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Store> store;
  std::string prefix;  // "tandem/gloo/<generation>/"
  milliseconds timeout{0};
  std::vector<std::string> labels;
  std::int64_t bytes_per_pack = 0;
  GlooAllReduceAlgorithm algorithm = GlooAllReduceAlgorithm::kRankOrdered;
  bool check = false;
  std::string group_name;  // GlooOptions::group_name
};

// How long a failed call may spend on its diagnosis, on top of its own timeout: recording its
// failure (a live store answers in milliseconds; one that does not within this is reported as
// unreachable, and the survey is skipped), then reading the peers' records. Every store call in
// it ends by then, even when the store's server is frozen or cut off, so a failure is reported
// within timeout + kRecordBudget + kFailureReportGrace at most.
constexpr milliseconds kRecordBudget = milliseconds(1000);
// The monitor's look at the store, likewise bounded.
constexpr milliseconds kMonitorStoreBudget = milliseconds(1000);

// The two ends of this rank's connection to each peer (peer_sockets.h). Once connected, a gloo
// pair's own address is its socket's local end, and gloo keeps the peer's to itself: every rank
// publishes its pairs' addresses, and reads its own far ends from its peers' lists. Throws what
// the store throws.
std::vector<detail::Endpoints> connection_endpoints(gloo::rendezvous::Context& context, Store& store,
                                                    const Config& config, milliseconds timeout) {
  const auto key = [&](int q) { return config.prefix + fmt::format("endpoints/{}", q); };
  std::vector<sockaddr_storage> own(static_cast<std::size_t>(config.size));
  for (int q = 0; q < config.size; ++q) {
    if (q == config.rank) continue;
    const auto& pair = context.getPair(q);
    const auto* address = pair ? dynamic_cast<const gloo::transport::tcp::Address*>(&pair->address()) : nullptr;
    if (address != nullptr) own[static_cast<std::size_t>(q)] = address->getSockaddr();
  }
  store.set(key(config.rank), detail::encode_endpoints(own));
  if (const std::vector<int> missing = detail::wait_for_ranks(store, key, config.size, timeout); !missing.empty()) {
    throw DeadlineExceeded(fmt::format("{} connected but did not publish its addresses within {}",
                                       detail::rank_names(config.labels, missing, config.size),
                                       format_duration(timeout)));
  }
  std::vector<detail::Endpoints> connections;
  for (int q = 0; q < config.size; ++q) {
    if (q == config.rank) continue;
    const auto theirs = detail::decode_endpoints(store.get(key(q), timeout));
    if (!theirs || theirs->size() != own.size()) {
      throw DataLoss(fmt::format("the store's {} holds no list of {} addresses", key(q), own.size()));
    }
    connections.push_back({own[static_cast<std::size_t>(q)], (*theirs)[static_cast<std::size_t>(config.rank)]});
  }
  return connections;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(Config config, std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::rendezvous::Context> context,
                   const std::vector<detail::Endpoints>& connections = {})
      : config_(std::move(config)),
        records_(config_.store, config_.prefix, config_.rank, config_.size, config_.labels, label(0)),
        device_(std::move(device)),
        context_(std::move(context)),
        gathered_descriptors_(static_cast<std::size_t>(config_.size)) {
    if (!context_) return;
    records_.forget_earlier_losses();
    // Setups made once, with buffers of our own (kept by the options): interrupt() needs them.
    auto descriptor_in = context_->createUnboundBuffer(&descriptor_, sizeof(Descriptor));
    auto descriptor_out =
        context_->createUnboundBuffer(gathered_descriptors_.data(), sizeof(Descriptor) * gathered_descriptors_.size());
    descriptor_buffers_ = {descriptor_in.get(), descriptor_out.get()};
    descriptor_gather_ = std::make_unique<gloo::AllgatherOptions>(context_);
    descriptor_gather_->setInput<std::uint8_t>(std::move(descriptor_in));
    descriptor_gather_->setOutput<std::uint8_t>(std::move(descriptor_out));
    // The barrier is an all-reduce of one word: unlike gloo::barrier's, its buffer is ours.
    auto barrier_buffer = context_->createUnboundBuffer(&barrier_word_, sizeof(barrier_word_));
    barrier_buffer_ = barrier_buffer.get();
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> barrier_outputs;
    barrier_outputs.push_back(std::move(barrier_buffer));
    barrier_reduce_ = std::make_unique<gloo::AllreduceOptions>(context_);
    barrier_reduce_->setOutputs<std::int64_t>(std::move(barrier_outputs));
    barrier_reduce_->setReduceFunction(static_cast<ReduceFn>(&gloo::sum<std::int64_t>));
    sockets_ = detail::find_peer_sockets(connections);
    if (sockets_.size() != connections.size()) {
      logging::warn("gloo on {}: found {} of its {} connections to its peers; a failed call may wake the calls "
                    "waiting on the others only at their timeouts",
                    label(config_.rank), sockets_.size(), connections.size());
    }
    if (config_.algorithm == GlooAllReduceAlgorithm::kRankOrdered)
      ordered_ = std::make_unique<detail::OrderedAllReduce>(context_);
    monitor_ = std::thread([this] { monitor(); });
  }

  ~GlooCommunicator() override {
    if (monitor_.joinable()) {
      {
        std::lock_guard lock(monitor_mutex_);
        stopping_ = true;
      }
      monitor_cv_.notify_all();
      monitor_.join();
    }
    // Buffers of the context go before it.
    allreduce_cache_.clear();
    ordered_.reset();
    descriptor_gather_.reset();
    barrier_reduce_.reset();
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::uint64_t sequence_number() const override { return seq_.load(std::memory_order_relaxed); }
  std::string_view backend() const override { return "gloo"; }

 protected:
  void do_all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) override {
    Call call = begin(OpKind::kAllReduce, options);
    call.reduce = op;
    call.dtype = tensors.empty() ? kFloat32 : tensors[0].dtype();
    std::string problem;
    for (std::size_t i = 0; i < tensors.size() && problem.empty(); ++i) {
      // (Formatted only when there is a problem: the steady state allocates nothing.)
      if (!usable(tensors[i])) {
        problem =
            detail::host_tensor_problem(tensors[i], fmt::format("tensor {} of {}", i, tensors.size()), kBackendName);
      }
      if (problem.empty() && tensors[i].dtype() != call.dtype) {
        problem = fmt::format("tensor {} of {} has dtype {}, tensor 0 has {}; one all_reduce reduces one dtype", i,
                              tensors.size(), tensors[i].dtype(), call.dtype);
      }
      call.elements += tensors[i].num_elements();
    }
    if (problem.empty() && !reducible(call.dtype)) problem = not_reducible(call.dtype);
    if (!problem.empty()) reject(call, problem);
    if (config_.check) {
      check_consistency(call, static_cast<std::int64_t>(tensors.size()),
                        hash_shapes(std::span<const Tensor>(tensors.data(), tensors.size())));
    }
    if (config_.size == 1 || call.elements == 0) return;

    const std::size_t esize = dtype_size(call.dtype);
    const std::size_t bytes = static_cast<std::size_t>(call.elements) * esize;
    std::byte* data = nullptr;
    if (tensors.size() == 1) {
      data = static_cast<std::byte*>(tensors[0].raw_data());
    } else {
      data = staging_.reserve(bytes);
      std::size_t offset = 0;
      for (const Tensor& t : tensors) {
        if (t.nbytes() > 0) std::memcpy(data + offset, t.raw_data(), t.nbytes());
        offset += t.nbytes();
      }
    }
    reduce_buffer(call, data, call.elements);
    if (op == ReduceOp::kMean) divide_in_place(data, call.elements, call.dtype, config_.size);
    if (tensors.size() > 1) {
      std::size_t offset = 0;
      for (const Tensor& t : tensors) {
        if (t.nbytes() > 0) std::memcpy(t.raw_data(), data + offset, t.nbytes());
        offset += t.nbytes();
      }
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
    if (!problem.empty()) reject(call, problem);
    if (config_.check) check_consistency(call, 1, hash_shapes(std::span<const Tensor>(&tensor, 1)));
    if (config_.size == 1 || tensor.nbytes() == 0) return;
    gloo::BroadcastOptions o(context_);
    auto buffer = context_->createUnboundBuffer(tensor.raw_data(), tensor.nbytes());
    InFlight in_flight(*this, buffer.get());  // ends before o, which owns the buffer, goes
    o.setOutput<std::uint8_t>(std::move(buffer));
    o.setRoot(root);
    o.setTag(op_tag(call));
    o.setTimeout(call.timeout);
    run(call, [&] { gloo::broadcast(o); });
  }

  void do_all_gather(const Tensor& input, Tensor& output, const CallOptions& options) override {
    Call call = begin(OpKind::kAllGather, options);
    call.dtype = input.dtype();
    std::string problem = detail::in_out_problem(input, output, kBackendName);
    if (problem.empty()) {
      call.elements = input.num_elements();
      problem = detail::check_all_gather_shapes(input.shape(), output.shape(), config_.size).value_or("");
    }
    if (!problem.empty()) reject(call, problem);
    if (config_.check) check_consistency(call, 1, hash_shapes(std::span<const Tensor>(&input, 1)));
    const std::size_t bytes = input.nbytes();
    if (bytes == 0) return;
    if (config_.size == 1) {
      if (output.raw_data() != input.raw_data()) std::memcpy(output.raw_data(), input.raw_data(), bytes);
      return;
    }
    gloo::AllgatherOptions o(context_);
    auto in = context_->createUnboundBuffer(input.raw_data(), bytes);
    auto out = context_->createUnboundBuffer(output.raw_data(), bytes * static_cast<std::size_t>(config_.size));
    InFlight in_flight(*this, in.get(), out.get());  // ends before o, which owns the buffers, goes
    o.setInput<std::uint8_t>(std::move(in));
    o.setOutput<std::uint8_t>(std::move(out));
    o.setTag(op_tag(call));
    o.setTimeout(call.timeout);
    run(call, [&] { gloo::allgather(o); });
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) override {
    Call call = begin(OpKind::kReduceScatter, options);
    call.reduce = op;
    call.dtype = input.dtype();
    std::string problem = detail::in_out_problem(input, output, kBackendName);
    if (problem.empty()) {
      call.elements = input.num_elements();
      problem = detail::check_reduce_scatter_shapes(input.shape(), output.shape(), config_.size).value_or("");
    }
    if (problem.empty() && !reducible(call.dtype)) problem = not_reducible(call.dtype);
    if (!problem.empty()) reject(call, problem);
    if (config_.check) check_consistency(call, 1, hash_shapes(std::span<const Tensor>(&input, 1)));
    const std::size_t part_bytes = output.nbytes();
    if (part_bytes == 0) return;
    // An all-reduce of a copy, of which this rank keeps its part: twice the traffic of a true
    // reduce-scatter, but gloo's ring all-reduce is its fastest collective and the input stays
    // untouched.
    std::byte* data = staging_.reserve(input.nbytes());
    std::memcpy(data, input.raw_data(), input.nbytes());
    if (config_.size > 1) reduce_buffer(call, data, call.elements);
    std::byte* part = data + static_cast<std::size_t>(config_.rank) * part_bytes;
    if (op == ReduceOp::kMean) divide_in_place(part, output.num_elements(), call.dtype, config_.size);
    std::memcpy(output.raw_data(), part, part_bytes);
  }

  void do_barrier(const CallOptions& options) override {
    Call call = begin(OpKind::kBarrier, options);
    if (config_.check) check_consistency(call, 0, 0);
    if (config_.size == 1) return;
    InFlight in_flight(*this, barrier_buffer_);
    run(call, [&] {
      barrier_reduce_->setTag(op_tag(call));
      barrier_reduce_->setTimeout(call.timeout);
      gloo::allreduce(*barrier_reduce_);
    });
  }

  // Point-to-point: each message is a descriptor (the pair's message number, dtype, element count)
  // on slot (kPointToPointDescriptorSlot, number), then its bytes on (kPointToPointDataSlot,
  // number). The receiver posts the bytes' recv once the descriptor has come, with a buffer of the
  // sent size: a message that does not fit its tensor is drained into scratch memory (gloo would
  // abort the process on a message of another size) and reported. Every recv and send is posted
  // before the call waits for any, so a send_recv's halves go on at once.
  void do_send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                    const CallOptions& options) override {
    PointToPoint call;
    call.op = detail::point_to_point_name(send_peer, recv_peer);
    call.send_peer = send_peer;
    call.recv_peer = recv_peer;
    call.receiving = recv_peer >= 0;
    if (send_peer >= 0) call.send_number = sent_to_[static_cast<std::size_t>(send_peer)];
    if (recv_peer >= 0) call.recv_number = received_from_[static_cast<std::size_t>(recv_peer)];
    call.timeout = options.timeout == kDefaultTimeout ? config_.timeout : options.timeout;
    call.started = Clock::now();
    // This rank's own arguments: nothing is posted yet, so the peers are not affected.
    if (call.timeout <= milliseconds(0)) {
      throw InvalidArgument(
          fmt::format("{}: the timeout must be positive, got {} ms", describe(call), call.timeout.count()));
    }
    for (const bool receiving : {false, true}) {
      if ((receiving ? recv_peer : send_peer) < 0) continue;
      const Tensor& t = receiving ? recv_tensor : send_tensor;
      if (usable(t)) continue;
      call.receiving = receiving;
      throw InvalidArgument(
          fmt::format("{}: {}", describe(call),
                      detail::host_tensor_problem(t, receiving ? "the tensor to receive into" : "the tensor to send",
                                                  kBackendName)));
    }
    if (failed_.load(std::memory_order_acquire)) {
      std::lock_guard lock(mutex_);
      throw Unavailable(fmt::format("{}: {}", describe(call), failure_));
    }
    const Clock::time_point deadline = detail::deadline_after(call.timeout);
    PointToPointDescriptor outgoing, incoming;
    std::unique_ptr<gloo::transport::UnboundBuffer> send_descriptor, send_data, recv_descriptor, recv_data;
    if (send_peer >= 0) {
      outgoing = {.number = call.send_number,
                  .elements = send_tensor.num_elements(),
                  .dtype = static_cast<std::uint8_t>(send_tensor.dtype())};
      send_descriptor = context_->createUnboundBuffer(&outgoing, sizeof(outgoing));
      if (send_tensor.nbytes() > 0)
        send_data = context_->createUnboundBuffer(send_tensor.raw_data(), send_tensor.nbytes());
    }
    if (recv_peer >= 0) recv_descriptor = context_->createUnboundBuffer(&incoming, sizeof(incoming));
    std::vector<std::byte> scratch;  // a mismatched message's bytes
    InFlight in_flight(*this, send_descriptor.get(), send_data.get(), recv_descriptor.get());
    bool mismatch = false;
    run_point_to_point(call, [&] {
      if (recv_descriptor)
        recv_descriptor->recv(recv_peer, gloo::Slot::build(kPointToPointDescriptorSlot, tag(call.recv_number)));
      if (send_descriptor) {
        send_descriptor->send(send_peer, gloo::Slot::build(kPointToPointDescriptorSlot, tag(call.send_number)));
        if (send_data) send_data->send(send_peer, gloo::Slot::build(kPointToPointDataSlot, tag(call.send_number)));
      }
      if (recv_descriptor) {
        call.receiving = true;
        wait(*recv_descriptor, true, deadline);
        const auto sent_dtype = static_cast<DType>(incoming.dtype);
        mismatch = sent_dtype != recv_tensor.dtype() || incoming.elements != recv_tensor.num_elements();
        const std::size_t bytes = static_cast<std::size_t>(incoming.elements) * dtype_size(sent_dtype);
        if (bytes > 0) {
          void* into = recv_tensor.raw_data();
          if (mismatch) {
            scratch.resize(bytes);
            into = scratch.data();
          }
          recv_data = context_->createUnboundBuffer(into, bytes);
          track(recv_data.get());
          recv_data->recv(recv_peer, gloo::Slot::build(kPointToPointDataSlot, tag(call.recv_number)));
          wait(*recv_data, true, deadline);
        }
        ++received_from_[static_cast<std::size_t>(recv_peer)];
      }
      if (send_descriptor) {
        call.receiving = false;
        wait(*send_descriptor, false, deadline);
        if (send_data) wait(*send_data, false, deadline);
        ++sent_to_[static_cast<std::size_t>(send_peer)];
      }
    });
    if (mismatch) {
      call.receiving = true;
      call.recv_number = received_from_[static_cast<std::size_t>(recv_peer)] - 1;
      throw InvalidArgument(
          fmt::format("{}: {}", describe(call),
                      detail::point_to_point_mismatch(recv_peer, static_cast<DType>(incoming.dtype), incoming.elements,
                                                      config_.rank, recv_tensor.dtype(), recv_tensor.num_elements())));
    }
  }

 public:
  void abort(const std::string& reason) override {
    {
      std::lock_guard lock(mutex_);
      if (failed_.load(std::memory_order_relaxed)) return;
      aborted_ = true;
      failure_ = fmt::format("the group was aborted by {}: {}", label(config_.rank), reason);
      abort_reason_ = reason;
      failed_.store(true, std::memory_order_release);
    }
    // Tell the peers why before they notice the closed connections.
    records_.record_abort(seq_.load(std::memory_order_relaxed), reason);
    poisoned_.store(true, std::memory_order_release);
    interrupt();
  }

 private:
  struct Call {
    OpKind kind = OpKind::kBarrier;
    std::uint64_t seq = 0;
    milliseconds timeout{0};
    Clock::time_point started{};
    DType dtype = kFloat32;
    std::int64_t elements = 0;
    ReduceOp reduce = ReduceOp::kSum;
    int root = 0;
  };

  enum class FailureKind { kTimeout, kConnection, kGloo };

  // One point-to-point call; `receiving` says which half it waits for (and messages name).
  struct PointToPoint {
    std::string_view op;
    int send_peer = -1;
    int recv_peer = -1;
    std::uint64_t send_number = 0;  // the pairs' message numbers
    std::uint64_t recv_number = 0;
    bool receiving = false;
    milliseconds timeout{0};
    Clock::time_point started{};
  };

  // What goes ahead of every point-to-point message (plain bytes, the same on every rank).
  struct PointToPointDescriptor {
    std::uint64_t number = 0;
    std::int64_t elements = 0;
    std::uint8_t dtype = 0;
    std::uint8_t padding[7] = {};
  };

  // A slot's tag: the message number (wrapping after 2^32 messages of one pair, long after the
  // earlier ones have matched: a pair's messages match in order).
  static std::uint32_t tag(std::uint64_t number) { return static_cast<std::uint32_t>(number); }

  // "gloo recv #3 from rank 0 on rank 1".
  std::string describe(const PointToPoint& call) const {
    const int peer = call.receiving ? call.recv_peer : call.send_peer;
    const std::string group = config_.group_name.empty() ? "" : fmt::format(" in the {} group", config_.group_name);
    return fmt::format(
        "gloo {}{}",
        detail::point_to_point_label(call.op, call.receiving, call.receiving ? call.recv_number : call.send_number,
                                     label(peer), label(config_.rank)),
        group);
  }

  // An interrupted wait (abort, or the monitor after a peer failed).
  struct Interrupted {};

  // Waits for one posted operation until `deadline`: gloo throws its IoException at the timeout.
  static void wait(gloo::transport::UnboundBuffer& buffer, bool receiving, Clock::time_point deadline) {
    const auto left = std::max(milliseconds(1), std::chrono::ceil<milliseconds>(deadline - Clock::now()));
    const bool done = receiving ? buffer.waitRecv(left) : buffer.waitSend(left);
    if (!done) throw Interrupted{};
  }

  // Adds a buffer to the call in flight (after InFlight began), for interrupt().
  void track(gloo::transport::UnboundBuffer* buffer) {
    std::lock_guard lock(call_mutex_);
    for (auto*& slot : call_buffers_) {
      if (slot == nullptr) {
        slot = buffer;
        return;
      }
    }
  }

  // Runs a point-to-point call's gloo operations, turning their failures into ours. A failure
  // fails the communicator as a collective's does: a timed-out or interrupted operation stays
  // posted in gloo, and the pair's next messages could meet it.
  template <class Fn>
  void run_point_to_point(PointToPoint& call, Fn&& fn) {
    try {
      fn();
    } catch (const Interrupted&) {
      fail(call, FailureKind::kConnection, "interrupted: a connection to a peer closed");
    } catch (const gloo::IoException& e) {
      const std::string message = gloo_message(e.what());
      fail(call, message.starts_with("Timed out") ? FailureKind::kTimeout : FailureKind::kConnection, message);
    } catch (const gloo::Exception& e) {
      fail(call, FailureKind::kConnection, gloo_message(e.what()));
    }
  }

  [[noreturn]] void fail(const PointToPoint& call, FailureKind kind, const std::string& gloo_error) {
    const std::string what = describe(call);
    const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - call.started);
    const int peer = call.receiving ? call.recv_peer : call.send_peer;
    std::optional<detail::DeadlineScope> bounded(std::in_place, Clock::now() + kRecordBudget);
    const std::uint64_t issued = seq_.load(std::memory_order_relaxed);
    {
      std::lock_guard lock(mutex_);
      if (aborted_) {
        records_.record_failure(issued, detail::FailureCause::kAborted);
        throw Unavailable(fmt::format("{}: the group was aborted: {}", what, abort_reason_));
      }
    }
    const bool store_reachable = records_.record_failure(
        issued, kind == FailureKind::kTimeout ? detail::FailureCause::kTimeout : detail::FailureCause::kConnection,
        what);
    bounded.emplace(Clock::now() + kFailureReportGrace + milliseconds(500));
    poisoned_.store(true, std::memory_order_release);
    shut_down_connections();
    std::string verdict;
    bool deadline = false;
    if (kind == FailureKind::kTimeout) {
      verdict = fmt::format("{}: timed out after {}: {} {}", what, format_duration(waited), label(peer),
                            call.receiving ? "sent nothing" : "did not receive it");
      deadline = true;
    } else {
      detail::PeerSurvey survey;
      survey.store_reachable = false;
      if (store_reachable) survey = records_.survey(issued, std::min(kFailureReportGrace, call.timeout), true);
      verdict = culprit_verdict(what, gloo_error, survey).value_or(fmt::format("{}: gloo: {}", what, gloo_error));
    }
    remember_failure(fmt::format("the group failed: {}", verdict));
    if (deadline) throw DeadlineExceeded(verdict);
    throw Unavailable(verdict);
  }

  // What a survey of the peers' reports says failed: the store out of reach, a lost peer, or a
  // peer's abort; nullopt when none of them (the caller's own diagnosis then).
  std::optional<std::string> culprit_verdict(const std::string& what, const std::string& gloo_error,
                                             const detail::PeerSurvey& survey) const {
    if (!survey.store_reachable) {
      return fmt::format("{}: {}; {}", what, gloo_error, records_.store_unreachable_message(" too"));
    }
    if (!survey.lost.empty()) return fmt::format("{}: {}; gloo: {}", what, records_.lost_message(survey.lost), gloo_error);
    if (!survey.aborted.empty()) {
      return fmt::format("{}: {} aborted the group: {}", what, label(survey.aborted.front().first),
                         survey.aborted.front().second);
    }
    return std::nullopt;
  }

  // Keeps the communicator's first failure: later calls throw Unavailable naming it.
  void remember_failure(std::string failure) {
    std::lock_guard lock(mutex_);
    if (!failed_.load(std::memory_order_relaxed)) {
      failure_ = std::move(failure);
      failed_.store(true, std::memory_order_release);
    }
  }

  // Marks a gloo operation on these buffers as in flight, so that abort() and the monitor can
  // interrupt its waits.
  class InFlight {
   public:
    InFlight(GlooCommunicator& c, gloo::transport::UnboundBuffer* a, gloo::transport::UnboundBuffer* b = nullptr,
             gloo::transport::UnboundBuffer* d = nullptr)
        : c_(c) {
      std::lock_guard lock(c_.call_mutex_);
      c_.call_buffers_ = {a, b, d, nullptr};
      c_.in_flight_ = true;
    }
    ~InFlight() {
      std::lock_guard lock(c_.call_mutex_);
      c_.call_buffers_ = {};
      c_.in_flight_ = false;
    }
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;

   private:
    GlooCommunicator& c_;
  };

  Call begin(OpKind kind, const CallOptions& options) {
    Call call;
    call.kind = kind;
    call.seq = seq_.fetch_add(1, std::memory_order_relaxed);
    call.timeout = options.timeout == kDefaultTimeout ? config_.timeout : options.timeout;
    call.started = Clock::now();
    if (call.timeout <= milliseconds(0)) {
      throw InvalidArgument(
          fmt::format("{}: the timeout must be positive, got {} ms", describe(call), call.timeout.count()));
    }
    if (failed_.load(std::memory_order_acquire)) {
      std::lock_guard lock(mutex_);
      throw Unavailable(fmt::format("{}: {}", describe(call), failure_));
    }
    return call;
  }

  // "gloo all_reduce #12 (float32, 262144 elements) on worker 0".
  std::string describe(const Call& call) const {
    std::string details;
    if (call.kind != OpKind::kBarrier) details = fmt::format(" ({}, {} elements)", call.dtype, call.elements);
    const std::string group = config_.group_name.empty() ? "" : fmt::format(" in the {} group", config_.group_name);
    return fmt::format("gloo {}{} on {}{}", detail::call_label(call.kind, call.seq), details, label(config_.rank),
                       group);
  }

  std::string label(int rank) const { return detail::rank_label(config_.labels, rank); }

  std::string names(const std::vector<int>& ranks) const { return records_.names(ranks); }

  // The tag of a call's messages mixes everything the ranks must agree on. Ranks that disagree
  // (another element count, dtype, operation, root) then post messages that never match, and the
  // call times out cleanly: with matching tags, gloo's event-loop thread asserts on a message of
  // the wrong size, which terminates the process. (Check mode names the disagreement instead.)
  std::uint32_t op_tag(const Call& call) const {
    std::uint64_t h = call.seq;
    for (std::uint64_t v : {static_cast<std::uint64_t>(call.kind), static_cast<std::uint64_t>(call.dtype),
                            static_cast<std::uint64_t>(call.elements), static_cast<std::uint64_t>(call.reduce),
                            static_cast<std::uint64_t>(call.root)}) {
      h = (h ^ v) * 0x9E3779B97F4A7C15ull;  // splitmix64's finaliser, one round per field
      h ^= h >> 31;
    }
    return static_cast<std::uint32_t>(h) & ~std::uint32_t{1};
  }
  std::uint32_t check_tag(const Call& call) const { return static_cast<std::uint32_t>((call.seq << 1) | 1); }

  // This rank's own arguments are wrong: the peers, already inside the call, would wait for it
  // until their timeout. Fail the group so that they learn at once, then throw.
  [[noreturn]] void reject(const Call& call, const std::string& problem) {
    const std::string message = fmt::format("{}: {}", describe(call), problem);
    if (config_.size > 1) abort(fmt::format("{} had invalid arguments: {}", describe(call), problem));
    throw InvalidArgument(message);
  }

  // All-reduces `elements` elements at data in place, pack by pack.
  void reduce_buffer(const Call& call, std::byte* data, std::int64_t elements) {
    const std::size_t esize = dtype_size(call.dtype);
    std::int64_t per_pack = elements;
    if (config_.bytes_per_pack > 0) {
      per_pack = std::max<std::int64_t>(1, config_.bytes_per_pack / static_cast<std::int64_t>(esize));
    }
    const ReduceFn fn = reduce_function(call.dtype, call.reduce);
    for (std::int64_t begin = 0; begin < elements; begin += per_pack) {
      const std::int64_t n = std::min(per_pack, elements - begin);
      if (ordered_) {
        InFlight in_flight(*this, nullptr);  // interrupt() reaches the call through ordered_
        run(call, [&] {
          ordered_->run(data + static_cast<std::size_t>(begin) * esize, n, call.dtype, call.reduce, op_tag(call),
                        detail::deadline_after(call.timeout));
        });
        continue;
      }
      CachedAllreduce& setup = allreduce_setup(data + static_cast<std::size_t>(begin) * esize, n, call.dtype);
      InFlight in_flight(*this, setup.buffer);
      run(call, [&] {
        setup.options->setReduceFunction(fn);
        setup.options->setTag(op_tag(call));
        setup.options->setTimeout(call.timeout);
        gloo::allreduce(*setup.options);
      });
    }
  }

  struct CachedAllreduce {
    std::byte* data = nullptr;
    std::int64_t elements = 0;
    DType dtype = kFloat32;
    gloo::transport::UnboundBuffer* buffer = nullptr;  // owned by options
    std::unique_ptr<gloo::AllreduceOptions> options;
  };

  // The setup of an all-reduce over (data, elements, dtype), made once: gloo's options hold
  // unbound buffers that cost allocations to make.
  CachedAllreduce& allreduce_setup(std::byte* data, std::int64_t elements, DType dtype) {
    for (auto& entry : allreduce_cache_) {
      if (entry.data == data && entry.elements == elements && entry.dtype == dtype) return entry;
    }
    CachedAllreduce entry{data, elements, dtype, nullptr, std::make_unique<gloo::AllreduceOptions>(context_)};
    entry.options->setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    auto buffer = context_->createUnboundBuffer(data, static_cast<std::size_t>(elements) * dtype_size(dtype));
    entry.buffer = buffer.get();
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> outputs;
    outputs.push_back(std::move(buffer));
    graph::dispatch<detail::ReducibleTypes>(dtype, "gloo all_reduce",
                                            [&]<class T>() { entry.options->setOutputs<T>(std::move(outputs)); });
    if (allreduce_cache_.size() < kMaxCachedAllreduces) {
      allreduce_cache_.push_back(std::move(entry));
      return allreduce_cache_.back();
    }
    auto& slot = allreduce_cache_[next_eviction_];
    next_eviction_ = (next_eviction_ + 1) % kMaxCachedAllreduces;
    slot = std::move(entry);
    return slot;
  }

  // Check mode: every rank publishes what it is about to do; all compare the same list, so all
  // throw or none does.
  void check_consistency(const Call& call, std::int64_t tensors, std::uint64_t shapes_hash) {
    Descriptor d;
    d.seq = call.seq;
    d.elements = call.elements;
    d.tensors = tensors;
    d.shapes_hash = shapes_hash;
    d.root = call.kind == OpKind::kBroadcast ? call.root : 0;
    d.kind = static_cast<std::uint8_t>(call.kind);
    d.has_reduce = call.kind == OpKind::kAllReduce || call.kind == OpKind::kReduceScatter;
    d.reduce = d.has_reduce ? static_cast<std::uint8_t>(call.reduce) : 0;
    d.dtype = call.kind == OpKind::kBarrier ? 0 : static_cast<std::uint8_t>(call.dtype);
    if (config_.size == 1) return;
    descriptor_ = d;
    InFlight in_flight(*this, descriptor_buffers_[0], descriptor_buffers_[1]);
    run(call, [&] {
      descriptor_gather_->setTag(check_tag(call));
      descriptor_gather_->setTimeout(call.timeout);
      gloo::allgather(*descriptor_gather_);
    });
    const Descriptor& first = gathered_descriptors_[0];
    for (int q = 1; q < config_.size; ++q) {
      const Descriptor& other = gathered_descriptors_[static_cast<std::size_t>(q)];
      if (other == first) continue;
      const bool with_seq = other.seq != first.seq;
      std::string a = describe_descriptor(first, with_seq);
      std::string b = describe_descriptor(other, with_seq);
      if (a == b) b += " with tensors of other shapes";
      throw InvalidArgument(fmt::format("collective mismatch at #{}: {} issued {} but {} issued {}", first.seq,
                                        label(0), a, label(q), b));
    }
  }

  // Runs a gloo operation, turning its exceptions into ours. An operation that returns after it
  // was interrupted (its waits report "aborted" instead of throwing) failed too.
  template <class Fn>
  void run(const Call& call, Fn&& fn) {
    try {
      fn();
    } catch (const gloo::IoException& e) {
      const std::string message = gloo_message(e.what());
      fail(call, message.starts_with("Timed out") ? FailureKind::kTimeout : FailureKind::kConnection, message);
    } catch (const gloo::EnforceNotMet& e) {
      fail(call, FailureKind::kGloo, gloo_message(e.what()));
    } catch (const gloo::Exception& e) {
      fail(call, FailureKind::kConnection, gloo_message(e.what()));
    }
    if (poisoned_.load(std::memory_order_acquire)) {
      fail(call, FailureKind::kConnection, "interrupted: a connection to a peer closed");
    }
  }

  // Decides whom to blame for a failed call, fails the communicator and throws.
  [[noreturn]] void fail(const Call& call, FailureKind kind, const std::string& gloo_error) {
    const std::string what = describe(call);
    // The time it really waited (messages once said "after 10 s" of a wait that took longer).
    const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - call.started);
    std::optional<detail::DeadlineScope> bounded(std::in_place, Clock::now() + kRecordBudget);
    {
      std::lock_guard lock(mutex_);
      if (aborted_) {
        // Our own abort interrupted this call.
        const std::string message = fmt::format("{}: the group was aborted: {}", what, abort_reason_);
        records_.record_failure(call.seq + 1, detail::FailureCause::kAborted);
        throw Unavailable(message);
      }
    }
    const bool store_reachable =
        records_.record_failure(call.seq + 1,
                                kind == FailureKind::kTimeout ? detail::FailureCause::kTimeout
                                : kind == FailureKind::kGloo  ? detail::FailureCause::kError
                                                              : detail::FailureCause::kConnection,
                                what);
    bounded.emplace(Clock::now() + kFailureReportGrace + milliseconds(500));
    // Peers still inside the call fail now rather than at their own timeout.
    poisoned_.store(true, std::memory_order_release);
    shut_down_connections();
    std::string verdict;
    bool deadline = false;
    if (kind == FailureKind::kGloo) {
      verdict = fmt::format("{}: gloo: {} (do all ranks issue the same collectives? TANDEM_CHECK_COLLECTIVES=1 checks)",
                            what, gloo_error);
    } else {
      std::tie(verdict, deadline) = diagnose(call, kind, gloo_error, store_reachable, waited);
    }
    remember_failure(fmt::format("the group failed at {} #{}: {}", detail::op_kind_name(call.kind), call.seq, verdict));
    if (kind == FailureKind::kGloo) throw Internal(verdict);
    if (deadline) throw DeadlineExceeded(verdict);
    throw Unavailable(verdict);
  }

  // Returns the message and whether it is a DeadlineExceeded (else Unavailable).
  std::pair<std::string, bool> diagnose(const Call& call, FailureKind kind, const std::string& gloo_error,
                                        bool store_reachable, milliseconds waited) {
    const std::string what = describe(call);
    const milliseconds grace = std::min(kFailureReportGrace, std::max(call.timeout, milliseconds(200)));
    detail::PeerSurvey survey;
    survey.store_reachable = false;
    if (store_reachable) survey = records_.survey(call.seq, grace, /*stop_at_culprit=*/true);
    if (auto verdict = culprit_verdict(what, gloo_error, survey)) return {std::move(*verdict), false};
    const bool someone_timed_out = kind == FailureKind::kTimeout || survey.peer_timed_out;
    const std::string timeout = format_duration(waited);
    if (!survey.elsewhere.empty()) {
      const auto& [peer, their_call] = survey.elsewhere.front();
      return {fmt::format("{}: timed out after {}: {} never reached it, and failed in another call instead: {}. The "
                          "workers issue different collectives: do they run the same program with the same global "
                          "batch size and steps per epoch?",
                          what, timeout, label(peer), their_call),
              true};
    }
    if (!survey.behind.empty()) {
      if (someone_timed_out) {
        return {fmt::format("{}: timed out after {} waiting for {}, which never reached it", what, timeout,
                            names(survey.behind)),
                true};
      }
      return {fmt::format("{}: lost the connection to {}, which did not report since (its process may have died); "
                          "gloo: {}",
                          what, names(survey.behind), gloo_error),
              false};
    }
    if (someone_timed_out) {
      return {fmt::format("{}: timed out after {}, though every rank reached it (a stalled network, or ranks "
                          "issuing different collectives: TANDEM_CHECK_COLLECTIVES=1 checks)",
                          what, timeout),
              true};
    }
    return {fmt::format("{}: gloo: {}", what, gloo_error), false};
  }

  // Shuts down this rank's sockets to its peers: the peers see the connections close, and this
  // rank's gloo event loop reads end-of-file and fails the operations pending on them.
  void shut_down_connections() {
    for (const detail::PeerSocket& s : sockets_) s.shut_down();
  }

  // Wakes this rank's pending call, if any. Gloo cannot cancel a collective: a pair that fails
  // wakes only the operations pending on that pair, and closing one wakes none. So: shut the
  // sockets down (every pair fails, waking its operations), and make the waits on this call's own
  // buffers return (gloo then goes on into an operation on a failed pair, which throws, or
  // returns; run() treats both as failures).
  void interrupt() {
    shut_down_connections();
    std::lock_guard lock(call_mutex_);
    if (ordered_) ordered_->interrupt();
    for (auto* buffer : call_buffers_) {
      if (buffer == nullptr) continue;
      buffer->abortWaitSend();
      buffer->abortWaitRecv();
    }
  }

  // The monitor thread. While a call is in flight it watches this rank's sockets: gloo closes a
  // pair's socket when the pair fails (a peer died, aborted, or timed out and closed its side),
  // but wakes only the operations pending on that pair, so a call waiting on another peer would
  // sit until its own timeout. When a socket has closed and the store says why (a peer reported
  // a failure or abort, or the store's server saw a process die; a peer that merely finished and
  // exited is no failure), the monitor interrupts the call; it repeats until the call returns,
  // since an interrupted wait may be followed by another.
  void monitor() {
    std::unique_lock lock(monitor_mutex_);
    while (!stopping_) {
      monitor_cv_.wait_for(lock, kMonitorInterval, [&] { return stopping_; });
      if (stopping_) break;
      lock.unlock();
      {
        bool in_flight = false;
        {
          std::lock_guard call_lock(call_mutex_);
          in_flight = in_flight_;
        }
        if (in_flight && (poisoned_.load(std::memory_order_acquire) || connection_failed())) {
          poisoned_.store(true, std::memory_order_release);
          interrupt();
        }
      }
      lock.lock();
    }
  }

  bool connection_failed() {
    if (std::none_of(sockets_.begin(), sockets_.end(), [](const auto& s) { return s.closed_by_owner(); })) return false;
    try {
      const detail::DeadlineScope bounded(Clock::now() + kMonitorStoreBudget);
      return records_.peer_failed();
    } catch (const std::exception&) {
      return true;  // the store's server is gone with its process
    }
  }

  static bool usable(const Tensor& t) { return t.defined() && t.device().host_accessible(); }

  const Config config_;
  detail::PeerRecords records_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;  // null for a group of one
  std::vector<detail::PeerSocket> sockets_;  // the connections to the peers (for interrupt())
  std::atomic<std::uint64_t> seq_{0};
  // Point-to-point: the messages this rank sent to / received from each peer (the pairs' message
  // numbers). The calling thread's.
  std::vector<std::uint64_t> sent_to_ = std::vector<std::uint64_t>(static_cast<std::size_t>(config_.size));
  std::vector<std::uint64_t> received_from_ = std::vector<std::uint64_t>(static_cast<std::size_t>(config_.size));

  // Failure state: set once (by a failed call or abort), read by every later call.
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::string failure_;       // guarded by mutex_
  bool aborted_ = false;      // guarded by mutex_
  std::string abort_reason_;  // guarded by mutex_
  // A failure is known (abort, or a failed call or connection): the call in flight must end.
  std::atomic<bool> poisoned_{false};

  // The call in flight, for interrupt().
  std::mutex call_mutex_;
  bool in_flight_ = false;                                         // guarded by call_mutex_
  // Up to four: a point-to-point call's two descriptors and two data buffers.
  std::array<gloo::transport::UnboundBuffer*, 4> call_buffers_{};  // guarded by call_mutex_

  std::thread monitor_;
  std::mutex monitor_mutex_;
  std::condition_variable monitor_cv_;
  bool stopping_ = false;  // guarded by monitor_mutex_

  // The calling thread's scratch (one call at a time per rank).
  StagingBuffer staging_;
  std::vector<CachedAllreduce> allreduce_cache_;
  std::size_t next_eviction_ = 0;
  std::unique_ptr<detail::OrderedAllReduce> ordered_;  // kRankOrdered's setups; null for kRing
  Descriptor descriptor_;
  std::vector<Descriptor> gathered_descriptors_;
  std::unique_ptr<gloo::AllgatherOptions> descriptor_gather_;
  std::array<gloo::transport::UnboundBuffer*, 2> descriptor_buffers_{};  // owned by descriptor_gather_
  std::int64_t barrier_word_ = 0;
  std::unique_ptr<gloo::AllreduceOptions> barrier_reduce_;
  gloo::transport::UnboundBuffer* barrier_buffer_ = nullptr;  // owned by barrier_reduce_
};

bool check_from_environment() { return env::get_bool(env::kCheckCollectives); }

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(GlooOptions options) {
  TANDEM_REQUIRE(options.size >= 1, InvalidArgument, "make_gloo_communicator: size must be at least 1, got {}",
                 options.size);
  TANDEM_REQUIRE(options.rank >= 0 && options.rank < options.size, InvalidArgument,
                 "make_gloo_communicator: rank {} is not in [0, {})", options.rank, options.size);
  TANDEM_REQUIRE(options.store != nullptr, InvalidArgument,
                 "make_gloo_communicator: rank {} has no store (GlooOptions::store); the ranks meet through one",
                 options.rank);
  TANDEM_REQUIRE(options.timeout > milliseconds(0), InvalidArgument,
                 "make_gloo_communicator: the timeout must be positive, got {} ms", options.timeout.count());
  TANDEM_REQUIRE(options.rank_labels.empty() || static_cast<int>(options.rank_labels.size()) == options.size,
                 InvalidArgument, "make_gloo_communicator: {} rank labels for a group of {}; give one per rank or none",
                 options.rank_labels.size(), options.size);
  TANDEM_REQUIRE(options.bytes_per_pack >= 0, InvalidArgument,
                 "make_gloo_communicator: bytes_per_pack must be 0 (one pack) or positive, got {}",
                 options.bytes_per_pack);

  Config config;
  config.rank = options.rank;
  config.size = options.size;
  config.store = options.store;
  config.timeout = options.timeout;
  config.labels = std::move(options.rank_labels);
  config.bytes_per_pack = options.bytes_per_pack;
  config.algorithm = options.all_reduce_algorithm;
  config.check = options.check_consistency.value_or(check_from_environment());
  config.group_name = std::move(options.group_name);
  const auto label = [&](int r) {
    return config.labels.empty() ? fmt::format("rank {}", r) : config.labels[static_cast<std::size_t>(r)];
  };
  const std::string who = fmt::format("make_gloo_communicator on {} of {}", label(config.rank), config.size);
  Store& store = *config.store;
  const milliseconds connect_timeout = std::max(milliseconds(1), options.connect_timeout.value_or(config.timeout));

  try {
    config.prefix = detail::group_prefix(store, "gloo", config.rank);
    if (config.size == 1) return std::make_unique<GlooCommunicator>(std::move(config), nullptr, nullptr);

    // Everyone arrives first, so that a missing rank is named (gloo's own rendezvous would only
    // report a key it waited for).
    const auto arrived = [&](int q) { return config.prefix + fmt::format("arrived/{}", q); };
    store.set(arrived(config.rank), bytes_of(label(config.rank)));
    const std::vector<int> missing = detail::wait_for_ranks(store, arrived, config.size, connect_timeout);
    if (!missing.empty()) {
      throw DeadlineExceeded(fmt::format("{}: {} did not arrive at the store {} within {}", who,
                                         detail::rank_names(config.labels, missing, config.size), store.address(),
                                         format_duration(connect_timeout)));
    }
  } catch (const Unavailable& e) {
    throw Unavailable(fmt::format("{}: the store is unreachable: {}", who, e.what()));
  }

  ignore_sigpipe();
  gloo::transport::tcp::attr attr;
  attr.hostname = options.listen_host.empty() ? default_listen_host(store) : options.listen_host;
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw InvalidArgument(fmt::format("{}: cannot listen on \"{}\" (GlooOptions::listen_host): {}", who, attr.hostname,
                                      gloo_message(e.what())));
  }
  auto context = std::make_shared<gloo::rendezvous::Context>(config.rank, config.size);
  context->setTimeout(connect_timeout);
  GlooStoreAdapter adapter(config.store, config.prefix + "mesh/", connect_timeout);
  try {
    context->connectFullMesh(adapter, device);
    context->setTimeout(config.timeout);
  } catch (const Error&) {
    throw;
  } catch (const gloo::IoException& e) {
    throw Unavailable(fmt::format("{}: cannot connect to the other ranks (listening on {}): {}", who, attr.hostname,
                                  gloo_message(e.what())));
  } catch (const std::exception& e) {
    throw Unavailable(fmt::format("{}: cannot connect to the other ranks (listening on {}): {}", who, attr.hostname,
                                  gloo_message(e.what())));
  }
  std::vector<detail::Endpoints> connections;
  try {
    connections = connection_endpoints(*context, store, config, connect_timeout);
  } catch (const Error& e) {
    throw Unavailable(fmt::format("{}: cannot swap the connections' addresses with the other ranks: {}", who, e.what()));
  }
  return std::make_unique<GlooCommunicator>(std::move(config), std::move(device), std::move(context), connections);
}

}  // namespace tandem::collective
