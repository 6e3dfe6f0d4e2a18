// The safetensors reader and writer, model weight files and training checkpoints.
#include <doctest/doctest.h>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/base/log.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
namespace fs = std::filesystem;

namespace {

// A fresh folder per test, removed afterwards.
struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("tandem_saving_test") {}
};

std::string read_bytes(const std::string& path) { return testing::read_file_bytes(path); }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A safetensors file from a header text and raw data, for files our writer would never make.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string bytes_of(const Tensor& t) {
  const Tensor host = t.to(devices::default_cpu_device());
  return std::string(static_cast<const char*>(host.raw_data()), host.nbytes());
}

// Plain CRC-32 (the zlib polynomial), to check the writer's checksum independently.
std::uint32_t crc32_of(const std::string& bytes) {
  std::uint32_t crc = 0xffffffffu;
  for (const unsigned char c : bytes) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

bool python_safetensors_available() {
  return std::system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0;
}

keras::Model small_model(const std::string& prefix = "") {
  auto x = keras::Input({3});
  auto h = keras::Dense(4, "relu", {.name = prefix + "hidden"})(x);
  auto y = keras::Dense(2, {.name = prefix + "out"})(h);
  return keras::Model(x, y);
}

// Training data for small_model: 4 examples of 3 features, 2 targets each.
std::pair<Tensor, Tensor> four_examples() {
  return {Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, -0.5f, 0.4f, 0.9f, 1.0f, -1.0f, 0.0f, 0.3f, 0.3f, 0.3f}, {4, 3}),
          Tensor::from_vector<float>({1, 0, 0, 1, 1, 1, 0, 0}, {4, 2})};
}

std::vector<std::vector<float>> weight_values(const keras::Model& model) {
  std::vector<std::vector<float>> out;
  for (const auto& w : model.get_weights()) out.push_back(w.to_vector<float>());
  return out;
}

}  // namespace

TEST_CASE("safetensors: every dtype, metadata, scalars and empty tensors round-trip") {
  TempDir dir;
  const auto path = dir.file("all.safetensors");
  std::vector<std::uint8_t> half_bits = {0x00, 0x3c, 0x00, 0xc0};  // 1.0 and -2.0 as float16
  Tensor f16 = Tensor::empty({2}, DType::kF16);
  std::memcpy(f16.raw_data(), half_bits.data(), half_bits.size());
  Tensor bf16 = Tensor::empty({2}, DType::kBF16);
  std::memcpy(bf16.raw_data(), half_bits.data(), half_bits.size());
  const keras::NamedTensors tensors = {
      {"f32", Tensor::from_vector<float>({1.5f, -2.25f, 3e-8f, 1e30f, 0.0f, -0.0f}, {2, 3})},
      {"f64", Tensor::from_vector<double>({3.141592653589793, -1e-300}, {2})},
      {"i32", Tensor::from_vector<std::int32_t>({-7, 2147483647, -2147483647 - 1}, {3, 1})},
      {"i64", Tensor::from_vector<std::int64_t>({-1, 9007199254740993LL}, {1, 2})},
      {"u8", Tensor::from_vector<std::uint8_t>({0, 255, 7}, {3})},
      {"f16", f16},
      {"bf16", bf16},
      {"scalar", Tensor::scalar<float>(42.0f)},
      {"empty", Tensor::zeros({0}, DType::kF32)},
      {"empty2d", Tensor::zeros({2, 0, 3}, DType::kI64)},
      {"layer/with/slashes", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2, 1, 1})},
  };
  keras::write_safetensors(path, tensors, {{"format", "test"}, {"note", "héllo, \"quoted\""}});
  const auto content = keras::read_safetensors(path);
  REQUIRE(content.tensors.size() == tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    CAPTURE(tensors[i].first);
    CHECK(content.tensors[i].first == tensors[i].first);  // file order is write order
    CHECK(content.tensors[i].second.dtype() == tensors[i].second.dtype());
    CHECK(content.tensors[i].second.shape() == tensors[i].second.shape());
    CHECK(bytes_of(content.tensors[i].second) == bytes_of(tensors[i].second));
  }
  CHECK(content.metadata.at("format") == "test");
  CHECK(content.metadata.at("note") == "héllo, \"quoted\"");
  CHECK(content.metadata.at("checksum").rfind("crc32:", 0) == 0);
  CHECK(dir.entries() == std::vector<std::string>{"all.safetensors"});  // no temporary left behind
}

