// tandem/keras_like/detail/event_file.cc — event files as TensorFlow's summary writers make them:
// TFRecords of serialized Event messages (tensorboard_events.proto, encoded by libprotobuf).
#include "tandem/keras_like/detail/event_file.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <filesystem>
#include <system_error>

#include "tandem/base/errors.h"
#include "tandem/base/log.h"
#include "detail/tensorboard_events.pb.h"

namespace tandem::keras::detail {
namespace {

namespace pb = tandem::tensorboard;

// The byte-at-a-time table of the reflected Castagnoli polynomial: fast enough for a few records
// per epoch, and nothing to detect at run time (SSE4.2's crc32 instruction would be faster).
constexpr std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1U) != 0 ? (c >> 1) ^ 0x82F63B78U : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr auto kCrcTable = make_crc_table();

void append_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFFU);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  std::array<char, HOST_NAME_MAX + 1> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0) return "localhost";
  return name.data();
}

// TensorFlow's name: the time in seconds (10 digits), host, pid and a number unique in the
// process, so two writers started in one second (train/ and validation/, or two fits) differ.
std::string event_file_name() {
  static std::atomic<int> counter{0};
  const auto seconds = static_cast<long long>(now_seconds());
  return fmt::format("events.out.tfevents.{:010d}.{}.{}.{}.v2", seconds, host_name(), ::getpid(), counter++);
}

std::string errno_text() { return std::system_category().message(errno); }

}  // namespace

std::uint32_t crc32c(std::string_view data, std::uint32_t crc) {
  crc = ~crc;
  for (const char ch : data) crc = kCrcTable[(crc ^ static_cast<unsigned char>(ch)) & 0xFFU] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t mask_crc(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8U; }

std::string tfrecord(std::string_view data) {
  std::string length;
  append_le(length, data.size(), 8);
  std::string out = length;
  append_le(out, mask_crc(crc32c(length)), 4);
  out.append(data);
  append_le(out, mask_crc(crc32c(data)), 4);
  return out;
}

Histogram make_histogram(const std::vector<double>& values, int bucket_count) {
  TANDEM_REQUIRE(bucket_count >= 1, InvalidArgument, "a histogram needs at least one bucket, not {}", bucket_count);
  Histogram h;
  if (values.empty()) return h;
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  h.min = *lo;
  h.max = *hi;
  h.num = static_cast<double>(values.size());
  for (const double v : values) {
    h.sum += v;
    h.sum_squares += v * v;
  }
  // Equal values would make zero-width buckets: one bucket holds them all.
  const int n = h.max > h.min ? bucket_count : 1;
  const double width = (h.max - h.min) / n;
  h.bucket.assign(static_cast<std::size_t>(n), 0.0);
  for (int i = 0; i < n; ++i) h.bucket_limit.push_back(i + 1 == n ? h.max : h.min + width * (i + 1));
  for (const double v : values) {
    const auto i = n == 1 ? 0 : static_cast<int>(std::floor((v - h.min) / width));
    h.bucket[static_cast<std::size_t>(std::clamp(i, 0, n - 1))] += 1.0;
  }
  return h;
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TANDEM_REQUIRE(!ec, Unavailable, "TensorBoard: cannot create the log directory \"{}\": {}", dir, ec.message());
  path_ = (std::filesystem::path(dir) / event_file_name()).string();
  file_ = std::fopen(path_.c_str(), "wb");
  TANDEM_REQUIRE(file_ != nullptr, Unavailable, "TensorBoard: cannot open \"{}\" for writing: {}", path_, errno_text());
  pb::Event event;
  event.set_wall_time(now_seconds());
  event.set_file_version("brain.Event:2");
  write_event(event.SerializeAsString());
  flush();  // TensorBoard lists a run as soon as its file has a valid first record
}

EventFileWriter::~EventFileWriter() {
  if (file_ == nullptr) return;
  if (std::fclose(file_) != 0) logging::error("TensorBoard: closing \"{}\" failed: {}", path_, errno_text());
}

void EventFileWriter::write_event(const std::string& serialized) {
  const std::string record = tfrecord(serialized);
  TANDEM_REQUIRE(std::fwrite(record.data(), 1, record.size(), file_) == record.size(), Unavailable,
                 "TensorBoard: cannot write to \"{}\": {}", path_, errno_text());
}

void EventFileWriter::add_scalar(const std::string& tag, double value, std::int64_t step) {
  pb::Event event;
  event.set_wall_time(now_seconds());
  event.set_step(step);
  auto* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  write_event(event.SerializeAsString());
}

void EventFileWriter::add_histogram(const std::string& tag, const Histogram& histogram, std::int64_t step) {
  pb::Event event;
  event.set_wall_time(now_seconds());
  event.set_step(step);
  auto* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  auto* h = v->mutable_histo();
  h->set_min(histogram.min);
  h->set_max(histogram.max);
  h->set_num(histogram.num);
  h->set_sum(histogram.sum);
  h->set_sum_squares(histogram.sum_squares);
  for (const double limit : histogram.bucket_limit) h->add_bucket_limit(limit);
  for (const double count : histogram.bucket) h->add_bucket(count);
  write_event(event.SerializeAsString());
}

void EventFileWriter::add_graph(const std::vector<GraphNode>& nodes) {
  pb::GraphDef graph;
  for (const auto& node : nodes) {
    auto* n = graph.add_node();
    n->set_name(node.name);
    n->set_op(node.op);
    for (const auto& input : node.inputs) n->add_input(input);
  }
  pb::Event event;
  event.set_wall_time(now_seconds());
  event.set_graph_def(graph.SerializeAsString());
  write_event(event.SerializeAsString());
}

void EventFileWriter::flush() {
  TANDEM_REQUIRE(std::fflush(file_) == 0, Unavailable, "TensorBoard: cannot write to \"{}\": {}", path_, errno_text());
}

}  // namespace tandem::keras::detail
