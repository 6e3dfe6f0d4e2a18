// Sharded checkpoint directories (keras_like/sharded_checkpoint.h): saved from 4 shards and loaded
// on 1, 2 and 3 and into replicated variables, from 2 workers (two strategies in this process
// whose worker collectives meet in memory), consolidated, and every corruption refused naming the
// file and the tensor with the model unchanged; a save killed part-way leaves the previous
// checkpoint loadable. Sharded variables are made by hand (a ShardSpec over the replicas), as a
// ZeRO strategy makes them. Four logical CPU devices (CMakeLists.txt).
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include "keras/sharded_checkpoint_values.h"
#include "tandem/keras_like/keras.h"
#include "tandem/keras_like/sharded_checkpoint.h"

using namespace tandem;
namespace fs = std::filesystem;
using strategy::ShardSpec;
using strategy::Strategy;
using strategy::Variable;
using VariablePtr = std::shared_ptr<Variable>;
using testing::contents_on;
using testing::kA;
using testing::kB;
using testing::kValueA;
using testing::kValueB;
using testing::kValueC;
using testing::replicated_variable;
using testing::sharded_variable;

namespace {

struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("tandem_sharded_checkpoint_test") {}
};

std::vector<std::string> cpu_devices(int first, int count) {
  std::vector<std::string> out;
  for (int d = first; d < first + count; ++d) out.push_back(fmt::format("CPU:{}", d));
  return out;
}

// Workers of one job inside this process: each a Strategy over its own local devices whose
// worker collectives (sum_across_workers, broadcast_from_chief) meet here, as
// MultiWorkerMirroredStrategy's meet across processes. Each worker runs on a thread of its own.
class Job {
 public:
  explicit Job(int workers) : workers_(workers), barrier_(workers), sums_(static_cast<std::size_t>(workers)) {}
  int workers() const { return workers_; }

  void sum(int rank, std::span<double> values) {
    sums_[static_cast<std::size_t>(rank)].assign(values.begin(), values.end());
    barrier_.arrive_and_wait();
    for (std::size_t i = 0; i < values.size(); ++i) {
      double total = 0;
      for (const auto& s : sums_) total += s.at(i);
      values[i] = total;
    }
    barrier_.arrive_and_wait();
  }
  void broadcast(int rank, std::span<Tensor> values) {
    if (rank == 0) {
      chief_.clear();
      for (const auto& v : values) chief_.push_back(v.clone());
    }
    barrier_.arrive_and_wait();
    if (rank != 0) {
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = chief_.at(i).clone();
    }
    barrier_.arrive_and_wait();
  }

 private:
  int workers_;
  std::barrier<> barrier_;
  std::vector<std::vector<double>> sums_;
  std::vector<Tensor> chief_;
};

class FakeWorker final : public Strategy {
 public:
  FakeWorker(Job& job, int rank, int local_devices)
      : Strategy(fmt::format("FakeWorker#{}", rank), devices_for(rank, local_devices)), job_(job), rank_(rank) {}
  int num_workers() const override { return job_.workers(); }
  int worker_rank() const override { return rank_; }
  int num_replicas_in_sync() const override { return job_.workers() * static_cast<int>(replica_devices().size()); }
  bool should_checkpoint() const override { return rank_ == 0; }
  void sum_across_workers(std::span<double> values) override { job_.sum(rank_, values); }
  void broadcast_from_chief(std::span<Tensor> values) override { job_.broadcast(rank_, values); }

 private:
  static std::vector<devices::Device*> devices_for(int rank, int local) {
    std::vector<devices::Device*> out;
    for (const auto& name : cpu_devices(rank * local, local)) out.push_back(&devices::get_device(name));
    return out;
  }
  Job& job_;
  int rank_;
};

