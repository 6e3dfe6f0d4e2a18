// tandem/keras_like/sharded_checkpoint.cc — checkpoint directories: writing them across workers,
// reading the byte ranges each replica needs, consolidating them into one file
// (sharded_checkpoint.h describes the format; checkpoint_index.cc reads and writes its index).
#include "tandem/keras_like/sharded_checkpoint.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <random>
#include <set>
#include <system_error>

#include "tandem/base/detail/atomic_file.h"
#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "tandem/keras_like/detail/checkpoints.h"
#include "tandem/keras_like/detail/safetensors_io.h"
#include "tandem/keras_like/model.h"
#include "tandem/strategy/strategy.h"
#include "tandem/strategy/variable.h"

namespace tandem::keras {
namespace {

namespace fs = std::filesystem;
using strategy::Strategy;
using strategy::Variable;

// The index is read whole: a bigger one is corrupt (a model with a million tensors of a thousand
// chunks each takes a few hundred megabytes).
constexpr std::uint64_t kMaxIndexBytes = std::uint64_t{1} << 30;
// A save killed part-way leaves its hidden directory behind; the next save of the same checkpoint
// removes those not written for this long (a live save writes its files far more often).
constexpr auto kStaleSaveIdle = std::chrono::minutes(10);

std::string system_reason(int error) { return std::system_category().message(error); }

// "run/ckpt/" and "run/ckpt" name the same directory.
fs::path directory_path(const std::string& path) {
  fs::path p(path);
  if (p.has_filename()) return p;
  return p.parent_path();
}

std::string rank_file_name(int rank, int workers) {
  return fmt::format("rank-{:05d}-of-{:05d}.safetensors", rank, workers);
}

std::string chunk_key(const std::string& name, std::int64_t begin, std::int64_t end) {
  return fmt::format("{}[{}:{}]", name, begin, end);
}

// CRC-32 of each block of `bytes` (the last one shorter).
std::vector<std::uint32_t> block_checksums(const unsigned char* data, std::uint64_t bytes, std::uint64_t block) {
  std::vector<std::uint32_t> out;
  for (std::uint64_t at = 0; at < bytes; at += block) {
    out.push_back(detail::crc32_update(detail::crc32_initial(), data + at, std::min(block, bytes - at)));
  }
  return out;
}

// The first `elements` of a tensor, on the host (a shard without its padding).
Tensor host_prefix(const Tensor& tensor, std::int64_t elements) {
  return strategy::flat_view(tensor, 0, elements).to(devices::default_cpu_device()).clone();
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Removes the hidden directories that killed saves of `target` left (.NAME.tmp-*), once idle.
// Best effort, like the atomic writer's cleanup of its temporary files.
void remove_stale_saves(const fs::path& parent, const std::string& name) {
  const std::string prefix = fmt::format(".{}.tmp-", name);
  const auto now = fs::file_time_type::clock::now();
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->path().filename().string().starts_with(prefix) || !it->is_directory(ec)) continue;
    auto newest = fs::last_write_time(it->path(), ec);
    for (fs::directory_iterator f(it->path(), ec), fend; !ec && f != fend; f.increment(ec)) {
      newest = std::max(newest, fs::last_write_time(f->path(), ec));
    }
    if (ec || now - newest < kStaleSaveIdle) continue;
    fs::remove_all(it->path(), ec);
    logging::debug("removed {}, a checkpoint directory a killed save left", it->path().string());
  }
}

// A save replaces a checkpoint of the same name (a directory with an index, or a file: an older
// single-file checkpoint) or an empty folder, never a folder of other things the path happens to
// name: those would be deleted with the old checkpoint.
void check_replaceable(const fs::path& target) {
  std::error_code ec;
  if (!fs::is_directory(target, ec) || fs::exists(target / kCheckpointIndexName, ec) || fs::is_empty(target, ec)) {
    return;
  }
  throw AlreadyExists(fmt::format(
      "cannot save a checkpoint as \"{}\": it is a folder that holds other things than a checkpoint (no {}); "
      "name a new or empty folder, or a checkpoint to replace",
      target.string(), kCheckpointIndexName));
}

// Puts the complete directory `temp` in place of `target`: an exchange of the two names when the
// file system supports it (the old checkpoint stays whole under the name until the new one is),
// else two renames; then the old one goes.
void swap_into_place(const fs::path& temp, const fs::path& target) {
  const auto fail = [&](int error) {
    throw Unavailable(fmt::format("cannot put checkpoint \"{}\" in place: {}", target.string(), system_reason(error)));
  };
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(target, ec))) {
    if (::rename(temp.c_str(), target.c_str()) != 0) fail(errno);
  } else if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(temp, ec);  // now the old checkpoint
  } else {
    if (errno != EINVAL && errno != ENOSYS) fail(errno);
    const fs::path old = temp.string() + ".old";
    if (::rename(target.c_str(), old.c_str()) != 0) fail(errno);
    if (::rename(temp.c_str(), target.c_str()) != 0) fail(errno);
    fs::remove_all(old, ec);
  }
  sync_directory(target.parent_path().empty() ? fs::path(".") : target.parent_path());
}

