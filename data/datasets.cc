// Fashion-MNIST and MNIST from their IDX files, as keras.datasets returns them after the usual
// "x / 255.0" (float32 images in [0, 1], int64 labels).
#include "tandem/data/datasets.h"

#include <array>
#include <filesystem>

#include "tandem/base/errors.h"
#include "tandem/data/detail/readers.h"

namespace tandem::data {
namespace {

struct IdxFile {
  std::string path;
  Tensor values;
};

// Reads `dir`/`name`.gz, or `dir`/`name` when only the uncompressed file is there.
IdxFile read_idx_in(const std::string& dir, const std::string& name, std::string_view source_hint) {
  const auto base = std::filesystem::path(dir) / name;
  const std::string gz = base.string() + ".gz";
  std::error_code ec;
  if (!std::filesystem::exists(gz, ec) && std::filesystem::exists(base, ec)) {
    return {base.string(), detail::read_idx(base.string(), "")};
  }
  return {gz, detail::read_idx(gz, fmt::format(" (nor {} without .gz); {}", name, source_hint))};
}

// uint8 pixels to float32 in [0, 1]. The table holds float(double(v) / 255), the value Keras's
// tutorials get from numpy's float64 division followed by the cast to float32.
Tensor scale_images(const Tensor& images, const std::string& path) {
  TANDEM_REQUIRE(images.dtype() == kUInt8 && images.shape().rank() == 3, DataLoss,
                 "{}: expected uint8 images of shape (N, rows, columns); the file holds {} values of shape {}", path,
                 images.dtype(), images.shape());
  std::array<float, 256> table{};
  for (std::size_t v = 0; v < table.size(); ++v) table[v] = static_cast<float>(static_cast<double>(v) / 255.0);
  Tensor out = Tensor::empty(images.shape(), kFloat32);
  const auto* src = images.data<std::uint8_t>();
  auto* dst = out.data<float>();
  const auto n = images.num_elements();
  for (std::int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
  return out;
}

Tensor widen_labels(const Tensor& labels, const std::string& path) {
  TANDEM_REQUIRE(labels.dtype() == kUInt8 && labels.shape().rank() == 1, DataLoss,
                 "{}: expected uint8 labels of shape (N,); the file holds {} values of shape {}", path, labels.dtype(),
                 labels.shape());
  Tensor out = Tensor::empty(labels.shape(), kInt64);
  const auto* src = labels.data<std::uint8_t>();
  auto* dst = out.data<std::int64_t>();
  for (std::int64_t i = 0; i < labels.num_elements(); ++i) dst[i] = src[i];
  return out;
}

// One split: images and labels, which must be as many.
std::pair<Tensor, Tensor> read_split(const std::string& dir, const std::string& prefix, std::string_view hint) {
  const auto images = read_idx_in(dir, prefix + "-images-idx3-ubyte", hint);
  const auto labels = read_idx_in(dir, prefix + "-labels-idx1-ubyte", hint);
  Tensor x = scale_images(images.values, images.path);
  Tensor y = widen_labels(labels.values, labels.path);
  TANDEM_REQUIRE(x.shape()[0] == y.shape()[0], DataLoss,
                 "{} holds {} images but {} holds {} labels; the files do not belong together", images.path,
                 x.shape()[0], labels.path, y.shape()[0]);
  return {std::move(x), std::move(y)};
}

ImageClassificationData load(const std::string& dir, std::string_view hint) {
  ImageClassificationData data;
  std::tie(data.x_train, data.y_train) = read_split(dir, "train", hint);
  std::tie(data.x_test, data.y_test) = read_split(dir, "t10k", hint);
  data.train = Dataset::from_tensor_slices({data.x_train, data.y_train});
  data.test = Dataset::from_tensor_slices({data.x_test, data.y_test});
  return data;
}

}  // namespace

ImageClassificationData fashion_mnist(const std::string& dir) {
  return load(dir, "install Debian's dataset-fashion-mnist package (apt-get install dataset-fashion-mnist)");
}

ImageClassificationData mnist(const std::string& dir) {
  return load(dir, fmt::format("no Debian package ships MNIST: download train-images-idx3-ubyte.gz, "
                               "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and "
                               "t10k-labels-idx1-ubyte.gz from the MNIST site into {}",
                               dir));
}

}  // namespace tandem::data
