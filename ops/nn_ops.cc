// Placeholder until the nn family lands.
#include "tandem/ops/detail/registration.h"
namespace tandem::ops::detail {
void register_nn_ops() {}
}
