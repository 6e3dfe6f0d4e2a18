// Helpers shared by the fuzzing harnesses (tests/fuzz/*_fuzzer.cc): the input as a file for
// readers that take a path, a scratch folder for writers, and the check that stops a run when a
// harness's invariant fails. Single-threaded, like libFuzzer's calls.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace tandem::fuzz {

// Stops the run when cond fails: libFuzzer (or the replaying main) reports the input.
#define TANDEM_FUZZ_CHECK(cond) \
  do { \
    if (!(cond)) { \
      std::fprintf(stderr, "fuzz check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort(); \
    } \
  } while (false)

// The input as a file that readers open by path. One memory file for the process (memfd, so no
// disk write per input and nothing left behind by a crash), rewritten for each input and opened
// through /proc/self/fd/N.
inline const std::string& input_file(const std::uint8_t* data, std::size_t size) {
  static const int fd = ::memfd_create("tandem-fuzz-input", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  TANDEM_FUZZ_CHECK(fd >= 0);
  TANDEM_FUZZ_CHECK(::ftruncate(fd, 0) == 0);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    TANDEM_FUZZ_CHECK(n > 0);
    done += static_cast<std::size_t>(n);
  }
  return path;
}

// A folder of the process's own for files a harness writes, in memory when /dev/shm exists,
// removed when the process exits normally.
inline const std::filesystem::path& scratch_folder() {
  struct Folder {
    std::filesystem::path path;
    Folder() {
      const std::filesystem::path base = std::filesystem::exists("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                                             : std::filesystem::temp_directory_path();
      path = base / ("tandem-fuzz-" + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
    }
    ~Folder() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Folder folder;
  return folder.path;
}

}  // namespace tandem::fuzz
