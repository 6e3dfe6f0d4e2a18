// tandem/keras_like/safetensors.cc — the safetensors format: write_safetensors and
// read_safetensors (declared in saving.h). Files are written through base's atomic writer
// (base/detail/atomic_file.h).
//
// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON (padded with spaces to a multiple of 8), then the tensors' raw bytes, back to
// back in header order. We keep to the strict reading of the spec (no gaps, no overlap, no
// trailing bytes) because the reference reader refuses anything else, and a file it refuses is
// useless to the people we write it for. A file is input from outside: every size, offset, dtype
// and shape its header declares is checked against the file's real size before memory is
// allocated for it. This file needs only graph/ and base/, so the fuzzing harness
// (tests/fuzz/safetensors_fuzzer.cc) builds it without the rest of keras_like.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "tandem/base/detail/atomic_file.h"
#include "tandem/base/detail/json.h"
#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"
#include "tandem/keras_like/detail/safetensors_io.h"
#include "tandem/keras_like/saving.h"

namespace tandem::keras {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; tandem writes the host's bytes as they are");

using Json = nlohmann::ordered_json;  // keeps the header in file order
using tandem::detail::quote_value;
using detail::crc32_update;
using detail::parse_safetensors_dtype;
using detail::ReadFile;
using detail::safetensors_dtype;

// A header's value in a message: short, whatever the file holds.
std::string show(const Json& value) { return tandem::detail::json_for_message(value); }

constexpr std::string_view kChecksumKey = "checksum";
// The reference implementation's limit: a bigger header is a corrupt length, not a real header.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

std::string system_reason(int error) { return std::system_category().message(error); }

std::string checksum_string(std::uint32_t crc) { return fmt::format("crc32:{:08x}", crc); }

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
    throw DataLoss(fmt::format("\"{}\": tensor {}: {} holds {}, not a non-negative integer", path, quote_value(name),
                               field, show(value)));
  }
  return value.get<std::uint64_t>();
}

Entry parse_entry(const std::string& path, const std::string& name, const Json& value, std::uint64_t data_bytes) {
  const auto bad = [&](const std::string& what) {
    return DataLoss(fmt::format("\"{}\": tensor {}: {}", path, quote_value(name), what));
  };
  if (!value.is_object())
    throw bad(fmt::format("expected an object with dtype, shape and data_offsets; got {}", show(value)));
  Entry e;
  e.name = name;
  const auto dtype_it = value.find("dtype");
  const auto shape_it = value.find("shape");
  const auto offsets_it = value.find("data_offsets");
  if (dtype_it == value.end() || shape_it == value.end() || offsets_it == value.end()) {
    throw bad("the header entry lacks dtype, shape or data_offsets");
  }
  if (!dtype_it->is_string()) throw bad(fmt::format("dtype {} is not a string", show(*dtype_it)));
  const auto& dtype_name = dtype_it->get_ref<const std::string&>();
  const auto dtype = parse_safetensors_dtype(dtype_name);
  if (!dtype) {
    throw bad(fmt::format("unknown dtype {} (tandem reads F32, F64, I32, I64, U8, BOOL, F16, BF16)",
                          quote_value(dtype_name)));
  }
  e.dtype = *dtype;
  if (!shape_it->is_array()) throw bad(fmt::format("shape {} is not an array", show(*shape_it)));
  if (shape_it->size() > static_cast<std::size_t>(Shape::kMaxRank)) {
    throw bad(fmt::format("shape {} has rank {}; tandem supports at most {}", show(*shape_it), shape_it->size(),
                          Shape::kMaxRank));
  }
  // The byte count. The element size times the dimensions other than 0 must fit in int64: a
  // shape of 0 x 2^32 x 2^31 holds nothing, but code that multiplies its dimensions in another
  // order (Shape::num_elements, strides) would overflow. A larger shape is a corrupt one.
  constexpr auto kMaxBytes = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t nonzero_bytes = graph::dtype_size(e.dtype);
  bool empty = false;
  for (const auto& d : *shape_it) {
    const auto dim = json_unsigned(d, path, name, "shape");
    if (dim != 0 && nonzero_bytes > kMaxBytes / dim) throw bad(fmt::format("shape {} is too large", show(*shape_it)));
    if (dim == 0) empty = true;
    if (dim != 0) nonzero_bytes *= dim;
    e.shape.push_back(static_cast<std::int64_t>(dim));
  }
  const std::uint64_t bytes = empty ? 0 : nonzero_bytes;
  if (!offsets_it->is_array() || offsets_it->size() != 2) {
    throw bad(fmt::format("data_offsets {} is not [begin, end]", show(*offsets_it)));
  }
  e.begin = json_unsigned((*offsets_it)[0], path, name, "data_offsets");
  e.end = json_unsigned((*offsets_it)[1], path, name, "data_offsets");
  if (e.end < e.begin) throw bad(fmt::format("data_offsets [{}, {}] end before they begin", e.begin, e.end));
  if (e.end > data_bytes) {
    throw bad(fmt::format("data_offsets [{}, {}] run past the data section, which holds {} bytes (truncated?)", e.begin,
                          e.end, data_bytes));
  }
  if (e.end - e.begin != bytes) {
    throw bad(fmt::format("shape {} of {} needs {} bytes, but data_offsets [{}, {}] hold {}", e.shape, dtype_name,
                          bytes, e.begin, e.end, e.end - e.begin));
  }
  return e;
}

}  // namespace

// ----- detail/safetensors_io.h -----

namespace detail {

ReadFile::ReadFile(const std::string& path) : path_(path) {
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

ReadFile::~ReadFile() { ::close(fd_); }

// The file shrinking under us is a truncation.
void ReadFile::read(void* dst, std::size_t bytes, std::uint64_t offset) const {
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

std::uint32_t crc32_initial() { return static_cast<std::uint32_t>(::crc32_z(0, nullptr, 0)); }

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t bytes) {
  return static_cast<std::uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}

}  // namespace detail

std::uint64_t write_safetensors(const std::string& path, const NamedTensors& tensors,
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
  std::uint32_t crc = detail::crc32_initial();
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

  tandem::detail::AtomicFile file(path);
  file.write(length.data(), length.size());
  file.write(text.data(), text.size());
  for (const auto& t : host) file.write(t.raw_data(), t.nbytes());
  file.commit();
  return length.size() + text.size();
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
  if (auto problem = tandem::detail::parse_json(text, header)) {
    throw DataLoss(fmt::format("\"{}\": the header: {}", path, *problem));
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
        throw DataLoss(fmt::format("\"{}\": __metadata__ is {}, not an object", path, show(value)));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          throw DataLoss(fmt::format("\"{}\": metadata {} is {}, not a string", path, quote_value(mk), show(mv)));
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
      throw DataLoss(fmt::format("\"{}\": tensor {} at bytes [{}, {}] overlaps tensor {}, which ends at {}", path,
                                 quote_value(e.name), e.begin, e.end, quote_value(previous->name), covered));
    }
    if (e.begin > covered) {
      throw DataLoss(fmt::format("\"{}\": {} unused bytes at data offset {}, before tensor {}", path, e.begin - covered,
                                 covered, quote_value(e.name)));
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
  std::uint32_t crc = detail::crc32_initial();
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
      throw DataLoss(fmt::format("\"{}\": checksum {} in the metadata is not \"crc32:<8 hex digits>\"", path,
                                 quote_value(expected)));
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

}  // namespace tandem::keras
