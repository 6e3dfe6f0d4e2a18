// tandem/keras_like/saving.cc — the safetensors format, model weights and training checkpoints.
//
// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON (padded with spaces to a multiple of 8), then the tensors' raw bytes, back to
// back in header order. We keep to the strict reading of the spec (no gaps, no overlap, no
// trailing bytes) because the reference reader refuses anything else, and a file it refuses is
// useless to the people we write it for.
#include "tandem/keras_like/saving.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "tandem/base/errors.h"
#include "tandem/keras_like/model.h"

namespace tandem::keras {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; tandem writes the host's bytes as they are");

using Json = nlohmann::ordered_json;  // keeps the header in file order

constexpr std::string_view kFormatKey = "format";
constexpr std::string_view kChecksumKey = "checksum";
constexpr std::string_view kWeightsFormat = "tandem.weights";
constexpr std::string_view kCheckpointFormat = "tandem.checkpoint";
constexpr std::string_view kOptimizerPrefix = "optimizer/";
constexpr std::string_view kIterationsName = "optimizer/iterations";
constexpr std::string_view kLearningRateName = "optimizer/learning_rate";
// The reference implementation's limit: a bigger header is a corrupt length, not a real header.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

std::string system_reason(int error) { return std::system_category().message(error); }

std::optional<std::string_view> safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return std::nullopt;
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F64") return DType::kF64;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  if (name == "U8") return DType::kU8;
  if (name == "BOOL") return DType::kU8;  // numpy/torch booleans: one byte each, as tandem stores them
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t bytes) {
  return static_cast<std::uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}

std::string checksum_string(std::uint32_t crc) { return fmt::format("crc32:{:08x}", crc); }

// A temporary file next to the destination, removed unless commit() renames it into place. The
// same folder keeps the rename atomic (one file system).
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)) {
    namespace fs = std::filesystem;
    const fs::path target(path_);
    const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
    static std::atomic<std::uint64_t> counter{0};
    for (int attempt = 0; attempt < 100; ++attempt) {
      const auto name = fmt::format(".{}.tmp-{}-{}", target.filename().string(), ::getpid(),
                                    counter.fetch_add(1, std::memory_order_relaxed));
      temp_ = (dir / name).string();
      fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0 || errno != EEXIST) break;
    }
    if (fd_ < 0) fail(errno);
  }
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Buffered: small tensors go out together, big ones straight from their memory.
  void write(const void* data, std::size_t bytes) {
    if (bytes >= kBufferBytes) {
      flush_buffer();
      write_fully(data, bytes);
      return;
    }
    if (buffer_.size() + bytes > kBufferBytes) flush_buffer();
    const auto* p = static_cast<const char*>(data);
    buffer_.insert(buffer_.end(), p, p + bytes);
  }

  void commit() {
    flush_buffer();
    // The data must be on disk before the name points at it, or a crash could leave the new
    // name on an empty file.
    if (::fsync(fd_) != 0) fail(errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(errno);
    if (::rename(temp_.c_str(), path_.c_str()) != 0) fail(errno);
    committed_ = true;
    // Make the rename itself durable; a failure here leaves a complete file either way.
    const auto dir = std::filesystem::path(path_).parent_path();
    const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd >= 0) {
      ::fsync(dir_fd);
      ::close(dir_fd);
    }
  }

 private:
  static constexpr std::size_t kBufferBytes = std::size_t{4} << 20;

  [[noreturn]] void fail(int error) const {
    throw Unavailable(fmt::format("cannot write \"{}\": {}", path_, system_reason(error)));
  }
  void flush_buffer() {
    write_fully(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void write_fully(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, p, bytes);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail(errno);
      }
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }

  std::string path_;
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<char> buffer_;
};

