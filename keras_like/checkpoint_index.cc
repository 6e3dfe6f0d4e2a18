// tandem/keras_like/checkpoint_index.cc — a sharded checkpoint's index.json: parse_checkpoint_index
// and checkpoint_index_json (sharded_checkpoint.h describes the format). The index is input from
// outside, read under the same rules as a safetensors header (safetensors.cc): every number is
// checked before it sizes anything, nesting is limited, and messages quote the file short. This
// file needs only graph/ and base/ (and the dtype names of safetensors.cc), so that the fuzzing
// harness (tests/fuzz/checkpoint_index_fuzzer.cc) builds it without the rest of keras_like.
#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "tandem/base/detail/json.h"
#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"
#include "tandem/keras_like/detail/safetensors_io.h"
#include "tandem/keras_like/sharded_checkpoint.h"

namespace tandem::keras {
namespace {

using Json = nlohmann::ordered_json;  // keeps the tensors in the order written
using tandem::detail::quote_value;

constexpr auto kMaxInt64 = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
// More shards or workers than any job has is a corrupt number, not a job.
constexpr std::uint64_t kMaxCount = std::uint64_t{1} << 24;

std::string show(const Json& value) { return tandem::detail::json_for_message(value); }

// The errors of one index: every message starts with the path (and the tensor, when there is one).
class Problems {
 public:
  explicit Problems(const std::string& path) : path_(path) {}
  [[noreturn]] void fail(const std::string& what) const {
    throw DataLoss(fmt::format("checkpoint index \"{}\": {}", path_, what));
  }
  [[noreturn]] void fail(const std::string& tensor, const std::string& what) const {
    fail(fmt::format("tensor {}: {}", quote_value(tensor), what));
  }