// Runs fn(rank) on one thread per worker; rethrows the first error.
void on_every_worker(int workers, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        fn(w);
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// The elements this worker's copies of a sharded variable hold, at their global positions (the
// rest untouched), and the padding of each copy.
void collect(const Variable& v, std::vector<float>& global, std::vector<float>& padding) {
  const auto& spec = *v.sharding();
  for (int r = 0; r < v.num_replicas(); ++r) {
    const int s = v.strategy().worker_rank() * v.num_replicas() + r;
    const auto shard = v.value(r).to(devices::default_cpu_device()).to_vector<float>();
    REQUIRE(static_cast<std::int64_t>(shard.size()) == spec.shard_elements);
    for (std::int64_t i = 0; i < spec.shard_elements; ++i) {
      if (spec.begin(s) + i < spec.end(s)) {
        global[static_cast<std::size_t>(spec.begin(s) + i)] = shard[static_cast<std::size_t>(i)];
      } else {
        padding.push_back(shard[static_cast<std::size_t>(i)]);
      }
    }
  }
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Loads the checkpoint into fresh sharded targets on `strategy` and checks what this worker holds.
void check_loads_on(Strategy& strategy, const std::string& dir) {
  const keras::CheckpointReader reader(dir);
  for (const auto& [name, shape, expected] :
       {std::tuple{std::string("a"), kA, kValueA}, std::tuple{std::string("b"), kB, kValueB}}) {
    auto target = sharded_variable(strategy, name, shape, std::vector<float>(expected.size(), 9.0f));
    keras::assign_checkpoint_value(*target, reader.read_for(name, *target));
    std::vector<float> global(expected.size(), 9.0f), padding;
    collect(*target, global, padding);
    for (int r = 0; r < target->num_replicas(); ++r) {
      const int s = strategy.worker_rank() * target->num_replicas() + r;
      for (std::int64_t i = target->sharding()->begin(s); i < target->sharding()->end(s); ++i) {
        CHECK(std::memcmp(&global[static_cast<std::size_t>(i)], &expected[static_cast<std::size_t>(i)], 4) == 0);
      }
    }
    for (const float p : padding) CHECK(p == 0.0f);  // padding stays zero
  }
  // A replicated target takes the whole value, whatever the shards it was saved from.
  auto whole_a = replicated_variable(strategy, "a", Tensor::zeros(kA, DType::kF32));
  keras::assign_checkpoint_value(*whole_a, reader.read_for("a", *whole_a));
  CHECK(bitwise_equal(whole_a->read_value().to_vector<float>(), kValueA));
  auto c = replicated_variable(strategy, "c", Tensor::zeros({2, 2}, DType::kF32));
  keras::assign_checkpoint_value(*c, reader.read_for("c", *c));
  CHECK(bitwise_equal(c->read_value().to_vector<float>(), kValueC));
  CHECK(reader.read("step").item<std::int64_t>() == 20);
}

void flip_byte(const std::string& path, std::uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

keras::Model small_model(const std::string& prefix) {
  auto x = keras::Input({3});
  auto h = keras::Dense(4, "relu", {.name = prefix + "hidden"})(x);
  auto y = keras::Dense(2, {.name = prefix + "out"})(h);
  return keras::Model(x, y);
}

std::vector<std::vector<float>> weight_values(const keras::Model& model) {
  std::vector<std::vector<float>> out;
  for (const auto& w : model.get_weights()) out.push_back(w.to_vector<float>());
  return out;
}

}  // namespace

TEST_CASE("sharded checkpoint: saved on 4 shards, loads on 1, 2 and 3 shards and into replicated variables") {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  MirroredStrategy four(cpu_devices(0, 4));
  keras::save_checkpoint_directory(four, dir, contents_on(four));

  CHECK(entries(dir) == std::vector<std::string>{"index.json", "rank-00000-of-00001.safetensors"});
  CHECK(tmp.entries() == std::vector<std::string>{"ckpt"});  // no hidden directory left
  const keras::CheckpointReader reader(dir);
  CHECK(reader.is_directory());
  CHECK(reader.metadata().at("epoch") == "3");
  const auto index = keras::parse_checkpoint_index(testing::read_file_bytes(dir + "/index.json"), "index.json");
  CHECK(index.num_shards == 4);
  CHECK(index.num_workers == 1);
  CHECK(index.find("a")->num_shards == 4);
  CHECK(index.find("a")->chunks.size() == 4);
  CHECK(index.find("a")->chunks.back().begin == 27);  // 9, 9, 9 and 8 elements: no padding written
  CHECK(index.find("b")->chunks.size() == 3);         // the fourth shard is padding only
  CHECK(index.find("c")->num_shards == 0);
  CHECK(index.find("c")->chunks.size() == 1);  // replicated: written once
  CHECK(index.find("step")->shape == Shape{});

  for (const int m : {1, 2, 3, 4}) {
    CAPTURE(m);
    MirroredStrategy strategy(cpu_devices(0, m));
    check_loads_on(strategy, dir);
  }
  // A folder of other things is never replaced (it would be deleted); a checkpoint or an empty
  // folder is.
  const std::string other = tmp.file("other");
  fs::create_directories(other);
  std::ofstream(other + "/notes.txt") << "mine";
  CHECK(testing::error_message<AlreadyExists>([&] {
          keras::save_checkpoint_directory(four, other, contents_on(four));
        }).find("other things than a checkpoint") != std::string::npos);
  CHECK(entries(other) == std::vector<std::string>{"notes.txt"});
  CHECK(tmp.entries() == std::vector<std::string>{"ckpt", "other"});
  fs::create_directories(tmp.file("empty"));
  keras::save_checkpoint_directory(four, tmp.file("empty"), contents_on(four));
  keras::save_checkpoint_directory(four, dir, contents_on(four));
  // A trailing slash names the same directory.
  CHECK(keras::CheckpointReader(dir + "/").read("c").to_vector<float>() == kValueC);
}

TEST_CASE("sharded checkpoint: two workers write one file each; loads under 2 workers of 1 replica and on 3 shards") {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  {
    Job job(2);
    std::vector<std::unique_ptr<FakeWorker>> workers;
    for (int w = 0; w < 2; ++w) workers.push_back(std::make_unique<FakeWorker>(job, w, 2));
    on_every_worker(2, [&](int w) {
      auto& strategy = *workers[static_cast<std::size_t>(w)];
      keras::save_checkpoint_directory(strategy, dir, contents_on(strategy));
    });
  }
  CHECK(entries(dir) ==
        std::vector<std::string>{"index.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"});
  // Worker 1 holds shards 2 and 3 of "a" and nothing replicated.
  const auto rank1 = keras::read_safetensors(dir + "/rank-00001-of-00002.safetensors");
  std::vector<std::string> names;
  for (const auto& [name, t] : rank1.tensors) names.push_back(name);
  CHECK(names == std::vector<std::string>{"a[18:27]", "a[27:35]", "b[2:3]"});
  const auto index = keras::parse_checkpoint_index(testing::read_file_bytes(dir + "/index.json"), "index.json");
  CHECK(index.num_workers == 2);
  CHECK(index.num_shards == 4);

  Job job(2);
  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (int w = 0; w < 2; ++w) workers.push_back(std::make_unique<FakeWorker>(job, w, 1));
  on_every_worker(2, [&](int w) { check_loads_on(*workers[static_cast<std::size_t>(w)], dir); });
  MirroredStrategy three(cpu_devices(0, 3));
  check_loads_on(three, dir);

  // Consolidated: one ordinary file, every tensor whole and bitwise equal, the metadata kept.
  const std::string out = tmp.file("whole.safetensors");
  keras::consolidate(dir, out);
  const auto whole = keras::read_safetensors(out);
  std::map<std::string, Tensor> by_name(whole.tensors.begin(), whole.tensors.end());
  CHECK(by_name.at("a").shape() == kA);
  CHECK(bitwise_equal(by_name.at("a").to_vector<float>(), kValueA));
  CHECK(bitwise_equal(by_name.at("b").to_vector<float>(), kValueB));
  CHECK(bitwise_equal(by_name.at("c").to_vector<float>(), kValueC));
  CHECK(by_name.at("step").item<std::int64_t>() == 20);
  CHECK(whole.metadata.at("epoch") == "3");
  CHECK(testing::error_message([&] {
          keras::consolidate(out, tmp.file("again.safetensors"));
        }).find("not a checkpoint directory") != std::string::npos);
}

TEST_CASE("sharded checkpoint: a worker that fails makes the save fail on every worker and leaves the old one") {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  MirroredStrategy one(cpu_devices(0, 1));
  keras::save_checkpoint_directory(one, dir, {.variables = {}, .values = {{"step", Tensor::scalar<std::int64_t>(1)}}});
  Job job(2);
  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (int w = 0; w < 2; ++w) workers.push_back(std::make_unique<FakeWorker>(job, w, 1));
  std::vector<std::string> errors(2);
  on_every_worker(2, [&](int w) {
    auto& strategy = *workers[static_cast<std::size_t>(w)];
    auto contents = contents_on(strategy);
    // Worker 1 holds a shard its file cannot take (a name that is not UTF-8): its write fails.
    if (w == 1) contents.variables.emplace_back("\xff", sharded_variable(strategy, "\xff", kB, kValueB));
    try {
      keras::save_checkpoint_directory(strategy, dir, contents);
    } catch (const Error& e) {
      errors[static_cast<std::size_t>(w)] = e.what();
    }
  });
  CHECK(errors[1].find("not valid UTF-8") != std::string::npos);
  CHECK(errors[0].find("worker 1 failed") != std::string::npos);
  CHECK(tmp.entries() == std::vector<std::string>{"ckpt"});  // the hidden directory is gone
  CHECK(keras::CheckpointReader(dir).read("step").item<std::int64_t>() == 1);
}

TEST_CASE(
    "sharded checkpoint: save_weights and training checkpoints to a directory path, loaded on other replica counts") {
  TempDir tmp;
  const auto [x, y] = std::pair{
      Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, -0.5f, 0.4f, 0.9f, 1.0f, -1.0f, 0.0f, 0.3f, 0.3f, 0.3f}, {4, 3}),
      Tensor::from_vector<float>({1, 0, 0, 1, 1, 1, 0, 0}, {4, 2})};
  MirroredStrategy two(cpu_devices(0, 2));
  keras::Model model;
  {
    auto scope = two.scope();
    model = small_model("dir_");
    model.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  }
  model.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .shuffle = false});
  const std::string weights = tmp.file("weights") + "/";
  model.save_weights(weights);
  CHECK(fs::is_directory(weights));
  const std::string checkpoint = tmp.file("checkpoint") + "/";
  keras::save_training_checkpoint(model, checkpoint, {.epoch = 2, .step = 0});

  MirroredStrategy three(cpu_devices(0, 3));
  keras::Model twin;
  {
    auto scope = three.scope();
    twin = small_model("dir_");
    twin.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  }
  twin.load_weights(weights);
  CHECK(weight_values(twin) == weight_values(model));
  const auto state = keras::load_training_checkpoint(twin, checkpoint);
  CHECK(state.epoch == 2);
  CHECK(twin.optimizer().iterations() == model.optimizer().iterations());
  REQUIRE(twin.optimizer().slots().size() == model.optimizer().slots().size());
  for (std::size_t i = 0; i < model.optimizer().slots().size(); ++i) {
    CHECK(twin.optimizer().slots()[i].second->read_value().to_vector<float>() ==
          model.optimizer().slots()[i].second->read_value().to_vector<float>());
  }
  // The consolidated checkpoint is an ordinary training checkpoint.
  const std::string whole = tmp.file("whole.safetensors");
  keras::consolidate(checkpoint, whole);
  auto from_file = small_model("dir_");
  from_file.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  CHECK(keras::load_training_checkpoint(from_file, whole).epoch == 2);
  CHECK(weight_values(from_file) == weight_values(model));

  // BackupAndRestore resumes from a backup directory under its file's name.
  const std::string backup_dir = tmp.file("backup");
  auto backup_callback =
      std::make_shared<keras::BackupAndRestore>(backup_dir, keras::BackupAndRestoreOptions{.delete_checkpoint = false});
  auto& backup = *backup_callback;
  fs::create_directories(backup_dir);
  keras::save_training_checkpoint(model, backup.latest_path() + "/", {.epoch = 2, .step = 0});
  auto resumed = small_model("dir_");
  resumed.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  resumed.fit(x, y, {.batch_size = 2, .epochs = 2, .verbose = 0, .callbacks = {backup_callback}, .shuffle = false});
  CHECK(backup.restored_from() == backup.latest_path());
  CHECK(weight_values(resumed) == weight_values(model));  // epochs 1 and 2 were done: nothing to train
}

