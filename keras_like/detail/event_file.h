// tandem/keras_like/detail/event_file.h — TensorBoard's event files: TFRecord framing with masked
// CRC-32C checksums, and a writer of Event records (scalars, histograms, a graph).
//
// Called by the TensorBoard callback (keras_like/tensorboard.cc) on the thread that runs fit(),
// and by tests. Writes block on the file system (buffered; flush() pushes them to the kernel).
// Errors opening or writing a file are Unavailable naming its path.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::keras::detail {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`, continuing from `crc` (the CRC
// of the bytes before). crc32c("123456789") == 0xE3069283.
std::uint32_t crc32c(std::string_view data, std::uint32_t crc = 0);
// TFRecord's masked CRC: rotated right by 15 bits plus 0xa282ead8, so that a CRC over data
// holding CRCs stays well distributed.
std::uint32_t mask_crc(std::uint32_t crc);
// One TFRecord: uint64 length, masked CRC of the length's 8 bytes, the data, masked CRC of the
// data; integers little-endian.
std::string tfrecord(std::string_view data);

// A histogram as TensorBoard draws it: `bucket_count` equal buckets over [min, max] (one bucket
// when all values are equal), bucket_limit[i] the right edge of bucket i (the last is max).
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit, bucket;
};
Histogram make_histogram(const std::vector<double>& values, int bucket_count = 30);

// A node of the graph written for TensorBoard's graph plugin (TensorFlow's NodeDef): inputs are
// other nodes' names, "name:k" for a node's output k > 0.
struct GraphNode {
  std::string name, op;
  std::vector<std::string> inputs;
};

// One event file, events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2 in `dir` (created with its
// parents), named as TensorFlow names them; its first record is the file_version event
// "brain.Event:2". Records are buffered until flush() or destruction.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();  // flushes and closes; a failure is logged (destructors do not throw)
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // A scalar summary (Summary.Value.simple_value, a float32: TensorBoard's scalars).
  void add_scalar(const std::string& tag, double value, std::int64_t step);
  void add_histogram(const std::string& tag, const Histogram& histogram, std::int64_t step);
  // The graph as a serialized GraphDef in Event.graph_def.
  void add_graph(const std::vector<GraphNode>& nodes);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& serialized);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tandem::keras::detail
