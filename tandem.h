// tandem/tandem.h — everything a program needs, in one include.
#pragma once

#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/graph/tensor.h"
#include "tandem/ops/ops.h"
