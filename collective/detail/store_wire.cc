// The TCP store's frames (store_wire.h): building, reading and parsing them, and whose a key is.
#include "tandem/collective/detail/store_wire.h"

#include <charconv>
#include <climits>
#include <utility>

#include <fmt/format.h>

namespace tandem::collective::detail::wire {

std::uint32_t read_u32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::vector<char> Writer::finish() {
  const auto length = static_cast<std::uint32_t>(buffer_.size() - 4);
  for (int i = 0; i < 4; ++i) buffer_[static_cast<std::size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
  return std::move(buffer_);
}

const char* Reader::take(std::size_t n) {
  if (static_cast<std::size_t>(end_ - p_) < n) {
    ok_ = false;
    return nullptr;
  }
  const char* at = p_;
  p_ += n;
  return at;
}

const char* Reader::take_run(std::uint32_t& n) {
  n = 0;
  return u32(n) ? take(n) : nullptr;
}

bool Reader::u8(std::uint8_t& v) {
  const char* p = take(1);
  if (p != nullptr) v = static_cast<std::uint8_t>(*p);
  return p != nullptr;
}

bool Reader::u32(std::uint32_t& v) {
  const char* p = take(4);
  if (p != nullptr) v = read_u32(p);
  return p != nullptr;
}

bool Reader::i64(std::int64_t& value) {
  const char* p = take(8);
  if (p == nullptr) return false;
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  value = static_cast<std::int64_t>(v);
  return true;
}

bool Reader::bytes(std::vector<char>& v) {
  std::uint32_t n = 0;
  const char* p = take_run(n);
  if (p != nullptr) v.assign(p, p + n);
  return p != nullptr;
}

bool Reader::str(std::string& s) {
  std::uint32_t n = 0;
  const char* p = take_run(n);
  if (p != nullptr) s.assign(p, p + n);
  return p != nullptr;
}

bool Reader::view(std::string_view& s) {
  std::uint32_t n = 0;
  const char* p = take_run(n);
  if (p != nullptr) s = std::string_view(p, n);
  return p != nullptr;
}

FrameScan scan_frame(const char* data, std::size_t size, std::uint32_t limit) {
  if (size < 4) return {FrameScan::kIncomplete, 0, 4 - size};
  const std::uint32_t length = read_u32(data);
  if (length > limit) return {FrameScan::kTooLarge, length, 0};
  if (size - 4 < length) return {FrameScan::kIncomplete, length, length - (size - 4)};
  return {FrameScan::kComplete, length, 0};
}

namespace {

// The request's fields after its opcode; false when they do not parse or do not end the frame.
bool parse_fields(Reader& r, Request& q) {
  switch (q.op) {
    case Op::kHello:
      return r.i64(q.rank) && r.view(q.prefix) && q.rank >= 0 && q.rank <= INT_MAX &&
             q.prefix.size() <= kMaxPrefixBytes;
    case Op::kJoin: return r.view(q.token);
    case Op::kAuth: return r.view(q.nonce) && r.view(q.proof);
    case Op::kBye:
    case Op::kCancel: return true;
    case Op::kSet: return r.view(q.key) && r.view(q.value);
    case Op::kGet:
    case Op::kCheck: return r.view(q.key);
    case Op::kAdd: return r.view(q.key) && r.i64(q.delta);
    case Op::kWait: {
      std::uint32_t count = 0;
      // Each key takes at least its 4-byte length: a count the frame cannot hold is refused
      // before anything is allocated for it.
      if (!r.u32(count) || count > kMaxWaitKeys || count > r.remaining() / 4) return false;
      q.keys.resize(count);
      for (auto& key : q.keys) {
        if (!r.view(key)) return false;
      }
      return true;
    }
  }
  return false;
}

std::string_view op_name(Op op) {
  switch (op) {
    case Op::kHello: return "HELLO";
    case Op::kBye: return "BYE";
    case Op::kSet: return "SET";
    case Op::kGet: return "GET";
    case Op::kWait: return "WAIT";
    case Op::kCheck: return "CHECK";
    case Op::kAdd: return "ADD";
    case Op::kCancel: return "CANCEL";
    case Op::kAuth: return "AUTH";
    case Op::kJoin: return "JOIN";
  }
  return "?";
}

// A rank as a key spells it: decimal digits, no sign, no leading zero, within int.
bool parse_rank(std::string_view text, int& rank) {
  if (text.empty() || (text.size() > 1 && text[0] == '0')) return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), rank);
  return ec == std::errc() && end == text.data() + text.size() && rank >= 0;
}

}  // namespace

bool parse_request(const char* data, std::size_t size, Request& request, std::string& error) {
  Reader r(data, size);
  std::uint8_t op = 0;
  if (!r.u8(op)) {
    error = "empty frame";
    return false;
  }
  if (op < static_cast<std::uint8_t>(Op::kHello) || op > static_cast<std::uint8_t>(Op::kJoin)) {
    error = fmt::format("unknown request {}", op);
    return false;
  }
  request = Request{};
  request.op = static_cast<Op>(op);
  if (!parse_fields(r, request) || !r.at_end()) {
    error = fmt::format("malformed {}", op_name(request.op));
    return false;
  }
  return true;
}

KeyOwner key_owner(std::string_view key) {
  // Split into segments; look at "rank/<r>" pairs and a trailing "tandem/lost/<r>".
  std::vector<std::string_view> segments;
  for (std::size_t begin = 0;;) {
    const std::size_t slash = key.find('/', begin);
    segments.push_back(key.substr(begin, slash == std::string_view::npos ? std::string_view::npos : slash - begin));
    if (slash == std::string_view::npos) break;
    begin = slash + 1;
  }
  const std::size_t n = segments.size();
  int rank = -1;
  if (n >= 3 && segments[n - 3] == "tandem" && segments[n - 2] == "lost" && parse_rank(segments[n - 1], rank)) {
    return {KeyOwner::kServer, rank};
  }
  KeyOwner owner;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    if (segments[i] != "rank" || !parse_rank(segments[i + 1], rank)) continue;
    if (owner.kind == KeyOwner::kRank && owner.rank != rank) return {KeyOwner::kConflict, -1};
    owner = {KeyOwner::kRank, rank};
  }
  return owner;
}

bool parse_reply(const std::vector<char>& frame, Reply& reply) {
  Reader r(frame.data(), frame.size());
  std::uint8_t status = 0;
  if (!r.u8(status) || status > static_cast<std::uint8_t>(Status::kWelcome)) return false;
  reply.status = static_cast<Status>(status);
  switch (reply.status) {
    case Status::kOk:
    case Status::kCancelled: break;
    case Status::kValue: r.bytes(reply.value); break;
    case Status::kBool: {
      std::uint8_t b = 0;
      r.u8(b);
      reply.flag = b != 0;
      break;
    }
    case Status::kInt: r.i64(reply.number); break;
    case Status::kError:
      r.u8(reply.error_code);
      r.str(reply.error);
      break;
    case Status::kChallenge: {
      std::uint8_t version = 0;
      std::uint8_t required = 0;
      r.u8(version);
      r.u8(required);
      r.bytes(reply.value);
      reply.number = version;
      reply.flag = required != 0;
      break;
    }
    case Status::kWelcome: r.bytes(reply.value); break;
  }
  return r.at_end();
}

}  // namespace tandem::collective::detail::wire
