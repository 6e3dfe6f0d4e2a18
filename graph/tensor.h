// tandem/graph/tensor.h — an n-dimensional array on a device.
//
// A Tensor is a shape, a dtype and a reference-counted Buffer on one Device. Copying a Tensor
// copies the reference, not the data (like torch.Tensor); clone() copies the data. Data is
// row-major and contiguous; reshape() returns a view of the same buffer.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "tandem/devices/device.h"
#include "tandem/graph/dtype.h"
#include "tandem/graph/shape.h"

namespace tandem::graph {

// A block of device memory. Freed through its device's allocator when the last Tensor (or other
// holder) lets go.
class Buffer {
 public:
  Buffer(devices::Device& device, std::size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  devices::Device& device() const { return *device_; }

 private:
  devices::Device* device_;
  void* data_;
  std::size_t bytes_;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  // A view of `buffer` starting at byte_offset. Checks that the view fits.
  Tensor(const Shape& shape, DType dtype, std::shared_ptr<Buffer> buffer, std::size_t byte_offset = 0);

  // New, uninitialised storage. The shape must be fully defined.
  static Tensor empty(const Shape& shape, DType dtype, devices::Device& device = devices::default_cpu_device());
  static Tensor zeros(const Shape& shape, DType dtype, devices::Device& device = devices::default_cpu_device());
  // Copies `values` (row-major; values.size() must equal the shape's element count).
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape,
                            devices::Device& device = devices::default_cpu_device());
  template <class T>
  static Tensor scalar(T value, devices::Device& device = devices::default_cpu_device()) {
    return from_vector<T>({value}, Shape{}, device);
  }
  template <class T>
  static Tensor filled(const Shape& shape, T value, devices::Device& device = devices::default_cpu_device()) {
    return from_vector<T>(std::vector<T>(static_cast<std::size_t>(checked_elements(shape)), value), shape, device);
  }

  bool defined() const { return buffer_ != nullptr; }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  devices::Device& device() const;
  std::int64_t num_elements() const { return shape_.num_elements(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(num_elements()) * dtype_size(dtype_); }

  // Raw device pointer (not host-readable on GPUs).
  void* raw_data() const;
  // Typed host pointer. Throws InvalidArgument when T is not the tensor's dtype, and
  // FailedPrecondition when the tensor is not in host-accessible memory (copy it with to()).
  template <class T>
  T* data() const {
    check_host_access(dtype_of<T>);
    return static_cast<T*>(raw_data());
  }
  // Copies the elements to a host vector (from any device).
  template <class T>
  std::vector<T> to_vector() const;
  // The single element of a one-element tensor.
  template <class T>
  T item() const;

  // A view with another shape and the same number of elements.
  Tensor reshape(const Shape& shape) const;
  // A copy on `device`; returns *this when the tensor is already there.
  Tensor to(devices::Device& device) const;
  // A deep copy on the same device.
  Tensor clone() const;
  // Copies source's data into this tensor; shapes (element counts) and dtypes must match.
  void copy_from(const Tensor& source);

  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
  std::size_t byte_offset() const { return byte_offset_; }

  // "Tensor(shape=(2, 3), dtype=float32, device=CPU:0, [[1, 2, 3], [4, 5, 6]])", elided past max_elements.
  std::string to_string(int max_elements = 16) const;

 private:
  static std::int64_t checked_elements(const Shape& shape);
  void check_host_access(DType requested) const;

  std::shared_ptr<Buffer> buffer_;
  std::size_t byte_offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::kF32;
};

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape, devices::Device& device) {
  const auto n = checked_elements(shape);
  TANDEM_REQUIRE(static_cast<std::int64_t>(values.size()) == n, InvalidArgument,
                 "Tensor::from_vector: {} values do not fill shape {} ({} elements)", values.size(), shape, n);
  Tensor t = empty(shape, dtype_of<T>, device);
  device.copy_from_host(t.raw_data(), values.data(), values.size() * sizeof(T));
  return t;
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "to_vector on an undefined tensor");
  TANDEM_REQUIRE(dtype_ == dtype_of<T>, InvalidArgument, "to_vector<{}> on a tensor of dtype {}", dtype_of<T>, dtype_);
  std::vector<T> out(static_cast<std::size_t>(num_elements()));
  device().copy_to_host(out.data(), raw_data(), nbytes());
  return out;
}

template <class T>
T Tensor::item() const {
  TANDEM_REQUIRE(defined() && num_elements() == 1, InvalidArgument,
                 "item() needs a tensor with exactly one element; this one has shape {}", shape_);
  return to_vector<T>()[0];
}

}  // namespace tandem::graph

namespace tandem {
using graph::DType;
using graph::kFloat32;
using graph::kFloat64;
using graph::kInt32;
using graph::kInt64;
using graph::kUInt8;
using graph::Shape;
using graph::Tensor;
}  // namespace tandem
