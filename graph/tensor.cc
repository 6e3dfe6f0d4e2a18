#include "tandem/graph/tensor.h"

#include <cstring>

namespace tandem::graph {

Buffer::Buffer(devices::Device& device, std::size_t bytes)
    : device_(&device), data_(device.allocator().allocate(bytes)), bytes_(bytes) {}

Buffer::~Buffer() { device_->allocator().deallocate(data_, bytes_); }

Tensor::Tensor(const Shape& shape, DType dtype, std::shared_ptr<Buffer> buffer, std::size_t byte_offset)
    : buffer_(std::move(buffer)), byte_offset_(byte_offset), shape_(shape), dtype_(dtype) {
  TANDEM_ASSERT(buffer_ != nullptr, "a tensor view needs a buffer");
  const auto n = checked_elements(shape);
  TANDEM_ASSERT(byte_offset + static_cast<std::size_t>(n) * dtype_size(dtype) <= buffer_->bytes(),
                "view of {} {} at offset {} overruns a buffer of {} bytes", shape, dtype, byte_offset,
                buffer_->bytes());
}

std::int64_t Tensor::checked_elements(const Shape& shape) {
  TANDEM_REQUIRE(shape.is_fully_defined(), InvalidArgument, "a tensor needs a fully defined shape; got {}", shape);
  return shape.num_elements();
}

Tensor Tensor::empty(const Shape& shape, DType dtype, devices::Device& device) {
  const auto n = checked_elements(shape);
  auto buffer = std::make_shared<Buffer>(device, static_cast<std::size_t>(n) * dtype_size(dtype));
  return Tensor(shape, dtype, std::move(buffer));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, devices::Device& device) {
  Tensor t = empty(shape, dtype, device);
  device.fill_zero(t.raw_data(), t.nbytes());
  return t;
}

devices::Device& Tensor::device() const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "device() of an undefined tensor");
  return buffer_->device();
}

void* Tensor::raw_data() const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "data of an undefined tensor");
  return static_cast<char*>(buffer_->data()) + byte_offset_;
}

void Tensor::check_host_access(DType requested) const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "data of an undefined tensor");
  TANDEM_REQUIRE(requested == dtype_, InvalidArgument, "tensor of shape {} has dtype {}; it was read as {}", shape_,
                 dtype_, requested);
  TANDEM_REQUIRE(device().host_accessible(), FailedPrecondition,
                 "tensor of shape {} is on {}, which the host cannot read; copy it with .to(CPU) first", shape_,
                 device().short_name());
}

Tensor Tensor::reshape(const Shape& shape) const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "reshape of an undefined tensor");
  TANDEM_REQUIRE(checked_elements(shape) == num_elements(), InvalidArgument,
                 "cannot reshape a tensor of shape {} ({} elements) to {} ({} elements)", shape_, num_elements(), shape,
                 shape.num_elements());
  return Tensor(shape, dtype_, buffer_, byte_offset_);
}

Tensor Tensor::to(devices::Device& device) const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "to() of an undefined tensor");
  if (&device == &this->device()) return *this;
  Tensor out = empty(shape_, dtype_, device);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::clone() const {
  TANDEM_REQUIRE(defined(), FailedPrecondition, "clone() of an undefined tensor");
  Tensor out = empty(shape_, dtype_, device());
  out.copy_from(*this);
  return out;
}

void Tensor::copy_from(const Tensor& source) {
  TANDEM_REQUIRE(defined() && source.defined(), FailedPrecondition, "copy_from with an undefined tensor");
  TANDEM_REQUIRE(source.dtype_ == dtype_ && source.num_elements() == num_elements(), InvalidArgument,
                 "copy_from: source {} {} does not match destination {} {}", source.shape_, source.dtype_, shape_,
                 dtype_);
  auto& src = source.device();
  auto& dst = device();
  const auto bytes = nbytes();
  if (&src == &dst) {
    dst.copy_on_device(raw_data(), source.raw_data(), bytes);
  } else if (src.host_accessible()) {
    dst.copy_from_host(raw_data(), source.raw_data(), bytes);
  } else if (dst.host_accessible()) {
    src.copy_to_host(raw_data(), source.raw_data(), bytes);
  } else {  // device to another device: stage through the host
    std::vector<char> staging(bytes);
    src.copy_to_host(staging.data(), source.raw_data(), bytes);
    dst.copy_from_host(raw_data(), staging.data(), bytes);
  }
}

namespace {
template <class T>
void append_elements(std::string& out, const Tensor& host, int max_elements) {
  const T* p = host.data<T>();
  const auto& shape = host.shape();
  const auto n = host.num_elements();
  const int rank = shape.rank();
  if (rank == 0) {
    out += fmt::format("{}", +p[0]);
    return;
  }
  // Open a bracket at each dimension boundary; elide after max_elements.
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      stride *= shape[d];
      if (i % stride == 0) out += "[";
    }
    if (i >= max_elements) {
      out += "...";
      out.append(static_cast<std::size_t>(rank), ']');
      return;
    }
    out += fmt::format("{}", +p[i]);
    stride = 1;
    int closed = 0;
    for (int d = rank - 1; d >= 0; --d) {
      stride *= shape[d];
      if ((i + 1) % stride == 0) {
        out += "]";
        ++closed;
      }
    }
    if (i + 1 < n) out += closed > 0 ? ", " : ", ";
  }
}
}  // namespace

std::string Tensor::to_string(int max_elements) const {
  if (!defined()) return "Tensor(undefined)";
  std::string out = fmt::format("Tensor(shape={}, dtype={}, device={}, ", shape_, dtype_, device().short_name());
  if (dtype_ == DType::kF16 || dtype_ == DType::kBF16) return out + "...)";
  const Tensor host = to(devices::default_cpu_device());
  dispatch<AllTypes>(dtype_, "Tensor::to_string", [&]<class T>() { append_elements<T>(out, host, max_elements); });
  return out + ")";
}

}  // namespace tandem::graph
