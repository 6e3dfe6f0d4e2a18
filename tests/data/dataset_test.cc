#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <thread>

#include "tandem/base/random.h"
#include "tandem/data/dataset.h"

using namespace tandem;
using data::Dataset;
using data::Element;

namespace {

// 0, 1, ..., n-1 as int64 scalars.
Dataset range(std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return Dataset::from_tensor_slices({Tensor::from_vector<std::int64_t>(v, {n})});
}

// The first component of every element, each a scalar int64.
std::vector<std::int64_t> collect(const Dataset& ds) {
  std::vector<std::int64_t> out;
  auto it = ds.iterate();
  while (auto e = it->next()) out.push_back((*e)[0].item<std::int64_t>());
  return out;
}

std::vector<std::int64_t> iota_vector(std::int64_t begin, std::int64_t end, std::int64_t step = 1) {
  std::vector<std::int64_t> v;
  for (auto i = begin; i < end; i += step) v.push_back(i);
  return v;
}

// Every batch's first component, flattened, and the batch sizes.
struct Batches {
  std::vector<std::vector<std::int64_t>> values;
  std::vector<std::int64_t> sizes;
};
Batches collect_batches(const Dataset& ds) {
  Batches b;
  auto it = ds.iterate();
  while (auto e = it->next()) {
    b.values.push_back((*e)[0].to_vector<std::int64_t>());
    b.sizes.push_back((*e)[0].shape()[0]);
  }
  return b;
}

template <class E, class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

graph::TensorSpec spec(DType dtype, Shape shape) { return {dtype, shape}; }

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

}  // namespace

TEST_CASE("from_tensor_slices yields views of each row, with cardinality and element_spec") {
  auto x = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 2, 2});
  auto y = Tensor::from_vector<std::int64_t>({7, 8, 9}, {3});
  auto ds = Dataset::from_tensor_slices({x, y});
  CHECK(ds.defined());
  CHECK(ds.cardinality() == 3);
  CHECK(ds.element_spec() == std::vector{spec(kFloat32, {2, 2}), spec(kInt64, {})});

  auto it = ds.iterate();
  for (std::int64_t i = 0; i < 3; ++i) {
    auto e = it->next();
    REQUIRE(e);
    REQUIRE(e->size() == 2);
    const Tensor& xi = (*e)[0];
    CHECK(xi.shape() == Shape{2, 2});
    CHECK(xi.buffer() == x.buffer());  // a view, not a copy
    CHECK(xi.byte_offset() == static_cast<std::size_t>(i) * 4 * sizeof(float));
    CHECK(xi.to_vector<float>() == std::vector<float>{4.0f * i, 4.0f * i + 1, 4.0f * i + 2, 4.0f * i + 3});
    CHECK((*e)[1].item<std::int64_t>() == 7 + i);
    CHECK(&xi.device() == &devices::default_cpu_device());
  }
  CHECK_FALSE(it->next());
  CHECK_FALSE(it->next());  // stays at the end
}

TEST_CASE("from_tensor_slices of a view starts at the view's offset") {
  auto base = Tensor::from_vector<std::int64_t>(iota_vector(0, 12), {12});
  Tensor tail(Shape{4}, kInt64, base.buffer(), 8 * sizeof(std::int64_t));  // elements 8..11
  CHECK(collect(Dataset::from_tensor_slices({tail})) == std::vector<std::int64_t>{8, 9, 10, 11});
}

TEST_CASE("from_tensor_slices rejects mismatched first dimensions, scalars and empty lists") {
  auto x = Tensor::zeros({6, 28, 28}, kFloat32);
  auto y = Tensor::zeros({5}, kInt64);
  const auto message = error_message<InvalidArgument>([&] { Dataset::from_tensor_slices({x, y}); });
  CHECK(contains(message, "(6, 28, 28)"));
  CHECK(contains(message, "(5,)"));
  CHECK(contains(message, "component 1"));
  CHECK_THROWS_AS(Dataset::from_tensor_slices({Tensor::scalar<float>(1)}), InvalidArgument);
  CHECK_THROWS_AS(Dataset::from_tensor_slices({}), InvalidArgument);
  CHECK_THROWS_AS(Dataset::from_tensor_slices({Tensor()}), InvalidArgument);
}

