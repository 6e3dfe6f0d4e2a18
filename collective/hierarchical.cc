// The hierarchical group: the replicas of a multi-worker job, L per worker process. Each
// collective is composed of a local collective among the worker's replicas (shared memory), one
// cross-worker collective issued by local replica 0 alone (one rank per process), and a local
// broadcast of its result. Only replica 0 talks to the other workers, so the slow network sees each
// worker's data once instead of L times.
//
// Failures cross levels in both directions: a cross-worker error aborts the local group (the
// replicas waiting in the next local step get Unavailable with that error), and a local error on
// replica 0 aborts the cross-worker communicator (the other workers learn at once instead of at
// their timeout).
#include <fmt/format.h>

#include <atomic>
#include <cstring>

#include "tandem/collective/hierarchical.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/detail/reduce_kernels.h"

namespace tandem::collective {
namespace {

// MEAN divides once, at the end, on the host: device tensors (GPU replicas) are summed only (the
// trainer's all-reduces are sums); a MEAN of GPU tensors says so rather than touching device memory.
void divide_in_place(Tensor& t, int divisor) {
  TANDEM_REQUIRE(t.device().host_accessible(), Unimplemented,
                 "hierarchical all_reduce MEAN of tensors on {}: only SUM is supported for GPU replicas; divide after "
                 "a SUM",
                 t.device().short_name());
  graph::dispatch<detail::ReducibleTypes>(t.dtype(), "hierarchical MEAN", [&]<class T>() {
    T* __restrict p = static_cast<T*>(t.raw_data());
    const T d = static_cast<T>(divisor);
    const std::int64_t n = t.num_elements();
    for (std::int64_t i = 0; i < n; ++i) p[i] = p[i] / d;
  });
}

// `shape` with its first dimension multiplied (divided) by k; a scalar becomes the vector (k).
Shape scale_first_dim(const Shape& shape, std::int64_t multiply, std::int64_t divide) {
  std::vector<std::int64_t> dims(shape.dims().begin(), shape.dims().end());
  if (dims.empty()) dims.push_back(1);
  dims[0] = dims[0] * multiply / divide;
  return Shape(std::span<const std::int64_t>(dims));
}

struct Levels {
  std::vector<std::unique_ptr<Communicator>> local;
  std::unique_ptr<Communicator> cross;
  int replicas = 1;  // L
  int worker = 0;
  int workers = 1;
};

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(std::shared_ptr<Levels> levels, int replica)
      : levels_(std::move(levels)), replica_(replica) {}

  int rank() const override { return levels_->worker * levels_->replicas + replica_; }
  int size() const override { return levels_->workers * levels_->replicas; }
  std::uint64_t sequence_number() const override { return seq_.load(std::memory_order_relaxed); }
  std::string_view backend() const override { return "hierarchical"; }

 protected:
  void do_all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) override {
    seq_.fetch_add(1, std::memory_order_relaxed);
    // Sums travel up; the mean is taken once, of the global sum.
    const ReduceOp partial = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    local_step([&](Communicator& c) { c.all_reduce(tensors, partial, options); });
    cross_step([&](Communicator& c) {
      c.all_reduce(tensors, partial, options);
      if (op == ReduceOp::kMean) {
        for (Tensor& t : tensors) divide_in_place(t, size());
      }
    });
    for (Tensor& t : tensors) local_step([&](Communicator& c) { c.broadcast(t, 0, options); });
  }

  void do_broadcast(Tensor& tensor, int root, const CallOptions& options) override {
    seq_.fetch_add(1, std::memory_order_relaxed);
    TANDEM_REQUIRE(root >= 0 && root < size(), InvalidArgument,
                   "hierarchical broadcast #{} on rank {}: root {} is not a rank of this group of {}",
                   sequence_number() - 1, rank(), root, size());
    const int root_worker = root / levels_->replicas;
    const int root_replica = root % levels_->replicas;
    if (levels_->worker == root_worker) {
      // The root's value reaches replica 0 first (and this worker's other replicas with it).
      local_step([&](Communicator& c) { c.broadcast(tensor, root_replica, options); });
      cross_step([&](Communicator& c) { c.broadcast(tensor, root_worker, options); });
    } else {
      cross_step([&](Communicator& c) { c.broadcast(tensor, root_worker, options); });
      local_step([&](Communicator& c) { c.broadcast(tensor, 0, options); });
    }
  }