// One chunk a worker wrote, as the workers tell the chief (numbers exact in a double below 2^53):
// tensor index, begin, end, byte offset, checksum count, checksums.
void append_record(std::vector<double>& record, std::size_t tensor, const CheckpointChunk& chunk) {
  record.insert(record.end(),
                {static_cast<double>(tensor), static_cast<double>(chunk.begin), static_cast<double>(chunk.end),
                 static_cast<double>(chunk.byte_offset), static_cast<double>(chunk.crc32.size())});
  for (const auto crc : chunk.crc32) record.push_back(crc);
}

// Every worker's records, on every worker (two sums across the workers: the lengths, then the
// records each in its place).
std::vector<std::vector<double>> gather_records(Strategy& strategy, const std::vector<double>& mine) {
  const int workers = strategy.num_workers();
  const int rank = strategy.worker_rank();
  std::vector<double> lengths(static_cast<std::size_t>(workers), 0.0);
  lengths[static_cast<std::size_t>(rank)] = static_cast<double>(mine.size());
  strategy.sum_across_workers(lengths);
  std::vector<std::size_t> starts{0};
  for (const double n : lengths) starts.push_back(starts.back() + static_cast<std::size_t>(n));
  std::vector<double> all(starts.back(), 0.0);
  std::copy(mine.begin(), mine.end(),
            all.begin() + static_cast<std::ptrdiff_t>(starts[static_cast<std::size_t>(rank)]));
  strategy.sum_across_workers(all);
  std::vector<std::vector<double>> out;
  for (int w = 0; w < workers; ++w) {
    out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(starts[static_cast<std::size_t>(w)]),
                     all.begin() + static_cast<std::ptrdiff_t>(starts[static_cast<std::size_t>(w) + 1]));
  }
  return out;
}