class ReadFile {
 public:
  explicit ReadFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      const int error = errno;
      if (error == ENOENT) throw NotFound(fmt::format("no file \"{}\"", path));
      throw Unavailable(fmt::format("cannot read \"{}\": {}", path, system_reason(error)));
    }
    // The destructor does not run when the constructor throws: close here.
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int error = errno;
      ::close(fd_);
      throw Unavailable(fmt::format("cannot read \"{}\": {}", path, system_reason(error)));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw InvalidArgument(fmt::format("\"{}\" is not a regular file", path));
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  ~ReadFile() { ::close(fd_); }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  std::uint64_t size() const { return size_; }
  // Reads exactly `bytes` at `offset`; the file shrinking under us is a truncation.
  void read(void* dst, std::size_t bytes, std::uint64_t offset) const {
    auto* p = static_cast<char*>(dst);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw Unavailable(fmt::format("cannot read \"{}\": {}", path_, system_reason(errno)));
      }
      if (n == 0)
        throw DataLoss(
            fmt::format("\"{}\": the file ends at byte {}, in the middle of its data (truncated)", path_, offset));
      p += n;
      bytes -= static_cast<std::size_t>(n);
      offset += static_cast<std::uint64_t>(n);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// One tensor as the header describes it.
struct Entry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;
};

std::uint64_t json_unsigned(const Json& value, const std::string& path, const std::string& name,
                            std::string_view field) {
  // JSON numbers parse as unsigned when non-negative integers; anything else is not an offset.
  if (!value.is_number_unsigned()) {
    throw DataLoss(
        fmt::format("\"{}\": tensor \"{}\": {} holds {}, not a non-negative integer", path, name, field, value.dump()));
  }
  return value.get<std::uint64_t>();
}

Entry parse_entry(const std::string& path, const std::string& name, const Json& value, std::uint64_t data_bytes) {
  const auto bad = [&](const std::string& what) {
    return DataLoss(fmt::format("\"{}\": tensor \"{}\": {}", path, name, what));
  };
  if (!value.is_object())
    throw bad(fmt::format("expected an object with dtype, shape and data_offsets; got {}", value.dump()));
  Entry e;
  e.name = name;
  const auto dtype_it = value.find("dtype");
  const auto shape_it = value.find("shape");
  const auto offsets_it = value.find("data_offsets");
  if (dtype_it == value.end() || shape_it == value.end() || offsets_it == value.end()) {
    throw bad("the header entry lacks dtype, shape or data_offsets");
  }
  if (!dtype_it->is_string()) throw bad(fmt::format("dtype {} is not a string", dtype_it->dump()));
  const auto dtype = parse_safetensors_dtype(dtype_it->get<std::string>());
  if (!dtype) {
    throw bad(fmt::format("unknown dtype \"{}\" (tandem reads F32, F64, I32, I64, U8, BOOL, F16, BF16)",
                          dtype_it->get<std::string>()));
  }
  e.dtype = *dtype;
  if (!shape_it->is_array()) throw bad(fmt::format("shape {} is not an array", shape_it->dump()));
  if (shape_it->size() > static_cast<std::size_t>(Shape::kMaxRank)) {
    throw bad(fmt::format("shape {} has rank {}; tandem supports at most {}", shape_it->dump(), shape_it->size(),
                          Shape::kMaxRank));
  }
  // The byte count, with overflow caught: a huge shape is a corrupt one.
  std::uint64_t bytes = graph::dtype_size(e.dtype);
  bool overflow = false;
  for (const auto& d : *shape_it) {
    const auto dim = json_unsigned(d, path, name, "shape");
    if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) overflow = true;
    e.shape.push_back(static_cast<std::int64_t>(dim));
    if (dim != 0 && bytes > std::numeric_limits<std::uint64_t>::max() / dim) overflow = true;
    bytes *= dim;
  }
  if (!offsets_it->is_array() || offsets_it->size() != 2) {
    throw bad(fmt::format("data_offsets {} is not [begin, end]", offsets_it->dump()));
  }
  e.begin = json_unsigned((*offsets_it)[0], path, name, "data_offsets");
  e.end = json_unsigned((*offsets_it)[1], path, name, "data_offsets");
  if (e.end < e.begin) throw bad(fmt::format("data_offsets [{}, {}] end before they begin", e.begin, e.end));
  if (e.end > data_bytes) {
    throw bad(fmt::format("data_offsets [{}, {}] run past the data section, which holds {} bytes (truncated?)", e.begin,
                          e.end, data_bytes));
  }
  if (overflow || bytes > std::numeric_limits<std::uint64_t>::max() / 2) {
    throw bad(fmt::format("shape {} is too large", shape_it->dump()));
  }
  if (e.end - e.begin != bytes) {
    throw bad(fmt::format("shape {} of {} needs {} bytes, but data_offsets [{}, {}] hold {}", e.shape,
                          dtype_it->get<std::string>(), bytes, e.begin, e.end, e.end - e.begin));
  }
  return e;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += fmt::format("{}{}", out.empty() ? "" : ", ", item);
  return out;
}