 private:
  const std::string& path_;
};

const Json& member(const Json& object, std::string_view key, const Problems& problems, std::string_view where) {
  const auto it = object.find(key);
  if (it == object.end()) problems.fail(fmt::format("{} has no \"{}\"", where, key));
  return *it;
}

std::uint64_t unsigned_number(const Json& value, std::uint64_t max, const Problems& problems, std::string_view what) {
  if (!value.is_number_unsigned() || value.get<std::uint64_t>() > max) {
    problems.fail(fmt::format("{} is {}; expected an integer from 0 to {}", what, show(value), max));
  }
  return value.get<std::uint64_t>();
}

const std::string& string_value(const Json& value, const Problems& problems, std::string_view what) {
  if (!value.is_string()) problems.fail(fmt::format("{} is {}, not a string", what, show(value)));
  return value.get_ref<const std::string&>();
}

// A file of the directory: a plain name, so that no index reaches outside its folder.
bool plain_file_name(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos && name != "." && name != "..";
}

std::string hex32(std::uint32_t value) { return fmt::format("{:08x}", value); }

std::uint32_t parse_hex32(const Json& value, const Problems& problems, const std::string& tensor) {
  const std::string& text = string_value(value, problems, "a checksum");
  if (text.size() != 8 || text.find_first_not_of("0123456789abcdef") != std::string::npos) {
    problems.fail(tensor, fmt::format("checksum {} is not 8 lowercase hex digits", quote_value(text)));
  }
  return static_cast<std::uint32_t>(std::stoul(text, nullptr, 16));
}

CheckpointChunk parse_chunk(const Json& value, const CheckpointTensorInfo& tensor, std::uint64_t elements,
                            const std::set<std::string, std::less<>>& files, std::uint64_t block_bytes,
                            const Problems& problems) {
  const auto bad = [&](const std::string& what) { problems.fail(tensor.name, what); };
  if (!value.is_object()) bad(fmt::format("a chunk is {}, not an object", show(value)));
  CheckpointChunk chunk;
  chunk.file = string_value(member(value, "file", problems, "a chunk"), problems, "a chunk's file");
  if (!files.contains(chunk.file)) {
    bad(fmt::format("a chunk names file {}, which is not among the index's files", quote_value(chunk.file)));
  }
  chunk.key = string_value(member(value, "key", problems, "a chunk"), problems, "a chunk's key");
  if (chunk.key.empty()) bad("a chunk's key is empty");
  if (!value.contains("range")) {
    // N-D blocks (offsets and sizes) are the next version's; say so rather than "corrupt".
    bad(fmt::format("a chunk has no \"range\" (this tandem reads flat element ranges; {})", show(value)));
  }
  const Json& range = value["range"];
  if (!range.is_array() || range.size() != 2) bad(fmt::format("range {} is not [begin, end]", show(range)));
  const auto begin = unsigned_number(range[0], elements, problems, "a chunk's begin");
  const auto end = unsigned_number(range[1], elements, problems, "a chunk's end");
  if (end <= begin) bad(fmt::format("range [{}, {}] is empty or reversed", begin, end));
  chunk.begin = static_cast<std::int64_t>(begin);
  chunk.end = static_cast<std::int64_t>(end);
  const Json& bytes = member(value, "bytes", problems, "a chunk");
  if (!bytes.is_array() || bytes.size() != 2) bad(fmt::format("bytes {} is not [offset, length]", show(bytes)));
  chunk.byte_offset = unsigned_number(bytes[0], kMaxInt64, problems, "a chunk's byte offset");
  chunk.byte_length = unsigned_number(bytes[1], kMaxInt64 - chunk.byte_offset, problems, "a chunk's byte length");
  // (end - begin) x the element size fits: elements x size was checked against int64 already.
  const std::uint64_t expected = (end - begin) * graph::dtype_size(tensor.dtype);
  if (chunk.byte_length != expected) {
    bad(fmt::format("range [{}, {}] of {} needs {} bytes, but the chunk holds {}", begin, end,
                    *detail::safetensors_dtype(tensor.dtype), expected, chunk.byte_length));
  }
  const Json& crc = member(value, "crc32", problems, "a chunk");
  const std::uint64_t blocks = (chunk.byte_length + block_bytes - 1) / block_bytes;
  if (!crc.is_array() || crc.size() != blocks) {
    bad(fmt::format("crc32 must list {} checksums (one per {}-byte block); got {}", blocks, block_bytes, show(crc)));
  }
  chunk.crc32.reserve(crc.size());
  for (const auto& c : crc) chunk.crc32.push_back(parse_hex32(c, problems, tensor.name));
  return chunk;
}

CheckpointTensorInfo parse_tensor(const std::string& name, const Json& value,
                                  const std::set<std::string, std::less<>>& files, std::uint64_t block_bytes,
                                  const Problems& problems) {
  const auto bad = [&](const std::string& what) { problems.fail(name, what); };
  if (!value.is_object()) bad(fmt::format("expected an object with dtype, shape and chunks; got {}", show(value)));
  CheckpointTensorInfo tensor;
  tensor.name = name;
  const std::string& dtype_name = string_value(member(value, "dtype", problems, "a tensor"), problems, "dtype");
  const auto dtype = detail::parse_safetensors_dtype(dtype_name);
  if (!dtype) bad(fmt::format("unknown dtype {}", quote_value(dtype_name)));
  tensor.dtype = *dtype;
  const Json& shape = member(value, "shape", problems, "a tensor");
  if (!shape.is_array() || shape.size() > static_cast<std::size_t>(Shape::kMaxRank)) {
    bad(fmt::format("shape {} is not an array of at most {} dimensions", show(shape), Shape::kMaxRank));
  }
  // The element count times the element size must fit in int64, so that no byte count overflows.
  std::uint64_t elements = 1;
  const std::uint64_t limit = kMaxInt64 / graph::dtype_size(tensor.dtype);
  for (const auto& d : shape) {
    const auto dim = unsigned_number(d, kMaxInt64, problems, "a dimension");
    if (dim != 0 && elements > limit / dim) bad(fmt::format("shape {} is too large", show(shape)));
    elements *= dim;
    tensor.shape.push_back(static_cast<std::int64_t>(dim));
  }
  if (const auto it = value.find("layout"); it != value.end()) {
    const std::string& kind = string_value(member(*it, "kind", problems, "a layout"), problems, "layout kind");
    if (kind == "flat") {
      tensor.num_shards = static_cast<int>(unsigned_number(member(*it, "num_shards", problems, "a flat layout"),
                                                           kMaxCount, problems, "a layout's num_shards"));
      if (tensor.num_shards == 0) bad("a flat layout of 0 shards");
    } else if (kind == "split") {
      const auto count = [&](const char* key, std::uint64_t most) {
        return static_cast<int>(
            unsigned_number(member(*it, key, problems, "a split layout"), most, problems, "a split layout's count"));
      };
      CheckpointSplit split{.dim = count("dim", static_cast<std::uint64_t>(Shape::kMaxRank)),
                            .parts = count("parts", kMaxCount),
                            .axis = {}};
      split.axis = string_value(member(*it, "axis", problems, "a split layout"), problems, "a split layout's axis");
      if (split.parts == 0) bad("a split layout of 0 parts");
      if (split.dim >= std::max(tensor.shape.rank(), 1)) {
        bad(fmt::format("a split layout along dimension {} of a tensor of shape {}", split.dim, show(shape)));
      }
      tensor.split = std::move(split);
    } else if (kind != "replicated") {
      bad(fmt::format("unknown layout kind {}", quote_value(kind)));
    }
  }
  const Json& chunks = member(value, "chunks", problems, "a tensor");
  if (!chunks.is_array()) bad(fmt::format("chunks {} is not an array", show(chunks)));
  for (const auto& c : chunks) tensor.chunks.push_back(parse_chunk(c, tensor, elements, files, block_bytes, problems));
  // The chunks must tile the value exactly: a gap is a lost chunk, an overlap two answers.
  std::sort(tensor.chunks.begin(), tensor.chunks.end(),
            [](const CheckpointChunk& a, const CheckpointChunk& b) { return a.begin < b.begin; });
  std::int64_t covered = 0;
  for (const auto& c : tensor.chunks) {
    if (c.begin < covered) {
      bad(fmt::format("chunks overlap at element {} (in {} and before)", c.begin, quote_value(c.file)));
    }
    if (c.begin > covered) {
      bad(fmt::format("elements [{}, {}) are in no chunk (a chunk is missing from the index)", covered, c.begin));
    }
    covered = c.end;
  }
  if (static_cast<std::uint64_t>(covered) != elements) {
    bad(fmt::format("elements [{}, {}) are in no chunk (a chunk is missing from the index)", covered, elements));
  }
  return tensor;
}

}  // namespace

const CheckpointTensorInfo* CheckpointIndex::find(std::string_view name) const {
  const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.name == name; });
  return it == tensors.end() ? nullptr : &*it;
}