TEST_CASE("from_tensors yields one element holding the tensors whole") {
  auto x = Tensor::from_vector<float>({1, 2, 3}, {3});
  auto ds = Dataset::from_tensors({x, Tensor::scalar<std::int64_t>(4)});
  CHECK(ds.cardinality() == 1);
  CHECK(ds.element_spec() == std::vector{spec(kFloat32, {3}), spec(kInt64, {})});
  auto it = ds.iterate();
  auto e = it->next();
  REQUIRE(e);
  CHECK((*e)[0].to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK_FALSE(it->next());
  CHECK(collect(Dataset::from_tensors({Tensor::scalar<std::int64_t>(5)}).repeat(3)) ==
        std::vector<std::int64_t>{5, 5, 5});
}

TEST_CASE("an empty Dataset handle raises FailedPrecondition") {
  Dataset empty;
  CHECK_FALSE(empty.defined());
  CHECK_THROWS_AS(empty.iterate(), FailedPrecondition);
  CHECK_THROWS_AS(empty.cardinality(), FailedPrecondition);
  CHECK_THROWS_AS(empty.batch(2), FailedPrecondition);
  CHECK_THROWS_AS(empty.element_spec(), FailedPrecondition);
}

TEST_CASE("shuffle with a buffer of 1 is the identity") {
  CHECK(collect(range(20).shuffle(1, 3)) == iota_vector(0, 20));
}

TEST_CASE("shuffle with a full buffer is a permutation, the same for the same seed") {
  const auto a = collect(range(100).shuffle(100, 42));
  const auto b = collect(range(100).shuffle(100, 42));
  const auto c = collect(range(100).shuffle(100, 43));
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a != iota_vector(0, 100));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == iota_vector(0, 100));
}

TEST_CASE("a full-buffer shuffle draws every permutation about equally often") {
  auto ds = range(3).shuffle(3, 17);
  std::map<std::vector<std::int64_t>, int> counts;
  const int passes = 6000;
  for (int i = 0; i < passes; ++i) ++counts[collect(ds)];
  CHECK(counts.size() == 6);
  for (const auto& [order, count] : counts) CHECK(std::abs(count - passes / 6) < 150);  // about 5 sigma
}

TEST_CASE("shuffle with a small buffer keeps elements within the buffer's reach") {
  const std::int64_t buffer = 5;
  const auto order = collect(range(200).shuffle(buffer, 7));
  auto sorted = order;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == iota_vector(0, 200));
  CHECK(order != iota_vector(0, 200));
  // Output position p can hold input elements up to p + buffer - 1, never later ones.
  for (std::size_t p = 0; p < order.size(); ++p) CHECK(order[p] <= static_cast<std::int64_t>(p) + buffer - 1);
}

TEST_CASE("a reshuffling dataset changes order each pass; a non-reshuffling one repeats it") {
  auto reshuffling = range(50).shuffle(50, 9);
  const auto first = collect(reshuffling);
  const auto second = collect(reshuffling);
  CHECK(first != second);
  CHECK(first == collect(range(50).shuffle(50, 9)));  // a new node starts again at epoch 0

  auto fixed = range(50).shuffle(50, 9, /*reshuffle_each_iteration=*/false);
  CHECK(collect(fixed) == first);  // epoch 0's order
  CHECK(collect(fixed) == first);

  // repeat() starts a new pass of the shuffle for every repetition.
  const auto repeated = collect(range(50).shuffle(50, 9).repeat(2));
  CHECK(std::vector<std::int64_t>(repeated.begin(), repeated.begin() + 50) == first);
  CHECK(std::vector<std::int64_t>(repeated.begin() + 50, repeated.end()) == second);
}

TEST_CASE("shuffle without a seed draws it from the global seed") {
  set_global_seed(1234);
  const auto a1 = collect(range(64).shuffle(64));
  const auto a2 = collect(range(64).shuffle(64));
  set_global_seed(1234);
  CHECK(collect(range(64).shuffle(64)) == a1);
  CHECK(collect(range(64).shuffle(64)) == a2);
  CHECK(a1 != a2);
  set_global_seed(0);
}