std::string describe(DType dtype, const Shape& shape) { return fmt::format("{} {}", dtype, shape); }

// A weight name without the numbers unique_layer_name appends ("dense_3/kernel" -> "dense/kernel",
// "conv2d_1/bias" -> "conv2d/bias"): what two models built by the same code share.
std::string without_numbering(std::string_view name) {
  std::string out;
  while (true) {
    const auto slash = name.find('/');
    std::string_view part = name.substr(0, slash);
    const auto underscore = part.rfind('_');
    if (underscore != std::string_view::npos && underscore > 0 && underscore + 1 < part.size() &&
        part.find_first_not_of("0123456789", underscore + 1) == std::string_view::npos) {
      part = part.substr(0, underscore);
    }
    out += part;
    if (slash == std::string_view::npos) return out;
    out += '/';
    name = name.substr(slash + 1);
  }
}

// Where the model's variables are in a file. By name; or, when the file was written by a model
// built the same way whose layers were numbered otherwise (auto-generated names count up through
// the process: dense, dense_1, then dense_2, dense_3 for an identical second model), by structure
// as Keras 3 loads weights: the model's weights in order against the file's, pairwise, their names
// equal but for the numbering. Optimizer slots ("<weight>/m") follow their weight.
class FileNames {
 public:
  // weights: the model's unique weights in order; file: the file's weights (no optimizer state), in
  // file order (the order save_weights writes).
  FileNames(const std::vector<VariablePtr>& weights, const NamedTensors& file) {
    std::set<std::string> in_file;
    for (const auto& [name, tensor] : file) in_file.insert(name);
    const bool by_name = std::all_of(weights.begin(), weights.end(),
                                     [&](const VariablePtr& w) { return in_file.contains(w->name()); });
    if (by_name) return;
    const std::size_t n = std::min(weights.size(), file.size());
    const auto same_name = [&](std::size_t k) {
      return without_numbering(weights[k]->name()) == without_numbering(file[k].first);
    };
    std::size_t i = 0;
    while (i < n && same_name(i)) ++i;
    if (i == weights.size() && i == file.size()) {
      // Paired; a dtype or shape that differs is then reported under the model's name.
      for (std::size_t k = 0; k < n; ++k) {
        if (weights[k]->name() != file[k].first) renamed_.emplace(weights[k]->name(), file[k].first);
      }
      return;
    }
    // Neither: say where the two part, for the error the missing names will raise.
    i = 0;
    while (i < n && same_name(i) && weights[i]->dtype() == file[i].second.dtype() &&
           weights[i]->shape() == file[i].second.shape()) {
      ++i;
    }
    if (i < n) {
      first_difference_ =
          fmt::format("in order, weight {} of the model is \"{}\" ({}) where the file has \"{}\" ({})", i + 1,
                      weights[i]->name(), describe(weights[i]->dtype(), weights[i]->shape()), file[i].first,
                      describe(file[i].second.dtype(), file[i].second.shape()));
    } else {
      first_difference_ = fmt::format("in order, the model has {} weights and the file {}; the first without a partner is "
                                      "\"{}\"",
                                      weights.size(), file.size(), i < weights.size() ? weights[i]->name() : file[i].first);
    }
  }