TEST_CASE("safetensors: large tensors between small ones, and a folder is not a file") {
  TempDir dir;
  const auto path = dir.file("big.safetensors");
  std::vector<float> big(3'000'000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.25f;
  keras::write_safetensors(path, {{"a", Tensor::scalar<std::int32_t>(1)},
                                  {"big", Tensor::from_vector<float>(big, {1000, 3000})},
                                  {"z", Tensor::from_vector<std::uint8_t>({9, 8, 7}, {3})}});
  const auto content = keras::read_safetensors(path);
  REQUIRE(content.tensors.size() == 3);
  CHECK(content.tensors[0].second.item<std::int32_t>() == 1);
  CHECK(content.tensors[1].second.to_vector<float>() == big);
  CHECK(content.tensors[2].second.to_vector<std::uint8_t>() == std::vector<std::uint8_t>{9, 8, 7});
  CHECK_THROWS_AS(keras::read_safetensors(dir.path().string()), InvalidArgument);
}

TEST_CASE("safetensors: the bytes on disk follow the spec exactly") {
  TempDir dir;
  const auto path = dir.file("exact.safetensors");
  keras::write_safetensors(path,
                           {{"b", Tensor::from_vector<float>({1.0f, 2.0f}, {2})},
                            {"a", Tensor::from_vector<std::int64_t>({5}, {1, 1})},
                            {"z", Tensor::zeros({0, 4}, DType::kU8)}},
                           {{"format", "x"}});
  const std::string bytes = read_bytes(path);
  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)])) << (8 * i);
  CHECK(n % 8 == 0);  // the data starts 8-byte aligned
  REQUIRE(bytes.size() == 8 + n + 16);
  std::string data = bytes.substr(8 + n);
  std::string expected_data(16, '\0');
  const float fv[2] = {1.0f, 2.0f};
  const std::int64_t iv = 5;
  std::memcpy(expected_data.data(), fv, 8);
  std::memcpy(expected_data.data() + 8, &iv, 8);
  CHECK(data == expected_data);
  const std::string checksum = fmt::format("crc32:{:08x}", crc32_of(expected_data));
  std::string header = R"({"__metadata__":{"format":"x","checksum":")" + checksum +
                       R"("},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("a":{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]},)"
                       R"("z":{"dtype":"U8","shape":[0,4],"data_offsets":[16,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  CHECK(bytes.substr(8, n) == header);
}

TEST_CASE("safetensors: Python's safetensors package reads our files and we read its files") {
  if (!python_safetensors_available()) {
    MESSAGE("skipped: python3 with the safetensors and numpy packages is not available");
    return;
  }
  TempDir dir;
  const auto ours = dir.file("ours.safetensors");
  keras::write_safetensors(ours,
                           {{"dense/kernel", Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3})},
                            {"dense/bias", Tensor::from_vector<double>({0.5, -0.5, 1e-9}, {3})},
                            {"count", Tensor::scalar<std::int64_t>(-12345678901LL)},
                            {"ids", Tensor::from_vector<std::int32_t>({3, -4}, {2})},
                            {"mask", Tensor::from_vector<std::uint8_t>({1, 0, 1}, {3})},
                            {"none", Tensor::zeros({0, 2}, DType::kF32)}},
                           {{"format", "tandem.weights"}});
  const auto script = dir.file("check.py");
  write_bytes(script, R"(import sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
assert t["dense/kernel"].dtype == np.float32 and t["dense/kernel"].tolist() == [[1, 2, 3], [4, 5, 6]], t
assert t["dense/bias"].dtype == np.float64 and t["dense/bias"].tolist() == [0.5, -0.5, 1e-9], t
assert t["count"].dtype == np.int64 and t["count"].shape == () and int(t["count"]) == -12345678901, t
assert t["ids"].dtype == np.int32 and t["ids"].tolist() == [3, -4], t
assert t["mask"].dtype == np.uint8 and t["mask"].tolist() == [1, 0, 1], t
assert t["none"].shape == (0, 2), t
with safe_open(sys.argv[1], framework="np") as f:
    meta = f.metadata()
assert meta["format"] == "tandem.weights" and meta["checksum"].startswith("crc32:"), meta
save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7, 8], dtype=np.int64),
           "s": np.array(2.5, dtype=np.float64), "flag": np.array([True, False])},
          sys.argv[2], metadata={"origin": "python"})
print("python-ok")
)");
  const auto theirs = dir.file("theirs.safetensors");
  const auto command = fmt::format("python3 '{}' '{}' '{}' > '{}' 2>&1", script, ours, theirs, dir.file("out.txt"));
  const int rc = std::system(command.c_str());
  INFO(read_bytes(dir.file("out.txt")));
  REQUIRE(rc == 0);
  CHECK(read_bytes(dir.file("out.txt")).find("python-ok") != std::string::npos);

  const auto content = keras::read_safetensors(theirs);
  CHECK(content.metadata.at("origin") == "python");
  CHECK(content.metadata.count("checksum") == 0);
  std::map<std::string, Tensor> by_name(content.tensors.begin(), content.tensors.end());
  CHECK(by_name.at("w").shape() == Shape{2, 3});
  CHECK(by_name.at("w").to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4, 5});
  CHECK(by_name.at("b").to_vector<std::int64_t>() == std::vector<std::int64_t>{7, 8});
  CHECK(by_name.at("s").shape() == Shape{});
  CHECK(by_name.at("s").item<double>() == 2.5);
  CHECK(by_name.at("flag").to_vector<std::uint8_t>() == std::vector<std::uint8_t>{1, 0});  // BOOL reads as uint8
}

