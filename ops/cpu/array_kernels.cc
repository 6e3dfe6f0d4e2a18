// CPU kernels of the array family: transpose, cast, argmax, equal, one-hot, fills, gather and
// scatter-add, slices and concatenation.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tandem/graph/detail/low_precision_types.h"
#include "tandem/ops/cpu/broadcast.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/detail/gather_args.h"
#include "tandem/ops/detail/slice_args.h"
#include "tandem/ops/cpu/isa.h"

namespace tandem::ops::cpu {
namespace {

using graph::AllTypes;
using graph::IndexTypes;
using graph::Shape;

// Element strides of a row-major tensor of shape `in`.
std::array<std::int64_t, Shape::kMaxRank> row_major_strides(const Shape& in) {
  std::array<std::int64_t, Shape::kMaxRank> strides{};
  std::int64_t stride = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    strides[static_cast<std::size_t>(d)] = stride;
    stride *= in[d];
  }
  return strides;
}

// A transpose that keeps the innermost axis in place (attention's [batch, tokens, heads, depth]
// <-> [batch, heads, tokens, depth]) moves whole rows: the output is rows of `row` elements, each
// contiguous in the input too, copied with memcpy. The element-wise walk below took about 0.5 ms
// for char_gpt's 2 MiB head split on a 2-core Zen 4, a run of 32 elements at a time through a
// strided loop; the rows 0.25-0.34 ms.
struct TransposeRows {
  int rank = 0;                                         // leading (row-indexing) axes
  std::array<std::int64_t, Shape::kMaxRank> dims{};     // their output extents
  std::array<std::int64_t, Shape::kMaxRank> strides{};  // their input strides, in elements
  std::int64_t row = 1;                                 // elements per row
};

// The rows of y = transpose(x, perm), or row == 1 when the innermost axis moves.
TransposeRows transpose_rows(const Shape& in, const std::vector<std::int64_t>& perm) {
  TransposeRows t;
  const int rank = in.rank();
  const auto in_strides = row_major_strides(in);
  // Output axes from the last: they join the row while each is the input axis just before the
  // previous one (so the row stays one contiguous stretch of the input).
  int first_row_axis = rank;
  std::int64_t expected = rank - 1;
  while (first_row_axis > 0 && perm[static_cast<std::size_t>(first_row_axis - 1)] == expected) {
    --first_row_axis;
    t.row *= in[static_cast<int>(expected)];
    --expected;
  }
  if (first_row_axis == rank) {
    t.row = 1;
    return t;
  }
  t.rank = first_row_axis;
  for (int d = 0; d < t.rank; ++d) {
    const auto axis = static_cast<std::size_t>(perm[static_cast<std::size_t>(d)]);
    t.dims[static_cast<std::size_t>(d)] = in[static_cast<int>(axis)];
    t.strides[static_cast<std::size_t>(d)] = in_strides[axis];
  }
  return t;
}

// Copies output rows [begin, end) of `t`, each from its input offset.
void copy_transposed_rows(const TransposeRows& t, const char* x, char* y, std::size_t elem_bytes, std::int64_t begin,
                          std::int64_t end) {
  std::array<std::int64_t, Shape::kMaxRank> index{};
  std::int64_t rest = begin;
  for (int d = t.rank - 1; d >= 0; --d) {
    const auto du = static_cast<std::size_t>(d);
    index[du] = rest % t.dims[du];
    rest /= t.dims[du];
  }
  const auto row_bytes = static_cast<std::size_t>(t.row) * elem_bytes;
  for (std::int64_t r = begin; r < end; ++r) {
    std::int64_t offset = 0;
    for (int d = 0; d < t.rank; ++d)
      offset += index[static_cast<std::size_t>(d)] * t.strides[static_cast<std::size_t>(d)];
    std::memcpy(y + static_cast<std::size_t>(r) * row_bytes, x + static_cast<std::size_t>(offset) * elem_bytes,
                row_bytes);
    for (int d = t.rank - 1; d >= 0 && ++index[static_cast<std::size_t>(d)] == t.dims[static_cast<std::size_t>(d)]; --d)
      index[static_cast<std::size_t>(d)] = 0;
  }
}

void transpose_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const auto& perm = ctx.attrs().get<std::vector<std::int64_t>>("perm");
  const Shape& in = x.shape();
  if (y.num_elements() == 0) return;
  if (const TransposeRows t = transpose_rows(in, perm); t.row >= 8) {
    const std::int64_t rows = y.num_elements() / t.row;
    const auto elem_bytes = x.nbytes() / static_cast<std::size_t>(x.num_elements());
    const auto* px = static_cast<const char*>(x.raw_data());
    auto* py = static_cast<char*>(y.raw_data());
    ctx.device().parallel_for(
        rows, std::max<std::int64_t>(1, kElementwiseGrain / t.row),
        [&](std::int64_t b, std::int64_t e) { copy_transposed_rows(t, px, py, elem_bytes, b, e); });
    return;
  }
  // The output walks the input with strides permuted; reuse the broadcast iterator with one
  // operand whose strides are the input's strides in output order.
  BroadcastLayout layout;
  layout.operands = 1;
  const auto in_strides = row_major_strides(in);
  layout.rank = y.shape().rank();
  for (int d = 0; d < layout.rank; ++d) {
    layout.dims[static_cast<std::size_t>(d)] = y.shape()[d];
    layout.strides[0][static_cast<std::size_t>(d)] =
        in_strides[static_cast<std::size_t>(perm[static_cast<std::size_t>(d)])];
  }
  if (layout.rank == 0) {
    std::memcpy(y.raw_data(), x.raw_data(), y.nbytes());
    return;
  }
  graph::dispatch<AllTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    const T* px = static_cast<const T*>(x.raw_data());
    T* py = static_cast<T*>(y.raw_data());
    parallel_elements(ctx, y.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
        const T* src = px + off[0];
        for (std::int64_t i = 0; i < n; ++i) py[o + i] = src[i * inner[0]];
      });
    });
  });
}

