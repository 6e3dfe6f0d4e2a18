// bench_ops — GFLOP/s of tandem's MatMul, BatchMatMul and Conv2D ops next to the ceilings measured
// in the same run: the best sgemm this process can call (OpenBLAS with the kernels it runs here,
// Eigen; one thread and all threads) and memory-copy bandwidth; GB/s of the transformer's
// memory-bound nn ops (LayerNorm, the causal masked softmax, GELU) next to the copy ceiling. See
// bench/README.md for what each row means.
//
//   bench_ops [--threads N] [--rounds N] [--samples N] [--quick] [--only matmul|bmm|conv|nn]
//
// --threads sets the CPU device's intra-op threads (default: every usable core).
//
// Timing. The machines we run on are shared and noisy (other tenants come and go for seconds at a
// time), so every figure is a best case: each measurement is the mean over calls lasting at least
// kMinSampleSeconds, and its best over --samples samples in each of --rounds rounds. A round
// times everything once, ceilings and our ops alike, so a quiet or a noisy phase of the machine
// reaches all of them, and ratios compare like with like.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "machine_info.h"
#include "sgemm_ceiling.h"
#include "tandem/devices/device.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/ops.h"

namespace {

using namespace tandem;
using bench::OpenBlasThreads;
using bench::split_gemm;
using ops::cpu::GemmBackend;
using ops::cpu::GemmShape;

using Clock = std::chrono::steady_clock;

constexpr double kMinSampleSeconds = 0.02;
constexpr std::size_t kCopyBytes = 256u << 20;  // far beyond any cache
constexpr std::int64_t kLargeSquare = bench::kCeilingSquare;
constexpr std::int64_t kBatch = 128;
constexpr int kRuleWidth = 118;

struct Options {
  int threads = 0;  // 0: the device default (every usable core)
  int rounds = 3;
  int samples = 5;
  bool quick = false;
  std::string only;  // "matmul", "bmm", "conv" or "nn": run only that part
};

std::vector<float> random_floats(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = u(rng);
  return v;
}

// --- timing ----------------------------------------------------------------------------------

// Everything the bench times, by key; each round times every entry and keeps its best.
class Timings {
 public:
  explicit Timings(const Options& options) : options_(options) {}

  // `fn` is one call; `setup`/`teardown` run around each sample (not timed).
  void add(std::string key, std::function<void()> fn, std::function<void()> setup = {},
           std::function<void()> teardown = {}) {
    entries_.push_back({std::move(key), std::move(fn), std::move(setup), std::move(teardown)});
  }

  void run() {
    const int rounds = options_.quick ? 1 : options_.rounds;
    const int samples = options_.quick ? 2 : options_.samples;
    const double min_seconds = options_.quick ? kMinSampleSeconds / 5 : kMinSampleSeconds;
    const bool progress = isatty(STDERR_FILENO) != 0;
    for (int round = 0; round < rounds; ++round) {
      if (progress) fmt::print(stderr, "\rround {}/{} ...", round + 1, rounds);
      for (auto& e : entries_) {
        if (e.setup) e.setup();
        e.fn();  // warm-up: plans, packing buffers, page faults
        for (int s = 0; s < samples; ++s) {
          int reps = 0;
          const auto start = Clock::now();
          double elapsed = 0;
          do {
            e.fn();
            ++reps;
            elapsed = std::chrono::duration<double>(Clock::now() - start).count();
          } while (elapsed < min_seconds);
          auto& best = best_[e.key];
          best = best == 0 ? elapsed / reps : std::min(best, elapsed / reps);
        }
        if (e.teardown) e.teardown();
      }
    }
    if (progress) fmt::print(stderr, "\r{:<20}\r", "");
  }

  // Best seconds per call; NaN when the entry was not added (a reference that is unavailable).
  double seconds(const std::string& key) const {
    const auto it = best_.find(key);
    return it == best_.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
  }
  double gflops(const std::string& key, double flops) const { return flops / seconds(key) / 1e9; }