TEST_CASE(
    "sharded checkpoint: corrupt, truncated, missing chunks and a missing index are refused, the model unchanged") {
  TempDir tmp;
  auto model = small_model("bad_");
  model.build({3});
  const std::string dir = tmp.file("weights");
  model.save_weights(dir + "/");
  const std::string file = dir + "/rank-00000-of-00001.safetensors";
  const auto index = keras::parse_checkpoint_index(testing::read_file_bytes(dir + "/index.json"), "index.json");
  const auto& last = index.tensors.back();  // the file's last chunk
  const auto saved = testing::read_file_bytes(file);
  const auto saved_index = testing::read_file_bytes(dir + "/index.json");
  const auto restore = [&] {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << saved;
    std::ofstream(dir + "/index.json", std::ios::binary | std::ios::trunc) << saved_index;
  };
  auto target = small_model("bad_");
  target.build({3});
  const auto before = weight_values(target);
  const auto refused = [&](const std::string& what) {
    CAPTURE(what);
    const auto message = testing::error_message<DataLoss>([&] { target.load_weights(dir); });
    CHECK(weight_values(target) == before);
    restore();
    return message;
  };

  fs::resize_file(file, saved.size() - 3);
  auto message = refused("truncated");
  CHECK(message.find(file) != std::string::npos);
  CHECK(message.find("truncated") != std::string::npos);
  CHECK(message.find(fmt::format("\"{}\"", last.name)) != std::string::npos);

  flip_byte(file, last.chunks.front().byte_offset + 1);
  message = refused("corrupt");
  CHECK(message.find("checksum mismatch") != std::string::npos);
  CHECK(message.find(file) != std::string::npos);
  CHECK(message.find(fmt::format("\"{}\"", last.name)) != std::string::npos);

  fs::remove(file);
  message = refused("missing file");
  CHECK(message.find("is missing") != std::string::npos);
  CHECK(message.find(file) != std::string::npos);
  CHECK(message.find(fmt::format("\"{}\"", index.tensors.front().name)) != std::string::npos);

  fs::remove(dir + "/index.json");
  message = refused("missing index");
  CHECK(message.find("never finished") != std::string::npos);
  CHECK(message.find(dir) != std::string::npos);

  // A chunk dropped from the index: the tensor's elements are in no chunk.
  auto edited = index;
  edited.tensors.front().chunks.clear();
  std::ofstream(dir + "/index.json", std::ios::binary | std::ios::trunc) << keras::checkpoint_index_json(edited);
  message = refused("chunk dropped from the index");
  CHECK(message.find(fmt::format("\"{}\"", index.tensors.front().name)) != std::string::npos);
  CHECK(message.find("in no chunk") != std::string::npos);
  CHECK(message.find("index.json") != std::string::npos);

  // Another model's names are refused, naming them, and nothing loads.
  CHECK(testing::error_message([&] { small_model("other_").load_weights(dir); }).find("does not match") !=
        std::string::npos);
  target.load_weights(dir);  // the restored checkpoint loads
}

TEST_CASE("sharded checkpoint: a save killed at any point leaves the previous checkpoint loadable") {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  MirroredStrategy one(cpu_devices(0, 1));
  const auto value = [](float base) { return Tensor::filled<float>({4 << 20}, base); };
  keras::save_checkpoint_directory(one, dir,
                                   {.variables = {}, .values = {{"big", value(1.0f)}, {"big2", value(1.0f)}}});
  // A save stopped before its rename (its hidden directory complete but for the index) is never
  // picked up.
  const fs::path partial = tmp.path() / ".ckpt.tmp-000000000001";
  fs::create_directories(partial);
  fs::copy_file(dir + "/rank-00000-of-00001.safetensors", partial / "rank-00000-of-00001.safetensors");
  CHECK(keras::CheckpointReader(dir).read("big").to_vector<float>().front() == 1.0f);
  CHECK(testing::error_message<DataLoss>([&] {
          keras::CheckpointReader reader(partial.string());
        }).find("never finished") != std::string::npos);

  // A real save killed at several points: each time the name holds the old or the new checkpoint,
  // whole.
  for (const int delay_us : {0, 2000, 20000, 60000}) {
    CAPTURE(delay_us);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      try {
        keras::save_checkpoint_directory(one, dir,
                                         {.variables = {}, .values = {{"big", value(2.0f)}, {"big2", value(2.0f)}}});
      } catch (...) {
        ::_exit(1);
      }
      ::_exit(0);
    }
    ::usleep(static_cast<useconds_t>(delay_us));
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    const keras::CheckpointReader reader(dir);
    const float first = reader.read("big").to_vector<float>().front();
    CHECK((first == 1.0f || first == 2.0f));
    CHECK(reader.read("big2").to_vector<float>().back() == first);
  }
}

TEST_CASE("sharded checkpoint: the index parser reads the seed index and names what is wrong in the others") {
  const std::string corpus = TANDEM_INDEX_CORPUS;
  const auto parse = [&](const std::string& name) {
    return keras::parse_checkpoint_index(testing::read_file_bytes(corpus + "/" + name), name);
  };
  const auto index = parse("valid.json");
  CHECK(index.num_shards == 4);
  CHECK(index.num_workers == 2);
  CHECK(index.tensors.size() == 4);
  CHECK(index.find("dense/kernel")->chunks.size() == 3);
  CHECK(index.find("dense/bias")->dtype == DType::kF64);
  CHECK(index.find("empty")->chunks.empty());
  CHECK(keras::parse_checkpoint_index(keras::checkpoint_index_json(index), "again").tensors.size() == 4);
  // ModelParallel's split layout: read, and written back the same.
  const auto split = parse("valid_split.json");
  CHECK(*split.find("dense/kernel")->split == keras::CheckpointSplit{.dim = 0, .parts = 3, .axis = "model"});
  CHECK(!split.find("dense/bias")->split);
  CHECK(*keras::parse_checkpoint_index(keras::checkpoint_index_json(split), "again").find("dense/kernel")->split ==
        *split.find("dense/kernel")->split);
  const auto refused = [&](const std::string& name) {
    CAPTURE(name);
    const auto message = testing::error_message<DataLoss>([&] { parse(name); });
    CHECK(message.find(name) != std::string::npos);
    return message;
  };
  CHECK(refused("missing_chunk.json").find("\"dense/kernel\": elements [3, 6) are in no chunk") != std::string::npos);
  CHECK(refused("overlap.json").find("overlap") != std::string::npos);
  CHECK(refused("nd_block.json").find("no \"range\"") != std::string::npos);
  CHECK(refused("version2.json").find("version 2") != std::string::npos);
  CHECK(refused("traversal.json").find("not a plain file name") != std::string::npos);
  CHECK(refused("huge_shape.json").find("too large") != std::string::npos);
  CHECK(refused("offset_overflow.json").find("byte offset") != std::string::npos);
  CHECK(refused("crc_count.json").find("one per 1-byte block") != std::string::npos);
  CHECK(refused("deep.json").find("nested deeper") != std::string::npos);
  CHECK(refused("not_object.json").find("not a JSON object") != std::string::npos);
  CHECK(refused("split_dim.json").find("a split layout along dimension 2 of a tensor of shape [3,3]") !=
        std::string::npos);
}

