// The TCP store (tcp_store.h): its addresses and lost keys. The server is tcp_store_server.cc,
// the client tcp_store_client.cc; both speak detail/store_wire.h's frames over
// detail/socket.h's sockets.
#include "tandem/collective/tcp_store.h"

#include <charconv>

#include <fmt/format.h>

#include "tandem/base/errors.h"

namespace tandem::collective {

std::string lost_rank_key(int rank) { return fmt::format("tandem/lost/{}", rank); }

HostPort parse_host_port(std::string_view address) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(fmt::format("address \"{}\" is not host:port: {}", address, why));
  };
  std::string_view host;
  std::string_view port;
  if (address.starts_with('[')) {
    const auto close = address.find(']');
    if (close == std::string_view::npos) throw bad("'[' without ']'");
    host = address.substr(1, close - 1);
    if (close + 1 >= address.size() || address[close + 1] != ':') throw bad("no ':port' after the bracketed host");
    port = address.substr(close + 2);
  } else {
    const auto colon = address.rfind(':');
    if (colon == std::string_view::npos) throw bad("no ':port'");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) throw bad("an IPv6 host must be in brackets, e.g. [::1]:2222");
  }
  if (host.empty()) throw bad("the host is empty");
  int value = -1;
  const auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value < 0 || value > 65535) {
    throw bad(fmt::format("the port \"{}\" is not a number in 0..65535", port));
  }
  return HostPort{std::string(host), value};
}

}  // namespace tandem::collective