// The index of what every worker wrote.
CheckpointIndex build_index(const Strategy& strategy, const CheckpointContents& contents,
                            const std::vector<std::vector<double>>& records) {
  CheckpointIndex index;
  index.num_shards = strategy.data_shards_in_sync();  // ZeRO's shard count
  index.num_workers = strategy.num_workers();
  index.metadata = contents.metadata;
  for (int w = 0; w < index.num_workers; ++w) index.files.push_back(rank_file_name(w, index.num_workers));
  for (const auto& [name, variable] : contents.variables) {
    // Flat shards of the whole value; ZeRO's shards of tensor-parallel pieces are written whole.
    const int num_shards = variable->sharding() && !variable->tensor_split() ? variable->sharding()->num_shards : 0;
    index.tensors.push_back({.name = name,
                             .dtype = variable->dtype(),
                             .shape = variable->global_shape(),
                             .num_shards = num_shards,
                             .split = {},
                             .chunks = {}});
    if (const auto& split = variable->tensor_split(); split && !variable->sharding()) {
      index.tensors.back().split = CheckpointSplit{.dim = split->dim, .parts = split->parts, .axis = split->axis};
    }
  }
  for (const auto& [name, value] : contents.values) {
    index.tensors.push_back(
        {.name = name, .dtype = value.dtype(), .shape = value.shape(), .num_shards = 0, .split = {}, .chunks = {}});
  }
  for (const auto& [name, spec] : contents.block_tensors) {
    index.tensors.push_back(
        {.name = name, .dtype = spec.dtype, .shape = spec.shape, .num_shards = 0, .split = {}, .chunks = {}});
  }
  for (std::size_t w = 0; w < records.size(); ++w) {
    const auto& r = records[w];
    for (std::size_t at = 0; at < r.size();) {
      TANDEM_REQUIRE(r[at] < static_cast<double>(index.tensors.size()), InvalidArgument,
                     "save checkpoint: worker {} saved more tensors than the chief ({}); every worker must save the "
                     "same contents",
                     w, index.tensors.size());
      auto& tensor = index.tensors[static_cast<std::size_t>(r[at])];
      CheckpointChunk chunk{.file = index.files[w],
                            .key = "",
                            .begin = static_cast<std::int64_t>(r[at + 1]),
                            .end = static_cast<std::int64_t>(r[at + 2]),
                            .byte_offset = static_cast<std::uint64_t>(r[at + 3]),
                            .byte_length = 0,
                            .crc32 = {}};
      chunk.key = chunk_key(tensor.name, chunk.begin, chunk.end);
      chunk.byte_length = static_cast<std::uint64_t>(chunk.end - chunk.begin) * graph::dtype_size(tensor.dtype);
      const auto count = static_cast<std::size_t>(r[at + 4]);
      for (std::size_t i = 0; i < count; ++i) chunk.crc32.push_back(static_cast<std::uint32_t>(r[at + 5 + i]));
      at += 5 + count;
      tensor.chunks.push_back(std::move(chunk));
    }
  }
  for (auto& t : index.tensors) {
    std::sort(t.chunks.begin(), t.chunks.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  }
  return index;
}

// The global replica that writes piece `p` of a split variable: the first that holds it.
int first_holder(const strategy::TensorSplit& split, int p) {
  const auto it = std::find(split.piece_of_replica.begin(), split.piece_of_replica.end(), p);
  return static_cast<int>(it - split.piece_of_replica.begin());
}

// This worker's file: its shards of the sharded variables, and (the chief) every whole value.
// Returns the records of its chunks.
std::vector<double> write_worker_file(const Strategy& strategy, const fs::path& file,
                                      const CheckpointContents& contents) {
  const bool chief = strategy.worker_rank() == 0;
  struct Pending {
    std::size_t tensor;
    std::int64_t begin, end;
  };
  std::vector<Pending> pending;
  NamedTensors tensors;
  const auto add = [&](std::size_t tensor, const std::string& name, std::int64_t begin, Tensor value) {
    const std::int64_t end = begin + value.num_elements();
    if (end == begin) return;  // nothing to write: an empty tensor, or a shard of padding only
    pending.push_back({tensor, begin, end});
    tensors.emplace_back(chunk_key(name, begin, end), std::move(value));
  };
  // A block of tensor `tensor` (whole: `spec`) at `offsets`: one chunk per contiguous run of its
  // elements in the whole tensor (one for a split along the first dimension; one per row of a
  // column split), so that readers of flat chunks read it as they read everything else.
  const auto add_block = [&](std::size_t tensor, const std::string& name, const graph::TensorSpec& spec,
                             const std::vector<std::int64_t>& offsets, const Tensor& value) {
    const Shape& whole = spec.shape;
    const Tensor piece = value.to(devices::default_cpu_device());
    const Shape& p = piece.shape();
    const int rank = whole.rank();
    TANDEM_REQUIRE(piece.dtype() == spec.dtype && p.rank() == rank && static_cast<int>(offsets.size()) == rank,
                   InvalidArgument, "save checkpoint: a block of \"{}\" is {} {} at [{}]; the tensor is {} {}", name,
                   graph::dtype_name(piece.dtype()), p, fmt::join(offsets, ", "), graph::dtype_name(spec.dtype), whole);
    for (int d = 0; d < rank; ++d) {
      const auto o = offsets[static_cast<std::size_t>(d)];
      TANDEM_REQUIRE(o >= 0 && o + p[d] <= whole[d], InvalidArgument,
                     "save checkpoint: a block of \"{}\" of shape {} at [{}] reaches past the tensor's shape {}", name,
                     p, fmt::join(offsets, ", "), whole);
    }
    // Dimensions from `k` on are contiguous in the whole tensor: every later one is whole.
    int k = rank - 1;
    while (k > 0 && p[k] == whole[k]) --k;
    std::vector<std::int64_t> stride(static_cast<std::size_t>(std::max(rank, 1)), 1);
    for (int d = rank - 2; d >= 0; --d)
      stride[static_cast<std::size_t>(d)] = stride[static_cast<std::size_t>(d) + 1] * whole[d + 1];
    const std::int64_t run = rank == 0 ? 1 : p[k] * stride[static_cast<std::size_t>(k)];
    const std::int64_t runs = run == 0 ? 0 : piece.num_elements() / run;
    for (std::int64_t r = 0; r < runs; ++r) {
      // The run's position: r counts the piece's indices over dimensions [0, k) row-major.
      std::int64_t begin = rank == 0 ? 0 : offsets[static_cast<std::size_t>(k)] * stride[static_cast<std::size_t>(k)];
      std::int64_t rest = r;
      for (int d = k - 1; d >= 0; --d) {
        begin += (offsets[static_cast<std::size_t>(d)] + rest % p[d]) * stride[static_cast<std::size_t>(d)];
        rest /= p[d];
      }
      add(tensor, name, begin, strategy::flat_view(piece, r * run, run).clone());
    }
  };
  for (std::size_t i = 0; i < contents.variables.size(); ++i) {
    const auto& [name, variable] = contents.variables[i];
    const auto& spec = variable->sharding();
    if (const auto& split = variable->tensor_split(); split && !spec) {
      // ModelParallel's pieces (and a pipeline stage's weights): each written by the worker of
      // the first replica that holds it, so that every worker writes what it holds and no piece
      // twice (a piece held along a batch axis is held by several replicas).
      const graph::TensorSpec whole{.dtype = variable->dtype(), .shape = split->global_shape};
      for (int r = 0; r < variable->num_replicas(); ++r) {
        const int g = strategy.global_replica_index(r);
        const int p = split->piece_of_replica[static_cast<std::size_t>(g)];
        if (p < 0 || first_holder(*split, p) != g) continue;
        std::vector<std::int64_t> offsets(static_cast<std::size_t>(whole.shape.rank()), 0);
        if (split->parts > 1) offsets[static_cast<std::size_t>(split->dim)] = p * split->piece_shape()[split->dim];
        add_block(i, name, whole, offsets, variable->value(r));
      }
      continue;
    }
    if (!spec || variable->tensor_split()) {
      // Written whole by the chief. ZeRO's shards of split pieces are gathered by every worker
      // (read_value sums over the workers).
      if (chief || spec) {
        const Tensor whole = variable->read_value();
        if (chief) add(i, name, 0, whole.reshape({variable->global_shape().num_elements()}));
      }
      continue;
    }
    // Shard s is the data-parallel shard s (Strategy::data_shard; ShardSpec), written by the
    // replica that leads it (several hold it along a tensor-parallel axis).
    for (int r = 0; r < variable->num_replicas(); ++r) {
      if (!strategy.leads_data_shard(r)) continue;
      const int s = strategy.data_shard(r);
      add(i, name, spec->begin(s), host_prefix(variable->value(r), spec->end(s) - spec->begin(s)));
    }
  }
  if (chief) {
    for (std::size_t i = 0; i < contents.values.size(); ++i) {
      const auto& [name, value] = contents.values[i];
      add(contents.variables.size() + i, name, 0,
          value.to(devices::default_cpu_device()).reshape({value.shape().num_elements()}));
    }
  }
  // Blocks: one chunk per contiguous run of the piece's elements in the whole tensor.
  const std::size_t first_block_tensor = contents.variables.size() + contents.values.size();
  for (const auto& block : contents.blocks) {
    const auto it = std::find_if(contents.block_tensors.begin(), contents.block_tensors.end(),
                                 [&](const auto& t) { return t.first == block.name; });
    TANDEM_REQUIRE(it != contents.block_tensors.end(), InvalidArgument,
                   "save checkpoint: a block of \"{}\", which block_tensors does not list", block.name);
    add_block(first_block_tensor + static_cast<std::size_t>(it - contents.block_tensors.begin()), block.name,
              it->second, block.offsets, block.piece);
  }
  const std::uint64_t data_start = write_safetensors(file.string(), tensors, {{"format", "tandem.checkpoint_shard"}});
  std::vector<double> record;
  std::uint64_t offset = data_start;
  for (std::size_t k = 0; k < pending.size(); ++k) {
    const Tensor& t = tensors[k].second;
    const std::uint64_t bytes = t.nbytes();
    const CheckpointChunk chunk{
        .file = "",
        .key = "",
        .begin = pending[k].begin,
        .end = pending[k].end,
        .byte_offset = offset,
        .byte_length = bytes,
        .crc32 = block_checksums(static_cast<const unsigned char*>(t.raw_data()), bytes, kChecksumBlockBytes)};
    append_record(record, pending[k].tensor, chunk);
    offset += bytes;
  }
  return record;
}

}  // namespace