void copy_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  auto* dst = static_cast<char*>(ctx.output(0).raw_data());
  const auto* src = static_cast<const char*>(x.raw_data());
  ctx.device().parallel_for(
      static_cast<std::int64_t>(x.nbytes()), kElementwiseGrain * 4,
      [&](std::int64_t b, std::int64_t e) { std::memcpy(dst + b, src + b, static_cast<std::size_t>(e - b)); });
}

void cast_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  // Every pair of dtypes, 16-bit ones included; those convert through float (one rounding, since
  // float holds every float16 and bfloat16 value exactly).
  graph::dispatch<graph::EveryType>(x.dtype(), ctx.label(), [&]<class From>() {
    graph::dispatch<graph::EveryType>(y.dtype(), ctx.label(), [&]<class To>() {
      const From* px = static_cast<const From*>(x.raw_data());
      To* py = static_cast<To*>(y.raw_data());
      using Via = std::conditional_t<std::is_floating_point_v<From> || std::is_integral_v<From>, From, float>;
      parallel_elements(ctx, x.num_elements(), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) py[i] = static_cast<To>(static_cast<Via>(px[i]));
      });
    });
  });
}

void argmax_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const Shape& in = x.shape();
  const int axis = static_cast<int>(ctx.attrs().get_int("axis") < 0 ? ctx.attrs().get_int("axis") + in.rank()
                                                                    : ctx.attrs().get_int("axis"));
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= in[d];
  for (int d = axis + 1; d < in.rank(); ++d) inner *= in[d];
  const std::int64_t size = in[axis];
  TANDEM_REQUIRE(size > 0 || outer * inner == 0, InvalidArgument, "{}: argmax over an empty axis of {}", ctx.label(),
                 in);
  auto* out = out_ptr<std::int64_t>(ctx, 0);
  graph::dispatch<graph::NumericTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    const T* px = static_cast<const T*>(x.raw_data());
    ctx.device().parallel_for(outer * inner, row_grain(size), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t p = begin; p < end; ++p) {
        const std::int64_t o = p / inner, i = p % inner;
        const T* base = px + o * size * inner + i;
        std::int64_t best = 0;
        for (std::int64_t k = 1; k < size; ++k) {
          if (base[k * inner] > base[best * inner]) best = k;
        }
        out[p] = best;
      }
    });
  });
}

