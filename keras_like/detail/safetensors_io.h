// tandem/keras_like/detail/safetensors_io.h — the file reading, dtype names and CRC-32 that the
// safetensors codec (safetensors.cc) and the sharded checkpoint reader (sharded_checkpoint.cc)
// share, so that both read files, name dtypes and hash bytes one way. Defined in safetensors.cc.
// ReadFile blocks on the file system; every failure throws (NotFound for a missing file,
// Unavailable for a system error, DataLoss for a file shorter than a read needs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tandem/graph/tensor.h"

namespace tandem::keras::detail {

// A file opened for reading at given offsets (pread): what lets a reader fetch a few byte ranges
// of a large file without reading the rest.
class ReadFile {
 public:
  // NotFound when there is no such file; InvalidArgument when it is not a regular file.
  explicit ReadFile(const std::string& path);
  ~ReadFile();
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  std::uint64_t size() const { return size_; }
  // Reads exactly `bytes` at `offset`; the file ending first is DataLoss (truncated).
  void read(void* dst, std::size_t bytes, std::uint64_t offset) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// The format's dtype names ("F32", ...); nullopt for a dtype it cannot hold / a name it lacks.
std::optional<std::string_view> safetensors_dtype(DType dtype);
std::optional<DType> parse_safetensors_dtype(std::string_view name);

// zlib's CRC-32 (the polynomial of gzip and PNG), continued from `crc`; crc32_initial() starts one.
std::uint32_t crc32_initial();
std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t bytes);

}  // namespace tandem::keras::detail
