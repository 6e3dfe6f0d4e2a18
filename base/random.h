// tandem/base/random.h — the global seed that makes runs repeatable.
//
// Like keras.utils.set_random_seed: weight initialisers, dataset shuffles and dropout draw their
// seeds from here when none is given, so one call fixes a whole run. The default seed is 0.
#pragma once

#include <cstdint>

namespace tandem {

// Sets the global seed and restarts the sequence next_seed() returns. Call before building.
void set_global_seed(std::uint64_t seed);
std::uint64_t global_seed();
// A new seed from the global sequence: the n-th call after set_global_seed(s) returns the same
// value in every run. Thread-safe.
std::uint64_t next_seed();
// A 64-bit mix (splitmix64's finaliser) for deriving seeds from seeds.
std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b = 0);

}  // namespace tandem