void equal_kernel(KernelContext& ctx) {
  const Tensor& a = ctx.input(0);
  const Tensor& b = ctx.input(1);
  Tensor& y = ctx.output(0);
  const auto layout = make_broadcast_layout(y.shape(), {&a.shape(), &b.shape()});
  auto* py = out_ptr<std::uint8_t>(ctx, 0);
  graph::dispatch<AllTypes>(a.dtype(), ctx.label(), [&]<class T>() {
    const T* pa = static_cast<const T*>(a.raw_data());
    const T* pb = static_cast<const T*>(b.raw_data());
    parallel_elements(ctx, y.num_elements(), [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](std::int64_t o, std::int64_t n, const auto& off, const auto& inner) {
        for (std::int64_t i = 0; i < n; ++i) py[o + i] = pa[off[0] + i * inner[0]] == pb[off[1] + i * inner[1]];
      });
    });
  });
}

void one_hot_kernel(KernelContext& ctx) {
  const Tensor& indices = ctx.input(0);
  const std::int64_t depth = ctx.attrs().get_int("depth");
  const auto on = static_cast<float>(ctx.attrs().get_float_or("on_value", 1.0));
  const auto off = static_cast<float>(ctx.attrs().get_float_or("off_value", 0.0));
  float* out = out_ptr<float>(ctx, 0);
  graph::dispatch<graph::IntegerTypes>(indices.dtype(), ctx.label(), [&]<class I>() {
    const I* pi = static_cast<const I*>(indices.raw_data());
    ctx.device().parallel_for(indices.num_elements(), row_grain(depth), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        float* row = out + r * depth;
        std::fill(row, row + depth, off);
        const auto k = static_cast<std::int64_t>(pi[r]);
        if (k >= 0 && k < depth) row[k] = on;  // out of range: an all-`off` row, as in TF
      }
    });
  });
}

template <class T>
void fill_value(KernelContext& ctx, Tensor& y, T value) {
  T* p = static_cast<T*>(y.raw_data());
  parallel_elements(ctx, y.num_elements(),
                    [&](std::int64_t begin, std::int64_t end) { std::fill(p + begin, p + end, value); });
}

void fill_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  const double value = ctx.attrs().get_float_or("value", 0.0);
  graph::dispatch<AllTypes>(y.dtype(), ctx.label(), [&]<class T>() { fill_value<T>(ctx, y, static_cast<T>(value)); });
}

template <int kValue>
void fill_like_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  graph::dispatch<AllTypes>(y.dtype(), ctx.label(), [&]<class T>() { fill_value<T>(ctx, y, static_cast<T>(kValue)); });
}

// ----- Gather and UnsortedSegmentSum -----

// Checks every id against [0, limit) before anything is written: a bad id is the user's error
// (a token outside the vocabulary), reported with its value and position.
template <class I>
void check_ids(KernelContext& ctx, const Tensor& ids, const detail::IdRange& range) {
  const I* p = static_cast<const I*>(ids.raw_data());
  for (std::int64_t i = 0; i < ids.num_elements(); ++i) {
    if (p[i] < 0 || p[i] >= range.limit) [[unlikely]] {
      detail::throw_bad_id(ctx.label(), range, static_cast<std::int64_t>(p[i]), i, ids.shape());
    }
  }
}

// Gather (params, indices): out row i is params row indices[i]; rows are copied as bytes, so every
// dtype (16-bit ones included) takes the same path.
void gather_kernel(KernelContext& ctx) {
  const Tensor& params = ctx.input(0);
  const Tensor& ids = ctx.input(1);
  const std::int64_t rows = params.shape()[0];
  const std::int64_t width = detail::row_elements(params.shape(), 1);
  const std::size_t row_bytes = static_cast<std::size_t>(width) * graph::dtype_size(params.dtype());
  const auto* src = static_cast<const char*>(params.raw_data());
  auto* dst = static_cast<char*>(ctx.output(0).raw_data());
  graph::dispatch<IndexTypes>(ids.dtype(), ctx.label(), [&]<class I>() {
    check_ids<I>(ctx, ids, detail::gather_id_range(rows));
    const I* p = static_cast<const I*>(ids.raw_data());
    ctx.device().parallel_for(ids.num_elements(), row_grain(width), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        std::memcpy(dst + static_cast<std::size_t>(i) * row_bytes, src + static_cast<std::size_t>(p[i]) * row_bytes,
                    row_bytes);
      }
    });
  });
}