TEST_CASE("safetensors: corrupt and truncated files raise DataLoss naming the file") {
  TempDir dir;
  const auto good = dir.file("good.safetensors");
  keras::write_safetensors(
      good, {{"w", Tensor::from_vector<float>({1, 2, 3, 4}, {4})}, {"b", Tensor::from_vector<float>({5, 6}, {2})}});
  const std::string bytes = read_bytes(good);
  const auto path = dir.file("bad.safetensors");
  const auto read = [&] { keras::read_safetensors(path); };

  SUBCASE("a flipped data byte fails the checksum") {
    std::string b = bytes;
    b[b.size() - 3] = static_cast<char>(b[b.size() - 3] ^ 0x10);
    write_bytes(path, b);
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find(path) != std::string::npos);
    CHECK(m.find("checksum") != std::string::npos);
  }
  SUBCASE("truncated in the data") {
    write_bytes(path, bytes.substr(0, bytes.size() - 5));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find(path) != std::string::npos);
    CHECK(m.find("\"b\"") != std::string::npos);  // the tensor that runs past the end
  }
  SUBCASE("truncated in the header") {
    write_bytes(path, bytes.substr(0, 20));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find(path) != std::string::npos);
    CHECK(m.find("header length") != std::string::npos);
  }
  SUBCASE("shorter than the length field") {
    write_bytes(path, bytes.substr(0, 5));
    CHECK(tandem::testing::error_message<DataLoss>(read).find(path) != std::string::npos);
  }
  SUBCASE("an empty file") {
    write_bytes(path, "");
    CHECK(tandem::testing::error_message<DataLoss>(read).find(path) != std::string::npos);
  }
  SUBCASE("bad JSON") {
    write_bytes(path, raw_file(R"({"w": {"dtype": "F32", )", "abcd"));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find(path) != std::string::npos);
    CHECK(m.find("JSON") != std::string::npos);
  }
  SUBCASE("a header that is not an object") {
    write_bytes(path, raw_file("[1, 2]  ", ""));
    CHECK(tandem::testing::error_message<DataLoss>(read).find(path) != std::string::npos);
  }
  SUBCASE("offsets out of range") {
    write_bytes(
        path,
        raw_file(
            R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
            std::string(12, 'x')));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find(path) != std::string::npos);
    CHECK(m.find("\"v\"") != std::string::npos);
    CHECK(m.find("[8, 16]") != std::string::npos);
  }
  SUBCASE("overlapping tensors") {
    write_bytes(
        path,
        raw_file(
            R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            std::string(12, 'x')));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find("overlaps") != std::string::npos);
    CHECK(m.find("\"v\"") != std::string::npos);
  }
  SUBCASE("a gap between tensors") {
    write_bytes(
        path,
        raw_file(
            R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"v":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            std::string(12, 'x')));
    CHECK(tandem::testing::error_message<DataLoss>(read).find("\"v\"") != std::string::npos);
  }
  SUBCASE("trailing bytes after the last tensor") {
    write_bytes(path, raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(9, 'x')));
    CHECK(tandem::testing::error_message<DataLoss>(read).find(path) != std::string::npos);
  }
  SUBCASE("a shape that does not match the byte range") {
    write_bytes(path, raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x')));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find("\"w\"") != std::string::npos);
    CHECK(m.find("needs 12 bytes") != std::string::npos);
  }
  SUBCASE("an unknown dtype") {
    write_bytes(path, raw_file(R"({"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", std::string(8, 'x')));
    const auto m = tandem::testing::error_message<DataLoss>(read);
    CHECK(m.find("\"w\"") != std::string::npos);
    CHECK(m.find("C64") != std::string::npos);
  }
  SUBCASE("negative or non-integer offsets") {
    write_bytes(path, raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", std::string(4, 'x')));
    CHECK(tandem::testing::error_message<DataLoss>(read).find("\"w\"") != std::string::npos);
  }
  SUBCASE("a malformed checksum") {
    write_bytes(
        path,
        raw_file(R"({"__metadata__":{"checksum":"md5:1234"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                 std::string(4, 'x')));
    CHECK(tandem::testing::error_message<DataLoss>(read).find("md5:1234") != std::string::npos);
  }
  SUBCASE("non-string metadata") {
    write_bytes(path, raw_file(R"({"__metadata__":{"epoch":3},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                               std::string(4, 'x')));
    CHECK(tandem::testing::error_message<DataLoss>(read).find("epoch") != std::string::npos);
  }
}

TEST_CASE("safetensors: hostile headers raise DataLoss with a short message, never a crash") {
  TempDir dir;
  const auto path = dir.file("hostile.safetensors");
  const auto message_for = [&](const std::string& header, const std::string& data) {
    write_bytes(path, raw_file(header, data));
    const auto m = tandem::testing::error_message<DataLoss>([&] { keras::read_safetensors(path); });
    CHECK(m.find(path) != std::string::npos);
    CHECK_MESSAGE(m.size() < 1000, "a message of " << m.size() << " bytes");
    return m;
  };
  const auto contains = [](const std::string& m, const std::string& part) { return m.find(part) != std::string::npos; };
  // Nesting: dumping this value into the message overflowed the stack.
  const std::string deep = std::string(200'000, '[') + std::string(200'000, ']');
  CHECK(contains(message_for(R"({"w": )" + deep + "}", ""), "nested deeper than 32 levels"));
  CHECK(contains(message_for(R"({"__metadata__": {"a": )" + deep + "}}", ""), "nested deeper than 32 levels"));
  // Numbers beyond double's range.
  CHECK(
      contains(message_for(R"({"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}})", "abcd"), "number"));
  // A shape with a zero whose other dimensions multiply past int64: no data, but absurd.
  CHECK(contains(
      message_for(R"({"w": {"dtype": "U8", "shape": [4294967296, 2147483648, 0], "data_offsets": [0, 0]}})", ""),
      "too large"));
  CHECK(contains(
      message_for(R"({"w": {"dtype": "U8", "shape": [0, 9223372036854775807, 2], "data_offsets": [0, 0]}})", ""),
      "too large"));
  // A name or value of a megabyte is quoted short.
  const std::string long_name(1'000'000, 'n');
  CHECK(contains(message_for(R"({")" + long_name + R"(": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})",
                             std::string(8, 'x')),
                 "nnnn"));
  CHECK(contains(message_for(R"({"w": {"dtype": ")" + long_name + R"(", "shape": [1], "data_offsets": [0, 8]}})",
                             std::string(8, 'x')),
                 "unknown dtype"));
  CHECK(contains(message_for(R"({"w": ")" + long_name + R"("})", ""), "\"w\""));
  CHECK(contains(message_for(R"({"__metadata__": {"checksum": ")" + long_name + R"("}})", ""), "checksum"));
  // Control characters in names are escaped.
  CHECK(contains(message_for("{\"w\\u001b[2J\": 5}", ""), "\\x1b[2J"));
}

TEST_CASE("safetensors: a missing file is NotFound") {
  TempDir dir;
  const auto path = dir.file("nothing.safetensors");
  CHECK(tandem::testing::error_message<NotFound>([&] { keras::read_safetensors(path); }).find(path) !=
        std::string::npos);
}

TEST_CASE("safetensors: writes are atomic") {
  TempDir dir;
  const auto path = dir.file("w.safetensors");
  keras::write_safetensors(path, {{"w", Tensor::from_vector<float>({1, 2}, {2})}});
  const std::string before = read_bytes(path);

  SUBCASE("a folder that does not exist is Unavailable, naming the path and the reason") {
    const auto missing = dir.file("no/such/folder/w.safetensors");
    const auto m = tandem::testing::error_message<Unavailable>([&] {
      keras::write_safetensors(missing, {{"w", Tensor::scalar<float>(1)}});
    });
    CHECK(m.find(missing) != std::string::npos);
    CHECK(m.find("No such file or directory") != std::string::npos);
  }
  SUBCASE("a bad tensor list leaves the previous file as it was") {
    const auto duplicate = [&] {
      keras::write_safetensors(path, {{"w", Tensor::scalar<float>(1)}, {"w", Tensor::scalar<float>(2)}});
    };
    CHECK(tandem::testing::error_message<InvalidArgument>(duplicate).find("\"w\"") != std::string::npos);
    CHECK_THROWS_AS(keras::write_safetensors(path, {{"", Tensor::scalar<float>(1)}}), InvalidArgument);
    CHECK_THROWS_AS(keras::write_safetensors(path, {{"__metadata__", Tensor::scalar<float>(1)}}), InvalidArgument);
    CHECK_THROWS_AS(keras::write_safetensors(path, {{"u", Tensor()}}), InvalidArgument);
  }
  SUBCASE("renaming over a folder fails cleanly") {
    fs::create_directories(dir.path() / "taken");
    const auto m = tandem::testing::error_message<Unavailable>([&] {
      keras::write_safetensors(dir.file("taken"), {{"w", Tensor::scalar<float>(1)}});
    });
    CHECK(m.find(dir.file("taken")) != std::string::npos);
  }
  CHECK(read_bytes(path) == before);
  // Nothing but the original file (and the folder made above): no temporary files left.
  for (const auto& name : dir.entries()) CHECK((name == "w.safetensors" || name == "taken"));
  // Overwriting replaces the file whole.
  keras::write_safetensors(path, {{"v", Tensor::from_vector<float>({3, 4, 5}, {3})}});
  const auto content = keras::read_safetensors(path);
  REQUIRE(content.tensors.size() == 1);
  CHECK(content.tensors[0].first == "v");
}

TEST_CASE("safetensors: a write removes the temporaries that killed writers left for the same file") {
  TempDir dir;
  const auto path = dir.file("w.safetensors");
  char host_buffer[256] = {};
  REQUIRE(::gethostname(host_buffer, sizeof(host_buffer) - 1) == 0);
  const std::string host = host_buffer;
  // A process that is gone: a child that has exited and been reaped.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  REQUIRE(::waitpid(child, nullptr, 0) == child);
  const auto gone = std::to_string(child);
  const auto live = std::to_string(::getppid());
  const auto mine = std::to_string(::getpid());

  const auto now = fs::file_time_type::clock::now();
  const auto idle_minutes = [&](const std::string& name, int minutes) {
    write_bytes(dir.file(name), std::string(1000, 't'));
    fs::last_write_time(dir.file(name), now - std::chrono::minutes(minutes));
  };
  // Removed: this host's writers that are gone (once idle for a minute), and any writer's file
  // idle for hours (another host's process cannot be asked; a PID may have been reused).
  const std::vector<std::string> stale = {
      ".w.safetensors.tmp-" + host + "-" + gone + "-0",
      ".w.safetensors.tmp-" + host + "-" + gone + "-17",
      ".w.safetensors.tmp-other-host-" + gone + "-0",
      ".w.safetensors.tmp-" + host + "-" + live + "-3",
      ".w.safetensors.tmp-" + gone + "-2",  // the older name, without the host
  };
  idle_minutes(stale[0], 2);
  idle_minutes(stale[1], 2);
  idle_minutes(stale[2], 7 * 60);
  idle_minutes(stale[3], 7 * 60);
  idle_minutes(stale[4], 7 * 60);
  // Kept: live writers, a gone writer's file still being written a moment ago (a process in
  // another PID namespace of this host may own it), other hosts' recent files, other files.
  const std::vector<std::string> kept = {
      ".w.safetensors.tmp-" + host + "-" + live + "-0",
      ".w.safetensors.tmp-" + host + "-" + mine + "-99",
      ".w.safetensors.tmp-" + host + "-" + gone + "-5",
      ".w.safetensors.tmp-other-host-" + gone + "-1",
      ".w.safetensors.tmp-" + gone + "-4",
      ".v.safetensors.tmp-" + host + "-" + gone + "-0",
      ".w.safetensors.tmp-notes",
      "w.safetensors.tmp-" + host + "-" + gone + "-0",
  };
  idle_minutes(kept[0], 60);
  idle_minutes(kept[1], 60);
  idle_minutes(kept[2], 0);
  idle_minutes(kept[3], 60);
  idle_minutes(kept[4], 60);
  idle_minutes(kept[5], 7 * 60);
  idle_minutes(kept[6], 7 * 60);
  idle_minutes(kept[7], 7 * 60);

  keras::write_safetensors(path, {{"w", Tensor::scalar<float>(1)}});
  std::vector<std::string> expected = kept;
  expected.push_back("w.safetensors");
  std::sort(expected.begin(), expected.end());
  CHECK(dir.entries() == expected);
  CHECK(keras::read_safetensors(path).tensors.size() == 1);
}

TEST_CASE("model weights: save and load round-trip under the variable names") {
  TempDir dir;
  const auto path = dir.file("model.weights.safetensors");
  auto model = small_model("rt_");
  const auto original = weight_values(model);
  model.save_weights(path);

  const auto content = keras::read_safetensors(path);
  std::vector<std::string> names;
  for (const auto& [name, t] : content.tensors) names.push_back(name);
  CHECK(names == std::vector<std::string>{"rt_hidden/kernel", "rt_hidden/bias", "rt_out/kernel", "rt_out/bias"});
  CHECK(content.metadata.at("format") == "tandem.weights");

  // Scramble, then load back.
  std::vector<Tensor> zeros;
  for (const auto& w : model.get_weights()) zeros.push_back(Tensor::zeros(w.shape(), w.dtype()));
  model.set_weights(zeros);
  CHECK(weight_values(model) != original);
  model.load_weights(path);
  CHECK(weight_values(model) == original);
}

TEST_CASE("model weights: a file that does not match changes nothing and names the tensors") {
  TempDir dir;
  auto model = small_model("mm_");
  const auto original = weight_values(model);
  const auto path = dir.file("w.safetensors");
  auto tensors = keras::NamedTensors{};
  for (const auto& w : model.weights()) tensors.emplace_back(w->name(), Tensor::filled<float>(w->shape(), 7.0f));

  SUBCASE("a missing tensor") {
    tensors.erase(tensors.begin() + 1);
    keras::write_safetensors(path, tensors);
    const auto m = tandem::testing::error_message<InvalidArgument>([&] { model.load_weights(path); });
    CHECK(m.find("mm_hidden/bias") != std::string::npos);
    CHECK(m.find("missing") != std::string::npos);
    CHECK(m.find(path) != std::string::npos);
  }
  SUBCASE("an extra tensor") {
    tensors.emplace_back("mm_other/kernel", Tensor::zeros({1}, DType::kF32));
    keras::write_safetensors(path, tensors);
    const auto m = tandem::testing::error_message<InvalidArgument>([&] { model.load_weights(path); });
    CHECK(m.find("mm_other/kernel") != std::string::npos);
  }
  SUBCASE("a tensor of another shape") {
    tensors[2].second = Tensor::zeros({4, 3}, DType::kF32);
    keras::write_safetensors(path, tensors);
    const auto m = tandem::testing::error_message<InvalidArgument>([&] { model.load_weights(path); });
    CHECK(m.find("mm_out/kernel") != std::string::npos);
    CHECK(m.find("(4, 3)") != std::string::npos);
    CHECK(m.find("(4, 2)") != std::string::npos);
  }
  SUBCASE("a tensor of another dtype") {
    tensors[3].second = Tensor::zeros({2}, DType::kF64);
    keras::write_safetensors(path, tensors);
    const auto m = tandem::testing::error_message<InvalidArgument>([&] { model.load_weights(path); });
    CHECK(m.find("mm_out/bias") != std::string::npos);
    CHECK(m.find("float64") != std::string::npos);
  }
  SUBCASE("a corrupt file") {
    keras::write_safetensors(path, tensors);
    std::string b = read_bytes(path);
    b.back() = static_cast<char>(b.back() ^ 1);
    write_bytes(path, b);
    CHECK_THROWS_AS(model.load_weights(path), DataLoss);
  }
  CHECK(weight_values(model) == original);
}

TEST_CASE("training checkpoint: weights, optimizer slots, iterations and state round-trip") {
  TempDir dir;
  const auto path = dir.file("ckpt.safetensors");
  const auto [x, y] = four_examples();
  auto model = small_model("ck_");
  model.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  model.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .shuffle = false});
  model.optimizer().set_learning_rate(0.005);
  keras::save_training_checkpoint(model, path, {.epoch = 2, .step = 0});

  const auto content = keras::read_safetensors(path);
  CHECK(content.metadata.at("format") == "tandem.checkpoint");
  CHECK(content.metadata.at("epoch") == "2");
  std::map<std::string, Tensor> by_name(content.tensors.begin(), content.tensors.end());
  REQUIRE(by_name.count("optimizer/iterations") == 1);
  CHECK(by_name.at("optimizer/iterations").dtype() == DType::kI64);
  CHECK(by_name.at("optimizer/iterations").item<std::int64_t>() == 4);
  CHECK(by_name.count("ck_hidden/kernel") == 1);
  CHECK(by_name.count("optimizer/ck_hidden/kernel/m") == 1);  // Adam's first moment

  // A fresh model of the same architecture, compiled but never trained, resumes exactly.
  auto restored = small_model("ck2_");
  restored.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  // Names differ ("ck2_"), so this one must be refused without changing anything...
  const auto before = weight_values(restored);
  CHECK_THROWS_AS(keras::load_training_checkpoint(restored, path), InvalidArgument);
  CHECK(weight_values(restored) == before);
  CHECK(restored.optimizer().iterations() == 0);

  // ...while a checkpoint of the same names loads whole.
  auto twin = keras::NamedTensors{};
  for (auto [name, t] : content.tensors) {
    if (name.starts_with("ck_")) name = "ck2_" + name.substr(3);
    if (name.starts_with("optimizer/ck_")) name = "optimizer/ck2_" + name.substr(13);
    twin.emplace_back(name, t);
  }
  const auto twin_path = dir.file("twin.safetensors");
  keras::write_safetensors(twin_path, twin, content.metadata);
  const auto state = keras::load_training_checkpoint(restored, twin_path);
  CHECK(state.epoch == 2);
  CHECK(state.step == 0);
  const auto at_checkpoint = weight_values(model);
  CHECK(weight_values(restored) == at_checkpoint);
  CHECK(restored.optimizer().iterations() == 4);
  CHECK(restored.optimizer().learning_rate() == 0.005);
  REQUIRE(restored.optimizer().slots().size() == model.optimizer().slots().size());
  for (std::size_t i = 0; i < model.optimizer().slots().size(); ++i) {
    CHECK(restored.optimizer().slots()[i].second->read_value().to_vector<float>() ==
          model.optimizer().slots()[i].second->read_value().to_vector<float>());
  }
  // Both continue identically.
  model.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0, .shuffle = false});
  restored.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0, .shuffle = false});
  CHECK(weight_values(restored) == weight_values(model));

  // load_weights accepts a training checkpoint (its weights only).
  auto plain = small_model("ck2_");
  plain.load_weights(twin_path);
  CHECK(weight_values(plain) == at_checkpoint);
}

TEST_CASE("training checkpoint: a mismatch is refused before anything changes") {
  TempDir dir;
  const auto path = dir.file("ckpt.safetensors");
  auto x = Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, -0.5f, 0.4f, 0.9f}, {2, 3});
  auto y = Tensor::from_vector<float>({1, 0, 0, 1}, {2, 2});
  auto model = small_model("cm_");
  model.compile(keras::Adam{}, "mse");
  model.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0});
  keras::save_training_checkpoint(model, path, {.epoch = 1, .step = 0});
  auto content = keras::read_safetensors(path);
  const auto weights_before = weight_values(model);
  const auto bad_path = dir.file("bad.safetensors");
  auto drop = [&](const std::string& name) {
    keras::NamedTensors kept;
    for (const auto& nt : content.tensors) {
      if (nt.first != name) kept.push_back(nt);
    }
    keras::write_safetensors(bad_path, kept, content.metadata);
  };
  // Train on so that a wrongly applied load would be visible.
  model.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0});
  const auto trained = weight_values(model);
  const auto iterations = model.optimizer().iterations();

  SUBCASE("a missing slot") {
    drop("optimizer/cm_out/bias/v");
    const auto m =
        tandem::testing::error_message<InvalidArgument>([&] { keras::load_training_checkpoint(model, bad_path); });
    CHECK(m.find("optimizer/cm_out/bias/v") != std::string::npos);
  }
  SUBCASE("no iteration count") {
    drop("optimizer/iterations");
    CHECK(tandem::testing::error_message<DataLoss>([&] {
            keras::load_training_checkpoint(model, bad_path);
          }).find("optimizer/iterations") != std::string::npos);
  }
  SUBCASE("a weights file is not a checkpoint") {
    model.save_weights(bad_path);
    CHECK_THROWS_AS(keras::load_training_checkpoint(model, bad_path), InvalidArgument);
  }
  SUBCASE("another optimizer") {
    auto sgd_model = small_model("cm_");
    sgd_model.compile("sgd", "mse");
    CHECK_THROWS_AS(keras::load_training_checkpoint(sgd_model, path), InvalidArgument);
  }
  CHECK(weight_values(model) == trained);
  CHECK(model.optimizer().iterations() == iterations);
  // The good checkpoint still loads.
  keras::load_training_checkpoint(model, path);
  CHECK(weight_values(model) == weights_before);
}

