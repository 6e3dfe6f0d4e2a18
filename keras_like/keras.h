// tandem/keras_like/keras.h — the Keras-style API in one include.
#pragma once

#include "tandem/base/random.h"
#include "tandem/data/dataset.h"
#include "tandem/data/datasets.h"
#include "tandem/keras_like/callbacks.h"
#include "tandem/keras_like/initializers.h"
#include "tandem/keras_like/layer.h"
#include "tandem/keras_like/layers.h"
#include "tandem/keras_like/losses.h"
#include "tandem/keras_like/metrics.h"
#include "tandem/keras_like/mixed_precision.h"
#include "tandem/keras_like/model.h"
#include "tandem/keras_like/optimizers.h"
#include "tandem/keras_like/saving.h"
#include "tandem/keras_like/schedules.h"
#include "tandem/strategy/multi_worker.h"
#include "tandem/strategy/strategy.h"