// UnsortedSegmentSum (data, ids[, like]): out[ids[i]] += data[i]. Each thread owns a range of
// output rows and scans every id, adding the rows that fall in its range in the order of i, so
// every output row is the same sum in the same order whatever the threads: bitwise reproducible.
// The ranges split the work (rows to clear plus rows to add) evenly, since ids are rarely uniform
// (spaces in text, padding tokens).
void segment_sum_kernel(KernelContext& ctx) {
  const Tensor& data = ctx.input(0);
  const Tensor& ids = ctx.input(1);
  Tensor& out = ctx.output(0);
  const std::int64_t segments = out.shape()[0];
  const std::int64_t n = ids.num_elements();
  const std::int64_t width = detail::row_elements(data.shape(), ids.shape().rank());
  graph::dispatch<graph::NumericTypes>(data.dtype(), ctx.label(), [&]<class T>() {
    graph::dispatch<IndexTypes>(ids.dtype(), ctx.label(), [&]<class I>() {
      check_ids<I>(ctx, ids, detail::segment_id_range(segments));
      const I* p = static_cast<const I*>(ids.raw_data());
      const T* src = static_cast<const T*>(data.raw_data());
      T* dst = static_cast<T*>(out.raw_data());
      // Range boundaries over the output rows, by cumulative work.
      const auto threads = static_cast<std::int64_t>(ctx.device().intra_op_threads());
      const bool parallel = threads > 1 && segments > 1 && (n + segments) * width >= kElementwiseGrain;
      std::vector<std::int64_t> bounds{0};
      if (parallel) {
        std::vector<std::int64_t> work(static_cast<std::size_t>(segments), 1);
        for (std::int64_t i = 0; i < n; ++i) ++work[static_cast<std::size_t>(p[i])];
        const std::int64_t share = (n + segments + threads - 1) / threads;
        std::int64_t done = 0;
        for (std::int64_t s = 0; s < segments; ++s) {
          done += work[static_cast<std::size_t>(s)];
          if (done >= share * static_cast<std::int64_t>(bounds.size()) && s + 1 < segments) bounds.push_back(s + 1);
        }
      }
      bounds.push_back(segments);
      const auto ranges = static_cast<std::int64_t>(bounds.size()) - 1;
      ctx.device().parallel_for(ranges, 1, [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t r = first; r < last; ++r) {
          const std::int64_t lo = bounds[static_cast<std::size_t>(r)], hi = bounds[static_cast<std::size_t>(r) + 1];
          std::fill(dst + lo * width, dst + hi * width, T(0));
          for (std::int64_t i = 0; i < n; ++i) {
            const auto s = static_cast<std::int64_t>(p[i]);
            if (s < lo || s >= hi) continue;
            ArrayMap<T>(dst + s * width, width) += ConstArrayMap<T>(src + i * width, width);
          }
        }
      });
    });
  });
}

// ----- Slice, SliceGrad, Concat: block copies (ops/detail/block_copy.h) -----

struct BlockCopyJob {
  detail::BlockCopy copy;
  const char* src;
  char* dst;
};

// Copies every job's rows, all jobs' rows split over the device's threads together.
void run_block_copies(KernelContext& ctx, const std::vector<BlockCopyJob>& jobs, std::size_t element_bytes) {
  std::vector<std::int64_t> first_row{0};
  std::int64_t run_total = 0;
  for (const auto& job : jobs) {
    first_row.push_back(first_row.back() + (job.copy.run > 0 ? job.copy.rows : 0));
    run_total += job.copy.run;
  }
  const std::int64_t rows = first_row.back();
  if (rows == 0) return;
  const std::int64_t mean_run = std::max<std::int64_t>(1, run_total / static_cast<std::int64_t>(jobs.size()));
  ctx.device().parallel_for(rows, row_grain(mean_run), [&](std::int64_t begin, std::int64_t end) {
    auto j =
        static_cast<std::size_t>(std::upper_bound(first_row.begin(), first_row.end(), begin) - first_row.begin() - 1);
    for (std::int64_t row = begin; row < end; ++row) {
      while (row >= first_row[j + 1]) ++j;
      const auto& job = jobs[j];
      const std::int64_t r = row - first_row[j];
      std::memcpy(job.dst + static_cast<std::size_t>(job.copy.dst_offset(r)) * element_bytes,
                  job.src + static_cast<std::size_t>(job.copy.src_offset(r)) * element_bytes,
                  static_cast<std::size_t>(job.copy.run) * element_bytes);
    }
  });
}