 private:
  struct Entry {
    std::string key;
    std::function<void()> fn, setup, teardown;
  };
  const Options& options_;
  std::vector<Entry> entries_;
  std::map<std::string, double> best_;
};

// --- references ------------------------------------------------------------------------------

struct Product {
  std::string name;
  bool transpose_a, transpose_b;
  std::int64_t m, n, k;
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
  GemmShape shape() const {
    return GemmShape{.transpose_a = transpose_a,
                     .transpose_b = transpose_b,
                     .m = m,
                     .n = n,
                     .k = k,
                     .lda = transpose_a ? m : k,
                     .ldb = transpose_b ? k : n,
                     .ldc = n};
  }
  Shape a_shape() const { return transpose_a ? Shape{k, m} : Shape{m, k}; }
  Shape b_shape() const { return transpose_b ? Shape{n, k} : Shape{k, n}; }
  std::string shape_text() const {
    return fmt::format("{}{}x{} @ {}{}x{}", transpose_a ? "T" : "", a_shape()[0], a_shape()[1], transpose_b ? "T" : "",
                       b_shape()[0], b_shape()[1]);
  }
};

// Operands of one product, kept for the whole run.
struct Operands {
  std::vector<float> a, b, c;
  explicit Operands(const Product& p)
      : a(random_floats(p.m * p.k, 1)), b(random_floats(p.k * p.n, 2)), c(static_cast<std::size_t>(p.m * p.n)) {}
};

// The reference sgemm entries of one product under `key`: "<key>/openblas1", "/eigen1" (one
// thread, when with_single), "/openblas_split", "/openblas_threads", "/eigen_split".
void add_sgemm(Timings& timings, devices::Device& device, const OpenBlasThreads& own, const Product& p,
               const std::string& key, bool with_single, std::vector<std::unique_ptr<Operands>>& keep) {
  auto& buf = *keep.emplace_back(std::make_unique<Operands>(p));
  const GemmShape s = p.shape();
  const bool openblas = ops::cpu::openblas_available();
  if (with_single) {
    if (openblas) {
      timings.add(key + "/openblas1", [&buf, s] {
        ops::cpu::gemm_serial_with(GemmBackend::kOpenBLAS, s, 1.0f, buf.a.data(), buf.b.data(), 0.0f, buf.c.data());
      });
    }
    timings.add(key + "/eigen1", [&buf, s] {
      ops::cpu::gemm_serial_with(GemmBackend::kEigen, s, 1.0f, buf.a.data(), buf.b.data(), 0.0f, buf.c.data());
    });
  }
  if (openblas) {
    timings.add(key + "/openblas_split", [&buf, &device, s] {
      split_gemm(device, GemmBackend::kOpenBLAS, s, buf.a.data(), buf.b.data(), buf.c.data());
    });
  }
  if (own.available() && device.intra_op_threads() > 1) {
    const int threads = device.intra_op_threads();
    timings.add(
        key + "/openblas_threads", [&buf, &own, s] { own.run(s, buf.a.data(), buf.b.data(), buf.c.data()); },
        [&own, threads] { own.set_threads(threads); }, [&own] { own.set_threads(1); });
  }
  timings.add(key + "/eigen_split", [&buf, &device, s] {
    split_gemm(device, GemmBackend::kEigen, s, buf.a.data(), buf.b.data(), buf.c.data());
  });
}

// The fastest reference sgemm at the device's thread count (and, for one thread, the serial calls).
double best_sgemm(const Timings& t, const std::string& key, double flops) {
  double best = 0;
  for (const char* which : {"/openblas1", "/eigen1", "/openblas_split", "/openblas_threads", "/eigen_split"}) {
    const double gf = t.gflops(key + which, flops);
    if (gf == gf) best = std::max(best, gf);  // skips NaN: not measured
  }
  return best;
}

// Memory copy of kCopyBytes on one thread, or split over the device's threads.
struct CopyBuffers {
  std::vector<char> src = std::vector<char>(kCopyBytes, 1), dst = std::vector<char>(kCopyBytes, 0);
};

// --- ops through graph + executor ------------------------------------------------------------

// One op in its own graph, fed placeholders, run by an executor: what a training step pays.
class OpRunner {
 public:
  // Random float32 inputs of these shapes.
  template <class Build>
  OpRunner(devices::Device& device, const std::vector<Shape>& input_shapes, Build build)
      : OpRunner(device, random_inputs(input_shapes), build) {}
  template <class Build>
  OpRunner(devices::Device& device, const std::vector<Tensor>& input_values, Build build)
      : graph_(std::make_shared<Graph>()) {
    std::vector<Output> inputs;
    for (std::size_t i = 0; i < input_values.size(); ++i) {
      const Tensor& value = input_values[i];
      inputs.push_back(graph_->placeholder(value.dtype(), value.shape(), fmt::format("in{}", i)));
      feeds_.emplace_back(inputs.back(), value);
    }
    output_ = build(inputs);
    executor_ = std::make_unique<graph::Executor>(graph_, device);
  }
  static std::vector<Tensor> random_inputs(const std::vector<Shape>& shapes) {
    std::vector<Tensor> values;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      values.push_back(Tensor::from_vector<float>(random_floats(shapes[i].num_elements(), 10 + i), shapes[i]));
    return values;
  }
  // Each result is dropped before the next run, so that the executor reuses its arena.
  void run() { (void)executor_->run(feeds_, std::span<const Output>(&output_, 1)); }