  void do_all_gather(const Tensor& input, Tensor& output, const CallOptions& options) override {
    seq_.fetch_add(1, std::memory_order_relaxed);
    if (auto problem = detail::check_all_gather_shapes(input.shape(), output.shape(), size())) {
      throw InvalidArgument(
          fmt::format("hierarchical all_gather #{} on rank {}: {}", sequence_number() - 1, rank(), *problem));
    }
    // Global rank order is worker-major, so this worker's gathered block is contiguous in output.
    Tensor gathered =
        Tensor::empty(scale_first_dim(input.shape(), levels_->replicas, 1), input.dtype(), input.device());
    local_step([&](Communicator& c) { c.all_gather(input, gathered, options); });
    cross_step([&](Communicator& c) { c.all_gather(gathered, output, options); });
    local_step([&](Communicator& c) { c.broadcast(output, 0, options); });
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) override {
    seq_.fetch_add(1, std::memory_order_relaxed);
    if (auto problem = detail::check_reduce_scatter_shapes(input.shape(), output.shape(), size())) {
      throw InvalidArgument(
          fmt::format("hierarchical reduce_scatter #{} on rank {}: {}", sequence_number() - 1, rank(), *problem));
    }
    const ReduceOp partial = op == ReduceOp::kMean ? ReduceOp::kSum : op;
    // Local sum of the whole input, then each worker receives its block (its replicas' parts) of
    // the global reduction, then every replica takes its part of the block.
    Tensor reduced = input.clone();
    local_step([&](Communicator& c) { c.all_reduce(reduced, partial, options); });
    Tensor block = Tensor::empty(scale_first_dim(input.shape(), 1, levels_->workers), input.dtype(), input.device());
    cross_step([&](Communicator& c) {
      c.reduce_scatter(reduced, block, partial, options);
      if (op == ReduceOp::kMean) divide_in_place(block, size());
    });
    local_step([&](Communicator& c) { c.broadcast(block, 0, options); });
    const std::size_t part_bytes = output.nbytes();
    if (part_bytes > 0) {
      std::memcpy(output.raw_data(),
                  static_cast<const std::byte*>(block.raw_data()) + static_cast<std::size_t>(replica_) * part_bytes,
                  part_bytes);
    }
  }

  void do_barrier(const CallOptions& options) override {
    seq_.fetch_add(1, std::memory_order_relaxed);
    local_step([&](Communicator& c) { c.barrier(options); });
    cross_step([&](Communicator& c) { c.barrier(options); });
    local_step([&](Communicator& c) { c.barrier(options); });
  }

  // A pair within this worker goes through the local group (peer = its replica number), a pair of
  // two workers' replicas 0 through the cross-worker communicator (peer = its worker number).
  // Other pairs would need a relay through replicas 0, which are not in the call: Unimplemented,
  // before anything is sent, and so is a send_recv whose halves need different levels (the two
  // levels' calls could not be made at once). Failures are not carried across levels: point-to-
  // point calls are between two ranks only.
  void do_send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                    const CallOptions& options) override {
    const std::string_view op = detail::point_to_point_name(send_peer, recv_peer);
    const Level send_level = level_of(op, send_peer, "to");
    const Level recv_level = level_of(op, recv_peer, "from");
    if (send_level != Level::kNone && recv_level != Level::kNone && send_level != recv_level) {
      throw Unimplemented(fmt::format(
          "hierarchical send_recv on rank {}: sending to rank {} goes {}, receiving from rank {} goes {}; make two "
          "calls (a send and a recv, in an order that cannot deadlock)",
          rank(), send_peer, level_name(send_level), recv_peer, level_name(recv_level)));
    }
    const Level level = send_level != Level::kNone ? send_level : recv_level;
    Communicator& c = level == Level::kLocal ? local() : *levels_->cross;
    const int to = send_peer < 0            ? -1
                   : level == Level::kLocal ? send_peer % levels_->replicas
                                            : send_peer / levels_->replicas;
    const int from = recv_peer < 0            ? -1
                     : level == Level::kLocal ? recv_peer % levels_->replicas
                                              : recv_peer / levels_->replicas;
    c.send_recv(send_tensor, to, recv_tensor, from, options);
  }

 public:
  void abort(const std::string& reason) override {
    local().abort(reason);
    levels_->cross->abort(reason);
  }

  CommunicationStats cross_worker_stats() const { return levels_->cross->stats(); }

 private:
  Communicator& local() { return *levels_->local[static_cast<std::size_t>(replica_)]; }

  enum class Level { kNone, kLocal, kCross };
  static std::string_view level_name(Level level) {
    return level == Level::kLocal ? "through this worker's local group" : "across workers";
  }

  // Which communicator carries messages between this rank and `peer` (kNone for peer < 0); throws
  // Unimplemented for a pair that neither does.
  Level level_of(std::string_view op, int peer, std::string_view direction) const {
    if (peer < 0) return Level::kNone;
    const int peer_worker = peer / levels_->replicas;
    if (peer_worker == levels_->worker) return Level::kLocal;
    if (replica_ == 0 && peer % levels_->replicas == 0) return Level::kCross;
    throw Unimplemented(fmt::format(
        "hierarchical {} on rank {} (worker {}, replica {}) {} rank {} (worker {}, replica {}): across workers only "
        "the workers' replicas 0 can send and receive",
        op, rank(), levels_->worker, replica_, direction, peer, peer_worker, peer % levels_->replicas));
  }

  // A collective among this worker's replicas. When it fails on replica 0, the other workers
  // would wait for this worker's cross-worker call until their timeout: abort it.
  template <class Fn>
  void local_step(Fn&& fn) {
    try {
      fn(local());
    } catch (const std::exception& e) {
      if (replica_ == 0 && levels_->workers > 1) {
        levels_->cross->abort(fmt::format("a local collective of worker {} failed: {}", levels_->worker, e.what()));
      }
      throw;
    }
  }

  // The cross-worker collective, on replica 0 only. When it fails, the other replicas are about to
  // wait for replica 0 in the next local step: abort the local group with the error as reason.
  template <class Fn>
  void cross_step(Fn&& fn) {
    if (replica_ != 0) return;
    try {
      fn(*levels_->cross);
    } catch (const std::exception& e) {
      local().abort(fmt::format("the cross-worker collective of worker {} failed: {}", levels_->worker, e.what()));
      throw;
    }
  }

  std::shared_ptr<Levels> levels_;
  const int replica_;
  std::atomic<std::uint64_t> seq_{0};
};

}  // namespace

