// tandem/collective/tcp_store.h — the store served over TCP by the chief, and its clients.
//
// The chief (rank 0) starts a TcpStoreServer on the address its cluster spec names; every rank
// (the chief too) connects a client with connect_tcp_store and uses it as a Store. The server is
// one thread polling every connection; a get/wait whose key is not there yet is parked on the
// server and answered when the key arrives, so waiting clients never block other clients.
//
// Authentication. With a shared secret (TcpStoreServerOptions::secret / TcpStoreOptions::secret,
// else the environment variable TANDEM_STORE_SECRET; the same everywhere), every connection
// starts with a challenge-response handshake (HMAC-SHA256 over fresh nonces from both sides,
// detail/store_auth.h): a peer that cannot prove it holds the secret is refused before it can
// read or write a key, the server logs who it refused, and the client throws Unauthenticated
// ("... refused this process: TANDEM_STORE_SECRET differs"). The server proves it holds the
// secret too, so a client never talks to an impostor. Without a secret every peer is served; the
// server then warns when it listens beyond loopback. The secret is never logged. Traffic is not
// encrypted: the README's "Threat model" says what this does and does not defend.
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
// Keys that belong to a rank. A key with the path segments "rank/<r>" (e.g.
// "run/0/rendezvous/rank/1", "run/0/rendezvous/rank/1/claims") may be set or added only by the
// client that announced rank r, and only under the lost_key_prefix it announced with; lost keys
// ("tandem/lost/<r>") only by the server. Anyone may read any key. Another writer gets
// PermissionDenied naming the key and the rank: one process cannot pass itself off as another
// rank by writing that rank's keys (the rendezvous's arrival and claim keys live there).
//
// Bounds (TcpStoreServerOptions): connections; bytes buffered across connections (requests
// arriving, replies unsent, parked requests), a connection whose unsent replies pile up is not
// read until they drain; bytes stored. Before its handshake a connection is read no further than
// one small frame. See detail/store_service.h for how each is kept.
//
// Client threading: the client is thread-safe. Every call takes a connection of its own from a
// small pool (opening another when all are busy), so a get waiting for a key does not hold up
// other threads of the same process. The connection that announced the rank carries no requests:
// it only says hello and goodbye; the pool's connections join its announcement (they act for the
// rank).
//
// Sizes: a key and its value together up to 256 MiB less 1 KiB (set throws InvalidArgument above);
// a wait names at most 65536 keys.
//
// Counters written by add() are decimal text, so get() of a counter reads "3". The wire format
// (frames of a little-endian u32 length and that many bytes) is collective/detail/store_wire.h's;
// the server is tcp_store_server.cc around detail/store_service.cc, the client tcp_store_client.cc.
#pragma once

#include <chrono>
#include <cstdint>
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
  // Bounds the calls that wait for nobody (set, check, add, the handshake, and sending any
  // request): a live server answers at once, so this only matters when the server's machine hangs.
  std::chrono::milliseconds request_timeout = std::chrono::minutes(1);
  // The rank this client announces for liveness (see above); -1: none.
  int rank = -1;
  // Where the server writes this rank's lost key: rendezvous passes its run's prefix, so the key
  // reads as lost_rank_key(rank) through the run's prefixed store.
  std::string lost_key_prefix;
  // The shared secret (see above); empty: TANDEM_STORE_SECRET, and when that is unset too, none.
  std::string secret;
};

inline constexpr std::chrono::milliseconds kMaxRetryInterval = std::chrono::seconds(1);

// "host:port" split; IPv6 hosts are bracketed ("[::1]:2222"). InvalidArgument naming the address
// when it has no port or the port is not in 0..65535.
struct HostPort {
  std::string host;
  int port = 0;
};
HostPort parse_host_port(std::string_view address);

struct TcpStoreServerOptions {
  // The shared secret every client must prove it holds; empty: TANDEM_STORE_SECRET, and when that
  // is unset too, none (every client is served).
  std::string secret;
  // Connections open at once, in or past their handshake. One more closes the oldest connection
  // still in its handshake, or, when every one is past it, is refused at once (the client throws
  // ResourceExhausted). store_connections_for(world_size) suits a job.
  std::size_t max_connections = 1024;
  // Bytes buffered across all connections: requests arriving, replies not yet sent, the keys of
  // parked gets and waits. Each connection may always hold 64 KiB each way; a larger frame or
  // reply waits (that connection is not read, or not answered) until it fits. Allows four values
  // of the largest size in flight at once.
  std::size_t max_buffered_bytes = std::size_t{1} << 30;
  // Bytes of keys and values held (64 bytes more per key); a set or add beyond is
  // ResourceExhausted.
  std::size_t max_stored_bytes = std::size_t{2} << 30;
  // How long a new connection has to finish the handshake before it is closed.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
};

// Connections for a job of world_size processes: each keeps one to announce its rank and a pool
// of up to eight for its calls, with room for a few more at busy moments.
std::size_t store_connections_for(int world_size);

// What a server holds now, for monitoring and tests.
struct TcpStoreServerStats {
  std::size_t connections = 0;            // open, in or past their handshake
  std::size_t buffered_bytes = 0;         // requests arriving, replies unsent, parked keys
  std::size_t peak_buffered_bytes = 0;    // the most buffered_bytes has been
  std::size_t stored_bytes = 0;           // keys and values, as max_stored_bytes counts them
  std::uint64_t refused_connections = 0;  // failed or timed-out handshakes, over the limit
};

// The chief's side. Who calls: rank 0 only. Non-blocking: serves on its own thread until destroyed.
class TcpStoreServer {
 public:
  // Listens on `port` (SO_REUSEADDR, so a restarted job gets the port back at once; port 0 = any
  // free port) of every address `host` resolves to ("localhost": 127.0.0.1 and ::1), or of every
  // interface for "0.0.0.0", "::" or "". A name that resolves only to loopback addresses here
  // while other machines may reach it differently (Debian maps a machine's own name to
  // 127.0.1.1) listens on every interface instead, with a warning. AlreadyExists naming the
  // address when the port is taken; Unavailable when the host does not resolve or for any other
  // socket failure; InvalidArgument for a port outside 0..65535.
  static std::unique_ptr<TcpStoreServer> start(std::string_view host, int port, TcpStoreServerOptions options = {});

  // The port it listens on (the one picked, for port 0).
  int port() const;
  // "host:port", as given to start.
  std::string address() const;
  // Where a client on this machine reaches it: the first address bound, numeric
  // ("10.0.0.1:29500"), or "127.0.0.1:port" when it listens on every interface.
  std::string local_address() const;
  TcpStoreServerStats stats() const;

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
// Unauthenticated at once when the secrets differ (named as TANDEM_STORE_SECRET, never shown);
// ResourceExhausted when the server is at its connection limit.
// The returned store's calls throw Unavailable naming the server when the connection breaks
// (the server went away), DeadlineExceeded naming the keys when a get/wait times out,
// PermissionDenied for a key of another rank (see above), ResourceExhausted when the server's
// store is full. Its destructor says goodbye (bounded by a few seconds; never throws).
std::shared_ptr<Store> connect_tcp_store(std::string_view address, TcpStoreOptions options = {});

}  // namespace tandem::collective
