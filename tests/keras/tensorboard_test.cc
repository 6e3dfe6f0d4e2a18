// The TensorBoard callback: CRC-32C and TFRecord framing against published values, then event
// files written by fit() read back record by record (checksums verified, Events parsed with
// libprotobuf) and compared with History.
#include <doctest/doctest.h>

#include "common/error_message.h"
#include "common/temp_dir.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "tandem/keras_like/detail/event_file.h"
#include "tandem/keras_like/keras.h"
#include "detail/tensorboard_events.pb.h"
#include "common/regression_data.h"

using namespace tandem;
namespace fs = std::filesystem;
namespace pb = tandem::tensorboard;
using keras::detail::crc32c;
using keras::detail::mask_crc;

namespace {

struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("tandem_tensorboard_test") {}
};

std::uint64_t read_le(const std::string& bytes, std::size_t at, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + static_cast<std::size_t>(i)]);
  return v;
}

// The records of a TFRecord file, every checksum verified (a failed check fails the test).
std::vector<std::string> read_records(const std::string& path) {
  const std::string bytes = testing::read_file_bytes(path);
  std::vector<std::string> records;
  std::size_t at = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    const auto length = read_le(bytes, at, 8);
    REQUIRE(read_le(bytes, at + 8, 4) == mask_crc(crc32c(std::string_view(bytes).substr(at, 8))));
    REQUIRE(at + 12 + length + 4 <= bytes.size());
    std::string data = bytes.substr(at + 12, length);
    REQUIRE(read_le(bytes, at + 12 + length, 4) == mask_crc(crc32c(data)));
    records.push_back(std::move(data));
    at += 12 + length + 4;
  }
  return records;
}

// What one event file holds, by kind.
struct EventFile {
  std::string file_version;  // of the first record
  std::map<std::string, std::vector<std::pair<std::int64_t, float>>> scalars;
  std::map<std::string, std::vector<pb::HistogramProto>> histograms;
  std::vector<pb::GraphDef> graphs;
};

EventFile read_events(const std::string& path) {
  EventFile out;
  const auto records = read_records(path);
  REQUIRE(!records.empty());
  for (std::size_t i = 0; i < records.size(); ++i) {
    pb::Event event;
    REQUIRE(event.ParseFromString(records[i]));
    CHECK(event.wall_time() > 1.5e9);
    if (i == 0) out.file_version = event.file_version();
    if (event.has_summary()) {
      for (const auto& v : event.summary().value()) {
        if (v.has_histo()) {
          out.histograms[v.tag()].push_back(v.histo());
        } else {
          out.scalars[v.tag()].emplace_back(event.step(), v.simple_value());
        }
      }
    } else if (event.what_case() == pb::Event::kGraphDef) {
      pb::GraphDef graph;
      REQUIRE(graph.ParseFromString(event.graph_def()));
      out.graphs.push_back(graph);
    }
  }
  return out;
}

// The one event file in `dir`, named as TensorFlow names them.
std::string only_event_file(const fs::path& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
  REQUIRE(files.size() == 1);
  const std::regex name(R"(events\.out\.tfevents\.\d{10}\.[^.]+.*\.\d+\.\d+\.v2)");
  CHECK(std::regex_match(fs::path(files[0]).filename().string(), name));
  return files[0];
}

using testing::compiled_regression_model;
using testing::regression_data;

// 48 examples in batches of 16 (3 batches an epoch) for 3 epochs, validated on 16 others.
keras::History fit_three_epochs(keras::Model& model, const keras::CallbackPtr& callback) {
  const auto train = regression_data(48);
  const auto val = regression_data(16);
  return model.fit(train.x, train.y,
                   {.batch_size = 16,
                    .epochs = 3,
                    .verbose = 0,
                    .callbacks = {callback},
                    .validation_data = data::Dataset::from_tensor_slices({val.x, val.y}).batch(16),
                    .shuffle = false});
}

// scalars[tag] must be History's values for `name`, epoch by epoch, as float32.
void check_epochs(const EventFile& events, const std::string& tag, const std::vector<double>& expected) {
  INFO(tag);
  REQUIRE(events.scalars.count(tag) == 1);
  const auto& got = events.scalars.at(tag);
  REQUIRE(got.size() == expected.size());
  for (std::size_t e = 0; e < expected.size(); ++e) {
    CHECK(got[e].first == static_cast<std::int64_t>(e));
    CHECK(got[e].second == static_cast<float>(expected[e]));
  }
}

}  // namespace

