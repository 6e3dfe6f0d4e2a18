#include "tandem/strategy/variable.h"

#include "tandem/strategy/strategy.h"

#include <algorithm>
#include <cstring>
#include <map>

namespace tandem::strategy {

ShardSpec ShardSpec::even(const Shape& global_shape, int num_shards) {
  TANDEM_ASSERT(num_shards >= 1, "{} shards", num_shards);
  const std::int64_t n = global_shape.num_elements();
  return {.num_shards = num_shards, .shard_elements = (n + num_shards - 1) / num_shards, .global_shape = global_shape};
}

std::int64_t ShardSpec::begin(int shard) const {
  return std::min(global_shape.num_elements(), static_cast<std::int64_t>(shard) * shard_elements);
}

std::int64_t ShardSpec::end(int shard) const {
  return std::min(global_shape.num_elements(), static_cast<std::int64_t>(shard + 1) * shard_elements);
}

Tensor flat_view(const Tensor& tensor, std::int64_t offset, std::int64_t count) {
  TANDEM_ASSERT(offset >= 0 && count >= 0 && offset + count <= tensor.num_elements(),
                "flat_view [{}, {}) of a tensor of {} elements", offset, offset + count, tensor.num_elements());
  return Tensor({count}, tensor.dtype(), tensor.buffer(),
                tensor.byte_offset() + static_cast<std::size_t>(offset) * graph::dtype_size(tensor.dtype()));
}

Shape TensorSplit::piece_shape() const {
  if (parts == 1) return global_shape;
  Shape shape = global_shape;
  shape[dim] = global_shape[dim] / parts;
  return shape;
}

namespace {

// A tensor of `shape` seen as [outer, dim, inner] around dimension `dim`: the piece copies move
// `rows` x inner elements per outer index.
struct AroundDim {
  std::int64_t outer = 1, inner = 1;
  AroundDim(const Shape& shape, int dim) {
    for (int d = 0; d < dim; ++d) outer *= shape[d];
    for (int d = dim + 1; d < shape.rank(); ++d) inner *= shape[d];
  }
};

}  // namespace

Tensor TensorSplit::piece(const Tensor& whole, int p) const {
  const Tensor host = whole.to(devices::default_cpu_device());
  if (p < 0) return Tensor::empty({0}, host.dtype());  // a replica that holds nothing of it
  if (parts == 1) return host.clone();
  Tensor out = Tensor::empty(piece_shape(), host.dtype());
  const AroundDim around(global_shape, dim);
  const std::int64_t rows = global_shape[dim] / parts;
  const std::size_t chunk = static_cast<std::size_t>(rows * around.inner) * graph::dtype_size(host.dtype());
  const auto* src = static_cast<const char*>(host.raw_data());
  auto* dst = static_cast<char*>(out.raw_data());
  for (std::int64_t o = 0; o < around.outer; ++o) {
    std::memcpy(dst + static_cast<std::size_t>(o) * chunk, src + static_cast<std::size_t>(o * parts + p) * chunk,
                chunk);
  }
  return out;
}

void TensorSplit::put_piece(const Tensor& piece, int p, Tensor& whole) const {
  const Tensor host = piece.to(devices::default_cpu_device());
  if (parts == 1) {
    std::memcpy(whole.raw_data(), host.raw_data(), host.nbytes());
    return;
  }
  const AroundDim around(global_shape, dim);
  const std::int64_t rows = global_shape[dim] / parts;
  const std::size_t chunk = static_cast<std::size_t>(rows * around.inner) * graph::dtype_size(host.dtype());
  const auto* src = static_cast<const char*>(host.raw_data());
  auto* dst = static_cast<char*>(whole.raw_data());
  for (std::int64_t o = 0; o < around.outer; ++o) {
    std::memcpy(dst + static_cast<std::size_t>(o * parts + p) * chunk, src + static_cast<std::size_t>(o) * chunk,
                chunk);
  }
}

Variable::Variable(Strategy& strategy, VariableOptions options, std::vector<Tensor> copies,
                   std::optional<ShardSpec> sharding)
    : strategy_(&strategy),
      name_(std::move(options.name)),
      trainable_(options.trainable),
      synchronization_(options.synchronization),
      aggregation_(options.aggregation),
      copies_(std::move(copies)),
      sharding_(std::move(sharding)),
      tensor_split_(std::move(options.tensor_split)) {
  TANDEM_ASSERT(!copies_.empty(), "variable {} has no copies", name_);
  if (tensor_split_) piece_shape_ = tensor_split_->piece_shape();
}

void Variable::split_into_pieces(TensorSplit split) {
  if (sharding_ && !tensor_split_) {
    // ZeRO stage 3 sharded the whole value over the data shards: each replica's copy becomes its
    // shard of its piece instead. read_value sums over the workers: every worker splits the same
    // variables in the same order (ModelParallel's compile).
    const Tensor whole = read_value();
    TANDEM_ASSERT(split.global_shape == whole.shape(), "variable {}: split of {} for a value of {}", name_,
                  split.global_shape, whole.shape());
    piece_shape_ = split.piece_shape();
    tensor_split_ = std::move(split);
    sharding_ = ShardSpec::even(piece_shape_, strategy_->data_shards_in_sync());
    const int first = strategy_->global_replica_index(0);
    for (std::size_t r = 0; r < copies_.size(); ++r) {
      const bool holds = tensor_split_->piece_of_replica[static_cast<std::size_t>(first) + r] >= 0;
      copies_[r] = Tensor::zeros({holds ? sharding_->shard_elements : 0}, dtype(), copies_[r].device());
    }
    assign(whole);
    return;
  }
  if (tensor_split_) {
    TANDEM_REQUIRE(tensor_split_->dim == split.dim && tensor_split_->parts == split.parts, FailedPrecondition,
                   "variable \"{}\" is already split along dimension {} into {} pieces; cannot split it along "
                   "dimension {} into {}",
                   name_, tensor_split_->dim, tensor_split_->parts, split.dim, split.parts);
    return;
  }
  TANDEM_ASSERT(split.global_shape == shape() && split.parts >= 1 &&
                    (split.parts == 1 || split.global_shape[split.dim] % split.parts == 0),
                "variable {}: split of {} along {} into {}", name_, shape(), split.dim, split.parts);
  const int first = strategy_->global_replica_index(0);
  for (std::size_t r = 0; r < copies_.size(); ++r) {
    const int p = split.piece_of_replica[static_cast<std::size_t>(first) + r];
    Tensor piece = Tensor::empty(p < 0 ? Shape{0} : split.piece_shape(), dtype(), copies_[r].device());
    if (p >= 0) piece.copy_from(split.piece(copies_[r], p));
    copies_[r] = std::move(piece);
  }
  piece_shape_ = split.piece_shape();
  tensor_split_ = std::move(split);
}

// The other workers' shards of `out` are zeros here: the sum over the workers, in float64 (exact
// for every floating type, one term non-zero), is the whole value (a zero's sign aside).
Tensor Variable::sum_over_workers(const Tensor& out) const {
  std::vector<double> values(static_cast<std::size_t>(out.num_elements()));
  graph::dispatch<graph::FloatTypes>(dtype(), "read_value of a sharded variable", [&]<class T>() {
    const T* p = out.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(p[i]);
  });
  strategy_->sum_across_workers(values);
  Tensor whole = Tensor::empty(out.shape(), dtype());
  graph::dispatch<graph::FloatTypes>(dtype(), "read_value of a sharded variable", [&]<class T>() {
    T* p = whole.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return whole;
}

Tensor& Variable::value(int replica) {
  TANDEM_REQUIRE(replica >= 0 && replica < num_replicas(), InvalidArgument,
                 "variable \"{}\" has {} copies (it was created under {}), but replica {} uses it; create it under the "
                 "scope of the strategy that runs it",
                 name_, num_replicas(), strategy_->name(), replica);
  return copies_[static_cast<std::size_t>(replica)];
}

const Tensor& Variable::value(int replica) const { return const_cast<Variable*>(this)->value(replica); }

Tensor Variable::read_value() const {
  if (sharding_) {
    // Each local shard's elements, padding dropped, at their place in the flattened value (of its
    // piece, for a split variable): each element comes from one replica in sync (one shard of one
    // piece, or the leader of its data shard), so that the sum over the workers is the value.
    Tensor out = Tensor::zeros(global_shape(), dtype());
    std::map<int, Tensor> pieces;  // a split variable's pieces held here, by piece
    for (std::size_t r = 0; r < copies_.size(); ++r) {
      // A whole variable's shard is held by every replica of its data shard (along a
      // tensor-parallel axis): the one that leads it writes it.
      if (!tensor_split_ && !strategy_->leads_data_shard(static_cast<int>(r))) continue;
      const int s = strategy_->data_shard(static_cast<int>(r));
      const std::int64_t b = sharding_->begin(s), e = sharding_->end(s);
      Tensor target = out;
      if (tensor_split_) {
        const int p =
            tensor_split_
                ->piece_of_replica[static_cast<std::size_t>(strategy_->global_replica_index(static_cast<int>(r)))];
        if (p < 0) continue;  // holds none of it
        auto [it, fresh] = pieces.try_emplace(p);
        if (fresh) it->second = Tensor::zeros(piece_shape_, dtype());
        target = it->second;
      }
      if (e > b) flat_view(target, b, e - b).copy_from(flat_view(copies_[r], 0, e - b));
    }
    for (const auto& [p, piece] : pieces) tensor_split_->put_piece(piece, p, out);
    if (strategy_->num_workers() > 1) out = sum_over_workers(out);
    return out;
  }
  if (tensor_split_) {
    // A worker that holds every piece reads them here. Otherwise (some worker lacks a piece: the
    // same answer on every worker), each piece comes from the first replica in sync that holds
    // it, summed over the workers (every worker then reads in the same order).
    const TensorSplit& split = *tensor_split_;
    const auto& pieces = split.piece_of_replica;
    const auto local = static_cast<int>(copies_.size());
    const int first = strategy_->global_replica_index(0);
    bool every_worker_holds_all = true;
    for (std::size_t w = 0; w * static_cast<std::size_t>(local) < pieces.size(); ++w) {
      std::vector<bool> held(static_cast<std::size_t>(split.parts), false);
      for (int r = 0; r < local; ++r) {
        const int p = pieces[w * static_cast<std::size_t>(local) + static_cast<std::size_t>(r)];
        if (p >= 0) held[static_cast<std::size_t>(p)] = true;
      }
      every_worker_holds_all =
          every_worker_holds_all && std::all_of(held.begin(), held.end(), [](bool h) { return h; });
    }
    Tensor out = Tensor::zeros(split.global_shape, dtype());
    for (int p = 0; p < split.parts; ++p) {
      const auto begin = every_worker_holds_all ? pieces.begin() + first : pieces.begin();
      const auto holder = static_cast<int>(std::find(begin, pieces.end(), p) - pieces.begin());
      if (holder >= first && holder < first + local)
        split.put_piece(copies_[static_cast<std::size_t>(holder - first)], p, out);
    }
    if (!every_worker_holds_all) out = sum_over_workers(out);
    return out;
  }
  if (synchronization_ == VariableSynchronization::kOnRead && copies_.size() > 1 &&
      (aggregation_ == VariableAggregation::kSum || aggregation_ == VariableAggregation::kMean)) {
    return strategy_->reduce(aggregation_ == VariableAggregation::kSum ? ReduceOp::kSum : ReduceOp::kMean, copies_);
  }
  return copies_.front().to(devices::default_cpu_device()).clone();
}

void Variable::check_copies_equal() const {
  if (copies_.size() < 2 || synchronization_ == VariableSynchronization::kOnRead || sharding_) return;
  const int first_replica = strategy_->global_replica_index(0);
  const auto piece = [&](std::size_t r) {
    return tensor_split_ ? tensor_split_->piece_of_replica[static_cast<std::size_t>(first_replica) + r] : 0;
  };
  for (std::size_t r = 1; r < copies_.size(); ++r) {
    std::size_t q = 0;
    while (piece(q) != piece(r)) ++q;
    if (q == r) continue;  // the first copy of its piece
    const Tensor first = copies_[q].to(devices::default_cpu_device());
    const Tensor other = copies_[r].to(devices::default_cpu_device());
    const auto* a = static_cast<const unsigned char*>(first.raw_data());
    const auto* b = static_cast<const unsigned char*>(other.raw_data());
    const std::size_t element = graph::dtype_size(first.dtype());
    for (std::size_t i = 0; i < first.nbytes(); i += element) {
      if (std::memcmp(a + i, b + i, element) != 0) {
        throw FailedPrecondition(fmt::format(
            "mirrored variable \"{}\": the copies of replica {} ({}) and replica {} ({}) differ at element {}; every "
            "replica must apply the same updates",
            name_, q, copies_[q].device().short_name(), r, copies_[r].device().short_name(), i / element));
      }
    }
  }
}

void Variable::assign(const Tensor& value) {
  TANDEM_REQUIRE(value.defined() && value.dtype() == dtype() && value.shape() == global_shape(), InvalidArgument,
                 "assign to variable \"{}\": got {} {}; expected {} {}", name_,
                 value.defined() ? graph::dtype_name(value.dtype()) : "undefined",
                 value.defined() ? value.shape() : Shape{}, dtype(), global_shape());
  if (sharding_) {
    // Each local copy takes its shard's elements (of its piece, for a split variable); the
    // padding after them stays zero. Every worker holds the whole value: no communication.
    for (std::size_t r = 0; r < copies_.size(); ++r) {
      const int s = strategy_->data_shard(static_cast<int>(r));
      const std::int64_t b = sharding_->begin(s), e = sharding_->end(s);
      const int p =
          tensor_split_
              ? tensor_split_
                    ->piece_of_replica[static_cast<std::size_t>(strategy_->global_replica_index(static_cast<int>(r)))]
              : 0;
      if (p < 0) continue;  // holds none of it
      const Tensor source = tensor_split_ ? tensor_split_->piece(value, p) : value;
      Tensor& copy = copies_[r];
      copy.device().fill_zero(copy.raw_data(), copy.nbytes());
      if (e > b) flat_view(copy, 0, e - b).copy_from(flat_view(source, b, e - b));
    }
    return;
  }
  if (tensor_split_) {
    const int first = strategy_->global_replica_index(0);
    for (std::size_t r = 0; r < copies_.size(); ++r) {
      if (tensor_split_->piece_of_replica[static_cast<std::size_t>(first) + r] < 0) continue;  // holds nothing
      copies_[r].copy_from(
          tensor_split_->piece(value, tensor_split_->piece_of_replica[static_cast<std::size_t>(first) + r]));
    }
    return;
  }
  if (synchronization_ == VariableSynchronization::kOnRead && aggregation_ == VariableAggregation::kSum &&
      copies_.size() > 1) {
    Tensor divided = value.to(devices::default_cpu_device()).clone();
    graph::dispatch<graph::NumericTypes>(dtype(), "assign to an on-read SUM variable", [&]<class T>() {
      T* data = divided.data<T>();
      for (std::int64_t i = 0; i < divided.num_elements(); ++i)
        data[i] = static_cast<T>(data[i] / static_cast<T>(copies_.size()));
    });
    for (auto& copy : copies_) copy.copy_from(divided);
    return;
  }
  for (auto& copy : copies_) copy.copy_from(value);
}

void Variable::assign_per_replica(const std::vector<Tensor>& per_replica) {
  TANDEM_REQUIRE(!sharding_ && !tensor_split_, FailedPrecondition,
                 "variable \"{}\" is {} (each replica holds another part of it); set it with assign(), not from "
                 "per-replica values",
                 name_, sharding_ ? "sharded" : "split by tensor parallelism");
  TANDEM_REQUIRE(per_replica.size() == copies_.size(), InvalidArgument,
                 "variable \"{}\" has {} copies; got {} per-replica values", name_, copies_.size(), per_replica.size());
  for (std::size_t r = 0; r < per_replica.size(); ++r) {
    TANDEM_REQUIRE(per_replica[r].defined() && per_replica[r].dtype() == dtype() && per_replica[r].shape() == shape(),
                   InvalidArgument, "variable \"{}\": replica {}'s value is {} {}; expected {} {}", name_, r,
                   per_replica[r].defined() ? graph::dtype_name(per_replica[r].dtype()) : "undefined",
                   per_replica[r].defined() ? per_replica[r].shape() : Shape{}, dtype(), shape());
  }
  if (synchronization_ == VariableSynchronization::kOnRead) {
    for (std::size_t r = 0; r < copies_.size(); ++r) copies_[r].copy_from(per_replica[r]);
    return;
  }
  Tensor value;
  switch (aggregation_) {
    case VariableAggregation::kNone:
      TANDEM_REQUIRE(copies_.size() == 1, FailedPrecondition,
                     "mirrored variable \"{}\" was updated by {} replicas but has aggregation NONE: create it with "
                     "aggregation SUM, MEAN or ONLY_FIRST_REPLICA to say how the updates combine",
                     name_, copies_.size());
      value = per_replica.front();
      break;
    case VariableAggregation::kSum: value = reduce_on_host(ReduceOp::kSum, per_replica, name_); break;
    case VariableAggregation::kMean: value = reduce_on_host(ReduceOp::kMean, per_replica, name_); break;
    case VariableAggregation::kOnlyFirstReplica: value = per_replica.front(); break;
  }
  for (auto& copy : copies_) copy.copy_from(value);
}

}  // namespace tandem::strategy
