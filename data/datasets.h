// tandem/data/datasets.h — ready-made datasets.
#pragma once

#include <string>

#include "tandem/data/dataset.h"

namespace tandem::data {

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* kDebianFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// No Debian package ships MNIST; this is where tandem looks by default.
inline constexpr const char* kDefaultMnistDir = "/usr/share/datasets/mnist";

// An image classification dataset: images as float32 [N, 28, 28] scaled to [0, 1] (Keras's
// tutorial divides by 255), labels as int64 [N]. train and test are from_tensor_slices of them.
struct ImageClassificationData {
  Tensor x_train, y_train, x_test, y_test;
  Dataset train, test;
};

// Reads {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] from `dir`. A missing file raises
// NotFound naming the path and the package that provides it.
ImageClassificationData fashion_mnist(const std::string& dir = kDebianFashionMnistDir);
ImageClassificationData mnist(const std::string& dir = kDefaultMnistDir);

}  // namespace tandem::data