CommunicationStats cross_worker_stats(const Communicator& member) {
  const auto* hierarchical = dynamic_cast<const HierarchicalCommunicator*>(&member);
  TANDEM_REQUIRE(hierarchical != nullptr, InvalidArgument,
                 "cross_worker_stats: rank {}'s communicator is {}, not a hierarchical group's", member.rank(),
                 member.backend());
  return hierarchical->cross_worker_stats();
}

std::vector<std::unique_ptr<Communicator>> make_hierarchical_group(std::vector<std::unique_ptr<Communicator>> local,
                                                                   std::unique_ptr<Communicator> cross_worker) {
  TANDEM_REQUIRE(!local.empty(), InvalidArgument,
                 "make_hierarchical_group: no local communicators (need one per local replica)");
  TANDEM_REQUIRE(cross_worker != nullptr, InvalidArgument,
                 "make_hierarchical_group: the cross-worker communicator is null");
  const int replicas = static_cast<int>(local.size());
  for (int i = 0; i < replicas; ++i) {
    const auto& c = local[static_cast<std::size_t>(i)];
    TANDEM_REQUIRE(c != nullptr, InvalidArgument, "make_hierarchical_group: local communicator {} is null", i);
    TANDEM_REQUIRE(c->rank() == i && c->size() == replicas, InvalidArgument,
                   "make_hierarchical_group: local communicator {} has rank {} of {}; local[i] must be rank i of {}", i,
                   c->rank(), c->size(), replicas);
  }
  auto levels = std::make_shared<Levels>();
  levels->replicas = replicas;
  levels->worker = cross_worker->rank();
  levels->workers = cross_worker->size();
  if (levels->workers > 1) {
    // Every worker must have as many replicas: the global ranks are worker * L + i.
    Tensor mine = Tensor::from_vector<std::int64_t>({replicas}, {1});
    Tensor all = Tensor::zeros({levels->workers}, kInt64);
    cross_worker->all_gather(mine, all);
    const auto counts = all.to_vector<std::int64_t>();
    for (int w = 1; w < levels->workers; ++w) {
      TANDEM_REQUIRE(counts[static_cast<std::size_t>(w)] == counts[0], InvalidArgument,
                     "make_hierarchical_group: worker 0 has {} local replicas but worker {} has {}; every worker needs "
                     "the same number",
                     counts[0], w, counts[static_cast<std::size_t>(w)]);
    }
  }
  levels->local = std::move(local);
  levels->cross = std::move(cross_worker);
  std::vector<std::unique_ptr<Communicator>> group;
  group.reserve(static_cast<std::size_t>(replicas));
  for (int i = 0; i < replicas; ++i) group.push_back(std::make_unique<HierarchicalCommunicator>(levels, i));
  return group;
}

}  // namespace tandem::collective
