#include <doctest/doctest.h>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "tandem/data/datasets.h"
#include "tandem/data/readers.h"
#include "tandem/devices/device.h"

using namespace tandem;
namespace fs = std::filesystem;

namespace {

struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("tandem_data_test") {}
};

using Bytes = std::vector<unsigned char>;

void write_plain(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void write_text(const std::string& path, const std::string& text) {
  write_plain(path, Bytes(text.begin(), text.end()));
}

void write_gzip(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty())
    REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

Bytes read_plain(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void append_u32_be(Bytes& b, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<unsigned char>(v >> shift));
}

// An IDX file: magic, big-endian dimensions, then `data` (already big-endian).
Bytes idx_bytes(unsigned char type, const std::vector<std::uint32_t>& dims, const Bytes& data) {
  Bytes b{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (auto d : dims) append_u32_be(b, d);
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

template <class T>
Bytes big_endian(const std::vector<T>& values) {
  Bytes b;
  for (const T& v : values) {
    unsigned char raw[sizeof(T)];
    std::memcpy(raw, &v, sizeof(T));
    for (std::size_t i = 0; i < sizeof(T); ++i) b.push_back(raw[sizeof(T) - 1 - i]);  // little-endian host
  }
  return b;
}

using tandem::testing::error_message;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("read_idx reads every IDX type, plain and gzip-compressed") {
  TempDir dir;
  SUBCASE("uint8") {
    const Bytes data{0, 1, 2, 3, 4, 5, 250, 251, 252, 253, 254, 255};
    for (const bool gz : {false, true}) {
      const auto path = dir.file(gz ? "u8.idx.gz" : "u8.idx");
      (gz ? write_gzip : write_plain)(path, idx_bytes(0x08, {2, 2, 3}, data));
      const Tensor t = data::read_idx(path);
      CHECK(t.dtype() == kUInt8);
      CHECK(t.shape() == Shape{2, 2, 3});
      CHECK(t.to_vector<std::uint8_t>() == std::vector<std::uint8_t>(data.begin(), data.end()));
    }
  }
  SUBCASE("int8 and int16 widen to int32") {
    write_plain(dir.file("i8"), idx_bytes(0x09, {4}, Bytes{0x00, 0x7f, 0x80, 0xff}));
    const Tensor i8 = data::read_idx(dir.file("i8"));
    CHECK(i8.dtype() == kInt32);
    CHECK(i8.to_vector<std::int32_t>() == std::vector<std::int32_t>{0, 127, -128, -1});
    const std::vector<std::int16_t> v16{0, 1, -1, 32767, -32768, 1234};
    write_gzip(dir.file("i16.gz"), idx_bytes(0x0B, {2, 3}, big_endian(v16)));
    const Tensor i16 = data::read_idx(dir.file("i16.gz"));
    CHECK(i16.dtype() == kInt32);
    CHECK(i16.shape() == Shape{2, 3});
    CHECK(i16.to_vector<std::int32_t>() == std::vector<std::int32_t>(v16.begin(), v16.end()));
  }
  SUBCASE("int32, float32 and float64") {
    const std::vector<std::int32_t> v32{0, -7, 123456789, -2147483647 - 1};
    write_plain(dir.file("i32"), idx_bytes(0x0C, {4}, big_endian(v32)));
    CHECK(data::read_idx(dir.file("i32")).to_vector<std::int32_t>() == v32);
    const std::vector<float> f32{0.5f, -1.25f, 3.0e10f, 1e-20f, -0.0f, 7.0f};
    write_gzip(dir.file("f32.gz"), idx_bytes(0x0D, {3, 2}, big_endian(f32)));
    const Tensor tf = data::read_idx(dir.file("f32.gz"));
    CHECK(tf.dtype() == kFloat32);
    CHECK(tf.to_vector<float>() == f32);
    const std::vector<double> f64{3.141592653589793, -2.5e-300, 1e300};
    write_plain(dir.file("f64"), idx_bytes(0x0E, {3}, big_endian(f64)));
    const Tensor td = data::read_idx(dir.file("f64"));
    CHECK(td.dtype() == kFloat64);
    CHECK(td.to_vector<double>() == f64);
  }
  SUBCASE("empty dimensions and rank 0") {
    write_plain(dir.file("empty"), idx_bytes(0x08, {0, 28}, {}));
    CHECK(data::read_idx(dir.file("empty")).shape() == Shape{0, 28});
    write_plain(dir.file("scalar"), idx_bytes(0x08, {}, Bytes{42}));
    const Tensor s = data::read_idx(dir.file("scalar"));
    CHECK(s.shape() == Shape{});
    CHECK(s.item<std::uint8_t>() == 42);
  }
}

TEST_CASE("read_idx: a missing file raises NotFound naming it") {
  TempDir dir;
  const auto path = dir.file("nope-idx3-ubyte.gz");
  const auto message = error_message<NotFound>([&] { data::read_idx(path); });
  CHECK(contains(message, path));
  CHECK(contains(message, "no such file"));
  CHECK_THROWS_AS(data::read_idx(dir.file("missing_dir/x")), NotFound);
}

TEST_CASE("read_idx: a bad magic number raises DataLoss naming the file, offset 0 and the bytes") {
  TempDir dir;
  write_plain(dir.file("bad"), Bytes{0x1f, 0x00, 0x08, 0x01, 0, 0, 0, 0});
  auto message = error_message<DataLoss>([&] { data::read_idx(dir.file("bad")); });
  CHECK(contains(message, dir.file("bad")));
  CHECK(contains(message, "byte offset 0"));
  CHECK(contains(message, "1f 00 08 01"));
  write_plain(dir.file("badtype"), Bytes{0, 0, 0x07, 1, 0, 0, 0, 0});
  message = error_message<DataLoss>([&] { data::read_idx(dir.file("badtype")); });
  CHECK(contains(message, "00 00 07 01"));
  write_gzip(dir.file("text.gz"), Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
  CHECK(contains(error_message<DataLoss>([&] { data::read_idx(dir.file("text.gz")); }), "68 65 6c 6c"));
  write_plain(dir.file("rank9"), idx_bytes(0x08, {1, 1, 1, 1, 1, 1, 1, 1, 1}, Bytes{1}));
  CHECK(contains(error_message<Unimplemented>([&] { data::read_idx(dir.file("rank9")); }), "rank 9"));
}

TEST_CASE("read_idx: truncated headers and data raise DataLoss with the offset and the bytes expected") {
  TempDir dir;
  SUBCASE("magic cut short") {
    write_plain(dir.file("t"), Bytes{0, 0});
    const auto message = error_message<DataLoss>([&] { data::read_idx(dir.file("t")); });
    CHECK(contains(message, dir.file("t")));
    CHECK(contains(message, "byte offset 2"));
  }
  SUBCASE("empty file") {
    write_plain(dir.file("e"), {});
    CHECK(contains(error_message<DataLoss>([&] { data::read_idx(dir.file("e")); }), "byte offset 0"));
  }
  SUBCASE("dimensions cut short") {
    auto bytes = idx_bytes(0x08, {10, 28, 28}, {});
    bytes.resize(4 + 6);  // one and a half dimensions
    write_plain(dir.file("d"), bytes);
    const auto message = error_message<DataLoss>([&] { data::read_idx(dir.file("d")); });
    CHECK(contains(message, "byte offset 10"));
    CHECK(contains(message, "12 bytes of dimensions"));
  }
  SUBCASE("data cut short, plain and gzip") {
    const auto bytes = idx_bytes(0x08, {10, 28, 28}, Bytes(1000, 7));  // 7840 bytes declared
    write_plain(dir.file("data"), bytes);
    write_gzip(dir.file("data.gz"), bytes);
    for (const auto& name : {std::string("data"), std::string("data.gz")}) {
      const auto message = error_message<DataLoss>([&] { data::read_idx(dir.file(name)); });
      CHECK(contains(message, dir.file(name)));
      CHECK(contains(message, "truncated data at byte offset 1016"));
      CHECK(contains(message, "7840 bytes"));
    }
  }
  SUBCASE("a gzip file cut short") {
    Bytes pixels(28 * 28 * 50);
    for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<unsigned char>((i * 7919) % 251);
    write_gzip(dir.file("full.gz"), idx_bytes(0x08, {50, 28, 28}, pixels));
    auto compressed = read_plain(dir.file("full.gz"));
    REQUIRE(compressed.size() > 100);
    compressed.resize(compressed.size() / 2);
    write_plain(dir.file("cut.gz"), compressed);
    const auto message = error_message<DataLoss>([&] { data::read_idx(dir.file("cut.gz")); });
    CHECK(contains(message, dir.file("cut.gz")));
    CHECK(contains(message, "truncated"));
    CHECK(contains(message, "byte offset"));
  }
  SUBCASE("a corrupt gzip stream") {
    write_gzip(dir.file("ok.gz"), idx_bytes(0x08, {100, 100}, Bytes(10000, 3)));
    auto compressed = read_plain(dir.file("ok.gz"));
    REQUIRE(compressed.size() > 30);
    compressed[compressed.size() - 6] ^= 0xff;  // the CRC32 in the trailer
    write_plain(dir.file("crc.gz"), compressed);
    const auto message = error_message<DataLoss>([&] { data::read_idx(dir.file("crc.gz")); });
    CHECK(contains(message, dir.file("crc.gz")));
  }
}

TEST_CASE("read_idx: absurd dimensions and trailing bytes raise DataLoss") {
  TempDir dir;
  write_plain(dir.file("huge"), idx_bytes(0x0E, {0xffffffffu, 0xffffffffu, 4}, Bytes(8, 0)));
  auto message = error_message<DataLoss>([&] { data::read_idx(dir.file("huge")); });
  CHECK(contains(message, dir.file("huge")));
  CHECK(contains(message, "corrupt"));
  write_plain(dir.file("big"), idx_bytes(0x08, {1u << 20, 1u << 20}, Bytes(8, 0)));  // 1 TiB
  CHECK_THROWS_AS(data::read_idx(dir.file("big")), DataLoss);
  write_plain(dir.file("long"), idx_bytes(0x08, {2, 2}, Bytes(5, 1)));
  message = error_message<DataLoss>([&] { data::read_idx(dir.file("long")); });
  CHECK(contains(message, "byte offset 16"));
}

TEST_CASE("read_idx: sizes a header declares are checked against the file before anything is allocated") {
  TempDir dir;
  // 16 bytes whose header declares 13 GB: refused from the file's size, plain or gzip.
  const auto bytes = idx_bytes(0x08, {3250, 2000, 2000}, {});
  REQUIRE(bytes.size() == 16);
  write_plain(dir.file("lying"), bytes);
  write_gzip(dir.file("lying.gz"), bytes);
  auto& allocator = devices::default_cpu_device().allocator();
  for (const auto& name : {std::string("lying"), std::string("lying.gz")}) {
    CAPTURE(name);
    allocator.reset_peak_bytes_in_use();
    const auto before = allocator.stats().bytes_in_use;
    const auto message = error_message<DataLoss>([&] { data::read_idx(dir.file(name)); });
    CHECK(contains(message, dir.file(name)));
    CHECK(contains(message, "truncated data at byte offset 16"));
    CHECK(contains(message, "13000000000 bytes"));
    CHECK(allocator.stats().peak_bytes_in_use - before < (1 << 20));
  }
  // Widened types stage the file's bytes: the same check comes first.
  write_plain(dir.file("int16"), idx_bytes(0x0B, {1u << 30}, Bytes(10, 0)));
  CHECK(contains(error_message<DataLoss>([&] { data::read_idx(dir.file("int16")); }),
                 "truncated data at byte offset 18"));
  // A zero among dimensions whose product would overflow: refused, not an empty tensor of
  // absurd dimensions.
  write_plain(dir.file("zero"), idx_bytes(0x08, {0xffffffffu, 0xffffffffu, 0xffffffffu, 0}, {}));
  CHECK(contains(error_message<DataLoss>([&] { data::read_idx(dir.file("zero")); }), "corrupt"));
  write_plain(dir.file("zero_first"), idx_bytes(0x08, {0, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {}));
  CHECK(contains(error_message<DataLoss>([&] { data::read_idx(dir.file("zero_first")); }), "corrupt"));
}

TEST_CASE("read_csv reads numbers with or without a header") {
  TempDir dir;
  write_text(dir.file("a.csv"), "x, y,\"label\"\n1, 2.5, 0\n\n-3,4e2,+1\r\n  5 ,6,  7\n");
  const auto table = data::read_csv(dir.file("a.csv"));
  CHECK(table.column_names == std::vector<std::string>{"x", "y", "label"});
  CHECK(table.values.shape() == Shape{3, 3});
  CHECK(table.values.to_vector<float>() == std::vector<float>{1, 2.5f, 0, -3, 400, 1, 5, 6, 7});

  write_text(dir.file("b.csv"), "1;2\n3;4");
  const auto b = data::read_csv(dir.file("b.csv"), {.delimiter = ';', .header = false});
  CHECK(b.column_names == std::vector<std::string>{"column_0", "column_1"});
  CHECK(b.values.to_vector<float>() == std::vector<float>{1, 2, 3, 4});

  write_gzip(dir.file("c.csv.gz"), Bytes{'a', '\n', '1', '\n', '2', '\n'});
  CHECK(data::read_csv(dir.file("c.csv.gz")).values.shape() == Shape{2, 1});

  write_text(dir.file("header_only.csv"), "a,b\n");
  CHECK(data::read_csv(dir.file("header_only.csv")).values.shape() == Shape{0, 2});
}

TEST_CASE("read_csv: an empty file is an error naming it, not an empty table") {
  TempDir dir;
  for (const std::string text : {"", "\n\n", " \r\n\t\n"}) {
    write_text(dir.file("empty.csv"), text);
    auto message = error_message<DataLoss>([&] { data::read_csv(dir.file("empty.csv")); });
    CHECK(contains(message, dir.file("empty.csv")));
    CHECK(contains(message, "empty: no header row"));
    message = error_message<DataLoss>([&] { data::read_csv(dir.file("empty.csv"), {.header = false}); });
    CHECK(contains(message, dir.file("empty.csv")));
    CHECK(contains(message, "empty: no rows"));
  }
  write_gzip(dir.file("empty.csv.gz"), {});
  CHECK(contains(error_message<DataLoss>([&] { data::read_csv(dir.file("empty.csv.gz")); }), "empty: no header row"));
}

TEST_CASE("read_csv: a huge or unprintable field is quoted short and escaped") {
  TempDir dir;
  write_text(dir.file("wide.csv"), "a\n" + std::string(1'000'000, 'x') + "\n");
  auto message = error_message<DataLoss>([&] { data::read_csv(dir.file("wide.csv")); });
  CHECK(contains(message, "line 2, column 1"));
  CHECK(message.size() < 1000);
  write_text(dir.file("escape.csv"), std::string(1'000, 'n') + "\n\x1b[2J\n");
  message = error_message<DataLoss>([&] { data::read_csv(dir.file("escape.csv")); });
  CHECK(contains(message, "\"\\x1b[2J\" is not a number"));
  CHECK(message.size() < 1000);
}

TEST_CASE("read_csv errors name the file, the line and the column") {
  TempDir dir;
  write_text(dir.file("ragged.csv"), "a,b,c\n1,2,3\n\n4,5\n");
  auto message = error_message<DataLoss>([&] { data::read_csv(dir.file("ragged.csv")); });
  CHECK(contains(message, dir.file("ragged.csv")));
  CHECK(contains(message, "line 4, column 3"));

  write_text(dir.file("long.csv"), "1,2\n3,4,5\n");
  message = error_message<DataLoss>([&] { data::read_csv(dir.file("long.csv"), {.header = false}); });
  CHECK(contains(message, "line 2, column 3"));

  write_text(dir.file("nan.csv"), "a,b\n1,2\n3,abc\n");
  message = error_message<DataLoss>([&] { data::read_csv(dir.file("nan.csv")); });
  CHECK(contains(message, "line 3, column 2"));
  CHECK(contains(message, "\"abc\""));

  write_text(dir.file("empty_field.csv"), "1,,3\n");
  CHECK(contains(error_message<DataLoss>([&] { data::read_csv(dir.file("empty_field.csv"), {.header = false}); }),
                 "line 1, column 2"));
  write_text(dir.file("range.csv"), "1e60\n");
  CHECK(contains(error_message<DataLoss>([&] { data::read_csv(dir.file("range.csv"), {.header = false}); }), "range"));

  CHECK(contains(error_message<NotFound>([&] { data::read_csv(dir.file("missing.csv")); }), dir.file("missing.csv")));
}

namespace {

// Writes a tiny dataset in the Fashion-MNIST layout: n_train/n_test images of 28x28.
void write_mnist_like(const TempDir& dir, std::uint32_t n_train, std::uint32_t n_test, bool gz) {
  auto write = gz ? write_gzip : write_plain;
  const std::string suffix = gz ? ".gz" : "";
  for (const auto& [prefix, n] : {std::pair{std::string("train"), n_train}, std::pair{std::string("t10k"), n_test}}) {
    Bytes pixels(static_cast<std::size_t>(n) * 28 * 28);
    for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<unsigned char>(i % 256);
    Bytes labels(n);
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<unsigned char>(i % 10);
    write(dir.file(prefix + "-images-idx3-ubyte" + suffix), idx_bytes(0x08, {n, 28, 28}, pixels));
    write(dir.file(prefix + "-labels-idx1-ubyte" + suffix), idx_bytes(0x08, {n}, labels));
  }
}

}  // namespace

TEST_CASE("fashion_mnist reads the four files, gzipped or not, and scales the images") {
  for (const bool gz : {true, false}) {
    TempDir dir;
    write_mnist_like(dir, 6, 4, gz);
    const auto d = data::fashion_mnist(dir.file(""));
    CHECK(d.x_train.shape() == Shape{6, 28, 28});
    CHECK(d.x_train.dtype() == kFloat32);
    CHECK(d.y_train.shape() == Shape{6});
    CHECK(d.y_train.dtype() == kInt64);
    CHECK(d.x_test.shape() == Shape{4, 28, 28});
    CHECK(d.y_test.to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 1, 2, 3});
    const auto x = d.x_train.to_vector<float>();
    CHECK(x[0] == 0.0f);
    CHECK(x[255] == 1.0f);
    CHECK(x[51] == static_cast<float>(51.0 / 255.0));
    CHECK(d.train.cardinality() == 6);
    CHECK(d.test.cardinality() == 4);
    CHECK(d.train.element_spec() == std::vector<graph::TensorSpec>{{kFloat32, Shape{28, 28}}, {kInt64, Shape{}}});
  }
}

TEST_CASE("fashion_mnist and mnist: missing files and mismatched counts") {
  TempDir dir;
  auto message = error_message<NotFound>([&] { data::fashion_mnist(dir.file("")); });
  CHECK(contains(message, dir.file("train-images-idx3-ubyte.gz")));
  CHECK(contains(message, "apt-get install dataset-fashion-mnist"));
  message = error_message<NotFound>([&] { data::mnist(dir.file("")); });
  CHECK(contains(message, dir.file("train-images-idx3-ubyte.gz")));
  CHECK(contains(message, "MNIST site"));

  write_mnist_like(dir, 6, 4, true);
  write_gzip(dir.file("t10k-labels-idx1-ubyte.gz"), idx_bytes(0x08, {3}, Bytes{1, 2, 3}));
  message = error_message<DataLoss>([&] { data::fashion_mnist(dir.file("")); });
  CHECK(contains(message, "4 images"));
  CHECK(contains(message, "3 labels"));
}

TEST_CASE("the real Fashion-MNIST loads with the expected sizes and ranges") {
  if (!fs::exists(data::kDebianFashionMnistDir)) {
    MESSAGE("skipped: ", data::kDebianFashionMnistDir, " is absent (apt-get install dataset-fashion-mnist)");
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto d = data::fashion_mnist();
  MESSAGE("fashion_mnist() took ",
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count(), " ms");
  CHECK(d.x_train.shape() == Shape{60000, 28, 28});
  CHECK(d.y_train.shape() == Shape{60000});
  CHECK(d.x_test.shape() == Shape{10000, 28, 28});
  CHECK(d.y_test.shape() == Shape{10000});
  for (const auto* x : {&d.x_train, &d.x_test}) {
    const auto v = x->to_vector<float>();
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    CHECK(*lo == 0.0f);
    CHECK(*hi == 1.0f);
  }
  for (const auto* y : {&d.y_train, &d.y_test}) {
    const auto v = y->to_vector<std::int64_t>();
    CHECK(std::set<std::int64_t>(v.begin(), v.end()) == std::set<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  }
  // Fashion-MNIST is balanced: 6000 training images per class.
  const auto y = d.y_train.to_vector<std::int64_t>();
  CHECK(std::count(y.begin(), y.end(), 0) == 6000);

  auto pipeline = d.train.shuffle(60000).batch(128);
  CHECK(pipeline.cardinality() == 469);
  std::int64_t batches = 0;
  auto it = pipeline.iterate();
  while (auto e = it->next()) ++batches;
  CHECK(batches == 469);
}