  // The file's name for a model variable or optimizer slot.
  std::string operator()(const std::string& name) const {
    if (renamed_.empty()) return name;
    if (const auto it = renamed_.find(name); it != renamed_.end()) return it->second;
    // A slot "<weight>/<slot>": the longest renamed weight it starts with.
    const std::pair<const std::string, std::string>* owner = nullptr;
    for (const auto& entry : renamed_) {
      if (name.size() > entry.first.size() && name.starts_with(entry.first) && name[entry.first.size()] == '/' &&
          (owner == nullptr || entry.first.size() > owner->first.size())) {
        owner = &entry;
      }
    }
    return owner == nullptr ? name : owner->second + name.substr(owner->first.size());
  }
  // "" unless the names differ and the structures too: where they part.
  const std::string& first_difference() const { return first_difference_; }

 private:
  std::map<std::string, std::string> renamed_;  // model name -> file name, matched by structure
  std::string first_difference_;
};

// The file's weights in file order: every tensor but a training checkpoint's optimizer state.
NamedTensors weights_in_file(const SafetensorsContent& content, bool checkpoint) {
  NamedTensors out;
  for (const auto& [name, tensor] : content.tensors) {
    if (!checkpoint || !std::string_view(name).starts_with(kOptimizerPrefix)) out.emplace_back(name, tensor);
  }
  return out;
}

// Pairs every variable with the file's tensor of its name (in_file's), checking dtype and shape,
// and marks the names used. Every problem is collected so one error lists them all.
std::vector<std::pair<VariablePtr, Tensor>> match_variables(const std::vector<VariablePtr>& variables,
                                                            const std::map<std::string, Tensor>& file,
                                                            const FileNames& in_file, std::set<std::string>& used,
                                                            std::string_view prefix, std::vector<std::string>& missing,
                                                            std::vector<std::string>& mismatched) {
  std::vector<std::pair<VariablePtr, Tensor>> plan;
  for (const auto& v : variables) {
    const std::string name = fmt::format("{}{}", prefix, in_file(v->name()));
    if (!used.insert(name).second) continue;  // the same variable listed twice: assign once
    const auto it = file.find(name);
    if (it == file.end()) {
      missing.push_back(name);
      continue;
    }
    const Tensor& t = it->second;
    if (t.dtype() != v->dtype() || t.shape() != v->shape()) {
      const std::string model_name = fmt::format("{}{}", prefix, v->name());
      mismatched.push_back(fmt::format("\"{}\"{} is {} in the file but {} in the model", model_name,
                                       model_name == name ? "" : fmt::format(" (the file's \"{}\")", name),
                                       describe(t.dtype(), t.shape()), describe(v->dtype(), v->shape())));
      continue;
    }
    plan.emplace_back(v, t);
  }
  return plan;
}

std::string mismatch_report(const std::vector<std::string>& missing, const std::vector<std::string>& extra,
                            const std::vector<std::string>& mismatched, const FileNames& in_file) {
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back(fmt::format("missing from the file: {}", join(missing)));
  if (!extra.empty()) parts.push_back(fmt::format("in the file but not in the model: {}", join(extra)));
  for (const auto& m : mismatched) parts.push_back(m);
  if (!missing.empty() && !in_file.first_difference().empty()) parts.push_back(in_file.first_difference());
  std::string out;
  for (const auto& p : parts) out += fmt::format("{}{}", out.empty() ? "" : "; ", p);
  return out;
}

