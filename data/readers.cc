// IDX and CSV readers. Both read through zlib's gz* functions, which read plain files as they are
// and decompress gzip files, so "train-images-idx3-ubyte" and "train-images-idx3-ubyte.gz" take
// the same path. Offsets in error messages count bytes of the (decompressed) content, which is
// what a hex dump of the gunzipped file shows.
#include "tandem/data/readers.h"

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string_view>
#include <system_error>

#include "tandem/base/detail/text.h"
#include "tandem/base/errors.h"
#include "tandem/data/detail/readers.h"

namespace tandem::data {
namespace {

// zlib's default buffer is 8 KiB; a larger one halves the time to inflate the MNIST images. A
// small file gets a buffer of its size (zlib takes three times the buffer), down to the default.
constexpr unsigned kGzBufferBytes = 256 * 1024;
constexpr unsigned kMinGzBufferBytes = 8 * 1024;
// gzread takes an unsigned int count; larger reads go in pieces of this size.
constexpr std::size_t kReadChunkBytes = std::size_t{1} << 30;
// No real IDX file comes near 16 GiB; a header asking for more is corrupt, and we say so rather
// than attempt the allocation.
constexpr std::uint64_t kMaxIdxDataBytes = std::uint64_t{1} << 34;
constexpr std::size_t kIdxMagicBytes = 4;
// A gzip stream does not say how much it inflates to, so its data is read into memory that grows
// with what arrives, from this much up, each step at most doubling it.
constexpr std::size_t kMinStagingBytes = std::size_t{1} << 20;

// A file opened for reading through zlib. Callers: one thread at a time.
class GzFile {
 public:
  GzFile(const std::string& path, std::string_view not_found_hint) : path_(path) {
    std::error_code ec;
    TANDEM_REQUIRE(!std::filesystem::is_directory(path, ec), FailedPrecondition, "{}: is a directory, not a file",
                   path);
    errno = 0;
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr) {
      const int error = errno;
      TANDEM_REQUIRE(error != ENOENT && error != ENOTDIR, NotFound, "{}: no such file{}", path, not_found_hint);
      throw FailedPrecondition(fmt::format("{}: cannot open: {}", path,
                                           error != 0 ? std::generic_category().message(error) : "out of memory"));
    }
    const auto size = std::filesystem::file_size(path, ec);
    gzbuffer(file_, ec ? kGzBufferBytes
                       : static_cast<unsigned>(std::clamp<std::uintmax_t>(size, kMinGzBufferBytes, kGzBufferBytes)));
  }
  ~GzFile() { gzclose_r(file_); }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  // Reads up to `bytes` bytes; fewer only at the end of the file. A corrupt gzip stream raises
  // DataLoss; a gzip stream cut short reads as a short file (truncated_note() then says why).
  std::size_t read(void* destination, std::size_t bytes) {
    auto* out = static_cast<char*>(destination);
    std::size_t done = 0;
    while (done < bytes) {
      const auto chunk = static_cast<unsigned>(std::min(bytes - done, kReadChunkBytes));
      const int got = gzread(file_, out + done, chunk);
      if (got < 0) {
        int code = Z_OK;
        const char* message = gzerror(file_, &code);
        throw DataLoss(fmt::format("{}: cannot read after byte offset {}: {}", path_, offset_ + done,
                                   code == Z_ERRNO ? std::generic_category().message(errno) : std::string(message)));
      }
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
    }
    offset_ += done;
    return done;
  }

  // Where the reader stands: bytes of content read so far.
  std::uint64_t offset() const { return offset_; }

  // The content's size when the file is not compressed (its size on disk), known after the first
  // read; nullopt for a gzip stream, whose inflated size is known only by reading it.
  std::optional<std::uint64_t> plain_size() const {
    if (gzdirect(file_) == 0) return std::nullopt;
    std::error_code ec;
    const auto size = std::filesystem::file_size(path_, ec);
    if (ec) return std::nullopt;
    return static_cast<std::uint64_t>(size);
  }

  // Whether the content ended because the compressed stream is cut short: zlib reads it as a
  // short file and records Z_BUF_ERROR ("unexpected end of file").
  bool stream_truncated() {
    int code = Z_OK;
    gzerror(file_, &code);
    return code == Z_BUF_ERROR;
  }

