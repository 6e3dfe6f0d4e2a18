// libFuzzer harness for the TCP store's wire protocol: the parsers of store_wire.h on the raw
// input, then the server's whole service (detail/store_service.h: handshake, requests, parked
// gets and waits, rank sessions, key ownership, budgets) driven without sockets by a script read
// from the input, over up to four connections at once.
//
// The script: each command is a byte c, acting on connection slot (c >> 3) & 3:
//   c & 7 == 0  open the slot (if it has no connection)
//            1  n = next byte; the next n bytes arrive on it (as much as the service wants)
//            2  k, v = next bytes; k * 256 bytes of value v arrive (large frames from small inputs)
//            3  everything queued for it is sent
//            4  n = next byte; n bytes of what is queued are sent
//            5  it hangs up
//            6  t = next byte; the clock moves t * 50 ms and deadlines pass
//            7  a well-formed frame arrives, built from the next bytes (see well_formed): the
//               handshake (with a right, missing, wrong or malformed proof), HELLO, JOIN with a
//               token seen, requests on keys that matter to ownership, and the starts of large
//               SETs and WAITs that "fill" completes
// The first byte picks the service's options (a secret or none, small budgets and limits).
//
// What must hold, whatever the input (a failure traps): the harness never feeds more than the
// service wants; every connection's output is a sequence of well-formed reply frames; buffered
// bytes stay within the budget plus each connection's allowances; stored bytes within their
// limit; and once every connection is gone, nothing is buffered.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/base/log.h"
#include "tandem/collective/detail/store_auth.h"
#include "tandem/collective/detail/store_service.h"
#include "tandem/collective/detail/store_wire.h"