void slice_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  Tensor& y = ctx.output(0);
  const auto copy = detail::slice_copy(x.shape(), ctx.attrs().get<std::vector<std::int64_t>>("begin"), y.shape());
  run_block_copies(ctx, {{copy, static_cast<const char*>(x.raw_data()), static_cast<char*>(y.raw_data())}},
                   graph::dtype_size(x.dtype()));
}

// SliceGrad (dy, x): zeros shaped like x, with dy at `begin`.
void slice_grad_kernel(KernelContext& ctx) {
  const Tensor& dy = ctx.input(0);
  Tensor& dx = ctx.output(0);
  auto* out = static_cast<char*>(dx.raw_data());
  ctx.device().parallel_for(
      static_cast<std::int64_t>(dx.nbytes()), kElementwiseGrain * 4,
      [&](std::int64_t b, std::int64_t e) { std::memset(out + b, 0, static_cast<std::size_t>(e - b)); });
  const auto copy =
      detail::slice_grad_copy(dy.shape(), ctx.attrs().get<std::vector<std::int64_t>>("begin"), dx.shape());
  run_block_copies(ctx, {{copy, static_cast<const char*>(dy.raw_data()), out}}, graph::dtype_size(dy.dtype()));
}

void concat_kernel(KernelContext& ctx) {
  Tensor& y = ctx.output(0);
  std::vector<Shape> shapes;
  for (int i = 0; i < ctx.num_inputs(); ++i) shapes.push_back(ctx.input(i).shape());
  const auto copies = detail::concat_copies(ctx.attrs(), ctx.label(), shapes, y.shape());
  std::vector<BlockCopyJob> jobs;
  for (int i = 0; i < ctx.num_inputs(); ++i) {
    jobs.push_back({copies[static_cast<std::size_t>(i)], static_cast<const char*>(ctx.input(i).raw_data()),
                    static_cast<char*>(y.raw_data())});
  }
  run_block_copies(ctx, jobs, graph::dtype_size(y.dtype()));
}

}  // namespace
}  // namespace tandem::ops::cpu

namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS {
void register_array_kernels() {
  using namespace tandem::ops::cpu;
  using devices::DeviceType;
  auto& r = graph::OpRegistry::global();
  r.add_kernel("Transpose", DeviceType::kCPU, transpose_kernel);
  r.add_kernel("Copy", DeviceType::kCPU, copy_kernel, {.low_precision = graph::LowPrecision::kNative});  // bytes
  r.add_kernel("Cast", DeviceType::kCPU, cast_kernel, {.low_precision = graph::LowPrecision::kNative});
  r.add_kernel("ArgMax", DeviceType::kCPU, argmax_kernel);
  r.add_kernel("Equal", DeviceType::kCPU, equal_kernel);
  r.add_kernel("OneHot", DeviceType::kCPU, one_hot_kernel);
  r.add_kernel("Fill", DeviceType::kCPU, fill_kernel);
  r.add_kernel("ZerosLike", DeviceType::kCPU, fill_like_kernel<0>);
  r.add_kernel("OnesLike", DeviceType::kCPU, fill_like_kernel<1>);
  // Row copies work on bytes: 16-bit tensors need no float32 copies.
  const graph::KernelOptions bytes{.low_precision = graph::LowPrecision::kNative};
  r.add_kernel("Gather", DeviceType::kCPU, gather_kernel, bytes);
  r.add_kernel("UnsortedSegmentSum", DeviceType::kCPU, segment_sum_kernel);
  r.add_kernel("Slice", DeviceType::kCPU, slice_kernel, bytes);
  r.add_kernel("SliceGrad", DeviceType::kCPU, slice_grad_kernel, bytes);
  r.add_kernel("Concat", DeviceType::kCPU, concat_kernel, bytes);
}
}  // namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS
