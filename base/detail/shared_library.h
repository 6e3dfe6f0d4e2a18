// tandem/base/detail/shared_library.h — optional libraries opened at run time (dlopen).
//
// cuBLAS, cuDNN, NCCL and OpenBLAS are opened at first use instead of linked: libtandem then
// starts where they are missing, and the path that needs one says why it is unavailable. Each
// user keeps its own table of function pointers; this is the opening and the lookup they share.
#pragma once

#include <dlfcn.h>

#include <initializer_list>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace tandem::detail {

struct SharedLibrary {
  void* handle = nullptr;  // null when no candidate loaded; never closed (the process keeps it)
  std::string name;        // the candidate that loaded
  std::string tried;       // when none did: each candidate's dlerror, "; "-separated
};

// Opens the first of `candidates` (names or paths, in order; empty ones are skipped) that dlopen
// loads with RTLD_NOW | RTLD_LOCAL. Callers: any thread (dlopen is thread-safe); loaders call it
// once, from a function-local static's initialiser.
inline SharedLibrary open_first_library(std::initializer_list<std::string_view> candidates) {
  SharedLibrary library;
  for (const std::string_view candidate : candidates) {
    if (candidate.empty()) continue;
    const std::string name(candidate);
    library.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library.handle != nullptr) {
      library.name = name;
      library.tried.clear();
      return library;
    }
    const char* why = dlerror();
    library.tried += fmt::format("{}{}", library.tried.empty() ? "" : "; ", why != nullptr ? why : name);
  }
  return library;
}

// Sets `fn` to `symbol` of `library` (null when missing). When it is missing, `problem` is given
// and still empty, *problem becomes "<label> has no <symbol>": the first missing function names
// the problem. An optional function passes no problem.
template <class Fn>
void load_symbol(const SharedLibrary& library, Fn& fn, const char* symbol, std::string_view label = {},
                 std::string* problem = nullptr) {
  fn = reinterpret_cast<Fn>(dlsym(library.handle, symbol));
  if (fn == nullptr && problem != nullptr && problem->empty()) *problem = fmt::format("{} has no {}", label, symbol);
}

}  // namespace tandem::detail
