// tandem/collective/tcp_store.h — the store served over TCP by the chief, and its clients.
//
// The chief (rank 0) starts a TcpStoreServer on the port its cluster spec names; every rank
// (the chief too) connects a client with connect_tcp_store and uses it as a Store. The server is
// one thread polling every connection; a get/wait whose key is not there yet is parked on the
// server and answered when the key arrives, so waiting clients never block other clients.
//
// Liveness. A client may announce its rank (TcpStoreOptions::rank). If that client's process dies
// (its connection closes without the goodbye the client's destructor sends), the server sets
//     lost_key_prefix + lost_rank_key(rank)  =  a short reason, e.g. "connection from
//                                              10.0.0.2:41234 closed without goodbye"
// so that surviving ranks can name who died (the Gloo communicator reads these keys after a
// failed collective). A clean exit (the client destroyed) sets nothing. A machine that vanishes
// without closing its sockets is noticed by TCP keepalive, within about a minute. One live
// connection per (lost_key_prefix, rank): a second client announcing the same rank is refused
// (InvalidArgument).
//
// Client threading: the client is thread-safe. Every call takes a connection of its own from a
// small pool (opening another when all are busy), so a get waiting for a key does not hold up
// other threads of the same process. The connection that announced the rank carries no requests:
// it only says hello and goodbye.
//
// Sizes: a key and its value together up to 256 MiB less 1 KiB (set throws InvalidArgument above).
//
// Counters written by add() are decimal text, so get() of a counter reads "3". The wire format
// (frames of a little-endian u32 length and that many bytes) is collective/detail/store_wire.h's;
// the server is tcp_store_server.cc, the client tcp_store_client.cc.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "tandem/collective/store.h"

namespace tandem::collective {

// The key (under TcpStoreOptions::lost_key_prefix) the server sets when the client that announced
// `rank` goes away without saying goodbye: "tandem/lost/3".
std::string lost_rank_key(int rank);

struct TcpStoreOptions {
  // How long a client keeps trying to connect (the server may start later than the client).
  std::chrono::milliseconds connect_timeout = kDefaultRendezvousTimeout;
  // Pause between connection attempts; it grows by half each attempt up to kMaxRetryInterval.
  std::chrono::milliseconds retry_interval = std::chrono::milliseconds(100);
  // How messages name the server's owner, e.g. "chief": "the store at 10.0.0.1:2222 (served by
  // chief)". Empty: the address alone.
  std::string label_of_server;
  // Bounds the calls that wait for nobody (set, check, add, and sending any request): a live
  // server answers at once, so this only matters when the server's machine hangs.
  std::chrono::milliseconds request_timeout = std::chrono::minutes(1);
  // The rank this client announces for liveness (see above); -1: none.
  int rank = -1;
  // Where the server writes this rank's lost key: rendezvous passes its run's prefix, so the key
  // reads as lost_rank_key(rank) through the run's prefixed store.
  std::string lost_key_prefix;
};

inline constexpr std::chrono::milliseconds kMaxRetryInterval = std::chrono::seconds(1);

// "host:port" split; IPv6 hosts are bracketed ("[::1]:2222"). InvalidArgument naming the address
// when it has no port or the port is not in 0..65535.
struct HostPort {
  std::string host;
  int port = 0;
};
HostPort parse_host_port(std::string_view address);

// The chief's side. Who calls: rank 0 only. Non-blocking: serves on its own thread until destroyed.
class TcpStoreServer {
 public:
  // Listens on every interface on `port` (SO_REUSEADDR, so a restarted job gets the port back at
  // once; port 0 = any free port). `host` is how address() names this machine. AlreadyExists
  // naming the address when the port is taken; Unavailable for any other socket failure.
  static std::unique_ptr<TcpStoreServer> start(std::string_view host, int port);

  // The port it listens on (the one picked, for port 0).
  int port() const;
  // "host:port".
  std::string address() const;

  // Stops serving, closes every connection (clients' pending and later calls throw Unavailable)
  // and joins the serving thread.
  ~TcpStoreServer();

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  class Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Connects a client to the store at `address` ("host:port"). Blocks while it retries (the server
// may start later), until options.connect_timeout: then DeadlineExceeded naming the address, the
// server's label and the last socket error (e.g. "connection refused"). InvalidArgument for a
// malformed address, or when options.rank is already announced by another live client.
// The returned store's calls throw Unavailable naming the server when the connection breaks
// (the server went away), and DeadlineExceeded naming the keys when a get/wait times out. Its
// destructor says goodbye (bounded by a few seconds; never throws).
std::shared_ptr<Store> connect_tcp_store(std::string_view address, TcpStoreOptions options = {});

}  // namespace tandem::collective