  // Why the content ended early: for a gzip file whose compressed stream is cut short, zlib
  // reports it, and the user should know the .gz file itself is truncated.
  std::string truncated_note() {
    if (stream_truncated()) return " (the gzip stream ends early: the compressed file is truncated)";
    return gzdirect(file_) ? "" : " (offsets count decompressed bytes)";
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
  std::uint64_t offset_ = 0;
};

// ---------------------------------------------------------------------------------------------
// IDX

struct IdxType {
  std::uint8_t code;
  const char* name;
  std::size_t bytes;  // per element in the file
  DType dtype;        // in memory
};

// The IDX element types (the third byte of the magic number). int8 and int16 widen to int32,
// tandem's narrowest signed type.
constexpr IdxType kIdxTypes[] = {
    {0x08, "uint8", 1, DType::kU8},  {0x09, "int8", 1, DType::kI32},    {0x0B, "int16", 2, DType::kI32},
    {0x0C, "int32", 4, DType::kI32}, {0x0D, "float32", 4, DType::kF32}, {0x0E, "float64", 8, DType::kF64},
};

const IdxType* find_idx_type(std::uint8_t code) {
  for (const auto& t : kIdxTypes) {
    if (t.code == code) return &t;
  }
  return nullptr;
}

std::uint32_t load_big_endian_u32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | std::uint32_t{p[3]};
}

// Converts big-endian `Word`s to host order, in place. memcpy in and out keeps it free of aliasing
// questions; compilers turn the loop into vector byte shuffles.
template <class Word>
void swap_from_big_endian(void* data, std::int64_t count) {
  if constexpr (std::endian::native == std::endian::little) {
    auto* p = static_cast<unsigned char*>(data);
    for (std::int64_t i = 0; i < count; ++i) {
      Word w;
      std::memcpy(&w, p + i * static_cast<std::int64_t>(sizeof(Word)), sizeof(Word));
      if constexpr (sizeof(Word) == 2) w = __builtin_bswap16(w);
      if constexpr (sizeof(Word) == 4) w = __builtin_bswap32(w);
      if constexpr (sizeof(Word) == 8) w = __builtin_bswap64(w);
      std::memcpy(p + i * static_cast<std::int64_t>(sizeof(Word)), &w, sizeof(Word));
    }
  }
}

}  // namespace