TEST_CASE("shuffle passes cardinality and element_spec through and rejects a zero buffer") {
  auto ds = range(10).shuffle(4, 1);
  CHECK(ds.cardinality() == 10);
  CHECK(ds.element_spec() == std::vector{spec(kInt64, {})});
  CHECK_THROWS_AS(range(10).shuffle(0), InvalidArgument);
  CHECK(collect(range(0).shuffle(10, 1)).empty());
}

TEST_CASE("element_spec does not consume a shuffle epoch") {
  auto mapped = range(30).shuffle(30, 5).map([](const Element& e) { return e; });
  (void)mapped.element_spec();
  CHECK(collect(mapped) == collect(range(30).shuffle(30, 5)));
}

TEST_CASE("batch stacks elements; the last batch is partial unless drop_remainder") {
  auto x = Tensor::from_vector<float>(std::vector<float>(20, 1.5f), {10, 2});
  auto ds = Dataset::from_tensor_slices({Tensor::from_vector<std::int64_t>(iota_vector(0, 10), {10}), x});

  auto batched = ds.batch(4);
  CHECK(batched.cardinality() == 3);
  CHECK(batched.element_spec() == std::vector{spec(kInt64, {-1}), spec(kFloat32, {-1, 2})});
  const auto b = collect_batches(batched);
  CHECK(b.sizes == std::vector<std::int64_t>{4, 4, 2});
  CHECK(b.values[0] == std::vector<std::int64_t>{0, 1, 2, 3});
  CHECK(b.values[2] == std::vector<std::int64_t>{8, 9});
  {
    auto it = batched.iterate();
    auto e = it->next();
    REQUIRE(e);
    CHECK((*e)[1].shape() == Shape{4, 2});
    CHECK((*e)[1].to_vector<float>() == std::vector<float>(8, 1.5f));
    CHECK((*e)[1].buffer() != x.buffer());  // a new tensor
  }

  auto dropped = ds.batch(4, /*drop_remainder=*/true);
  CHECK(dropped.cardinality() == 2);
  CHECK(dropped.element_spec() == std::vector{spec(kInt64, {4}), spec(kFloat32, {4, 2})});
  CHECK(collect_batches(dropped).sizes == std::vector<std::int64_t>{4, 4});

  // An even split has no partial batch, so the batch dimension is known.
  CHECK(ds.batch(5).element_spec()[0].shape == Shape{5});
  CHECK(collect_batches(ds.batch(5)).sizes == std::vector<std::int64_t>{5, 5});
  // An infinite input never reaches a last batch.
  CHECK(ds.repeat().batch(3).element_spec()[0].shape == Shape{3});
  CHECK(ds.repeat().batch(3).cardinality() == Dataset::kInfinite);
  // Larger than the dataset: one partial batch, or none.
  CHECK(collect_batches(ds.batch(100)).sizes == std::vector<std::int64_t>{10});
  CHECK(collect_batches(ds.batch(100, true)).sizes.empty());
  CHECK(ds.batch(100, true).cardinality() == 0);
  CHECK_THROWS_AS(ds.batch(0), InvalidArgument);
}

TEST_CASE("batch of batches adds another dimension") {
  auto ds = range(12).batch(3).batch(2);
  CHECK(ds.cardinality() == 2);
  CHECK(ds.element_spec() == std::vector{spec(kInt64, {2, 3})});
  auto it = ds.iterate();
  auto e = it->next();
  REQUIRE(e);
  CHECK((*e)[0].shape() == Shape{2, 3});
  CHECK((*e)[0].to_vector<std::int64_t>() == iota_vector(0, 6));
}