std::vector<VariablePtr> unique_variables(const std::vector<VariablePtr>& variables) {
  std::vector<VariablePtr> out;
  for (const auto& v : variables) {
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  return out;
}

std::int64_t parse_metadata_int(const SafetensorsContent& content, const std::string& path, const std::string& key) {
  const auto it = content.metadata.find(key);
  if (it == content.metadata.end()) {
    throw DataLoss(fmt::format("\"{}\": the training checkpoint has no \"{}\" in its metadata", path, key));
  }
  std::int64_t value = 0;
  const auto& s = it->second;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size() || value < 0) {
    throw DataLoss(fmt::format("\"{}\": metadata \"{}\" is \"{}\", not a non-negative integer", path, key, s));
  }
  return value;
}

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Everything is checked before the temporary file exists, so a bad call never touches disk.
  std::set<std::string_view> names;
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    TANDEM_REQUIRE(!name.empty(), InvalidArgument, "write_safetensors \"{}\": a tensor has an empty name", path);
    TANDEM_REQUIRE(name != "__metadata__", InvalidArgument,
                   "write_safetensors \"{}\": \"__metadata__\" is reserved by the format; rename the tensor", path);
    TANDEM_REQUIRE(names.insert(name).second, InvalidArgument, "write_safetensors \"{}\": two tensors are named \"{}\"",
                   path, name);
    TANDEM_REQUIRE(tensor.defined(), InvalidArgument, "write_safetensors \"{}\": tensor \"{}\" is undefined", path,
                   name);
    TANDEM_REQUIRE(safetensors_dtype(tensor.dtype()).has_value(), InvalidArgument,
                   "write_safetensors \"{}\": tensor \"{}\" has dtype {}, which safetensors cannot hold", path, name,
                   tensor.dtype());
    host.push_back(tensor.to(devices::default_cpu_device()));
  }

  // The checksum goes in the header, so it is computed before anything is written.
  std::uint32_t crc = ::crc32_z(0, nullptr, 0);
  for (const auto& t : host) crc = crc32_update(crc, t.raw_data(), t.nbytes());

  Json header = Json::object();
  Json meta = Json::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
  meta[std::string(kChecksumKey)] = checksum_string(crc);  // always recomputed, never the caller's
  header["__metadata__"] = std::move(meta);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = host[i];
    Json shape = Json::array();
    for (const auto d : t.shape().dims()) shape.push_back(d);
    const std::uint64_t end = offset + t.nbytes();
    header[tensors[i].first] = Json{{"dtype", *safetensors_dtype(t.dtype())},
                                    {"shape", std::move(shape)},
                                    {"data_offsets", Json::array({offset, end})}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    // Names and metadata must be valid UTF-8 for JSON.
    throw InvalidArgument(fmt::format(
        "write_safetensors \"{}\": a tensor name or metadata entry is not valid UTF-8 ({})", path, e.what()));
  }
  // Spaces keep the data section 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::array<unsigned char, 8> length{};
  for (std::size_t i = 0; i < 8; ++i)
    length[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));

  AtomicFile file(path);
  file.write(length.data(), length.size());
  file.write(text.data(), text.size());
  for (const auto& t : host) file.write(t.raw_data(), t.nbytes());
  file.commit();
}