 private:
  std::shared_ptr<Graph> graph_;
  std::vector<graph::Feed> feeds_;
  Output output_;
  std::unique_ptr<graph::Executor> executor_;
};

// char_gpt's dense layers (4096 tokens a step: batch 32 x context 128, width 128, MLP 512): each
// of the forward product and its two gradients, for the 128 -> 128 projections (query, key,
// value, attention output: 4 a block) and the MLP's 128 -> 512 and 512 -> 128.
std::vector<Product> gpt_products() {
  const std::int64_t tokens = 32 * 128;
  struct Layer {
    const char* name;
    std::int64_t in, out;
  };
  std::vector<Product> products;
  for (const Layer l : {Layer{"proj", 128, 128}, Layer{"up", 128, 512}, Layer{"down", 512, 128}}) {
    products.push_back({fmt::format("{} Y=X@W", l.name), false, false, tokens, l.out, l.in});
    products.push_back({fmt::format("{} dX=dY@Wt", l.name), false, true, tokens, l.in, l.out});
    products.push_back({fmt::format("{} dW=Xt@dY", l.name), true, false, l.in, l.out, tokens});
  }
  return products;
}

std::vector<Product> mlp_products() {
  const std::int64_t widths[] = {784, 1024, 1024, 10};
  std::vector<Product> products;
  for (int l = 0; l < 3; ++l)
    products.push_back({fmt::format("L{} forward  Y=X@W", l + 1), false, false, kBatch, widths[l + 1], widths[l]});
  for (int l = 0; l < 3; ++l)
    products.push_back({fmt::format("L{} backward dX=dY@Wt", l + 1), false, true, kBatch, widths[l], widths[l + 1]});
  for (int l = 0; l < 3; ++l)
    products.push_back({fmt::format("L{} backward dW=Xt@dY", l + 1), true, false, widths[l], widths[l + 1], kBatch});
  return products;
}

// A BatchMatMul of the char_gpt sample (batch 32, 4 heads, context 128, head size 32): the two
// attention products and the four products of their gradients, and a dense layer over the
// sequence (B shared by the batch: one folded product).
struct BatchProduct {
  std::string name;
  Shape a, b;
  bool adj_x, adj_y;
  // Which triangle causal attention lets the product skip (MultiHeadAttention's use_causal_mask):
  // a lower-triangular a (the probabilities, dS), or a lower-triangular output (scores, dP).
  bool a_lower = false, output_lower = false;
  std::int64_t batch() const { return a.num_elements() / (a.dim(-1) * a.dim(-2)); }
  std::int64_t m() const { return a.dim(adj_x ? -1 : -2); }
  std::int64_t k() const { return a.dim(adj_x ? -2 : -1); }
  std::int64_t n() const { return b.dim(adj_y ? -2 : -1); }
  double flops() const {
    return 2.0 * static_cast<double>(batch()) * static_cast<double>(m() * n()) * static_cast<double>(k());
  }
  // One of the batch's products, as a single-threaded sgemm (the per-matrix reference).
  Product one() const { return {name, adj_x, adj_y, m(), n(), k()}; }
};

std::vector<BatchProduct> attention_products() {
  const std::int64_t B = 32, H = 4, T = 128, D = 32;
  const Shape q{B, H, T, D}, s{B, H, T, T};
  return {{"scores S=Q@Kt", q, q, false, true, false, true},
          {"context O=P@V", s, q, false, false, true, false},
          {"dQ = dS@K", s, q, false, false, true, false},
          {"dK = dSt@Q", s, q, true, false, true, false},
          {"dP = dO@Vt", q, q, false, true, false, true},
          {"dV = Pt@dO", s, q, true, false, true, false},
          {"MLP X@W (folded)", {B, T, 128}, {128, 512}, false, false}};
}

struct ConvLayer {
  std::string name;
  std::int64_t h, w, cin, cout, k;
  Shape x() const { return {kBatch, h, w, cin}; }
  Shape filter() const { return {k, k, cin, cout}; }
  Shape y() const { return {kBatch, h - k + 1, w - k + 1, cout}; }
  double flops() const { return 2.0 * static_cast<double>(y().num_elements()) * static_cast<double>(k * k * cin); }
};

const ConvLayer kConvLayers[] = {{"28x28x1 -> 32", 28, 28, 1, 32, 3}, {"13x13x32 -> 64", 13, 13, 32, 64, 3}};
const char* const kConvPasses[] = {"forward", "backprop filter", "backprop input"};
const char* const kFusedConvPass = "forward + bias + relu (FusedConv2D)";
const char* const kPooledConvPass = "... + 2x2 max pool (FusedConv2DMaxPool)";
constexpr std::uint8_t kNoWinner = 255;  // FusedConv2DMaxPool's argmax where no cell wins (relu' = 0)
const char* const kPooledFilterPass = "backprop filter + bias from its argmax";
const char* const kPooledInputPass = "backprop input from its argmax";

void print_rule() { fmt::print("{}\n", std::string(kRuleWidth, '-')); }

// A GFLOP/s figure, or "-" for a reference this run could not measure.
std::string gf_text(double gflops) { return gflops == gflops ? fmt::format("{:.1f}", gflops) : "-"; }

std::string threads_text(int threads) { return fmt::format("{} thread{}", threads, threads == 1 ? "" : "s"); }

void print_matmul(const Timings& t, const devices::Device& device, const std::string& title,
                  const std::string& prefix, const std::vector<Product>& products) {
  fmt::print("\nMatMul at {} (GFLOP/s; {})\n", title, threads_text(device.intra_op_threads()));
  fmt::print(
      "  sgemm references: OB 1t, Eig 1t = one single-threaded call of OpenBLAS, Eigen; OB split = single-\n"
      "  threaded OpenBLAS calls split over tandem's threads (what gemm() runs for the products the register\n"
      "  tiles leave); OB thr = OpenBLAS's own thread pool; Eig split = Eigen split like OB split; best = the\n"
      "  fastest of these. gemm() = tandem's threaded GEMM called directly (its register tiles where the gemm\n"
      "  backend line says so); MatMul op = the op through graph + executor.\n");
  print_rule();
  fmt::print("{:<21} {:<21} {:>6} | {:>6} {:>6} {:>8} {:>6} {:>9} {:>6} | {:>6} {:>9} {:>7}\n", "product", "shape",
             "MFLOP", "OB 1t", "Eig 1t", "OB split", "OB thr", "Eig split", "best", "gemm()", "MatMul op", "op/best");
  print_rule();
  double flops = 0, best_s = 0, op_s = 0, kernel_s = 0;
  for (const auto& p : products) {
    const std::string key = prefix + p.name;
    const double best = best_sgemm(t, key, p.flops());
    const double op = t.gflops(key + "/op", p.flops());
    const auto ref = [&](const char* which) { return gf_text(t.gflops(key + which, p.flops())); };
    fmt::print("{:<21} {:<21} {:>6.1f} | {:>6} {:>6} {:>8} {:>6} {:>9} {:>6.1f} | {:>6.1f} {:>9.1f} {:>7.2f}\n", p.name,
               p.shape_text(), p.flops() / 1e6, ref("/openblas1"), ref("/eigen1"), ref("/openblas_split"),
               ref("/openblas_threads"), ref("/eigen_split"), best, t.gflops(key + "/gemm", p.flops()), op, op / best);
    flops += p.flops();
    best_s += p.flops() / (best * 1e9);
    op_s += t.seconds(key + "/op");
    kernel_s += t.seconds(key + "/gemm");
  }
  print_rule();
  const double best_total = flops / best_s / 1e9, op_total = flops / op_s / 1e9;
  fmt::print("{:<21} {:<21} {:>6.1f} | {:>6} {:>6} {:>8} {:>6} {:>9} {:>6.1f} | {:>6.1f} {:>9.1f} {:>7.2f}\n",
             fmt::format("all {} (flop-weighted)", products.size()), "", flops / 1e6, "", "", "", "", "", best_total, flops / kernel_s / 1e9, op_total,
             op_total / best_total);
}

std::string batch_shape_text(const BatchProduct& p) {
  return fmt::format("{}{} @ {}{}", p.adj_x ? "T" : "", p.a, p.adj_y ? "T" : "", p.b);
}

void print_batch_matmul(const Timings& t, const devices::Device& device, double ceiling) {
  const int threads = device.intra_op_threads();
  fmt::print("\nBatchMatMul at the attention shapes of char_gpt (B=32, H=4, T=128, head 32), float32 ({})\n",
             threads_text(threads));
  fmt::print(
      "  1 matrix = one of the batch's products as one single-threaded sgemm (the best of OpenBLAS and Eigen):\n"
      "  the rate a thread can reach at this matrix size. op = the op through graph + executor; op/1 matrix\n"
      "  divides by {} x that rate; ratio = op over the run's sgemm 2048^3 ceiling ({:.1f} GFLOP/s). T = adjoint.\n",
      threads, ceiling);
  print_rule();
  fmt::print(
      "  causal ms = the same product with the triangle a causal mask lets it skip (MultiHeadAttention's\n"
      "  use_causal_mask: a_lower_triangular or output_lower_triangular); its GFLOP/s count the whole product.\n");
  print_rule();
  fmt::print("{:<18} {:<44} {:>7} {:>8} {:>9} {:>8} {:>11} {:>6} {:>9}\n", "product", "shape", "MFLOP", "ms",
             "1 matrix", "op", "op/1 matrix", "ratio", "causal ms");
  print_rule();
  double flops = 0, seconds = 0, causal_seconds = 0;
  for (const auto& p : attention_products()) {
    const std::string key = "bmm/" + p.name;
    const Product one = p.one();
    const double single = std::max(t.gflops(key + "/openblas1", one.flops()), t.gflops(key + "/eigen1", one.flops()));
    const double op = t.gflops(key + "/op", p.flops());
    const bool causal = p.a_lower || p.output_lower;
    fmt::print("{:<18} {:<44} {:>7.1f} {:>8.3f} {:>9} {:>8.1f} {:>11.2f} {:>6.2f} {:>9}\n", p.name, batch_shape_text(p),
               p.flops() / 1e6, t.seconds(key + "/op") * 1e3, gf_text(single), op, op / (threads * single),
               op / ceiling, causal ? fmt::format("{:.3f}", t.seconds(key + "/causal") * 1e3) : "");
    if (p.a.rank() == 4) {
      flops += p.flops();
      seconds += t.seconds(key + "/op");
      causal_seconds += t.seconds(key + "/causal");
    }
  }
  print_rule();
  const double all = flops / seconds / 1e9;
  fmt::print("{:<18} {:<44} {:>7.1f} {:>8.3f} {:>9} {:>8.1f} {:>11} {:>6.2f} {:>9.3f}\n", "attention, all 6", "",
             flops / 1e6, seconds * 1e3, "", all, "", all / ceiling, causal_seconds * 1e3);
}

void print_conv(const Timings& t, const devices::Device& device, double ceiling) {
  fmt::print("\nConv2D 3x3, VALID, stride 1, batch {}, float32, through graph + executor ({})\n", kBatch,
             threads_text(device.intra_op_threads()));
  fmt::print(
      "  ratio: GFLOP/s over the best sgemm of this run at {} ({:.1f} GFLOP/s). Each pass counts\n"
      "  2 * out_pixels * 9 * cin * cout flops.\n",
      threads_text(device.intra_op_threads()), ceiling);
  print_rule();
  fmt::print("{:<18} {:<36} {:>8} {:>9} {:>9} {:>7}\n", "layer", "pass", "MFLOP", "ms", "GFLOP/s", "ratio");
  print_rule();
  const auto row = [&](const std::string& layer, const std::string& pass, double flops, double seconds) {
    const double gf = flops / seconds / 1e9;
    fmt::print("{:<18} {:<36} {:>8.1f} {:>9.3f} {:>9.1f} {:>7.2f}\n", layer, pass, flops / 1e6, seconds * 1e3, gf,
               gf / ceiling);
  };
  double all_flops = 0, all_s = 0, step_flops = 0, step_s = 0;
  for (const auto& layer : kConvLayers) {
    const double f = layer.flops();
    double layer_s = 0;
    for (const char* pass : kConvPasses) {
      const double s = t.seconds("conv/" + layer.name + "/" + pass);
      row(pass == kConvPasses[0] ? layer.name : "", pass, f, s);
      layer_s += s;
    }
    row("", kFusedConvPass, f, t.seconds("conv/" + layer.name + "/" + kFusedConvPass));
    row("", kPooledConvPass, f, t.seconds("conv/" + layer.name + "/" + kPooledConvPass));
    row("", kPooledFilterPass, f, t.seconds("conv/" + layer.name + "/" + kPooledFilterPass));
    row("", kPooledInputPass, f, t.seconds("conv/" + layer.name + "/" + kPooledInputPass));
    row("", "forward + backward (all three)", 3 * f, layer_s);
    all_flops += 3 * f;
    all_s += layer_s;
    // A training step needs no gradient for the data, so the first layer skips backprop input.
    const bool first = &layer == &kConvLayers[0];
    step_flops += first ? 2 * f : 3 * f;
    step_s += first ? layer_s - t.seconds("conv/" + layer.name + "/backprop input") : layer_s;
  }
  print_rule();
  row("both layers", "forward + backward (all three)", all_flops, all_s);
  row("both layers", "training step (no dx for the data)", step_flops, step_s);
}

// --- the transformer's nn ops (char_gpt's shapes) ----------------------------------------------

// One op at the GPT's shapes: `bytes` is what it must move at least (every input read once, every
// output written once), for GB/s against the copy ceiling; `flops` is non-zero for the products.
struct NnCase {
  std::string name, shape;
  double bytes = 0, flops = 0;
};

constexpr std::int64_t kTokens = 32 * 128;  // batch 32 x context 128
constexpr std::int64_t kWidth = 128, kHidden = 512, kHeads = 4, kContext = 128;

// Adds each case's runner under "nn/<name>" and returns the cases in table order.
std::vector<NnCase> add_nn_ops(Timings& t, devices::Device& device, std::vector<std::unique_ptr<OpRunner>>& runners) {
  std::vector<NnCase> cases;
  const auto add = [&](NnCase c, std::vector<Shape> inputs, auto build) {
    auto& runner = *runners.emplace_back(std::make_unique<OpRunner>(device, std::move(inputs), build));
    t.add("nn/" + c.name, [&runner] { runner.run(); });
    cases.push_back(std::move(c));
  };
  constexpr double kF = sizeof(float);
  const Shape rows{kTokens, kWidth}, stats{kTokens}, channel{kWidth};
  const double ln = static_cast<double>(kTokens * kWidth) * kF;
  add({"LayerNorm forward", "[4096, 128]", 2 * ln}, {rows, channel, channel},
      [](const std::vector<Output>& in) { return ops::layer_norm(in[0], in[1], in[2]); });
  add({"LayerNorm backward", "[4096, 128]", 3 * ln}, {rows, rows, stats, stats, channel},
      [](const std::vector<Output>& in) {
        graph::Attrs attrs;
        attrs.set("scale", true);
        return in[0].graph->add_node("LayerNormGrad", {in[0], in[1], in[2], in[3], in[4]}, std::move(attrs))[0];
      });
  const Shape scores{32, kHeads, kContext, kContext};
  const double sm = static_cast<double>(scores.num_elements()) * kF;
  const double scale = 1.0 / std::sqrt(32.0);
  add({"MaskedSoftmax causal forward", "[32, 4, 128, 128]", 2 * sm}, {scores}, [scale](const std::vector<Output>& in) {
    return ops::masked_softmax(in[0], Output{}, {.scale = scale, .causal = true});
  });
  add({"MaskedSoftmax causal backward", "[32, 4, 128, 128]", 3 * sm}, {scores, scores},
      [scale](const std::vector<Output>& in) {
        graph::Attrs attrs;
        attrs.set("scale", scale).set("causal", true);
        return in[0].graph->add("MaskedSoftmaxGrad", {in[0], in[1]}, std::move(attrs));
      });
  add({"Softmax (no mask), for scale", "[32, 4, 128, 128]", 2 * sm}, {scores},
      [](const std::vector<Output>& in) { return ops::softmax(in[0]); });
  const Shape hidden{kTokens, kHidden};
  const double h = static_cast<double>(hidden.num_elements()) * kF;
  const double dense_flops = 2.0 * static_cast<double>(kTokens * kWidth * kHidden);
  const double dense_bytes = (static_cast<double>(kTokens * kWidth + kWidth * kHidden) * kF) + h;
  for (const auto activation : {ops::Activation::kLinear, ops::Activation::kGelu, ops::Activation::kGeluApproximate}) {
    const bool gelu = activation != ops::Activation::kLinear;
    add({fmt::format("Dense {} forward", ops::activation_name(activation)), "[4096, 128] @ [128, 512]",
         dense_bytes + (gelu ? h : 0), dense_flops},
        {rows, {kWidth, kHidden}, {kHidden}},
        [activation](const std::vector<Output>& in) { return ops::dense(in[0], in[1], in[2], activation); });
  }
  for (const auto activation : {ops::Activation::kRelu, ops::Activation::kGelu, ops::Activation::kGeluApproximate}) {
    add({fmt::format("BiasActivationGrad {}", ops::activation_name(activation)), "[4096, 512]", 3 * h},
        {hidden, hidden}, [activation](const std::vector<Output>& in) {
          graph::Attrs attrs;
          attrs.set("activation", ops::activation_name(activation));
          return in[0].graph->add_node("BiasActivationGrad", {in[0], in[1]}, std::move(attrs))[0];
        });
  }
  add({"Gelu forward", "[4096, 512]", 2 * h}, {hidden}, [](const std::vector<Output>& in) { return ops::gelu(in[0]); });
  add({"GeluGrad", "[4096, 512]", 3 * h}, {hidden, hidden}, [](const std::vector<Output>& in) {
    graph::Attrs attrs;
    attrs.set("approximate", false);
    return in[0].graph->add("GeluGrad", {in[0], in[1]}, std::move(attrs));
  });
  // The cnn model's two 2x2 max pools (bench_fit): the forward and the fused gradient its
  // training step runs (relu's derivative and the bias gradient in the same pass).
  for (const Shape& y : {Shape{128, 26, 26, 32}, Shape{128, 11, 11, 64}}) {
    const Shape p{y[0], y[1] / 2, y[2] / 2, y[3]};
    const double yb = static_cast<double>(y.num_elements()) * kF, pb = static_cast<double>(p.num_elements()) * kF;
    const std::string shape = fmt::format("[{}, {}, {}, {}]", y[0], y[1], y[2], y[3]);
    add({fmt::format("MaxPool2D {}x{}", y[1], y[2]), shape, yb + pb}, {y},
        [](const std::vector<Output>& in) { return ops::max_pool2d(in[0]); });
    add({fmt::format("MaxPool2DBiasActGrad relu {}x{}", y[1], y[2]), shape, 2 * yb + pb}, {y, p},
        [](const std::vector<Output>& in) {
          graph::Attrs attrs = ops::max_pool2d(in[0]).producer().attrs;
          attrs.set("activation", "relu");
          return in[0].graph->add_node("MaxPool2DBiasActivationGrad", {in[0], in[1]}, std::move(attrs))[0];
        });
  }
  return cases;
}

void print_nn_ops(const Timings& t, const devices::Device& device, const std::vector<NnCase>& cases, double copy_gbs,
                  double ceiling) {
  fmt::print(
      "\nnn ops at the shapes of char_gpt (tokens 32 x 128, width 128, MLP 512, 4 heads) and of cnn's pools, "
      "float32 ({})\n",
      threads_text(device.intra_op_threads()));
  fmt::print(
      "  MB = every input read once + every output written once; copy = GB/s over the run's memory copy at the\n"
      "  same thread count ({:.1f} GB/s; these tensors fit in the last-level cache, so more than 1 is possible).\n"
      "  Dense rows: GFLOP/s and its ratio to the run's sgemm ceiling ({:.1f} GFLOP/s).\n",
      copy_gbs, ceiling);
  print_rule();
  fmt::print("{:<32} {:<26} {:>7} {:>9} {:>8} {:>6} {:>9} {:>6}\n", "op", "shape", "MB", "ms", "GB/s", "copy",
             "GFLOP/s", "sgemm");
  print_rule();
  for (const auto& c : cases) {
    const double seconds = t.seconds("nn/" + c.name);
    const double gbs = c.bytes / seconds / 1e9;
    const std::string flops =
        c.flops > 0 ? fmt::format("{:>9.1f} {:>6.2f}", c.flops / seconds / 1e9, c.flops / seconds / 1e9 / ceiling) : "";
    fmt::print("{:<32} {:<26} {:>7.1f} {:>9.3f} {:>8.1f} {:>6.2f} {}\n", c.name, c.shape, c.bytes / 1e6, seconds * 1e3,
               gbs, gbs / copy_gbs, flops);
  }
}

int run(const Options& options) {
  if (options.threads > 0) {
    devices::set_logical_device_configuration({.num_cpu_devices = 1, .intra_op_threads_per_device = options.threads});
  }
  ops::register_all();
  devices::Device& device = devices::default_cpu_device();
  const int threads = device.intra_op_threads();
  const OpenBlasThreads own;

  fmt::print("tandem bench_ops, {}\n", bench::now_text());
  fmt::print("CPU:           {}\n", bench::cpu_model());
  fmt::print("threads:       {} intra-op on {} ({} usable cores)\n", threads_text(threads), device.short_name(),
             devices::usable_cpu_cores());
  fmt::print("gemm backend:  {}\n", ops::cpu::gemm_backend_description());
  fmt::print("CPU kernels:   {}\n", bench::cpu_kernels_text());
  if (own.corename != nullptr)
    fmt::print("OpenBLAS core: {} ({})\n", own.corename(),
               std::getenv("OPENBLAS_CORETYPE") != nullptr ? "OPENBLAS_CORETYPE as the environment sets it"
                                                           : "OPENBLAS_CORETYPE set by tandem's loader");
  fmt::print("timing:        best of {} rounds x {} samples, each the mean of calls over >= {} ms\n",
             options.quick ? 1 : options.rounds, options.quick ? 2 : options.samples,
             kMinSampleSeconds * 1e3 / (options.quick ? 5 : 1));

  std::fflush(stdout);

  Timings t(options);
  std::vector<std::unique_ptr<Operands>> operands;
  std::vector<std::unique_ptr<OpRunner>> runners;

  // Ceilings.
  CopyBuffers copy;
  t.add("copy/1", [&] { std::memcpy(copy.dst.data(), copy.src.data(), kCopyBytes); });
  t.add("copy/all", [&] {
    const auto pages = static_cast<std::int64_t>(kCopyBytes >> 16);
    device.parallel_for(pages, 1, [&](std::int64_t begin, std::int64_t end) {
      std::memcpy(copy.dst.data() + (begin << 16), copy.src.data() + (begin << 16),
                  static_cast<std::size_t>((end - begin) << 16));
    });
  });
  const Product square{"square", false, false, kLargeSquare, kLargeSquare, kLargeSquare};
  add_sgemm(t, device, own, square, "square", true, operands);

  if (options.only.empty() || options.only == "matmul") {
    std::vector<std::pair<std::string, Product>> products;
    for (const auto& p : mlp_products()) products.emplace_back("mlp/" + p.name, p);
    for (const auto& p : gpt_products()) products.emplace_back("gpt/" + p.name, p);
    for (const auto& [key, p] : products) {
      add_sgemm(t, device, own, p, key, true, operands);
      auto& buf = *operands.back();
      const GemmShape s = p.shape();
      t.add(key + "/gemm",
            [&buf, &device, s] { ops::cpu::gemm(device, s, 1.0f, buf.a.data(), buf.b.data(), 0.0f, buf.c.data()); });
      auto& runner = *runners.emplace_back(std::make_unique<OpRunner>(
          device, std::vector<Shape>{p.a_shape(), p.b_shape()}, [&](const std::vector<Output>& in) {
            return ops::matmul(in[0], in[1], {.transpose_a = p.transpose_a, .transpose_b = p.transpose_b});
          }));
      t.add(key + "/op", [&runner] { runner.run(); });
    }
  }
  if (options.only.empty() || options.only == "bmm") {
    for (const auto& p : attention_products()) {
      const std::string key = "bmm/" + p.name;
      const Product one = p.one();
      auto& buf = *operands.emplace_back(std::make_unique<Operands>(one));
      const GemmShape s = one.shape();
      if (ops::cpu::openblas_available()) {
        t.add(key + "/openblas1", [&buf, s] {
          ops::cpu::gemm_serial_with(GemmBackend::kOpenBLAS, s, 1.0f, buf.a.data(), buf.b.data(), 0.0f, buf.c.data());
        });
      }
      t.add(key + "/eigen1", [&buf, s] {
        ops::cpu::gemm_serial_with(GemmBackend::kEigen, s, 1.0f, buf.a.data(), buf.b.data(), 0.0f, buf.c.data());
      });
      auto& runner = *runners.emplace_back(
          std::make_unique<OpRunner>(device, std::vector<Shape>{p.a, p.b}, [&](const std::vector<Output>& in) {
            return ops::batch_matmul(in[0], in[1], {.adj_x = p.adj_x, .adj_y = p.adj_y});
          }));
      t.add(key + "/op", [&runner] { runner.run(); });
      if (!p.a_lower && !p.output_lower) continue;
      auto& causal = *runners.emplace_back(
          std::make_unique<OpRunner>(device, std::vector<Shape>{p.a, p.b}, [&](const std::vector<Output>& in) {
            return ops::batch_matmul(in[0], in[1],
                                     {.adj_x = p.adj_x,
                                      .adj_y = p.adj_y,
                                      .a_lower_triangular = p.a_lower,
                                      .output_lower_triangular = p.output_lower});
          }));
      t.add(key + "/causal", [&causal] { causal.run(); });
    }
  }
  if (options.only.empty() || options.only == "conv") {
    graph::Attrs attrs;
    attrs.set("strides", std::vector<std::int64_t>{1, 1});
    attrs.set("padding", "VALID");
    for (const auto& layer : kConvLayers) {
      const std::string key = "conv/" + layer.name + "/";
      auto& forward = *runners.emplace_back(
          std::make_unique<OpRunner>(device, std::vector<Shape>{layer.x(), layer.filter()},
                                     [](const std::vector<Output>& in) { return ops::conv2d(in[0], in[1]); }));
      t.add(key + kConvPasses[0], [&forward] { forward.run(); });
      // A Conv2D layer's forward with a bias and relu (not in the sums below).
      auto& fused = *runners.emplace_back(std::make_unique<OpRunner>(
          device, std::vector<Shape>{layer.x(), layer.filter(), Shape{layer.cout}}, [](const std::vector<Output>& in) {
            return ops::fused_conv2d(in[0], in[1], in[2], ops::Activation::kRelu);
          }));
      t.add(key + kFusedConvPass, [&fused] { fused.run(); });
      // ... and with the max pool that follows each of cnn's convolutions, pooled in the kernel.
      auto& pooled = *runners.emplace_back(std::make_unique<OpRunner>(
          device, std::vector<Shape>{layer.x(), layer.filter(), Shape{layer.cout}}, [](const std::vector<Output>& in) {
            return ops::max_pool2d(ops::fused_conv2d(in[0], in[1], in[2], ops::Activation::kRelu));
          }));
      t.add(key + kPooledConvPass, [&pooled] { pooled.run(); });
      // Its filter and bias gradients from the pool's winners: each cell of a window wins in a
      // quarter of the lanes where relu lets one through, in half.
      const Shape pooled_shape{kBatch, layer.y().dim(1) / 2, layer.y().dim(2) / 2, layer.cout};
      std::vector<std::uint8_t> winners(static_cast<std::size_t>(pooled_shape.num_elements()));
      std::mt19937 rng(7);
      for (auto& cell : winners) cell = rng() % 2 == 0 ? kNoWinner : static_cast<std::uint8_t>(rng() % 4);
      std::vector<Tensor> values = OpRunner::random_inputs({layer.x(), layer.filter(), Shape{layer.cout}});
      values.push_back(Tensor::from_vector<std::uint8_t>(winners, pooled_shape));
      values.push_back(OpRunner::random_inputs({pooled_shape})[0]);
      for (const auto& [op, pass] : {std::pair{"Conv2DBackpropFilterArgmax", kPooledFilterPass},
                                     std::pair{"Conv2DBackpropInputArgmax", kPooledInputPass}}) {
        auto& runner = *runners.emplace_back(std::make_unique<OpRunner>(device, values, [&](const auto& in) {
          // The pooled forward only lends its attributes (nothing reads it, so it never runs).
          const Output source = ops::max_pool2d(ops::fused_conv2d(in[0], in[1], in[2], ops::Activation::kRelu));
          return in[0].graph->add_node(op, {in[0], in[1], in[3], in[4]}, source.producer().attrs)[0];
        }));
        t.add(key + pass, [&runner] { runner.run(); });
      }
      for (const char* op : {"Conv2DBackpropFilter", "Conv2DBackpropInput"}) {
        auto& backprop = *runners.emplace_back(std::make_unique<OpRunner>(
            device, std::vector<Shape>{layer.x(), layer.filter(), layer.y()}, [&](const std::vector<Output>& in) {
              return in[0].graph->add(op, {in[0], in[1], in[2]}, attrs);
            }));
        t.add(key + (op == std::string("Conv2DBackpropFilter") ? kConvPasses[1] : kConvPasses[2]),
              [&backprop] { backprop.run(); });
      }
    }
  }

  std::vector<NnCase> nn_cases;
  if (options.only.empty() || options.only == "nn") nn_cases = add_nn_ops(t, device, runners);

  t.run();

  fmt::print("\nCeilings\n");
  print_rule();
  fmt::print("{:<44} {:>10.1f} GB/s (bytes read + written)\n", "memory copy 256 MiB, 1 thread",
             2.0 * kCopyBytes / t.seconds("copy/1") / 1e9);
  if (threads > 1) {
    fmt::print("{:<44} {:>10.1f} GB/s\n", fmt::format("memory copy 256 MiB, {}", threads_text(threads)),
               2.0 * kCopyBytes / t.seconds("copy/all") / 1e9);
  }
  const double sq = square.flops();
  fmt::print("sgemm {0}^3, 1 thread: OpenBLAS {1}, Eigen {2} GFLOP/s\n", kLargeSquare,
             gf_text(t.gflops("square/openblas1", sq)), gf_text(t.gflops("square/eigen1", sq)));
  if (threads > 1) {
    fmt::print("sgemm {0}^3, {1}: OpenBLAS split {2}, OpenBLAS threads {3}, Eigen split {4} GFLOP/s\n", kLargeSquare,
               threads_text(threads), gf_text(t.gflops("square/openblas_split", sq)),
               gf_text(t.gflops("square/openblas_threads", sq)), gf_text(t.gflops("square/eigen_split", sq)));
  }
  const double ceiling = best_sgemm(t, "square", sq);
  fmt::print("best sgemm of this run at {}: {:.1f} GFLOP/s\n", threads_text(threads), ceiling);

  if (options.only.empty() || options.only == "matmul") {
    print_matmul(t, device, fmt::format("the shapes of a 784-1024-1024-10 MLP, batch {}", kBatch), "mlp/",
                 mlp_products());
    print_matmul(t, device, "char_gpt's dense shapes (4096 tokens, width 128, MLP 512)", "gpt/", gpt_products());
  }
  if (options.only.empty() || options.only == "bmm") print_batch_matmul(t, device, ceiling);
  if (options.only.empty() || options.only == "conv") print_conv(t, device, ceiling);
  if (!nn_cases.empty()) {
    const double copy_gbs = 2.0 * kCopyBytes / t.seconds(threads > 1 ? "copy/all" : "copy/1") / 1e9;
    print_nn_ops(t, device, nn_cases, copy_gbs, ceiling);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app(
      "bench_ops: GFLOP/s of tandem's MatMul, BatchMatMul and Conv2D, GB/s of its transformer nn ops, next to this "
      "machine's sgemm and copy ceilings");
  app.add_option("--threads", options.threads, "the CPU device's intra-op threads (0: every usable core)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  app.add_option("--rounds", options.rounds, "rounds, each timing everything once")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--samples", options.samples, "samples of each figure in a round (the best counts)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_flag("--quick", options.quick, "one round of two short samples (a smoke run)");
  app.add_option("--only", options.only, "run only that part")
      ->check(CLI::IsMember({"matmul", "bmm", "conv", "nn"}));
  CLI11_PARSE(app, argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_ops: {}\n", e.what());
    return 1;
  }
}