// ----- writing -----------------------------------------------------------------------------------

bool is_checkpoint_directory(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(directory_path(path), ec);
}

void save_checkpoint_directory(Strategy& strategy, const std::string& path, const CheckpointContents& contents) {
  const fs::path target = directory_path(path);
  TANDEM_REQUIRE(!target.empty(), InvalidArgument, "save checkpoint: the path \"{}\" names no directory", path);
  std::set<std::string> names;
  for (const auto& [name, variable] : contents.variables) {
    TANDEM_REQUIRE(names.insert(name).second, InvalidArgument, "checkpoint \"{}\": two tensors are named \"{}\"", path,
                   name);
  }
  for (const auto& [name, value] : contents.values) {
    TANDEM_REQUIRE(names.insert(name).second, InvalidArgument, "checkpoint \"{}\": two tensors are named \"{}\"", path,
                   name);
  }
  for (const auto& [name, spec] : contents.block_tensors) {
    TANDEM_REQUIRE(names.insert(name).second, InvalidArgument, "checkpoint \"{}\": two tensors are named \"{}\"", path,
                   name);
  }
  const bool chief = strategy.worker_rank() == 0;
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string name = target.filename().string();
  // The hidden directory every worker writes into: its name drawn by the chief.
  std::vector<Tensor> nonce{Tensor::zeros({1}, DType::kI64)};
  if (chief) {
    std::random_device device;
    nonce[0].data<std::int64_t>()[0] =
        static_cast<std::int64_t>((static_cast<std::uint64_t>(device()) << 31) ^ device()) & 0xffffffffffff;
  }
  strategy.broadcast_from_chief(nonce);
  const fs::path temp = parent / fmt::format(".{}.tmp-{:012x}", name, nonce[0].data<std::int64_t>()[0]);

  const auto what = fmt::format("save checkpoint \"{}\"", target.string());
  // A failed save leaves no hidden directory behind (every worker is done with it by then).
  const auto agree_or_clean_up = [&](const std::function<void()>& body) {
    try {
      detail::agree_on_outcome(strategy, what, body);
    } catch (...) {
      std::error_code ec;
      if (chief) fs::remove_all(temp, ec);
      throw;
    }
  };
  std::vector<double> record;
  agree_or_clean_up([&] {
    if (chief) {
      check_replaceable(target);
      remove_stale_saves(parent, name);
    }
    std::error_code ec;
    fs::create_directories(temp, ec);
    TANDEM_REQUIRE(!ec, Unavailable, "cannot create \"{}\": {}", temp.string(), ec.message());
    record =
        write_worker_file(strategy, temp / rank_file_name(strategy.worker_rank(), strategy.num_workers()), contents);
  });
  const auto records = gather_records(strategy, record);
  agree_or_clean_up([&] {
    if (!chief) return;
    const std::string text = checkpoint_index_json(build_index(strategy, contents, records));
    // What a reader will check, checked before the checkpoint exists: workers whose shards do not
    // tile a tensor (different contents or shard specs) fail the save, not a later load.
    try {
      parse_checkpoint_index(text, (target / kCheckpointIndexName).string());
    } catch (const DataLoss& e) {
      throw InvalidArgument(fmt::format("the workers' chunks do not make a checkpoint: {}", e.what()));
    }
    tandem::detail::AtomicFile index((temp / kCheckpointIndexName).string());
    index.write(text.data(), text.size());
    index.commit();  // syncs the file and the directory: every worker's file synced before it
    swap_into_place(temp, target);
  });
}

// ----- reading -----------------------------------------------------------------------------------

struct CheckpointReader::Source {
  std::string path;
  bool directory = false;
  std::map<std::string, std::string> metadata;
  std::vector<std::pair<std::string, graph::TensorSpec>> specs;
  std::map<std::string, Tensor> whole;  // a single file's tensors
  CheckpointIndex index;                // a directory's
  mutable std::map<std::string, std::unique_ptr<detail::ReadFile>> files;

  // The chunk file, opened once; a missing or short one is DataLoss naming it and the tensor.
  const detail::ReadFile& file(const CheckpointChunk& chunk, const std::string& tensor) const {
    auto& slot = files[chunk.file];
    const std::string file_path = (fs::path(path) / chunk.file).string();
    if (!slot) {
      try {
        slot = std::make_unique<detail::ReadFile>(file_path);
      } catch (const NotFound&) {
        throw DataLoss(
            fmt::format("checkpoint \"{}\": tensor \"{}\": its chunk file \"{}\" is missing", path, tensor, file_path));
      }
    }
    if (slot->size() < chunk.byte_offset + chunk.byte_length) {
      throw DataLoss(fmt::format(
          "checkpoint \"{}\": tensor \"{}\": chunk [{}, {}) ends at byte {} of \"{}\", which holds {} bytes "
          "(truncated)",
          path, tensor, chunk.begin, chunk.end, chunk.byte_offset + chunk.byte_length, file_path, slot->size()));
    }
    return *slot;
  }