SafetensorsContent read_safetensors(const std::string& path) {
  ReadFile file(path);
  const std::uint64_t size = file.size();
  if (size < 8) {
    throw DataLoss(fmt::format(
        "\"{}\": {} bytes is too short for a safetensors file (8-byte header length; truncated?)", path, size));
  }
  std::array<unsigned char, 8> length_bytes{};
  file.read(length_bytes.data(), length_bytes.size(), 0);
  std::uint64_t header_bytes = 0;
  for (std::size_t i = 0; i < 8; ++i) header_bytes |= static_cast<std::uint64_t>(length_bytes[i]) << (8 * i);
  if (header_bytes > size - 8) {
    throw DataLoss(fmt::format("\"{}\": the header length {} runs past the end of the file ({} bytes; truncated?)",
                               path, header_bytes, size));
  }
  if (header_bytes > kMaxHeaderBytes) {
    throw DataLoss(fmt::format("\"{}\": the header length {} exceeds the format's limit of {} bytes", path,
                               header_bytes, kMaxHeaderBytes));
  }
  std::string text(static_cast<std::size_t>(header_bytes), '\0');
  file.read(text.data(), text.size(), 8);
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& e) {
    throw DataLoss(fmt::format("\"{}\": the header is not valid JSON ({})", path, e.what()));
  }
  if (!header.is_object())
    throw DataLoss(fmt::format("\"{}\": the header is {}, not a JSON object", path, header.type_name()));

  const std::uint64_t data_start = 8 + header_bytes;
  const std::uint64_t data_bytes = size - data_start;
  SafetensorsContent content;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object())
        throw DataLoss(fmt::format("\"{}\": __metadata__ is {}, not an object", path, value.dump()));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          throw DataLoss(fmt::format("\"{}\": metadata \"{}\" is {}, not a string", path, mk, mv.dump()));
        }
        content.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, key, value, data_bytes));
  }

  // The tensors must tile the data section exactly: sorted by offset, each starts where the
  // previous one ended, and the last ends at the end of the file.
  std::vector<std::size_t> order(entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(entries[a].begin, entries[a].end) < std::pair(entries[b].begin, entries[b].end);
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const auto i : order) {
    const Entry& e = entries[i];
    if (e.begin < covered) {
      throw DataLoss(fmt::format("\"{}\": tensor \"{}\" at bytes [{}, {}] overlaps tensor \"{}\", which ends at {}",
                                 path, e.name, e.begin, e.end, previous->name, covered));
    }
    if (e.begin > covered) {
      throw DataLoss(fmt::format("\"{}\": {} unused bytes at data offset {}, before tensor \"{}\"", path,
                                 e.begin - covered, covered, e.name));
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_bytes) {
    throw DataLoss(fmt::format("\"{}\": the tensors cover {} bytes of data but the file holds {} after the header",
                               path, covered, data_bytes));
  }

  // Read in offset order, which is the order of the bytes on disk, hashing as we go.
  std::vector<Tensor> tensors(entries.size());
  std::uint32_t crc = ::crc32_z(0, nullptr, 0);
  for (const auto i : order) {
    const Entry& e = entries[i];
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (t.nbytes() > 0) {
      file.read(t.raw_data(), t.nbytes(), data_start + e.begin);
      crc = crc32_update(crc, t.raw_data(), t.nbytes());
    }
    tensors[i] = std::move(t);
  }
  if (const auto it = content.metadata.find(std::string(kChecksumKey)); it != content.metadata.end()) {
    const std::string& expected = it->second;
    if (expected.size() != 14 || expected.rfind("crc32:", 0) != 0 ||
        expected.find_first_not_of("0123456789abcdef", 6) != std::string::npos) {
      throw DataLoss(
          fmt::format("\"{}\": checksum \"{}\" in the metadata is not \"crc32:<8 hex digits>\"", path, expected));
    }
    const std::string actual = checksum_string(crc);
    if (actual != expected) {
      throw DataLoss(
          fmt::format("\"{}\": checksum mismatch over the {} data bytes: the header says {}, the data hashes to "
                      "{} (the file is corrupt)",
                      path, data_bytes, expected, actual));
    }
  }
  content.tensors.reserve(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) content.tensors.emplace_back(entries[i].name, std::move(tensors[i]));
  return content;
}

void save_model_weights(const Model& model, const std::string& path) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "save_weights \"{}\": model \"{}\" is not built yet (build it, or call it on data, first)", path,
                 model.name());
  NamedTensors tensors;
  std::set<std::string> seen;
  for (const auto& w : unique_variables(model.weights())) {
    TANDEM_REQUIRE(seen.insert(w->name()).second, InvalidArgument,
                   "save_weights \"{}\": model \"{}\" has two weights named \"{}\"; a weights file needs unique names "
                   "(give the layers distinct names)",
                   path, model.name(), w->name());
    tensors.emplace_back(w->name(), w->read_value());
  }
  write_safetensors(path, tensors, {{std::string(kFormatKey), std::string(kWeightsFormat)}});
}

void load_model_weights(Model& model, const std::string& path) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition,
                 "load_weights \"{}\": model \"{}\" is not built yet (build it, or call it on data, first)", path,
                 model.name());
  auto content = read_safetensors(path);
  // A training checkpoint holds the weights too; its optimizer state is not the model's.
  const auto format = content.metadata.find(std::string(kFormatKey));
  const bool checkpoint = format != content.metadata.end() && format->second == kCheckpointFormat;
  const NamedTensors weights = weights_in_file(content, checkpoint);
  const std::map<std::string, Tensor> file(weights.begin(), weights.end());
  const FileNames in_file(unique_variables(model.weights()), weights);
  std::set<std::string> used;
  std::vector<std::string> missing, mismatched, extra;
  const auto plan = match_variables(model.weights(), file, in_file, used, "", missing, mismatched);
  for (const auto& [name, tensor] : file) {
    if (!used.contains(name)) extra.push_back(name);
  }
  if (!missing.empty() || !extra.empty() || !mismatched.empty()) {
    throw InvalidArgument(
        fmt::format("load_weights \"{}\" into model \"{}\": the file does not match the model ({}); "
                    "nothing was loaded",
                    path, model.name(), mismatch_report(missing, extra, mismatched, in_file)));
  }
  for (const auto& [variable, value] : plan) variable->assign(value);
}

void save_training_checkpoint(const Model& model, const std::string& path, const TrainingState& state) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition, "save_training_checkpoint \"{}\": model \"{}\" is not built yet",
                 path, model.name());
  const Optimizer& optimizer = model.optimizer();  // FailedPrecondition before compile()
  NamedTensors tensors;
  for (const auto& w : unique_variables(model.weights())) tensors.emplace_back(w->name(), w->read_value());
  for (const auto& [name, slot] : optimizer.slots()) {
    tensors.emplace_back(fmt::format("{}{}", kOptimizerPrefix, name), slot->read_value());
  }
  tensors.emplace_back(std::string(kIterationsName), Tensor::scalar<std::int64_t>(optimizer.iterations()));
  // Kept so a learning rate changed during training (ReduceLROnPlateau) resumes as it was.
  tensors.emplace_back(std::string(kLearningRateName), Tensor::scalar<double>(optimizer.learning_rate()));
  write_safetensors(path, tensors,
                    {{std::string(kFormatKey), std::string(kCheckpointFormat)},
                     {"optimizer", optimizer.name()},
                     {"epoch", std::to_string(state.epoch)},
                     {"step", std::to_string(state.step)}});
}