CheckpointIndex parse_checkpoint_index(std::string_view text, const std::string& path) {
  const Problems problems(path);
  Json root;
  if (auto problem = tandem::detail::parse_json(text, root)) problems.fail(*problem);
  if (!root.is_object()) problems.fail(fmt::format("the index is {}, not a JSON object", root.type_name()));
  const std::string& format = string_value(member(root, "format", problems, "the index"), problems, "format");
  if (format != kCheckpointIndexFormat) {
    problems.fail(fmt::format("format is {}; expected \"{}\"", quote_value(format), kCheckpointIndexFormat));
  }
  const Json& version = member(root, "version", problems, "the index");
  if (!version.is_number_unsigned() || version.get<std::uint64_t>() != kCheckpointIndexVersion) {
    problems.fail(fmt::format("version {}; this tandem reads version {} (a newer tandem wrote it?)", show(version),
                              kCheckpointIndexVersion));
  }
  CheckpointIndex index;
  index.num_shards = static_cast<int>(
      unsigned_number(member(root, "num_shards", problems, "the index"), kMaxCount, problems, "num_shards"));
  index.num_workers = static_cast<int>(
      unsigned_number(member(root, "num_workers", problems, "the index"), kMaxCount, problems, "num_workers"));
  if (index.num_shards == 0 || index.num_workers == 0) problems.fail("num_shards and num_workers must be at least 1");
  const Json& checksum = member(root, "checksum", problems, "the index");
  if (!checksum.is_object()) problems.fail(fmt::format("checksum is {}, not an object", show(checksum)));
  const std::string& algorithm =
      string_value(member(checksum, "algorithm", problems, "checksum"), problems, "checksum algorithm");
  if (algorithm != "crc32")
    problems.fail(fmt::format("checksum algorithm {}; expected \"crc32\"", quote_value(algorithm)));
  index.checksum_block_bytes =
      unsigned_number(member(checksum, "block_bytes", problems, "checksum"), kMaxInt64, problems, "block_bytes");
  if (index.checksum_block_bytes == 0) problems.fail("block_bytes is 0");

  std::set<std::string, std::less<>> files;
  const Json& file_list = member(root, "files", problems, "the index");
  if (!file_list.is_array()) problems.fail(fmt::format("files is {}, not an array", show(file_list)));
  for (const auto& f : file_list) {
    const std::string& name = string_value(f, problems, "a file name");
    if (!plain_file_name(name)) problems.fail(fmt::format("file {} is not a plain file name", quote_value(name)));
    if (!files.insert(name).second) problems.fail(fmt::format("file {} is listed twice", quote_value(name)));
    index.files.push_back(name);
  }
  if (const auto it = root.find("metadata"); it != root.end()) {
    if (!it->is_object()) problems.fail(fmt::format("metadata is {}, not an object", show(*it)));
    for (const auto& [key, value] : it->items()) {
      index.metadata[key] = string_value(value, problems, fmt::format("metadata {}", quote_value(key)));
    }
  }
  const Json& tensors = member(root, "tensors", problems, "the index");
  if (!tensors.is_object()) problems.fail(fmt::format("tensors is {}, not an object", show(tensors)));
  for (const auto& [name, value] : tensors.items()) {
    if (name.empty()) problems.fail("a tensor has an empty name");
    index.tensors.push_back(parse_tensor(name, value, files, index.checksum_block_bytes, problems));
  }
  return index;
}