  // Elements [begin, end) of the chunk into `out`, reading and verifying whole checksum blocks.
  void read_chunk(const CheckpointTensorInfo& tensor, const CheckpointChunk& chunk, std::int64_t begin,
                  std::int64_t end, unsigned char* out) const {
    const std::uint64_t element = graph::dtype_size(tensor.dtype);
    const std::uint64_t lo = static_cast<std::uint64_t>(begin - chunk.begin) * element;
    const std::uint64_t hi = static_cast<std::uint64_t>(end - chunk.begin) * element;
    const std::uint64_t block = index.checksum_block_bytes;
    const std::uint64_t first = lo / block, last = (hi - 1) / block;
    const std::uint64_t from = first * block, to = std::min((last + 1) * block, chunk.byte_length);
    std::vector<unsigned char> bytes(static_cast<std::size_t>(to - from));
    const auto& f = file(chunk, tensor.name);
    try {
      f.read(bytes.data(), bytes.size(), chunk.byte_offset + from);
    } catch (const DataLoss& e) {
      throw DataLoss(fmt::format("checkpoint \"{}\": tensor \"{}\": {}", path, tensor.name, e.what()));
    }
    for (std::uint64_t b = first; b <= last; ++b) {
      const std::uint64_t at = b * block - from;
      const std::uint64_t n = std::min(block, chunk.byte_length - b * block);
      const std::uint32_t crc = detail::crc32_update(detail::crc32_initial(), bytes.data() + at, n);
      if (crc != chunk.crc32[b]) {
        throw DataLoss(fmt::format(
            "checkpoint \"{}\": tensor \"{}\": checksum mismatch in \"{}\" (chunk [{}, {}), bytes [{}, {}) of the "
            "file): the index says {:08x}, the data hashes to {:08x} (the file is corrupt)",
            path, tensor.name, (fs::path(path) / chunk.file).string(), chunk.begin, chunk.end,
            chunk.byte_offset + b * block, chunk.byte_offset + b * block + n, chunk.crc32[b], crc));
      }
    }
    std::memcpy(out, bytes.data() + (lo - from), static_cast<std::size_t>(hi - lo));
  }
};