namespace detail {

Tensor read_idx(const std::string& path, std::string_view not_found_hint) {
  GzFile file(path, not_found_hint);

  std::uint8_t magic[kIdxMagicBytes] = {};
  if (const auto got = file.read(magic, kIdxMagicBytes); got < kIdxMagicBytes) {
    throw DataLoss(
        fmt::format("{}: truncated header: the file ends at byte offset {}; expected a {}-byte IDX "
                    "magic number{}",
                    path, got, kIdxMagicBytes, file.truncated_note()));
  }
  const IdxType* type = find_idx_type(magic[2]);
  if (magic[0] != 0 || magic[1] != 0 || type == nullptr) {
    throw DataLoss(fmt::format(
        "{}: not an IDX file: the magic number at byte offset 0 is {:02x} {:02x} {:02x} {:02x}; expected 00 00, "
        "a type byte (08 uint8, 09 int8, 0b int16, 0c int32, 0d float32, 0e float64) and the rank",
        path, magic[0], magic[1], magic[2], magic[3]));
  }
  const int rank = magic[3];
  TANDEM_REQUIRE(rank <= Shape::kMaxRank, Unimplemented,
                 "{}: the IDX header (byte offset 3) gives rank {}; tandem tensors have at most {} dimensions", path,
                 rank, Shape::kMaxRank);

  std::uint8_t dim_bytes[4 * Shape::kMaxRank] = {};
  const std::size_t dims_size = 4 * static_cast<std::size_t>(rank);
  if (const auto got = file.read(dim_bytes, dims_size); got < dims_size) {
    throw DataLoss(
        fmt::format("{}: truncated header at byte offset {}: expected {} bytes of dimensions (rank {}) "
                    "from byte offset {}, got {}{}",
                    path, kIdxMagicBytes + got, dims_size, rank, kIdxMagicBytes, got, file.truncated_note()));
  }
  Shape shape;
  std::uint64_t count = 1;
  // The product of the dimensions other than 0 is bounded too: a shape of 0 x 4G x 4G x 4G has no
  // data, but code that multiplies its dimensions in another order would overflow.
  std::uint64_t nonzero = 1;
  for (int d = 0; d < rank; ++d) {
    const std::uint32_t dim = load_big_endian_u32(dim_bytes + 4 * d);
    shape.push_back(dim);
    // Check before multiplying, so the product itself cannot overflow.
    if (dim != 0 && nonzero > kMaxIdxDataBytes / type->bytes / dim) {
      throw DataLoss(
          fmt::format("{}: the IDX header's dimensions (byte offsets {} to {}) multiply to more than "
                      "{} bytes of {} data; the header is corrupt",
                      path, kIdxMagicBytes, kIdxMagicBytes + dims_size - 1, kMaxIdxDataBytes, type->name));
    }
    if (dim != 0) nonzero *= dim;
    count *= dim;
  }
  const std::uint64_t header_bytes = kIdxMagicBytes + dims_size;
  const std::uint64_t data_bytes = count * type->bytes;
  const auto truncated = [&](std::uint64_t got) {
    return DataLoss(fmt::format(
        "{}: truncated data at byte offset {}: the header declares {} {} values of shape {} "
        "({} bytes from byte offset {}), but only {} bytes follow{}",
        path, header_bytes + got, count, type->name, shape, data_bytes, header_bytes, got, file.truncated_note()));
  };

  // What the header declares is checked against what the file holds before anything is
  // allocated: a 16-byte file declaring 13 GB is refused from its size (plain), or by reading
  // into memory that grows only with the data that arrives (gzip).
  const auto plain_size = file.plain_size();
  if (plain_size && *plain_size < header_bytes + data_bytes) throw truncated(*plain_size - header_bytes);
  // Same width in the file and in memory: a plain file reads straight into the tensor. Otherwise
  // the bytes are staged, then copied or widened.
  const bool direct = graph::dtype_size(type->dtype) == type->bytes;
  std::vector<unsigned char> staging;
  Tensor out;
  if (plain_size && direct) {
    out = Tensor::empty(shape, type->dtype);
    const auto got = file.read(out.raw_data(), static_cast<std::size_t>(data_bytes));
    if (got < data_bytes) throw truncated(got);  // the file shrank under us
  } else {
    std::size_t have = 0;
    while (have < data_bytes) {
      const auto want =
          static_cast<std::size_t>(std::min<std::uint64_t>(data_bytes, std::max(2 * have, kMinStagingBytes)));
      staging.resize(want);
      const auto got = file.read(staging.data() + have, want - have);
      have += got;
      if (have < want) throw truncated(have);
    }
    out = Tensor::empty(shape, type->dtype);
    if (direct && data_bytes > 0) std::memcpy(out.raw_data(), staging.data(), static_cast<std::size_t>(data_bytes));
  }
  const auto n = static_cast<std::int64_t>(count);
  unsigned char extra = 0;
  if (file.read(&extra, 1) != 0) {
    throw DataLoss(
        fmt::format("{}: the data the header declares ({} {} values of shape {}) ends at byte offset {}, "
                    "but the file goes on; the header does not match the file",
                    path, count, type->name, shape, header_bytes + data_bytes));
  }

  switch (type->code) {
    case 0x08: break;
    case 0x09: {
      auto* dst = out.data<std::int32_t>();
      for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<std::int8_t>(staging[static_cast<std::size_t>(i)]);
      break;
    }
    case 0x0B: {
      swap_from_big_endian<std::uint16_t>(staging.data(), n);
      auto* dst = out.data<std::int32_t>();
      for (std::int64_t i = 0; i < n; ++i) {
        std::int16_t v;
        std::memcpy(&v, staging.data() + 2 * i, sizeof(v));
        dst[i] = v;
      }
      break;
    }
    case 0x0C:
    case 0x0D: swap_from_big_endian<std::uint32_t>(out.raw_data(), n); break;
    case 0x0E: swap_from_big_endian<std::uint64_t>(out.raw_data(), n); break;
    default: TANDEM_ASSERT(false, "IDX type {:#04x} is in kIdxTypes but has no conversion", type->code);
  }
  return out;
}

std::string read_file(const std::string& path, std::string_view not_found_hint, std::uint64_t max_bytes) {
  GzFile file(path, not_found_hint);
  std::string content;
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  constexpr std::size_t kMinChunkBytes = 1 << 16;
  // One byte more than the limit, so that content over it is seen.
  const std::uint64_t wanted = max_bytes == std::numeric_limits<std::uint64_t>::max() ? max_bytes : max_bytes + 1;
  std::size_t chunk = ec ? kMinChunkBytes : std::max<std::size_t>(static_cast<std::size_t>(size) + 1, kMinChunkBytes);
  for (;;) {
    const auto used = content.size();
    chunk = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, wanted - used));
    content.resize(used + chunk);
    const auto got = file.read(content.data() + used, chunk);
    content.resize(used + got);
    if (got < chunk || content.size() >= wanted) break;
    chunk = std::max(chunk, content.size());  // a gzip file inflates: grow geometrically
  }
  TANDEM_REQUIRE(content.size() <= max_bytes, DataLoss, "{}: larger than {} bytes{}; not a file of this kind", path,
                 max_bytes, file.plain_size() ? "" : " once decompressed");
  // A cut gzip stream reads as a short file; the content would be silently incomplete.
  TANDEM_REQUIRE(!file.stream_truncated(), DataLoss,
                 "{}: the gzip stream ends early after {} decompressed bytes: the compressed file is truncated", path,
                 content.size());
  return content;
}

}  // namespace detail

