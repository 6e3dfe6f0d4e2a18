// tandem/tandem.h — the graph API in one include (tensors, graphs, autodiff, executor, ops). The
// Keras-style API, strategies included, is <tandem/keras_like/keras.h>.
#pragma once

#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/graph/tensor.h"
#include "tandem/ops/ops.h"
