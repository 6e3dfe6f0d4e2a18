// tandem/collective/detail/peer_sockets.h — the Gloo communicator's hold on its TCP connections to
// its peers. Gloo keeps a pair's socket private, yet the communicator must shut every connection
// down to wake a call waiting on another peer (gloo.cc's interrupt()) and must notice when gloo
// closed one (a pair failed). Not part of the public contract.
//
// A connection is found among the process's descriptors by both of its endpoints: its gloo pair
// reports the local one, and the peer's pair reports it as its own, the far one (the ranks swap
// them through the store: gloo keeps a pair's peer address to itself). Both, because a local
// endpoint alone is ambiguous: Linux gives a connect()'s ephemeral port to other connections as
// well, as long as they go to other destinations, so the store client's connection to its server
// may leave from the very address and port of a gloo pair (matching on the local end alone once
// shut the store's connection down with the pair's, and the rank died on its next store call).
//
// Each PeerSocket keeps a duplicate of the descriptor: shut_down() acts on the duplicate, which no
// other socket can take the number of, so it cannot hit a socket that took the number of one gloo
// closed meanwhile. closed_by_owner() looks at gloo's own descriptor number: while the duplicate
// holds the connection open, no other socket can have its two endpoints, so a descriptor with
// them is gloo's.
//
// Who calls: the communicator's constructor (find_peer_sockets), its calling thread and its
// monitor thread (the rest, concurrently: they only read). Nothing here throws or blocks.
#pragma once

#include <sys/socket.h>

#include <optional>
#include <utility>
#include <vector>

#include "tandem/collective/detail/socket.h"

namespace tandem::collective::detail {

// A connection's two endpoints, as its owner reports them.
struct Endpoints {
  sockaddr_storage local{};
  sockaddr_storage peer{};
};

// Whether two IPv4 or IPv6 socket addresses are the same address and port.
bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b);

// An IPv4 or IPv6 address and port as bytes for the store, and back: the address family's byte,
// the port and the address as they are in the sockaddr (network order). decode_endpoints()
// returns nothing for bytes that are not a list of them.
std::vector<char> encode_endpoints(const std::vector<sockaddr_storage>& addresses);
std::optional<std::vector<sockaddr_storage>> decode_endpoints(const std::vector<char>& bytes);

class PeerSocket {
 public:
  PeerSocket(int fd, Endpoints endpoints, Fd duplicate)
      : fd_(fd), endpoints_(endpoints), duplicate_(std::move(duplicate)) {}

  // Whether the owner has closed its descriptor (its number is unused, or now another socket's).
  bool closed_by_owner() const;
  // Shuts the connection down both ways: the peer sees it close, and the owner's pending reads
  // and writes on it fail. Harmless on a connection already shut down or reset.
  void shut_down() const;

  int fd() const { return fd_; }

 private:
  int fd_;  // the owner's descriptor number
  Endpoints endpoints_;
  Fd duplicate_;
};

// The process's connected sockets whose two endpoints are one of `connections`, each with a
// duplicate of its descriptor (close-on-exec). A connection not found is left out.
std::vector<PeerSocket> find_peer_sockets(const std::vector<Endpoints>& connections);

}  // namespace tandem::collective::detail