Tensor read_idx(const std::string& path) { return detail::read_idx(path, ""); }

// ---------------------------------------------------------------------------------------------
// CSV

namespace {

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t");
  return s.substr(first, last - first + 1);
}

// Splits a line at `delimiter` into `fields` (views into `line`), trimmed of spaces.
void split_fields(std::string_view line, char delimiter, std::vector<std::string_view>& fields) {
  fields.clear();
  std::size_t start = 0;
  for (;;) {
    const auto end = line.find(delimiter, start);
    fields.push_back(trim(line.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start)));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
}

}  // namespace

CsvTable read_csv(const std::string& path, const CsvOptions& options) {
  TANDEM_REQUIRE(options.delimiter != '\n' && options.delimiter != '\r', InvalidArgument,
                 "read_csv {}: the delimiter cannot be a line break", path);
  const std::string content = detail::read_file(path, "");

  CsvTable table;
  std::vector<float> values;
  std::vector<std::string_view> fields;
  std::size_t columns = 0;
  std::int64_t rows = 0;
  std::int64_t shape_line = 0;  // the line that fixed the column count
  bool header_pending = options.header;

  std::int64_t line_number = 0;
  for (std::size_t pos = 0; pos < content.size();) {
    auto end = content.find('\n', pos);
    if (end == std::string::npos) end = content.size();
    std::string_view line(content.data() + pos, end - pos);
    pos = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (trim(line).empty()) continue;

    split_fields(line, options.delimiter, fields);
    if (header_pending) {
      header_pending = false;
      for (auto f : fields) {
        if (f.size() >= 2 && f.front() == '"' && f.back() == '"') f = f.substr(1, f.size() - 2);
        table.column_names.emplace_back(f);
      }
      columns = fields.size();
      shape_line = line_number;
      continue;
    }
    if (shape_line == 0) {
      columns = fields.size();
      shape_line = line_number;
      for (std::size_t c = 0; c < columns; ++c) table.column_names.push_back(fmt::format("column_{}", c));
    }
    if (fields.size() != columns) {
      const auto column = std::min(fields.size(), columns) + 1;
      throw DataLoss(fmt::format("{}: line {}, column {}: {}; the row has {} fields, but line {} has {}", path,
                                 line_number, column, fields.size() < columns ? "missing field" : "extra field",
                                 fields.size(), shape_line, columns));
    }
    for (std::size_t c = 0; c < columns; ++c) {
      std::string_view text = fields[c];
      if (text.size() > 1 && text.front() == '+') text.remove_prefix(1);  // from_chars takes no '+'
      float value = 0.0f;
      const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (ec != std::errc() || ptr != text.data() + text.size() || text.empty()) {
        throw DataLoss(fmt::format("{}: line {}, column {} ({}): {} is {}", path, line_number, c + 1,
                                   tandem::detail::quote_value(table.column_names[c]),
                                   tandem::detail::quote_value(fields[c]),
                                   ec == std::errc::result_out_of_range ? "out of float32's range" : "not a number"));
      }
      values.push_back(value);
    }
    ++rows;
  }
  // A table with no columns is no table: an empty file (or one of blank lines) is a mistake,
  // such as a download that failed, and training on it would fail later and less clearly.
  TANDEM_REQUIRE(shape_line != 0, DataLoss, "{}: empty: {}", path, options.header ? "no header row" : "no rows");
  table.values = Tensor::from_vector<float>(values, Shape{rows, static_cast<std::int64_t>(columns)});
  return table;
}

}  // namespace tandem::data