TEST_CASE("batch of elements with different shapes raises InvalidArgument naming them") {
  // Element i is a vector of length 1 + i % 2.
  auto ragged = range(4).map([](const Element& e) {
    const auto i = e[0].item<std::int64_t>();
    return Element{e[0], Tensor::zeros({1 + i % 2}, kFloat32)};
  });
  auto it = ragged.batch(2).iterate();
  const auto message = error_message<InvalidArgument>([&] { it->next(); });
  CHECK(contains(message, "component 1"));
  CHECK(contains(message, "(2,)"));
  CHECK(contains(message, "(1,)"));

  auto mixed = range(2).map([](const Element& e) {
    return e[0].item<std::int64_t>() == 0 ? Element{Tensor::zeros({}, kFloat32)} : Element{Tensor::zeros({}, kInt64)};
  });
  auto it2 = mixed.batch(2).iterate();
  CHECK(contains(error_message<InvalidArgument>([&] { it2->next(); }), "int64"));
}

TEST_CASE("repeat, take and skip follow tf.data, cardinalities included") {
  CHECK(collect(range(3).repeat(2)) == std::vector<std::int64_t>{0, 1, 2, 0, 1, 2});
  CHECK(range(3).repeat(2).cardinality() == 6);
  CHECK(range(3).repeat().cardinality() == Dataset::kInfinite);
  CHECK(range(3).repeat(0).cardinality() == 0);
  CHECK(collect(range(3).repeat(0)).empty());
  CHECK(collect(range(3).repeat().take(7)) == std::vector<std::int64_t>{0, 1, 2, 0, 1, 2, 0});
  CHECK(range(3).repeat().take(7).cardinality() == 7);
  // repeat(-1) of an empty dataset is empty, not a hang.
  CHECK(range(0).repeat().cardinality() == 0);
  CHECK(collect(range(0).repeat()).empty());
  CHECK(collect(range(3).take(0).repeat()).empty());

  CHECK(collect(range(5).take(3)) == std::vector<std::int64_t>{0, 1, 2});
  CHECK(collect(range(5).take(10)) == iota_vector(0, 5));
  CHECK(collect(range(5).take(-1)) == iota_vector(0, 5));
  CHECK(range(5).take(3).cardinality() == 3);
  CHECK(range(5).take(10).cardinality() == 5);
  CHECK(range(5).take(-1).cardinality() == 5);

  CHECK(collect(range(5).skip(2)) == std::vector<std::int64_t>{2, 3, 4});
  CHECK(collect(range(5).skip(9)).empty());
  CHECK(collect(range(5).skip(-1)).empty());
  CHECK(range(5).skip(2).cardinality() == 3);
  CHECK(range(5).skip(9).cardinality() == 0);
  CHECK(range(5).skip(-1).cardinality() == 0);
  CHECK(range(5).repeat().skip(3).cardinality() == Dataset::kInfinite);
  CHECK(collect(range(5).repeat().skip(3).take(4)) == std::vector<std::int64_t>{3, 4, 0, 1});
  CHECK(collect(range(5).repeat(3).skip(7)) == std::vector<std::int64_t>{2, 3, 4, 0, 1, 2, 3, 4});
  CHECK(collect(range(10).take(6).skip(2)) == std::vector<std::int64_t>{2, 3, 4, 5});
}

TEST_CASE("shard takes every n-th element from its index") {
  CHECK(collect(range(10).shard(3, 0)) == std::vector<std::int64_t>{0, 3, 6, 9});
  CHECK(collect(range(10).shard(3, 1)) == std::vector<std::int64_t>{1, 4, 7});
  CHECK(collect(range(10).shard(3, 2)) == std::vector<std::int64_t>{2, 5, 8});
  CHECK(range(10).shard(3, 0).cardinality() == 4);
  CHECK(range(10).shard(3, 1).cardinality() == 3);
  CHECK(range(10).shard(3, 2).cardinality() == 3);
  CHECK(range(10).repeat().shard(2, 1).cardinality() == Dataset::kInfinite);
  CHECK(collect(range(10).shard(1, 0)) == iota_vector(0, 10));
  CHECK(collect(range(2).shard(4, 3)).empty());
  CHECK(collect(range(5).repeat(2).shard(3, 1)) == std::vector<std::int64_t>{1, 4, 2});
  CHECK_THROWS_AS(range(10).shard(0, 0), InvalidArgument);
  CHECK_THROWS_AS(range(10).shard(3, 3), InvalidArgument);
  CHECK_THROWS_AS(range(10).shard(3, -1), InvalidArgument);
  // Shards of a shuffled dataset with the same seed partition it.
  std::vector<std::int64_t> all;
  for (int i = 0; i < 4; ++i) {
    const auto part = collect(range(37).shuffle(37, 11).shard(4, i));
    all.insert(all.end(), part.begin(), part.end());
  }
  std::sort(all.begin(), all.end());
  CHECK(all == iota_vector(0, 37));
}

