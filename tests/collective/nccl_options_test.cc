// make_nccl_process_communicator's options, in every build (with or without CUDA and NCCL, with or
// without a GPU): bad options are InvalidArgument, checked before the store (or CUDA) is touched.
// Valid options either make a communicator (a build with NCCL on a machine with a GPU) or say
// why they cannot: Unimplemented (no NCCL in this build) or FailedPrecondition (no GPU, no libnccl).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "tandem/collective/nccl.h"
#include "tandem/collective/store.h"

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;

namespace {

// An in-memory store that counts the calls made on it.
class CountingStore final : public Store {
 public:
  void set(const std::string& key, const std::vector<char>& value) override {
    ++calls;
    inner_->set(key, value);
  }
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) override {
    ++calls;
    return inner_->get(key, timeout);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    ++calls;
    inner_->wait(keys, timeout);
  }
  bool check(const std::string& key) override {
    ++calls;
    return inner_->check(key);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    ++calls;
    return inner_->add(key, delta);
  }
  std::string address() const override { return inner_->address(); }

  std::atomic<int> calls{0};

 private:
  std::shared_ptr<Store> inner_ = make_in_memory_store();
};

// The InvalidArgument message make_nccl_process_communicator(options) throws, and whether it left
// the store alone.
std::string invalid_argument(NcclProcessOptions options, const std::shared_ptr<CountingStore>& store) {
  try {
    make_nccl_process_communicator(std::move(options));
  } catch (const InvalidArgument& e) {
    CHECK(store->calls == 0);
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<another error: ") + e.what() + ">";
  }
  return "<no error>";
}

}  // namespace

TEST_CASE("make_nccl_process_communicator rejects bad options before touching the store") {
  auto store = std::make_shared<CountingStore>();
  CHECK(invalid_argument({.rank = 0, .size = 0, .store = store}, store) ==
        "make_nccl_process_communicator: size must be at least 1, got 0");
  CHECK(invalid_argument({.rank = 2, .size = 2, .store = store}, store) ==
        "make_nccl_process_communicator: rank 2 is not in [0, 2)");
  CHECK(invalid_argument({.rank = -1, .size = 2, .store = store}, store) ==
        "make_nccl_process_communicator: rank -1 is not in [0, 2)");
  CHECK(invalid_argument({.rank = 1, .size = 2}, store) ==
        "make_nccl_process_communicator: rank 1 has no store (NcclProcessOptions::store); the ranks meet through "
        "one, which carries NCCL's unique id");
  CHECK(invalid_argument({.rank = 0, .size = 2, .store = store, .timeout = 0ms}, store) ==
        "make_nccl_process_communicator: the timeout must be positive, got 0 ms");
  CHECK(invalid_argument({.rank = 0, .size = 2, .store = store, .rank_labels = {"chief"}}, store) ==
        "make_nccl_process_communicator: 1 rank labels for a group of 2; give one per rank or none");
  CHECK(invalid_argument({.rank = 1, .size = 2, .cuda_device = -1, .store = store}, store) ==
        "make_nccl_process_communicator: rank 1 has CUDA device -1; ordinals start at 0");
}

TEST_CASE("valid options make a communicator, or say why this build or machine cannot") {
  auto store = make_in_memory_store();
  try {
    auto comm =
        make_nccl_process_communicator({.rank = 0, .size = 1, .cuda_device = 0, .store = store, .timeout = 60s});
    // A build with NCCL, on a machine with a GPU.
    CHECK(comm->backend() == "nccl");
    CHECK(comm->rank() == 0);
    CHECK(comm->size() == 1);
    comm->barrier();
    CHECK(comm->sequence_number() == 1);
  } catch (const Unimplemented& e) {
    CHECK(std::string(e.what()) ==
          "make_nccl_process_communicator for rank 0 of 1 on CUDA device 0: this build of tandem has no NCCL (it was "
          "configured without CUDA, or without NCCL's library and header); the Gloo communicator "
          "(collective/gloo.h) connects processes without GPUs");
  } catch (const FailedPrecondition& e) {
    // A build with NCCL, on a machine without a GPU (or without libnccl).
    CHECK(std::string(e.what()).starts_with("make_nccl_process_communicator on rank 0 of 1 (CUDA device 0): "));
  }
}

TEST_CASE("a rank that never arrives is named, where a GPU and NCCL are there") {
  auto store = make_in_memory_store();
  try {
    make_nccl_process_communicator(
        {.rank = 0, .size = 2, .store = store, .timeout = 300ms, .rank_labels = {"chief", "worker 1"}});
    FAIL("rank 0 joined a group of 2 alone");
  } catch (const DeadlineExceeded& e) {
    CHECK(std::string(e.what()) ==
          "make_nccl_process_communicator on chief (CUDA device 0): worker 1 did not arrive at the store in-memory "
          "within 300 ms");
  } catch (const Unimplemented&) {
    // No NCCL in this build: the previous case checked the message.
  } catch (const FailedPrecondition&) {
    // No GPU or no libnccl here.
  }
}
