// tandem/collective/detail/socket.h — the TCP store's sockets: an owning descriptor, sends and
// receives on non-blocking sockets bounded by a deadline, one connection attempt, and the
// listening socket. The store's client (tcp_store_client.cc) and server (tcp_store_server.cc) use
// them; the frames that travel over them are store_wire.h's. Not part of the public contract.
//
// Nothing here throws or blocks past its deadline: every call says what happened (an IoResult,
// or an empty Fd with the reason), and the caller words the error for the call it was making.
#pragma once

#include <sys/socket.h>

#include <string>
#include <utility>
#include <vector>

#include "tandem/collective/detail/common.h"
#include "tandem/collective/tcp_store.h"

namespace tandem::collective::detail {

using Deadline = Clock::time_point;

// Owns a file descriptor: closed when reset or destroyed.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset();

 private:
  int fd_ = -1;
};

enum class IoKind { kOk, kTimeout, kClosed, kError };
struct IoResult {
  IoKind kind = IoKind::kOk;
  int err = 0;  // errno, for kError
};

// "connection refused": strerror, thread-safe, in the lower case messages use mid-sentence.
std::string socket_error_text(int err);

// Waits until fd is ready for `events` (or hung up / failed: the next read or write says how).
IoResult wait_ready(int fd, short events, Deadline deadline);
// Sends every byte, waiting for the socket to drain as needed.
IoResult send_all(int fd, const std::vector<char>& data, Deadline deadline);
// Receives exactly `size` bytes; kClosed when the peer closed first.
IoResult recv_all(int fd, char* data, std::size_t size, Deadline deadline);

// Requests are small and answered one at a time: Nagle's delay would only add latency.
void set_no_delay(int fd);
// A peer's machine that vanishes (power, network) sends no FIN: keepalive probes close its
// connection after about a minute (see socket.cc), so that the server notices.
void enable_keepalive(int fd);
// "10.0.0.2:41234", "[::1]:2222" (IPv4-mapped IPv6 addresses print as IPv4).
std::string format_sockaddr(const sockaddr* addr, socklen_t length);

// One connection attempt to every address `target` resolves to, in order. Returns a connected,
// non-blocking socket with TCP_NODELAY, or an empty Fd and *error saying why the last attempt
// failed.
Fd connect_once(const HostPort& target, Deadline deadline, std::string* error);

// A non-blocking socket listening on `port` of every interface (IPv6 dual-stack where the
// machine has IPv6, IPv4 otherwise; SO_REUSEADDR), or an empty Fd with *bind_errno set.
Fd bind_listener(int port, int* bind_errno);
// The port a bound socket listens on (the one the kernel picked, for port 0).
int bound_port(int fd);

}  // namespace tandem::collective::detail