TEST_CASE("sharded checkpoint: tandem-consolidate DIR OUT") {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  MirroredStrategy four(cpu_devices(0, 4));
  keras::save_checkpoint_directory(four, dir, contents_on(four));
  const std::string out = tmp.file("whole.safetensors");
  CHECK(std::system(fmt::format("{} {} {} > {}", TANDEM_CONSOLIDATE, dir, out, tmp.file("log")).c_str()) == 0);
  CHECK(testing::read_file_bytes(tmp.file("log")).find("4 tensors") != std::string::npos);
  const auto whole = keras::read_safetensors(out);
  CHECK(bitwise_equal(whole.tensors.front().second.to_vector<float>(), kValueA));
  // A damaged checkpoint: exit status 1 and the message naming the file.
  fs::remove(dir + "/rank-00000-of-00001.safetensors");
  const int status = std::system(fmt::format("{} {} {} 2> {}", TANDEM_CONSOLIDATE, dir, out, tmp.file("err")).c_str());
  CHECK(WEXITSTATUS(status) == 1);
  CHECK(testing::read_file_bytes(tmp.file("err")).find("rank-00000-of-00001.safetensors") != std::string::npos);
  CHECK(WEXITSTATUS(std::system(fmt::format("{} 2>/dev/null", TANDEM_CONSOLIDATE).c_str())) == 2);  // usage
}

