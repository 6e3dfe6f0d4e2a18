// tandem/collective/detail/socket.h — the TCP store's sockets: an owning descriptor, sends and
// receives on non-blocking sockets bounded by a deadline, receiving one frame, one connection
// attempt, and the listening sockets. The store's client (tcp_store_client.cc) and server
// (tcp_store_server.cc) use them; the frames that travel over them are store_wire.h's. Not part
// of the public contract.
//
// Nothing here throws or blocks past its deadline: every call says what happened (an IoResult,
// or an empty Fd with the reason), and the caller words the error for the call it was making.
#pragma once

#include <sys/socket.h>

#include <string>
#include <string_view>
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

// Reads one frame's payload (store_wire.h). `deadline` bounds the wait for its first byte; once
// that has come, the rest is in flight and gets until `rest_deadline` (a reply cut off halfway
// would leave the connection unusable, where a reply not yet begun can still be cancelled). A
// length above wire::kMaxFrameBytes is kError (EPROTO).
IoResult recv_frame(int fd, std::vector<char>& frame, Deadline deadline, Deadline rest_deadline);

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

// Whether `host` asks for every interface: "", "0.0.0.0", "::" or "*".
bool is_any_host(std::string_view host);

// Non-blocking sockets listening on `port` (SO_REUSEADDR) of `host`: every address it resolves
// to (e.g. 127.0.0.1 and ::1 for "localhost"), or every interface for is_any_host (IPv6
// dual-stack where the machine has IPv6, IPv4 otherwise). Port 0: the kernel picks one for the
// first address and the others take the same. On failure no socket, and `error` says why, with
// `bind_errno` the errno (EADDRINUSE when the port is taken; 0 when the host did not resolve).
struct Listeners {
  std::vector<Fd> fds;
  int bind_errno = 0;
  std::string error;
};
Listeners bind_listeners(const std::string& host, int port);
// The address a bound socket listens on: its port (the one the kernel picked, for port 0), and
// whether it is a loopback or wildcard address.
struct BoundAddress {
  std::string text;  // "127.0.0.1:2222", "[::1]:2222", "[::]:2222"
  int port = 0;
  bool loopback = false;
  bool any = false;
};
BoundAddress bound_address(int fd);

}  // namespace tandem::collective::detail
