// The TCP store's frames (store_wire.h): building, reading and receiving them.
#include "tandem/collective/detail/store_wire.h"

#include <algorithm>
#include <cerrno>
#include <utility>

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

bool parse_reply(const std::vector<char>& frame, Reply& reply) {
  Reader r(frame.data(), frame.size());
  std::uint8_t status = 0;
  if (!r.u8(status) || status > static_cast<std::uint8_t>(Status::kCancelled)) return false;
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
  }
  return r.at_end();
}

IoResult recv_frame(int fd, std::vector<char>& frame, Deadline deadline, Deadline rest_deadline) {
  char header[4];
  IoResult r = recv_all(fd, header, 1, deadline);
  if (r.kind == IoKind::kOk) r = recv_all(fd, header + 1, sizeof header - 1, std::max(deadline, rest_deadline));
  if (r.kind != IoKind::kOk) return r;
  const std::uint32_t length = read_u32(header);
  if (length > kMaxFrameBytes) return {IoKind::kError, EPROTO};
  frame.resize(length);
  return recv_all(fd, frame.data(), length, std::max(deadline, rest_deadline));
}

}  // namespace tandem::collective::detail::wire