TEST_CASE("CRC-32C and TFRecord framing match published values") {
  CHECK(crc32c("123456789") == 0xE3069283U);  // the CRC catalogue's check value
  CHECK(crc32c("") == 0U);
  CHECK(crc32c(std::string(32, '\0')) == 0x8A9136AAU);  // RFC 3720, B.4
  CHECK(crc32c(std::string(32, '\xff')) == 0x62A8AB43U);
  CHECK(crc32c("56789", crc32c("1234")) == 0xE3069283U);  // continues across pieces
  CHECK(mask_crc(0) == 0xa282ead8U);
  // "hello" framed: length 5, masked CRCs computed by an independent bitwise CRC-32C.
  const std::string expected(
      "\x05\0\0\0\0\0\0\0\xea\xb2\x04\x3e"
      "hello\xbb\x1f\x1c\x19",
      21);
  CHECK(keras::detail::tfrecord("hello") == expected);
}

TEST_CASE("Histograms: 30 equal buckets over [min, max]; equal values in one") {
  std::vector<double> values;
  for (int i = 0; i <= 300; ++i) values.push_back(i / 100.0);
  const auto h = keras::detail::make_histogram(values);
  CHECK(h.min == 0.0);
  CHECK(h.max == 3.0);
  CHECK(h.num == 301.0);
  REQUIRE(h.bucket.size() == 30);
  CHECK(h.bucket_limit.back() == 3.0);
  double total = 0;
  for (const double c : h.bucket) total += c;
  CHECK(total == 301.0);
  const auto flat = keras::detail::make_histogram({2.0, 2.0, 2.0});
  CHECK(flat.bucket == std::vector<double>{3.0});
  CHECK(flat.bucket_limit == std::vector<double>{2.0});
  CHECK(flat.sum_squares == 12.0);
}

TEST_CASE("fit() writes Keras's train/ and validation/ runs: scalars equal History, histograms, graph") {
  TempDir dir;
  auto model = compiled_regression_model();
  const auto log_dir = dir.path() / "logs";
  auto tb = std::make_shared<keras::TensorBoard>(log_dir.string(), keras::TensorBoardOptions{.histogram_freq = 1});
  const auto history = fit_three_epochs(model, tb);

  CHECK(tb->train_file() == only_event_file(log_dir / "train"));
  CHECK(tb->validation_file() == only_event_file(log_dir / "validation"));
  const auto train = read_events(tb->train_file());
  const auto val = read_events(tb->validation_file());
  CHECK(train.file_version == "brain.Event:2");
  CHECK(val.file_version == "brain.Event:2");

  check_epochs(train, "epoch_loss", history.at("loss"));
  check_epochs(train, "epoch_mae", history.at("mae"));
  check_epochs(train, "epoch_learning_rate", {0.05, 0.05, 0.05});
  check_epochs(val, "epoch_loss", history.at("val_loss"));
  check_epochs(val, "epoch_mae", history.at("val_mae"));
  CHECK(train.scalars.count("epoch_val_loss") == 0);
  CHECK(train.scalars.count("batch_loss") == 0);  // update_freq "epoch"
  CHECK(train.scalars.count("epoch_steps_per_second") == 0);
  // After each validation pass, at the optimizer's iterations (3 steps an epoch).
  REQUIRE(val.scalars.count("evaluation_loss_vs_iterations") == 1);
  const auto& evaluation = val.scalars.at("evaluation_loss_vs_iterations");
  REQUIRE(evaluation.size() == 3);
  CHECK(evaluation[2].first == 9);
  CHECK(evaluation[2].second == static_cast<float>(history.at("val_loss")[2]));

  // One histogram per weight and epoch, tagged by the weight's path.
  for (const auto& w : model.weights()) {
    INFO(w->name());
    const auto tag = w->name() + "/histogram";
    REQUIRE(train.histograms.count(tag) == 1);
    const auto& h = train.histograms.at(tag);
    REQUIRE(h.size() == 3);
    CHECK(h.back().num() == static_cast<double>(w->shape().num_elements()));
    double total = 0;
    for (const double c : h.back().bucket()) total += c;
    CHECK(total == h.back().num());
    CHECK(h.back().bucket_limit_size() == h.back().bucket_size());
  }
  CHECK(train.histograms.count("hidden/kernel/histogram") == 1);
  CHECK(val.histograms.empty());

  // The layer graph: input -> hidden -> out.
  REQUIRE(train.graphs.size() == 1);
  const auto& nodes = train.graphs[0].node();
  REQUIRE(nodes.size() == 3);
  CHECK(nodes[0].op() == "Placeholder");
  CHECK(nodes[1].name() == "hidden");
  CHECK(nodes[1].op() == "Dense");
  REQUIRE(nodes[1].input_size() == 1);
  CHECK(nodes[1].input(0) == nodes[0].name());
  CHECK(nodes[2].name() == "out");
  CHECK(nodes[2].input(0) == "hidden");
}

