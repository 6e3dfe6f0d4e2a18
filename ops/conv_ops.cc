// Placeholder until the conv family lands.
#include "tandem/ops/detail/registration.h"
namespace tandem::ops::detail {
void register_conv_ops() {}
}