TEST_CASE("training checkpoint: a learning-rate schedule is saved as Keras serialises it and resumes") {
  TempDir dir;
  const auto path = dir.file("sched.safetensors");
  const auto [x, y] = four_examples();
  const keras::CosineDecay cosine{
      .initial_learning_rate = 0.0, .decay_steps = 8, .alpha = 0.1, .warmup_target = 0.05, .warmup_steps = 3};
  const keras::AdamW adamw{.learning_rate = cosine, .exclude_from_weight_decay = {"bias"}};
  auto model = small_model("sc_");
  model.compile(adamw, "mse");
  model.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .shuffle = false});
  keras::save_training_checkpoint(model, path, {.epoch = 2, .step = 0});

  const auto content = keras::read_safetensors(path);
  CHECK(content.metadata.at("learning_rate_schedule") == keras::LearningRate(cosine).to_json());
  // The rate follows from iterations: no constant is stored.
  CHECK(std::none_of(content.tensors.begin(), content.tensors.end(),
                     [](const auto& nt) { return nt.first == "optimizer/learning_rate"; }));

  const auto capture_warnings = [](const std::function<void()>& fn) {
    std::string captured;
    auto previous = logging::set_sink([&](logging::Level level, std::string_view message) {
      if (level == logging::Level::kWarn) captured += message;
    });
    fn();
    logging::set_sink(std::move(previous));
    return captured;
  };

  SUBCASE("the same schedule: the same rate at the same step, and the same training after") {
    auto restored = small_model("sc_");
    restored.compile(adamw, "mse");
    CHECK(capture_warnings([&] { keras::load_training_checkpoint(restored, path); }).empty());
    CHECK(restored.optimizer().iterations() == 4);
    CHECK(restored.optimizer().learning_rate() == model.optimizer().learning_rate());
    CHECK(restored.optimizer().learning_rate() == keras::LearningRate(cosine)(4));
    model.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .shuffle = false});
    restored.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .shuffle = false});
    CHECK(weight_values(restored) == weight_values(model));
  }
  SUBCASE("another schedule: the compiled one is kept, and a warning names both") {
    keras::CosineDecay longer = cosine;
    longer.decay_steps = 80;
    auto restored = small_model("sc_");
    restored.compile(keras::AdamW{.learning_rate = longer}, "mse");
    const auto warning = capture_warnings([&] { keras::load_training_checkpoint(restored, path); });
    CHECK(warning.find("\"decay_steps\":8,") != std::string::npos);
    CHECK(warning.find("\"decay_steps\":80,") != std::string::npos);
    CHECK(warning.find("training continues with the optimizer's") != std::string::npos);
    CHECK(restored.optimizer().learning_rate_config() == keras::LearningRate(longer));
    CHECK(restored.optimizer().learning_rate() == keras::LearningRate(longer)(4));
    CHECK(weight_values(restored) == weight_values(model));
  }
  SUBCASE("a constant-rate optimizer keeps its constant") {
    auto restored = small_model("sc_");
    restored.compile(keras::AdamW{.learning_rate = 0.002}, "mse");
    const auto warning = capture_warnings([&] { keras::load_training_checkpoint(restored, path); });
    CHECK(warning.find("CosineDecay") != std::string::npos);
    CHECK(restored.optimizer().learning_rate() == 0.002);
  }
  SUBCASE("a checkpoint from before schedules (a constant rate, or none) loads into a scheduled optimizer") {
    auto constant = small_model("sc_");
    constant.compile(keras::AdamW{.learning_rate = 0.002}, "mse");
    constant.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0, .shuffle = false});
    const auto old_path = dir.file("old.safetensors");
    keras::save_training_checkpoint(constant, old_path, {.epoch = 1, .step = 0});
    auto restored = small_model("sc_");
    restored.compile(adamw, "mse");
    const auto warning = capture_warnings([&] { keras::load_training_checkpoint(restored, old_path); });
    CHECK(warning.find("learning rate 0.002") != std::string::npos);
    CHECK(restored.optimizer().learning_rate_config().is_schedule());
    CHECK(restored.optimizer().learning_rate() == keras::LearningRate(cosine)(2));
    CHECK(weight_values(restored) == weight_values(constant));

    auto old = keras::read_safetensors(old_path);
    std::erase_if(old.tensors, [](const auto& nt) { return nt.first == "optimizer/learning_rate"; });
    keras::write_safetensors(old_path, old.tensors, old.metadata);
    CHECK(capture_warnings([&] { keras::load_training_checkpoint(restored, old_path); }).empty());
    CHECK(restored.optimizer().iterations() == 2);
  }
}