TEST_CASE("sharded checkpoint: two worker processes save together and load a checkpoint of 4 shards") {
  TempDir tmp;
  const std::string saved = tmp.file("saved");
  const auto launch = [&](const std::string& args, const std::string& log) {
    return std::system(
        fmt::format("TANDEM_RENDEZVOUS_TIMEOUT=60 {} --nproc_per_node 2 --master_port 0 -- {} {} > {} 2>&1", TANDEM_RUN,
                    TANDEM_SHARDED_WORKER, args, tmp.file(log))
            .c_str());
  };
  const int saved_status = launch(fmt::format("--mode save --dir {}", saved), "save.log");
  INFO(testing::read_file_bytes(tmp.file("save.log")));
  REQUIRE(saved_status == 0);
  CHECK(entries(saved) ==
        std::vector<std::string>{"index.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"});
  for (const int m : {1, 3}) {
    CAPTURE(m);
    MirroredStrategy strategy(cpu_devices(0, m));
    check_loads_on(strategy, saved);
  }

  const std::string four = tmp.file("four");
  MirroredStrategy strategy(cpu_devices(0, 4));
  keras::save_checkpoint_directory(strategy, four, contents_on(strategy));
  const int loaded_status = launch(fmt::format("--mode load --dir {} --out {}", four, tmp.path().string()), "load.log");
  INFO(testing::read_file_bytes(tmp.file("load.log")));
  REQUIRE(loaded_status == 0);
  for (int w = 0; w < 2; ++w) {
    CAPTURE(w);
    const auto result = keras::read_safetensors(tmp.file(fmt::format("worker-{}.safetensors", w)));
    const auto a = result.tensors.at(0).second.to_vector<float>();  // shard w of 2: 18 elements
    const auto b = result.tensors.at(1).second.to_vector<float>();  // 2 elements, the second padding
    const std::vector<float> expected_a(kValueA.begin() + 18 * w, kValueA.begin() + std::min(35, 18 * (w + 1)));
    CHECK(bitwise_equal(std::vector<float>(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(expected_a.size())),
                        expected_a));
    CHECK(b[0] == kValueB[static_cast<std::size_t>(2 * w)]);
    CHECK(b[1] == (w == 0 ? kValueB[1] : 0.0f));
    CHECK(bitwise_equal(result.tensors.at(2).second.to_vector<float>(), kValueC));
  }
}

TEST_CASE("sharded checkpoint: a reader reads only the checksum blocks that hold what it asks for") {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  MirroredStrategy one(cpu_devices(0, 1));
  constexpr std::int64_t kElements = std::int64_t{1} << 20;  // 4 MiB: four checksum blocks
  keras::save_checkpoint_directory(one, dir,
                                   {.variables = {}, .values = {{"big", Tensor::filled<float>({kElements}, 1.5f)}}});
  const auto index = keras::parse_checkpoint_index(testing::read_file_bytes(dir + "/index.json"), "index.json");
  const auto& chunk = index.find("big")->chunks.at(0);
  REQUIRE(chunk.crc32.size() == 4);
  // Corrupt the last block: what lies in the first three still loads, and the last is refused.
  flip_byte(dir + "/rank-00000-of-00001.safetensors", chunk.byte_offset + chunk.byte_length - 1);
  const keras::CheckpointReader reader(dir);
  CHECK(reader.read_range("big", 0, 3 * kElements / 4).to_vector<float>().back() == 1.5f);
  CHECK(testing::error_message<DataLoss>([&] {
          reader.read_range("big", kElements - 10, kElements);
        }).find("checksum mismatch") != std::string::npos);
  CHECK_THROWS_AS(reader.read("big"), DataLoss);
}