std::string checkpoint_index_json(const CheckpointIndex& index) {
  Json root = Json::object();
  root["format"] = kCheckpointIndexFormat;
  root["version"] = kCheckpointIndexVersion;
  root["num_shards"] = index.num_shards;
  root["num_workers"] = index.num_workers;
  root["files"] = index.files;
  root["checksum"] = Json{{"algorithm", "crc32"}, {"block_bytes", index.checksum_block_bytes}};
  Json metadata = Json::object();
  for (const auto& [key, value] : index.metadata) metadata[key] = value;
  root["metadata"] = std::move(metadata);
  Json tensors = Json::object();
  for (const auto& t : index.tensors) {
    Json chunks = Json::array();
    for (const auto& c : t.chunks) {
      Json crc = Json::array();
      for (const auto value : c.crc32) crc.push_back(hex32(value));
      chunks.push_back(Json{{"file", c.file},
                            {"key", c.key},
                            {"range", Json::array({c.begin, c.end})},
                            {"bytes", Json::array({c.byte_offset, c.byte_length})},
                            {"crc32", std::move(crc)}});
    }
    Json layout =
        t.num_shards != 0 ? Json{{"kind", "flat"}, {"num_shards", t.num_shards}} : Json{{"kind", "replicated"}};
    if (t.split) {
      layout = Json{{"kind", "split"}, {"dim", t.split->dim}, {"parts", t.split->parts}, {"axis", t.split->axis}};
    }
    Json shape = Json::array();
    for (const auto d : t.shape.dims()) shape.push_back(d);
    tensors[t.name] = Json{{"dtype", *detail::safetensors_dtype(t.dtype)},
                           {"shape", std::move(shape)},
                           {"layout", layout},
                           {"chunks", std::move(chunks)}};
  }
  root["tensors"] = std::move(tensors);
  try {
    return root.dump(1, ' ');
  } catch (const Json::exception& e) {
    throw InvalidArgument(fmt::format("a checkpoint's tensor name or metadata is not valid UTF-8 ({})", e.what()));
  }
}

}  // namespace tandem::keras