TEST_CASE("training checkpoint: needs a compiled model") {
  TempDir dir;
  auto model = small_model("nc_");
  CHECK_THROWS_AS(keras::save_training_checkpoint(model, dir.file("c.safetensors"), {}), FailedPrecondition);
}

TEST_CASE("safetensors and weight files from GPU tensors and GPU models") {
  const auto gpus = devices::list_logical_devices(devices::DeviceType::kGPU);
  if (gpus.empty()) {
    MESSAGE("skipped: no GPU");
    return;
  }
  for (auto* gpu : gpus) {
    CAPTURE(gpu->full_name());
    TempDir dir;
    const auto path = dir.file("gpu.safetensors");
    const std::vector<float> values = {1, 2, 3, 4, 5, 6};
    keras::write_safetensors(path, {{"g", Tensor::from_vector<float>(values, {2, 3}, *gpu)},
                                    {"h", Tensor::from_vector<std::int64_t>({7}, {1})}});
    const auto content = keras::read_safetensors(path);
    CHECK(content.tensors[0].second.to_vector<float>() == values);

    OneDeviceStrategy strategy(gpu->full_name());
    keras::Model model;
    {
      auto scope = strategy.scope();
      model = small_model("gpu_");
    }
    const auto original = weight_values(model);
    const auto weights_path = dir.file("gpu.weights.safetensors");
    model.save_weights(weights_path);
    std::vector<Tensor> zeros;
    for (const auto& w : model.get_weights()) zeros.push_back(Tensor::zeros(w.shape(), w.dtype()));
    model.set_weights(zeros);
    model.load_weights(weights_path);
    CHECK(weight_values(model) == original);
    CHECK(&model.weights().front()->value().device() == gpu);  // the weights stay on the GPU
  }
}

