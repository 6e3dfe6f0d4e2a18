// Finding a process's connections by their endpoints, and shutting them down through duplicates
// (peer_sockets.h).
#include "tandem/collective/detail/peer_sockets.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <optional>

namespace tandem::collective::detail {
namespace {

// The descriptor's two endpoints, or nothing for a descriptor that is not a connected socket.
std::optional<Endpoints> endpoints_of(int fd) {
  Endpoints e;
  socklen_t local_length = sizeof(e.local), peer_length = sizeof(e.peer);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&e.local), &local_length) != 0) return std::nullopt;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&e.peer), &peer_length) != 0) return std::nullopt;  // a listener
  return e;
}

bool same_connection(const Endpoints& a, const Endpoints& b) {
  return same_endpoint(a.local, b.local) && same_endpoint(a.peer, b.peer);
}

}  // namespace

bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && std::memcmp(&x.sin_addr, &y.sin_addr, sizeof(x.sin_addr)) == 0;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr)) == 0;
  }
  return false;
}

std::vector<char> encode_endpoints(const std::vector<sockaddr_storage>& addresses) {
  std::vector<char> bytes;
  const auto append = [&](const void* data, std::size_t size) {
    const auto* p = static_cast<const char*>(data);
    bytes.insert(bytes.end(), p, p + size);
  };
  for (const sockaddr_storage& a : addresses) {
    if (a.ss_family == AF_INET) {
      const auto& x = reinterpret_cast<const sockaddr_in&>(a);
      bytes.push_back('4');
      append(&x.sin_port, sizeof(x.sin_port));
      append(&x.sin_addr, sizeof(x.sin_addr));
    } else if (a.ss_family == AF_INET6) {
      const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
      bytes.push_back('6');
      append(&x.sin6_port, sizeof(x.sin6_port));
      append(&x.sin6_addr, sizeof(x.sin6_addr));
    } else {
      bytes.push_back('-');  // none (this rank's own entry)
    }
  }
  return bytes;
}

std::optional<std::vector<sockaddr_storage>> decode_endpoints(const std::vector<char>& bytes) {
  std::vector<sockaddr_storage> addresses;
  std::size_t at = 0;
  const auto take = [&](void* into, std::size_t size) {
    if (bytes.size() - at < size) return false;
    std::memcpy(into, bytes.data() + at, size);
    at += size;
    return true;
  };
  while (at < bytes.size()) {
    sockaddr_storage a{};
    const char kind = bytes[at++];
    if (kind == '4') {
      auto& x = reinterpret_cast<sockaddr_in&>(a);
      x.sin_family = AF_INET;
      if (!take(&x.sin_port, sizeof(x.sin_port)) || !take(&x.sin_addr, sizeof(x.sin_addr))) return std::nullopt;
    } else if (kind == '6') {
      auto& x = reinterpret_cast<sockaddr_in6&>(a);
      x.sin6_family = AF_INET6;
      if (!take(&x.sin6_port, sizeof(x.sin6_port)) || !take(&x.sin6_addr, sizeof(x.sin6_addr))) return std::nullopt;
    } else if (kind != '-') {
      return std::nullopt;
    }
    addresses.push_back(a);
  }
  return addresses;
}

bool PeerSocket::closed_by_owner() const {
  const std::optional<Endpoints> now = endpoints_of(fd_);
  return !now || !same_connection(*now, endpoints_);
}

void PeerSocket::shut_down() const { ::shutdown(duplicate_.get(), SHUT_RDWR); }

std::vector<PeerSocket> find_peer_sockets(const std::vector<Endpoints>& connections) {
  std::vector<PeerSocket> found;
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return found;
  while (const dirent* entry = readdir(fds)) {
    char* end = nullptr;
    const long number = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || number == dirfd(fds)) continue;
    const int fd = static_cast<int>(number);
    const std::optional<Endpoints> e = endpoints_of(fd);
    if (!e) continue;
    for (const Endpoints& wanted : connections) {
      if (!same_connection(*e, wanted)) continue;
      Fd duplicate(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
      if (duplicate) found.emplace_back(fd, *e, std::move(duplicate));
      break;
    }
  }
  closedir(fds);
  return found;
}

}  // namespace tandem::collective::detail