TEST_CASE("map applies its function; its errors propagate from next() and the pass goes on") {
  auto doubled = range(4).map(
      [](const Element& e) { return Element{Tensor::scalar<std::int64_t>(2 * e[0].item<std::int64_t>())}; });
  CHECK(collect(doubled) == std::vector<std::int64_t>{0, 2, 4, 6});
  CHECK(doubled.cardinality() == 4);
  CHECK(doubled.element_spec() == std::vector{spec(kInt64, {})});

  auto failing = range(5).map([](const Element& e) {
    if (e[0].item<std::int64_t>() == 2) throw DataLoss("element 2 is bad");
    return e;
  });
  auto it = failing.iterate();
  CHECK(it->next()->at(0).item<std::int64_t>() == 0);
  CHECK(it->next()->at(0).item<std::int64_t>() == 1);
  CHECK_THROWS_WITH_AS(it->next(), "element 2 is bad", DataLoss);
  CHECK(it->next()->at(0).item<std::int64_t>() == 3);  // as tf.data: the next element follows

  CHECK_THROWS_AS(range(3).map(nullptr), InvalidArgument);
}

TEST_CASE("map's element_spec runs the function once on the first element") {
  std::atomic<int> calls{0};
  auto ds = range(10).map([&](const Element& e) {
    ++calls;
    return Element{Tensor::zeros({3, 4}, kFloat32), e[0]};
  });
  CHECK(ds.element_spec() == std::vector{spec(kFloat32, {3, 4}), spec(kInt64, {})});
  CHECK(ds.element_spec() == std::vector{spec(kFloat32, {3, 4}), spec(kInt64, {})});
  CHECK(calls == 1);
  CHECK(ds.batch(4).element_spec() == std::vector{spec(kFloat32, {-1, 3, 4}), spec(kInt64, {-1})});

  // A per-batch map keeps the varying batch dimension.
  auto per_batch = range(10).batch(4).map([](const Element& e) { return Element{e[0], Tensor::zeros({2}, kFloat32)}; });
  CHECK(per_batch.element_spec() == std::vector{spec(kInt64, {-1}), spec(kFloat32, {2})});
  CHECK_THROWS_AS(range(0).map([](const Element& e) { return e; }).element_spec(), FailedPrecondition);
}

TEST_CASE("prefetch yields the same elements in the same order") {
  auto ds = range(100).shuffle(100, 3).batch(7).prefetch(3);
  CHECK(ds.cardinality() == 15);
  CHECK(ds.element_spec() == std::vector{spec(kInt64, {-1})});
  CHECK(collect_batches(ds).values == collect_batches(range(100).shuffle(100, 3).batch(7)).values);
  CHECK(collect(range(50).prefetch(1)) == iota_vector(0, 50));
  CHECK(collect(range(50).prefetch(0)) == iota_vector(0, 50));
  CHECK(collect(range(0).prefetch(2)).empty());
  CHECK(collect(range(20).prefetch(2).prefetch(2)) == iota_vector(0, 20));
  CHECK_THROWS_AS(range(5).prefetch(-1), InvalidArgument);
}

TEST_CASE("prefetch rethrows upstream errors in order, after the elements before them") {
  auto ds = range(6)
                .map([](const Element& e) {
                  if (e[0].item<std::int64_t>() == 3) throw InvalidArgument("bad element 3");
                  return e;
                })
                .prefetch(4);
  auto it = ds.iterate();
  for (std::int64_t i = 0; i < 3; ++i) CHECK(it->next()->at(0).item<std::int64_t>() == i);
  CHECK_THROWS_WITH_AS(it->next(), "bad element 3", InvalidArgument);
  CHECK(it->next()->at(0).item<std::int64_t>() == 4);
  CHECK(it->next()->at(0).item<std::int64_t>() == 5);
  CHECK_FALSE(it->next());
  CHECK_FALSE(it->next());
}