TEST_CASE("model weights and checkpoints load into a twin built later in the process: matched by structure") {
  // Auto-generated layer names keep counting (dense_4, dense_5, then dense_6, dense_7): a second
  // model built by the same code has other names. Keras 3 matches weights by the layers' order.
  TempDir dir;
  const auto build = [](std::int64_t hidden = 4) {
    auto model = keras::Sequential({keras::Input({3}), keras::Dense(hidden, "relu"), keras::Dense(2)});
    model.compile(keras::Adam{.learning_rate = 0.01}, "mse");
    return model;
  };
  const auto [x, y] = four_examples();
  auto first = build();
  first.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .shuffle = false});
  const auto weights = dir.file("w.safetensors");
  const auto checkpoint = dir.file("ckpt.safetensors");
  first.save_weights(weights);
  keras::save_training_checkpoint(first, checkpoint, {.epoch = 2, .step = 0});

  auto twin = build();
  REQUIRE(twin.weights()[0]->name() != first.weights()[0]->name());
  twin.load_weights(weights);
  CHECK(weight_values(twin) == weight_values(first));

  auto resumed = build();
  const auto state = keras::load_training_checkpoint(resumed, checkpoint);
  CHECK(state.epoch == 2);
  CHECK(weight_values(resumed) == weight_values(first));
  CHECK(resumed.optimizer().iterations() == first.optimizer().iterations());
  first.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0, .shuffle = false});
  resumed.fit(x, y, {.batch_size = 2, .epochs = 1, .verbose = 0, .shuffle = false});
  CHECK(weight_values(resumed) == weight_values(first));

  // Another structure is refused, naming the first weight that differs and both shapes, and
  // changes nothing.
  auto wider = build(5);
  const auto before = weight_values(wider);
  const auto m = tandem::testing::error_message([&] { wider.load_weights(weights); });
  CHECK(m.find(wider.weights()[0]->name()) != std::string::npos);
  CHECK(m.find("(3, 4)") != std::string::npos);
  CHECK(m.find("(3, 5)") != std::string::npos);
  CHECK_THROWS_AS(keras::load_training_checkpoint(wider, checkpoint), InvalidArgument);
  CHECK(weight_values(wider) == before);
  // So is a model with a layer more, naming where the two part.
  auto deeper = keras::Sequential({keras::Input({3}), keras::Dense(4, "relu"), keras::Dense(4), keras::Dense(2)});
  const auto d = tandem::testing::error_message([&] { deeper.load_weights(weights); });
  CHECK(d.find(fmt::format("weight 3 of the model is \"{}\" (float32 (4, 4))", deeper.weights()[2]->name())) !=
        std::string::npos);
  // Names that differ other than by their numbering are not matched by position.
  auto renamed = small_model("other_");
  auto original = small_model("orig_");
  original.save_weights(weights);
  CHECK_THROWS_WITH_AS(renamed.load_weights(weights), doctest::Contains("missing from the file"), InvalidArgument);
}