namespace {

using tandem::collective::TcpStoreServerOptions;
using tandem::collective::detail::StoreService;
namespace wire = tandem::collective::detail::wire;
namespace auth = tandem::collective::detail::auth;

constexpr int kSlots = 4;
constexpr const char* kSecret = "fuzz secret";

void require(bool condition) {
  if (!condition) __builtin_trap();
}

class Script {
 public:
  Script(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ == end_; }
  std::uint8_t byte() { return p_ == end_ ? 0 : *p_++; }
  std::string_view bytes(std::size_t n) {
    n = std::min<std::size_t>(n, static_cast<std::size_t>(end_ - p_));
    const std::string_view out(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return out;
  }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

// Keys whose shape matters to the server (rank ownership, lost keys), and a few plain ones.
constexpr std::string_view kKeys[] = {"k",
                                      "run/0/rendezvous/rank/0",
                                      "run/0/rendezvous/rank/1",
                                      "run/0/rendezvous/rank/1/claims",
                                      "run/0/tandem/lost/1",
                                      "rank/1/rank/2",
                                      "run/1/rendezvous/rank/1",
                                      "",
                                      "counter",
                                      "rank/01"};
constexpr std::string_view kPrefixes[] = {"run/0/", "", "run/1/", "x"};

struct Slot {
  bool open = false;
  StoreService::Id id = 0;
  std::string received;      // what was sent to it, not yet split into frames
  std::string server_nonce;  // from its CHALLENGE
};

class Harness {
 public:
  Harness(TcpStoreServerOptions options, bool secret)
      : secret_(secret ? kSecret : ""),
        options_(options_with(std::move(options), secret)),
        service_(options_, "fuzz:1", counter()) {}

  void run(Script& script) {
    while (!script.done()) {
      const std::uint8_t c = script.byte();
      Slot& slot = slots_[(c >> 3) & 3];
      switch (c & 7) {
        case 0:
          if (!slot.open) slot = Slot{true, service_.open("peer", now_), {}, {}};
          break;
        case 1: {
          const std::string_view data = script.bytes(script.byte());
          feed(slot, data);
          break;
        }
        case 2: {
          const std::size_t k = script.byte();
          const std::string filler(k * 256, static_cast<char>(script.byte()));
          feed(slot, filler);
          break;
        }
        case 3: send(slot, SIZE_MAX); break;
        case 4: send(slot, script.byte()); break;
        case 5:
          if (slot.open) service_.hang_up(slot.id, "hung up");
          break;
        case 6:
          now_ += std::chrono::milliseconds(50) * script.byte();
          service_.expire(now_);
          break;
        case 7: {
          const std::vector<char> frame = well_formed(slot, script);
          feed(slot, std::string_view(frame.data(), frame.size()));
          break;
        }
      }
      collect_closed();
      check_bounds();
    }
    for (Slot& slot : slots_) {
      if (slot.open) service_.hang_up(slot.id, "end of input");
    }
    collect_closed();
    const auto stats = service_.stats();
    require(stats.connections == 0);
    require(stats.buffered_bytes == 0);
  }

 private:
  static TcpStoreServerOptions options_with(TcpStoreServerOptions options, bool secret) {
    options.secret = secret ? kSecret : "";
    return options;
  }
  // Nonces and tokens from a counter: distinct, and predictable enough for JOIN to be reachable.
  static StoreService::Random counter() {
    return [n = std::uint8_t{0}](std::size_t size) mutable {
      std::string out(size, '\0');
      for (char& ch : out) ch = static_cast<char>(++n);
      return out;
    };
  }

  // Bytes arrive on the slot, never more than the service wants at each step (as the server's
  // poll loop reads them).
  void feed(Slot& slot, std::string_view data) {
    while (slot.open && !data.empty()) {
      const std::size_t want = service_.wants(slot.id);
      if (want == 0) return;
      const std::size_t n = std::min(want, data.size());
      service_.receive(slot.id, data.data(), n);
      data.remove_prefix(n);
      collect_closed();
    }
  }

  // Up to `limit` queued bytes go out; whole frames received are checked.
  void send(Slot& slot, std::size_t limit) {
    while (slot.open && limit > 0) {
      const std::string_view out = service_.output(slot.id);
      if (out.empty()) return;
      const std::size_t n = std::min(limit, out.size());
      slot.received.append(out.substr(0, n));
      service_.sent(slot.id, n);
      limit -= n;
      check_replies(slot);
      collect_closed();
    }
  }

  void check_replies(Slot& slot) {
    for (;;) {
      const wire::FrameScan scan = wire::scan_frame(slot.received.data(), slot.received.size(), wire::kMaxFrameBytes);
      require(scan.kind != wire::FrameScan::kTooLarge);
      if (scan.kind == wire::FrameScan::kIncomplete) return;
      const std::vector<char> payload(slot.received.begin() + 4, slot.received.begin() + 4 + scan.length);
      wire::Reply reply;
      require(wire::parse_reply(payload, reply));
      if (reply.status == wire::Status::kChallenge) slot.server_nonce.assign(reply.value.begin(), reply.value.end());
      if (reply.status == wire::Status::kValue && reply.value.size() == auth::kTokenBytes) {
        token_.assign(reply.value.begin(), reply.value.end());
      }
      slot.received.erase(0, 4 + scan.length);
    }
  }

  std::vector<char> well_formed(const Slot& slot, Script& script) {
    const std::uint8_t kind = script.byte();
    const std::string_view key = kKeys[script.byte() % std::size(kKeys)];
    switch (kind % 12) {
      case 0: {
        // The client's answer to the challenge: right, without a proof, wrong, or malformed.
        const std::uint8_t variant = script.byte() % 4;
        const std::string nonce(variant == 3 ? 5 : auth::kNonceBytes, 'c');
        std::string proof = secret_.empty() ? "" : auth::proof(auth::Side::kClient, secret_, slot.server_nonce, nonce);
        if (variant == 1) proof.clear();
        if (variant == 2) proof = std::string(auth::kProofBytes, 'x');
        return wire::Writer(wire::Op::kAuth).str(nonce).str(proof).finish();
      }
      case 1:
        return wire::Writer(wire::Op::kHello)
            .i64(script.byte() % 3)
            .str(kPrefixes[script.byte() % std::size(kPrefixes)])
            .finish();
      case 2: return wire::Writer(wire::Op::kJoin).str(token_).finish();
      case 3: return wire::Writer(wire::Op::kSet).str(key).str(script.bytes(script.byte())).finish();
      case 4: return wire::Writer(wire::Op::kGet).str(key).finish();
      case 5: {
        wire::Writer w(wire::Op::kWait);
        const std::uint8_t count = script.byte() % 4;
        w.u32(count);
        for (std::uint8_t i = 0; i < count; ++i) w.str(kKeys[script.byte() % std::size(kKeys)]);
        return w.finish();
      }
      case 6: return wire::Writer(wire::Op::kAdd).str(key).i64(static_cast<std::int8_t>(script.byte())).finish();
      case 7: return wire::Writer(wire::Op::kCheck).str(key).finish();
      case 8: return wire::Writer(wire::Op::kCancel).finish();
      case 9: return wire::Writer(wire::Op::kBye).finish();
      case 10: {
        // The start of a SET of a large value, whose bytes come from "fill" commands.
        const std::uint32_t value = (static_cast<std::uint32_t>(script.byte()) << 10) + script.byte();
        std::vector<char> start = wire::Writer(wire::Op::kSet).str(key).u32(value).finish();
        const std::uint32_t length = static_cast<std::uint32_t>(start.size() - 4) + value;
        for (int i = 0; i < 4; ++i) start[static_cast<std::size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
        return start;
      }
      default: {
        // The start of a WAIT for many keys, empty ones when "fill" brings zeros.
        const std::uint32_t count = static_cast<std::uint32_t>(script.byte()) << 8;
        std::vector<char> start = wire::Writer(wire::Op::kWait).u32(count).finish();
        const std::uint32_t length = 1 + 4 + 4 * count;
        for (int i = 0; i < 4; ++i) start[static_cast<std::size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
        return start;
      }
    }
  }

  void collect_closed() {
    for (const StoreService::Id id : service_.take_closed()) {
      for (Slot& slot : slots_) {
        if (slot.open && slot.id == id) slot.open = false;
      }
    }
  }

  void check_bounds() {
    const auto stats = service_.stats();
    // Outside the budget, a connection holds at most its allowances: a request arriving, unsent
    // replies, parked keys (with the vectors' rounding up).
    require(stats.buffered_bytes <= options_.max_buffered_bytes + stats.connections * 8 * StoreService::kAllowance);
    require(stats.stored_bytes <= options_.max_stored_bytes);
  }

  std::string secret_;
  TcpStoreServerOptions options_;
  StoreService service_;
  StoreService::Clock::time_point now_ = StoreService::Clock::now();
  Slot slots_[kSlots];
  std::string token_;
};

// The parsers alone, on the raw input: whatever it is, they return (true or false) without
// reading past it.
void parse_everything(const std::uint8_t* data, std::size_t size) {
  const char* bytes = reinterpret_cast<const char*>(data);
  wire::Request request;
  std::string error;
  if (wire::parse_request(bytes, size, request, error)) {
    for (const std::string_view key : request.keys)
      require(key.data() >= bytes && key.data() + key.size() <= bytes + size);
  }
  wire::Reply reply;
  wire::parse_reply(std::vector<char>(bytes, bytes + size), reply);
  const wire::KeyOwner owner = wire::key_owner(std::string_view(bytes, size));
  require(owner.kind != wire::KeyOwner::kRank || owner.rank >= 0);
  const wire::FrameScan scan = wire::scan_frame(bytes, size, wire::kMaxHandshakeFrameBytes);
  require(scan.kind != wire::FrameScan::kComplete || scan.length + 4 <= size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool quiet = [] {
    tandem::logging::set_level(tandem::logging::Level::kOff);
    return true;
  }();
  (void)quiet;
  parse_everything(data, size);
  if (size == 0) return 0;
  Script script(data, size);
  const std::uint8_t choice = script.byte();
  TcpStoreServerOptions options;
  options.max_connections = 1 + (choice & 3);
  options.max_buffered_bytes = StoreService::kAllowance * (1 + ((choice >> 2) & 7));
  options.max_stored_bytes = (choice & 0x20) != 0 ? 4096 : 1 << 20;
  options.handshake_timeout = std::chrono::seconds(1);
  Harness harness(options, (choice & 0x40) != 0);
  harness.run(script);
  return 0;
}