TEST_CASE("destroying a prefetch iterator early does not hang") {
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 20; ++round) {
    auto it = range(1000).repeat().batch(10).prefetch(2).iterate();
    CHECK(it->next());
    // The producer is now blocked on a full queue; the destructor must wake and join it.
  }
  {
    auto never_read = range(10).repeat().prefetch(1).iterate();  // destroyed without a next()
  }
  {
    // A producer busy in a slow function stops after that one element.
    auto slow = range(100)
                    .map([](const Element& e) {
                      std::this_thread::sleep_for(std::chrono::milliseconds(20));
                      return e;
                    })
                    .prefetch(2)
                    .iterate();
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}

TEST_CASE("prefetch raises DeadlineExceeded when the input is slower than its timeout") {
  auto slow = range(3)
                  .map([](const Element& e) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(300));
                    return e;
                  })
                  .prefetch(1, {.timeout = std::chrono::milliseconds(20)});
  auto it = slow.iterate();
  const auto message = error_message<DeadlineExceeded>([&] { it->next(); });
  CHECK(contains(message, "prefetch"));
  CHECK(contains(message, "20 ms"));
  // The pass is not broken: a later call gets the element once it is ready.
  std::optional<Element> first;
  for (int attempt = 0; attempt < 500 && !first; ++attempt) {
    try {
      first = it->next();
    } catch (const DeadlineExceeded&) {
    }
  }
  REQUIRE(first);
  CHECK(first->at(0).item<std::int64_t>() == 0);
  CHECK_THROWS_AS(range(3).prefetch(1, {.timeout = std::chrono::milliseconds(0)}), InvalidArgument);
}

TEST_CASE("take releases an upstream prefetch as soon as it is done") {
  auto it = range(10).repeat().prefetch(2).take(3).iterate();
  CHECK(collect(range(10).repeat().prefetch(2).take(3)) == std::vector<std::int64_t>{0, 1, 2});
  for (int i = 0; i < 3; ++i) CHECK(it->next());
  CHECK_FALSE(it->next());
}

TEST_CASE("one dataset can be iterated from several threads at once") {
  auto ds = range(500).shuffle(500, 21, /*reshuffle_each_iteration=*/false).batch(32).prefetch(2);
  const auto expected = collect_batches(ds).values;
  std::vector<std::thread> threads;
  std::atomic<int> matches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int pass = 0; pass < 5; ++pass) {
        if (collect_batches(ds).values == expected) ++matches;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(matches == 20);
}

TEST_CASE("pipelines over slices (row mode) give what the same pipelines over Elements give") {
  // map(identity) hides the slices source, so everything after it works on Elements.
  const auto identity = [](const Element& e) { return e; };
  auto x = Tensor::from_vector<float>(std::vector<float>(2 * 53, 0.5f), {53, 2});
  auto rows = Dataset::from_tensor_slices({Tensor::from_vector<std::int64_t>(iota_vector(0, 53), {53}), x});
  auto elements = rows.map(identity);
  const std::vector<std::function<Dataset(const Dataset&)>> pipelines{
      [](const Dataset& d) { return d.shuffle(20, 4).batch(8); },
      [](const Dataset& d) { return d.shuffle(100, 4).batch(8, true); },
      [](const Dataset& d) { return d.repeat(3).shuffle(60, 5).batch(16); },
      [](const Dataset& d) { return d.skip(5).take(30).shard(3, 2).batch(4); },
      [](const Dataset& d) { return d.shard(2, 1).repeat(2).skip(3).batch(5); },
      [](const Dataset& d) { return d.shuffle(53, 6).shard(4, 1).batch(3); },
      [](const Dataset& d) { return d.repeat().shuffle(10, 7).take(100).batch(32); },
  };
  for (std::size_t p = 0; p < pipelines.size(); ++p) {
    CAPTURE(p);
    const auto a = pipelines[p](rows);
    const auto b = pipelines[p](elements);
    CHECK(a.cardinality() == b.cardinality());
    CHECK(a.element_spec() == b.element_spec());
    const auto ba = collect_batches(a);
    CHECK(ba.values == collect_batches(b).values);
    CHECK_FALSE(ba.values.empty());
    // The second component was gathered too.
    auto it = a.iterate();
    auto e = it->next();
    REQUIRE(e);
    CHECK((*e)[1].shape() == Shape{(*e)[0].shape()[0], 2});
    CHECK((*e)[1].to_vector<float>() == std::vector<float>(static_cast<std::size_t>(2 * (*e)[0].shape()[0]), 0.5f));
  }
  // Unbatched, next() on a row-mode pipeline gives views of the source.
  auto it = rows.shuffle(53, 8).take(3).iterate();
  auto e = it->next();
  REQUIRE(e);
  CHECK((*e)[1].buffer() == x.buffer());
  CHECK(collect(rows.shuffle(53, 8)) == collect(elements.shuffle(53, 8)));
}