TrainingState load_training_checkpoint(Model& model, const std::string& path) {
  TANDEM_REQUIRE(model.built(), FailedPrecondition, "load_training_checkpoint \"{}\": model \"{}\" is not built yet",
                 path, model.name());
  Optimizer& optimizer = model.optimizer();
  auto content = read_safetensors(path);
  const auto format = content.metadata.find(std::string(kFormatKey));
  TANDEM_REQUIRE(format != content.metadata.end() && format->second == kCheckpointFormat, InvalidArgument,
                 "\"{}\" is not a training checkpoint (its format is \"{}\"; expected \"{}\"); load weights with "
                 "load_weights()",
                 path, format == content.metadata.end() ? "unknown" : format->second, kCheckpointFormat);
  TrainingState state;
  const auto epoch = parse_metadata_int(content, path, "epoch");
  TANDEM_REQUIRE(epoch <= std::numeric_limits<int>::max(), DataLoss, "\"{}\": metadata epoch {} is out of range", path,
                 epoch);
  state.epoch = static_cast<int>(epoch);
  state.step = parse_metadata_int(content, path, "step");
  // Loss scaling is a wrapper: a mixed_float16 run's checkpoint (loss_scale_optimizer(adam)) loads
  // into a float32 model compiled with adam, and the other way round. Only the scale state is
  // left out (dropped, or started at the initial scale).
  const auto without_loss_scaling = [](std::string_view name) {
    constexpr std::string_view kWrapper = "loss_scale_optimizer(";
    if (name.starts_with(kWrapper) && name.ends_with(")"))
      name = name.substr(kWrapper.size(), name.size() - kWrapper.size() - 1);
    return std::string(name);
  };
  if (const auto it = content.metadata.find("optimizer"); it != content.metadata.end()) {
    TANDEM_REQUIRE(without_loss_scaling(it->second) == without_loss_scaling(optimizer.name()), InvalidArgument,
                   "load_training_checkpoint \"{}\": the checkpoint holds the state of optimizer \"{}\"; model \"{}\" "
                   "was compiled with \"{}\"",
                   path, it->second, model.name(), optimizer.name());
  }

  const FileNames in_file(unique_variables(model.weights()), weights_in_file(content, /*checkpoint=*/true));
  std::map<std::string, Tensor> file;
  for (auto& [name, tensor] : content.tensors) file.emplace(name, std::move(tensor));
  const auto take_scalar = [&](std::string_view name, DType dtype, bool required) -> std::optional<Tensor> {
    const auto it = file.find(std::string(name));
    if (it == file.end()) {
      TANDEM_REQUIRE(!required, DataLoss, "\"{}\": the training checkpoint has no \"{}\"", path, name);
      return std::nullopt;
    }
    TANDEM_REQUIRE(it->second.dtype() == dtype && it->second.shape() == Shape{}, DataLoss,
                   "\"{}\": \"{}\" is {}; expected a {} scalar", path, name,
                   describe(it->second.dtype(), it->second.shape()), dtype);
    Tensor t = it->second;
    file.erase(it);
    return t;
  };
  const auto iterations = take_scalar(kIterationsName, DType::kI64, true)->item<std::int64_t>();
  TANDEM_REQUIRE(iterations >= 0, DataLoss, "\"{}\": \"{}\" is {}; expected a count", path, kIterationsName,
                 iterations);
  const auto learning_rate_tensor = take_scalar(kLearningRateName, DType::kF64, false);
  std::optional<double> learning_rate;
  if (learning_rate_tensor) {
    learning_rate = learning_rate_tensor->item<double>();
    TANDEM_REQUIRE(std::isfinite(*learning_rate) && *learning_rate >= 0, DataLoss,
                   "\"{}\": \"{}\" is {}; expected a finite, non-negative rate", path, kLearningRateName,
                   *learning_rate);
  }

  std::set<std::string> used;
  std::vector<std::string> missing, mismatched, extra;
  auto plan = match_variables(model.weights(), file, in_file, used, "", missing, mismatched);
  bool has_slots_in_file = false;
  for (const auto& [name, tensor] : file) {
    if (std::string_view(name).starts_with(kOptimizerPrefix)) has_slots_in_file = true;
  }
  if (missing.empty() && mismatched.empty() && has_slots_in_file && optimizer.slots().empty()) {
    // A freshly compiled model has no slots until its first step; create them now (zeros, for
    // the same variables fit() would use) so they can take the checkpoint's values.
    optimizer.build(unique_variables(model.trainable_weights()));
  }
  std::vector<VariablePtr> slots;
  for (const auto& [name, slot] : optimizer.slots()) slots.push_back(slot);
  auto slot_plan = match_variables(slots, file, in_file, used, kOptimizerPrefix, missing, mismatched);
  for (const auto& [name, tensor] : file) {
    if (!used.contains(name)) extra.push_back(name);
  }
  const auto is_loss_scale_state = [](const std::string& name) {
    return std::string_view(name).starts_with(fmt::format("{}loss_scale_optimizer/", kOptimizerPrefix));
  };
  std::erase_if(extra, is_loss_scale_state);
  std::erase_if(missing, is_loss_scale_state);
  if (!missing.empty() || !extra.empty() || !mismatched.empty()) {
    throw InvalidArgument(
        fmt::format("load_training_checkpoint \"{}\" into model \"{}\": the checkpoint does not match "
                    "the model and its {} optimizer ({}); nothing was loaded",
                    path, model.name(), optimizer.name(), mismatch_report(missing, extra, mismatched, in_file)));
  }
  for (const auto& [variable, value] : plan) variable->assign(value);
  for (const auto& [variable, value] : slot_plan) variable->assign(value);
  optimizer.set_iterations(iterations);
  if (learning_rate) optimizer.set_learning_rate(*learning_rate);
  return state;
}

}  // namespace tandem::keras