// A model trained under ZeRO (DistributionOptions::zero): its optimizer slots are sharded once the
// strategy shards them, and its checkpoints are then directories. Without a sharding strategy the
// same calls write files; either way the state must resume alike on other replica counts.
TEST_CASE("sharded checkpoint: a training checkpoint and a backup under ZeRO stage 2 on 4 replicas resume on 3 and 1") {
  TempDir tmp;
  const auto [x, y] = std::pair{
      Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, -0.5f, 0.4f, 0.9f, 1.0f, -1.0f, 0.0f, 0.3f, 0.3f, 0.3f}, {4, 3}),
      Tensor::from_vector<float>({1, 0, 0, 1, 1, 1, 0, 0}, {4, 2})};
  const auto compiled = [](Strategy& strategy) {
    keras::Model model;
    auto scope = strategy.scope();
    model = small_model("zero_");
    model.compile(keras::Adam{.learning_rate = 0.01}, "mse");
    return model;
  };
  const auto zero = [](int devices, strategy::ZeroStage stage) {
    return strategy::MirroredOptions{.devices = cpu_devices(0, devices), .distribution = {.zero = stage}};
  };
  MirroredStrategy four(zero(4, strategy::ZeroStage::k2));
  auto model = compiled(four);
  const std::string backup_dir = tmp.file("backup");
  auto backup =
      std::make_shared<keras::BackupAndRestore>(backup_dir, keras::BackupAndRestoreOptions{.delete_checkpoint = false});
  model.fit(x, y, {.batch_size = 4, .epochs = 2, .verbose = 0, .callbacks = {backup}, .shuffle = false});
  const bool sharded = model.optimizer().slots().front().second->sharding().has_value();
  const std::string path = tmp.file("ckpt.safetensors");
  keras::save_training_checkpoint(model, path, {.epoch = 2});
  CHECK(fs::is_directory(path) == sharded);
  CHECK(fs::is_directory(backup->latest_path()) == sharded);
  if (sharded) {
    const auto index = keras::parse_checkpoint_index(testing::read_file_bytes(path + "/index.json"), "index.json");
    CHECK(index.num_shards == 4);
    CHECK(index.find("optimizer/zero_hidden/kernel/m")->num_shards == 4);
    CHECK(index.find("zero_hidden/kernel")->num_shards == 0);  // stage 2: weights replicated
  }
  std::vector<std::vector<float>> slots;
  for (const auto& [name, slot] : model.optimizer().slots()) slots.push_back(slot->read_value().to_vector<float>());

  for (const auto& [devices, stage] : {std::pair{3, strategy::ZeroStage::k1}, std::pair{1, strategy::ZeroStage::k0}}) {
    CAPTURE(devices);
    MirroredStrategy strategy(zero(devices, stage));
    for (const auto& source : {path, backup->latest_path()}) {
      CAPTURE(source);
      auto resumed = compiled(strategy);
      CHECK(keras::load_training_checkpoint(resumed, source).epoch == 2);
      CHECK(weight_values(resumed) == weight_values(model));
      CHECK(resumed.optimizer().iterations() == model.optimizer().iterations());
      REQUIRE(resumed.optimizer().slots().size() == slots.size());
      for (std::size_t s = 0; s < slots.size(); ++s) {
        CHECK(bitwise_equal(resumed.optimizer().slots()[s].second->read_value().to_vector<float>(), slots[s]));
      }
    }
  }
  // The consolidated checkpoint is one ordinary file with every slot whole.
  if (sharded) {
    keras::consolidate(path, tmp.file("whole.safetensors"));
    MirroredStrategy one(zero(1, strategy::ZeroStage::k0));
    auto whole = compiled(one);
    keras::load_training_checkpoint(whole, tmp.file("whole.safetensors"));
    CHECK(bitwise_equal(whole.optimizer().slots().front().second->read_value().to_vector<float>(), slots.front()));
  }
}
