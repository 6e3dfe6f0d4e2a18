// tandem/base/detail/atomic_file.h — the atomic writer of every file tandem saves (weights and
// checkpoints in keras_like/safetensors.cc, text vocabularies in data/text.cc).
//
// An AtomicFile is a temporary file .NAME.tmp-HOST-PID-N next to the destination, renamed into
// place by commit(), so that a crash never leaves half a file under the final name; making one
// first removes the temporaries that killed writers left for the same destination (atomic_file.cc
// says which, and why a live writer's never are). Used by one thread at a time; write() and
// commit() block on the file system. Every failure raises Unavailable naming the destination and
// the system's reason.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace tandem::detail {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  // Removes the temporary file unless commit() renamed it.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Buffered: small pieces go out together, big ones straight from their memory.
  void write(const void* data, std::size_t bytes);
  // Flushes, syncs and renames the temporary file to the destination.
  void commit();

 private:
  static constexpr std::size_t kBufferBytes = std::size_t{4} << 20;

  [[noreturn]] void fail(int error) const;
  void flush_buffer();
  void write_fully(const void* data, std::size_t bytes);

  std::string path_;
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<char> buffer_;
};

}  // namespace tandem::detail