TEST_CASE("batch copies large rows over the device's threads, and behind a prefetch on the prefetch's thread") {
  // Rows of 12 KB: a chunk of the copy is a few rows, so a batch of 37 is split over the default
  // device's threads (where it has more than one); each row's values name its row and column.
  const std::int64_t n = 101, width = 3001;
  std::vector<float> values(static_cast<std::size_t>(n * width));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  auto x = Tensor::from_vector<float>(values, {n, width});
  auto ids = Tensor::from_vector<std::int64_t>(iota_vector(0, n), {n});
  auto rows = Dataset::from_tensor_slices({ids, x});
  const auto expect_rows = [&](const Dataset& ds) {
    std::int64_t seen = 0;
    auto it = ds.iterate();
    while (auto e = it->next()) {
      const auto id = (*e)[0].to_vector<std::int64_t>();
      const auto got = (*e)[1].to_vector<float>();
      REQUIRE((*e)[1].shape() == Shape{static_cast<std::int64_t>(id.size()), width});
      for (std::size_t i = 0; i < id.size(); ++i) {
        const auto first = values.begin() + id[i] * width;
        CHECK(std::equal(first, first + width, got.begin() + static_cast<std::ptrdiff_t>(i) * width));
      }
      seen += static_cast<std::int64_t>(id.size());
    }
    CHECK(seen == n);
  };
  MESSAGE("default CPU device threads: ", devices::default_cpu_device().intra_op_threads());
  expect_rows(rows.shuffle(n, 3).batch(37));
  expect_rows(rows.batch(37));
  expect_rows(rows.shuffle(n, 4).batch(37).prefetch(2));
  // The same batches as over Elements (map(identity) leaves row mode), on both paths.
  const auto identity = [](const Element& e) { return e; };
  CHECK(collect_batches(rows.shuffle(n, 5).batch(37)).values ==
        collect_batches(rows.map(identity).shuffle(n, 5).batch(37)).values);
}

TEST_CASE("an epoch of the Fashion-MNIST pipeline is fast") {
  // Same shapes as Fashion-MNIST: x [60000, 28, 28] float32, y [60000] int64.
  const std::int64_t n = 60000;
  auto x = Tensor::empty({n, 28, 28}, kFloat32);
  auto* px = x.data<float>();
  for (std::int64_t i = 0; i < x.num_elements(); ++i) px[i] = static_cast<float>(i % 251) / 251.0f;
  std::vector<std::int64_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) labels[static_cast<std::size_t>(i)] = i % 10;
  auto y = Tensor::from_vector<std::int64_t>(labels, {n});
  auto ds = Dataset::from_tensor_slices({x, y}).shuffle(60000).batch(128);
  CHECK(ds.cardinality() == 469);

  double best_cpu_ms = 1e9, best_wall_ms = 1e9;
  for (int epoch = 0; epoch < 4; ++epoch) {
    const auto wall_start = std::chrono::steady_clock::now();
    const double cpu_start = thread_cpu_ms();
    std::int64_t batches = 0, examples = 0, label_sum = 0;
    auto it = ds.iterate();
    while (auto e = it->next()) {
      ++batches;
      examples += (*e)[0].shape()[0];
      label_sum += (*e)[1].data<std::int64_t>()[0];
    }
    const double cpu_ms = thread_cpu_ms() - cpu_start;
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall_start).count();
    CHECK(batches == 469);
    CHECK(examples == n);
    CHECK(label_sum >= 0);
    best_cpu_ms = std::min(best_cpu_ms, cpu_ms);
    best_wall_ms = std::min(best_wall_ms, wall_ms);
  }
  MESSAGE("Fashion-MNIST-shaped epoch (shuffle(60000).batch(128), 469 batches): best of 4: ", best_cpu_ms, " ms CPU, ",
          best_wall_ms, " ms wall");
  // Reported, not asserted: timings are for bench/ (about 35 ms here, most of it the 188 MB of row
  // copies); this case checks the pipeline's output.
}