TEST_CASE("Without histogram_freq and write_graph: no histograms, no graph; a second fit opens new files") {
  TempDir dir;
  auto model = compiled_regression_model();
  auto tb = std::make_shared<keras::TensorBoard>(dir.file("logs"), keras::TensorBoardOptions{.write_graph = false});
  fit_three_epochs(model, tb);
  const auto first = tb->train_file();
  const auto train = read_events(first);
  CHECK(train.histograms.empty());
  CHECK(train.graphs.empty());
  CHECK(train.scalars.at("epoch_loss").size() == 3);
  fit_three_epochs(model, tb);
  CHECK(tb->train_file() != first);
  CHECK(fs::exists(first));
}

TEST_CASE("update_freq N: batch_ scalars every N batches of the fit; steps per second when asked") {
  TempDir dir;
  auto model = compiled_regression_model();
  auto tb = std::make_shared<keras::TensorBoard>(
      dir.file("logs"), keras::TensorBoardOptions{.update_freq = 2, .write_steps_per_second = true});
  fit_three_epochs(model, tb);
  const auto train = read_events(tb->train_file());
  for (const char* tag : {"batch_loss", "batch_mae", "batch_steps_per_second"}) {
    INFO(tag);
    REQUIRE(train.scalars.count(tag) == 1);
    std::vector<std::int64_t> steps;
    for (const auto& [step, value] : train.scalars.at(tag)) steps.push_back(step);
    CHECK(steps == std::vector<std::int64_t>{2, 4, 6, 8});  // 9 batches, counted from 1
  }
  REQUIRE(train.scalars.count("epoch_steps_per_second") == 1);
  for (const auto& [step, value] : train.scalars.at("epoch_steps_per_second")) CHECK(value > 0.0f);

  auto every =
      std::make_shared<keras::TensorBoard>(dir.file("every"), keras::TensorBoardOptions{.update_freq = "batch"});
  fit_three_epochs(model, every);
  CHECK(read_events(every->train_file()).scalars.at("batch_loss").size() == 9);
}

TEST_CASE("Bad options are InvalidArgument; an unwritable log_dir is Unavailable before the first step") {
  using testing::error_message;
  const auto bogus = error_message([] { keras::TensorBoard("logs", {.update_freq = "bogus"}); });
  CHECK(bogus.find("\"bogus\"") != std::string::npos);
  CHECK(bogus.find("update_freq") != std::string::npos);
  CHECK(error_message([] { keras::TensorBoard("logs", {.update_freq = 0}); }).find("update_freq") != std::string::npos);
  const auto negative = error_message([] { keras::TensorBoard("tb_logs", {.histogram_freq = -1}); });
  CHECK(negative.find("histogram_freq is -1") != std::string::npos);
  CHECK(negative.find("tb_logs") != std::string::npos);
  CHECK_THROWS_AS(keras::TensorBoard(""), InvalidArgument);

  TempDir dir;
  { std::ofstream(dir.file("blocker")) << "a file, not a folder"; }
  const auto log_dir = dir.file("blocker") + "/logs";
  auto model = compiled_regression_model();
  const auto before = model.get_weights().front().to_vector<float>();
  auto tb = std::make_shared<keras::TensorBoard>(log_dir);
  const auto message = error_message<Unavailable>([&] { fit_three_epochs(model, tb); });
  CHECK(message.find(log_dir) != std::string::npos);
  CHECK(model.optimizer().iterations() == 0);
  CHECK(model.get_weights().front().to_vector<float>() == before);
}

namespace {
// A strategy that, like a worker other than the chief, must not write files.
class NonChiefStrategy final : public Strategy {
 public:
  NonChiefStrategy() : Strategy("NonChiefStrategy", {&devices::default_cpu_device()}) {}
  bool should_checkpoint() const override { return false; }
};
}  // namespace

TEST_CASE("Only the chief writes: a non-chief worker's callback leaves log_dir alone") {
  TempDir dir;
  NonChiefStrategy worker;
  keras::Model model;
  {
    auto scope = worker.scope();
    model = compiled_regression_model();
  }
  REQUIRE_FALSE(model.distribute_strategy().should_checkpoint());
  auto tb = std::make_shared<keras::TensorBoard>(dir.file("logs"),
                                                 keras::TensorBoardOptions{.update_freq = 1, .histogram_freq = 1});
  keras::CallbackList list({tb}, &model, {.epochs = 2, .steps = 1, .verbose = 0});
  keras::Logs logs;
  list.on_train_begin(logs);
  for (int epoch = 0; epoch < 2; ++epoch) {
    list.on_epoch_begin(epoch, logs);
    keras::Logs batch;
    batch.set("loss", 1.0);
    list.on_train_batch_begin(0, batch);
    list.on_train_batch_end(0, batch);
    keras::Logs epoch_logs;
    epoch_logs.set("loss", 1.0);
    epoch_logs.set("val_loss", 2.0);
    list.on_test_end(epoch_logs);
    list.on_epoch_end(epoch, epoch_logs);
  }
  list.on_train_end(logs);
  CHECK_FALSE(fs::exists(dir.path() / "logs"));
  CHECK(tb->train_file().empty());
}