CheckpointReader::CheckpointReader(const std::string& path) : source_(std::make_unique<Source>()) {
  Source& s = *source_;
  s.path = path;
  std::error_code ec;
  if (!is_checkpoint_directory(path)) {
    // One safetensors file, read and checked whole.
    auto content = read_safetensors(path);
    s.metadata = std::move(content.metadata);
    for (auto& [name, tensor] : content.tensors) {
      s.specs.emplace_back(name, graph::TensorSpec{.dtype = tensor.dtype(), .shape = tensor.shape()});
      s.whole.emplace(name, std::move(tensor));
    }
    return;
  }
  s.directory = true;
  s.path = directory_path(path).string();
  const std::string index_path = (fs::path(s.path) / kCheckpointIndexName).string();
  std::unique_ptr<detail::ReadFile> file;
  try {
    file = std::make_unique<detail::ReadFile>(index_path);
  } catch (const NotFound&) {
    throw DataLoss(fmt::format(
        "checkpoint directory \"{}\" has no {}: the save that made it never finished (a crash?); it cannot be loaded",
        s.path, kCheckpointIndexName));
  }
  if (file->size() > kMaxIndexBytes) {
    throw DataLoss(fmt::format("checkpoint index \"{}\" holds {} bytes, over the limit of {}", index_path, file->size(),
                               kMaxIndexBytes));
  }
  std::string text(static_cast<std::size_t>(file->size()), '\0');
  file->read(text.data(), text.size(), 0);
  s.index = parse_checkpoint_index(text, index_path);
  s.metadata = s.index.metadata;
  for (const auto& t : s.index.tensors)
    s.specs.emplace_back(t.name, graph::TensorSpec{.dtype = t.dtype, .shape = t.shape});
}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;

const std::string& CheckpointReader::path() const { return source_->path; }
bool CheckpointReader::is_directory() const { return source_->directory; }
const std::map<std::string, std::string>& CheckpointReader::metadata() const { return source_->metadata; }
const std::vector<std::pair<std::string, graph::TensorSpec>>& CheckpointReader::tensors() const {
  return source_->specs;
}

Tensor CheckpointReader::read_range(const std::string& name, std::int64_t begin, std::int64_t end) const {
  const Source& s = *source_;
  const auto spec = std::find_if(s.specs.begin(), s.specs.end(), [&](const auto& e) { return e.first == name; });
  TANDEM_REQUIRE(spec != s.specs.end(), NotFound, "checkpoint \"{}\" has no tensor \"{}\"", s.path, name);
  const std::int64_t elements = spec->second.shape.num_elements();
  TANDEM_REQUIRE(0 <= begin && begin <= end && end <= elements, InvalidArgument,
                 "checkpoint \"{}\": tensor \"{}\" has {} elements; elements [{}, {}) asked for", s.path, name,
                 elements, begin, end);
  Tensor out = Tensor::empty({end - begin}, spec->second.dtype);
  auto* dst = static_cast<unsigned char*>(out.raw_data());
  const std::size_t element = graph::dtype_size(spec->second.dtype);
  if (!s.directory) {
    const auto* src = static_cast<const unsigned char*>(s.whole.at(name).raw_data());
    if (end > begin) std::memcpy(dst, src + begin * static_cast<std::int64_t>(element), out.nbytes());
    return out;
  }
  const CheckpointTensorInfo& info = *s.index.find(name);
  for (const auto& chunk : info.chunks) {
    const std::int64_t lo = std::max(begin, chunk.begin), hi = std::min(end, chunk.end);
    if (lo < hi) s.read_chunk(info, chunk, lo, hi, dst + (lo - begin) * static_cast<std::int64_t>(element));
  }
  return out;
}

Tensor CheckpointReader::read(const std::string& name) const {
  const auto spec =
      std::find_if(source_->specs.begin(), source_->specs.end(), [&](const auto& e) { return e.first == name; });
  TANDEM_REQUIRE(spec != source_->specs.end(), NotFound, "checkpoint \"{}\" has no tensor \"{}\"", source_->path, name);
  return read_range(name, 0, spec->second.shape.num_elements()).reshape(spec->second.shape);
}

