// The Gloo communicator's hold on its connections (collective/detail/peer_sockets.h): found by
// both endpoints, never by the local one alone, and shut down through a duplicate that no other
// socket can take the number of. Real loopback sockets of this process.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "tandem/collective/detail/peer_sockets.h"

using namespace tandem::collective::detail;

namespace {

sockaddr_storage loopback(std::uint16_t port) {
  sockaddr_storage a{};
  auto& in = reinterpret_cast<sockaddr_in&>(a);
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  in.sin_port = htons(port);
  return a;
}

sockaddr_storage local_of(int fd) {
  sockaddr_storage a{};
  socklen_t length = sizeof(a);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) == 0);
  return a;
}

Endpoints endpoints_of(int fd) {
  Endpoints e{local_of(fd), {}};
  socklen_t length = sizeof(e.peer);
  REQUIRE(::getpeername(fd, reinterpret_cast<sockaddr*>(&e.peer), &length) == 0);
  return e;
}

std::uint16_t port_of(const sockaddr_storage& a) { return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port); }

// Reads on `fd` give up after 5 s: a check that fails does not hang the test.
Fd bounded(Fd fd) {
  const timeval five_seconds{5, 0};
  REQUIRE(::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &five_seconds, sizeof(five_seconds)) == 0);
  return fd;
}

// A listening socket on 127.0.0.1, at a port the kernel picks.
Fd listener() {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const sockaddr_storage a = loopback(0);
  REQUIRE(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(sockaddr_in)) == 0);
  REQUIRE(::listen(fd.get(), 4) == 0);
  return fd;
}

// A connection to `server` from 127.0.0.1:`from_port` (0: any). SO_REUSEADDR, so that two may
// leave from one port for two destinations, as Linux lets connect()'s ephemeral ports do.
Fd connect_from(std::uint16_t from_port, int server) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int on = 1;
  REQUIRE(::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == 0);
  const sockaddr_storage from = loopback(from_port);
  REQUIRE(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&from), sizeof(sockaddr_in)) == 0);
  const sockaddr_storage to = local_of(server);
  REQUIRE(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to), sizeof(sockaddr_in)) == 0);
  return bounded(std::move(fd));
}

Fd accept_one(int server) { return bounded(Fd(::accept4(server, nullptr, nullptr, SOCK_CLOEXEC))); }

// One byte from `from` arrives at `to`.
bool passes_a_byte(int from, int to) {
  const char sent = 'x';
  char got = 0;
  return ::send(from, &sent, 1, MSG_NOSIGNAL) == 1 && ::recv(to, &got, 1, 0) == 1 && got == sent;
}

// Whether `fd` reads end-of-file (its peer shut the connection down) within 5 s.
bool reads_end_of_file(int fd) {
  char byte = 0;
  return ::recv(fd, &byte, 1, 0) == 0;
}

}  // namespace

TEST_CASE("peer sockets: a connection sharing the local port with another is found alone, and shut alone") {
  // gloo's pair and the store client's connection, both leaving from 127.0.0.1:P.
  const Fd peer_listener = listener(), store_listener = listener();
  const Fd pair = connect_from(0, peer_listener.get());
  const std::uint16_t port = port_of(local_of(pair.get()));
  const Fd store = connect_from(port, store_listener.get());
  const Fd peer_end = accept_one(peer_listener.get()), server_end = accept_one(store_listener.get());
  REQUIRE(port_of(local_of(store.get())) == port);

  const std::vector<PeerSocket> found = find_peer_sockets({endpoints_of(pair.get())});
  REQUIRE(found.size() == 1);
  CHECK(found[0].fd() == pair.get());
  CHECK_FALSE(found[0].closed_by_owner());

  found[0].shut_down();
  CHECK(reads_end_of_file(peer_end.get()));
  CHECK(passes_a_byte(store.get(), server_end.get()));  // the store's connection goes on
  CHECK(passes_a_byte(server_end.get(), store.get()));
}

TEST_CASE("peer sockets: once the owner closes its descriptor, a socket that takes its number is left alone") {
  const Fd peer_listener = listener(), store_listener = listener();
  Fd pair = connect_from(0, peer_listener.get());
  const Fd peer_end = accept_one(peer_listener.get());
  const std::vector<PeerSocket> found = find_peer_sockets({endpoints_of(pair.get())});
  REQUIRE(found.size() == 1);
  const int number = pair.get();

  pair.reset();  // gloo closes the pair's socket; the duplicate keeps the connection
  const Fd store = connect_from(0, store_listener.get());
  const Fd server_end = accept_one(store_listener.get());
  REQUIRE(store.get() == number);  // the lowest free number
  CHECK(found[0].closed_by_owner());

  found[0].shut_down();
  CHECK(reads_end_of_file(peer_end.get()));  // the peer still learns
  CHECK(passes_a_byte(store.get(), server_end.get()));
}

TEST_CASE("peer sockets: a connection not among the process's sockets is not found") {
  const Fd peer_listener = listener();
  const Fd pair = connect_from(0, peer_listener.get());
  Endpoints elsewhere = endpoints_of(pair.get());
  elsewhere.peer = loopback(static_cast<std::uint16_t>(port_of(elsewhere.peer) ^ 1));
  CHECK(find_peer_sockets({elsewhere}).empty());
  CHECK(find_peer_sockets({}).empty());
}

TEST_CASE("peer sockets: addresses travel through the store's bytes and back") {
  sockaddr_storage v6{};
  auto& in6 = reinterpret_cast<sockaddr_in6&>(v6);
  in6.sin6_family = AF_INET6;
  in6.sin6_port = htons(40001);
  in6.sin6_addr = in6addr_loopback;
  const std::vector<sockaddr_storage> sent = {loopback(2222), sockaddr_storage{}, v6};
  const auto back = decode_endpoints(encode_endpoints(sent));
  REQUIRE(back.has_value());
  REQUIRE(back->size() == 3);
  CHECK(same_endpoint((*back)[0], sent[0]));
  CHECK((*back)[1].ss_family == AF_UNSPEC);
  CHECK(same_endpoint((*back)[2], v6));
  CHECK_FALSE(same_endpoint((*back)[0], (*back)[2]));

  std::vector<char> cut = encode_endpoints(sent);
  cut.pop_back();
  CHECK_FALSE(decode_endpoints(cut).has_value());
  CHECK_FALSE(decode_endpoints({'x'}).has_value());
  CHECK(decode_endpoints({})->empty());
}