namespace {
std::vector<std::int64_t> collect_with(const Dataset& ds, const tandem::data::IterateOptions& options) {
  std::vector<std::int64_t> out;
  auto it = ds.iterate(options);
  while (auto e = it->next()) out.push_back((*e)[0].item<std::int64_t>());
  return out;
}
}  // namespace

TEST_CASE("iterate with an epoch: a reshuffling shuffle gives that epoch's order in any process") {
  const Dataset ds = range(50).shuffle(50, 11);
  // Counted passes 0, 1, 2 ...
  const auto pass0 = collect(ds), pass1 = collect(ds), pass2 = collect(ds);
  CHECK(pass0 != pass1);
  // ... equal the numbered epochs, asked for in any order, without moving the counter.
  const Dataset fresh = range(50).shuffle(50, 11);
  CHECK(collect_with(fresh, {.epoch = 2}) == pass2);
  CHECK(collect_with(fresh, {.epoch = 0}) == pass0);
  CHECK(collect_with(fresh, {.epoch = 1}) == pass1);
  CHECK(collect(fresh) == pass0);
  // The repetitions of one epoch still differ from each other.
  const auto repeated = collect_with(range(20).shuffle(20, 3).repeat(2), {.epoch = 4});
  REQUIRE(repeated.size() == 40);
  CHECK(std::vector<std::int64_t>(repeated.begin(), repeated.begin() + 20) !=
        std::vector<std::int64_t>(repeated.begin() + 20, repeated.end()));
}

TEST_CASE("from_files concatenates the readers' datasets; FILE sharding takes every N-th file") {
  std::vector<std::string> opened;
  const auto reader = [&](const std::string& path) {
    opened.push_back(path);
    const std::int64_t base = std::stoll(path) * 100;
    return Dataset::from_tensor_slices({Tensor::from_vector<std::int64_t>({base, base + 1}, {2})});
  };
  const Dataset ds = Dataset::from_files({"0", "1", "2", "3", "4"}, reader);
  CHECK(ds.reads_files());
  CHECK(ds.batch(2).reads_files());
  CHECK_FALSE(range(3).reads_files());
  CHECK(ds.cardinality() == Dataset::kUnknown);
  CHECK(collect(ds) == std::vector<std::int64_t>{0, 1, 100, 101, 200, 201, 300, 301, 400, 401});
  CHECK(collect_with(ds, {.file_shards = 2, .file_shard_index = 1}) == std::vector<std::int64_t>{100, 101, 300, 301});
  opened.clear();
  CHECK(collect_with(ds, {.file_shards = 3, .file_shard_index = 0}) == std::vector<std::int64_t>{0, 1, 300, 301});
  CHECK(opened == std::vector<std::string>{"0", "3"});  // a worker opens only its files
  CHECK(error_message<InvalidArgument>([&] {
          ds.iterate({.file_shards = 2, .file_shard_index = 2});
        }).find("file shard 2 of 2") != std::string::npos);
  CHECK(error_message<InvalidArgument>([] { Dataset::from_files({}, nullptr); }).find("no reader") !=
        std::string::npos);
  CHECK(error_message<InvalidArgument>([] {
          (void)Dataset::from_files({}, [](const std::string&) { return Dataset(); }).element_spec();
        }).find("empty") != std::string::npos);
}