std::vector<Tensor> CheckpointReader::read_for(const std::string& name, const Variable& variable) const {
  const auto& spec = variable.sharding();
  if (!spec || variable.tensor_split()) return {read(name)};  // assign cuts a split one's shards
  std::vector<Tensor> out;
  for (int r = 0; r < variable.num_replicas(); ++r) {
    const int s = variable.strategy().data_shard(r);
    Tensor shard = Tensor::zeros({spec->shard_elements}, variable.dtype());
    const Tensor part = read_range(name, spec->begin(s), spec->end(s));
    if (part.nbytes() > 0) std::memcpy(shard.raw_data(), part.raw_data(), part.nbytes());
    out.push_back(std::move(shard));
  }
  return out;
}

void assign_checkpoint_value(Variable& variable, const std::vector<Tensor>& values) {
  if (!variable.sharding() || variable.tensor_split()) {
    variable.assign(values.at(0));
    return;
  }
  TANDEM_ASSERT(values.size() == static_cast<std::size_t>(variable.num_replicas()), "{} shards for {} copies of {}",
                values.size(), variable.num_replicas(), variable.name());
  for (int r = 0; r < variable.num_replicas(); ++r) variable.value(r).copy_from(values[static_cast<std::size_t>(r)]);
}

void consolidate(const std::string& dir, const std::string& out) {
  TANDEM_REQUIRE(is_checkpoint_directory(dir), InvalidArgument,
                 "consolidate: \"{}\" is not a checkpoint directory (a single-file checkpoint is already whole)", dir);
  const CheckpointReader reader(dir);
  NamedTensors tensors;
  for (const auto& [name, spec] : reader.tensors()) tensors.emplace_back(name, reader.read(name));
  write_safetensors(out, tensors, reader.metadata());
}

// ----- detail/checkpoints.h ---------------------------------------------------------------------

namespace detail {

void agree_on_outcome(Strategy& strategy, std::string_view what, const std::function<void()>& body) {
  const int workers = strategy.num_workers();
  if (workers == 1) {
    body();
    return;
  }
  std::exception_ptr error;
  bool data_loss = false;
  try {
    body();
  } catch (const DataLoss&) {
    error = std::current_exception();
    data_loss = true;
  } catch (...) {
    error = std::current_exception();
  }
  // Slot w: worker w failed; slot workers + w: with DataLoss.
  std::vector<double> failed(2 * static_cast<std::size_t>(workers), 0.0);
  const auto rank = static_cast<std::size_t>(strategy.worker_rank());
  failed[rank] = error ? 1.0 : 0.0;
  failed[static_cast<std::size_t>(workers) + rank] = data_loss ? 1.0 : 0.0;
  strategy.sum_across_workers(failed);
  if (error) std::rethrow_exception(error);
  std::string who;
  bool all_data_loss = true;
  for (int w = 0; w < workers; ++w) {
    if (failed[static_cast<std::size_t>(w)] == 0.0) continue;
    who += fmt::format("{}{}", who.empty() ? "" : ", ", w);
    all_data_loss = all_data_loss && failed[static_cast<std::size_t>(workers + w)] != 0.0;
  }
  if (who.empty()) return;
  const auto message = fmt::format("{}: worker {} failed (its error says why); nothing was changed", what, who);
  if (all_data_loss) throw DataLoss(message);
  throw Unavailable(message);
}

bool shards_state(const Model& model) {
  if (model.distribute_strategy().distribution_options().zero != strategy::ZeroStage::k0) return true;
  for (const auto& w : model.weights()) {
    if (w->sharding()) return true;
  }
  if (!model.compiled()) return false;
  for (const auto& [name, slot] : model.optimizer().slots()) {
    if (slot->sharding()) return true;
  }
  return false;
}

bool writes_directory(const Model& model, const std::string& path, bool with_optimizer) {
  if (path.ends_with('/') || is_checkpoint_directory(path)) return true;
  // ZeRO's shards, and across workers ModelParallel's pieces and stages: every worker takes part.
  const bool workers = model.distribute_strategy().num_workers() > 1;
  const auto split = [&](const Variable& v) { return v.sharding() || (workers && v.tensor_split()); };
  for (const auto& w : model.weights()) {
    if (split(*w)) return true;
  }
  if (!with_optimizer) return false;
  for (const auto& [name, slot] : model.optimizer().slots()) {
    if (split(*slot)) return true;
  }
  return false;
}

}  // namespace detail

}  // namespace tandem::keras
